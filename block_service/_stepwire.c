/* block_service._stepwire: a Step from the request's bytes to the answer's, compiled.
 *
 * Why: a decode Step is 256 one-token APPENDs. In Python, turning the parsed request's columns
 * into lists, the loop over the operations and building the answer cost ~350 us of the
 * service's CPU per Step (bench/control_plane.py); here they cost a few.
 *
 * What it does, and what it leaves to Python (block_service/step_wire.py is the caller):
 * - parse(data): reads a pagewire.block.v1.StepRequest from its wire bytes into C arrays.
 *   Anything it is not sure about (a malformed or unusual encoding, a wrong wire type, invalid
 *   UTF-8) returns None: the caller then parses with protobuf itself, which answers as it
 *   always did. Unknown fields are skipped, as protobuf does.
 * - run(parsed, ...): the operations in order. The one case decode steps are made of, an
 *   APPEND of one token into the sequence's last block when it has room and is not shared, or
 *   into a new block when the token starts one, is done here exactly as the Python fast path
 *   of block_service/step.py (run_step) does it, on the same Python objects (the pool's
 *   Sequence records, its ref counts). Every other operation, and anything unusual about
 *   those (unknown sequence, copy-on-write, no free block, a bad value), is handed to the
 *   `slow` callable: block_service.step.apply_op, the one source of truth for the semantics.
 *   Returns the StepResponse's wire bytes, the number of appends done here and how far
 *   they raised num_computed without set_computed (the pool's uncomputed-token count).
 * tests/block_service/test_step_wire.py drives this and the Python path with the same random
 * operation streams and compares every answer and the pool state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

enum { OP_APPEND = 2, STATUS_OK = 1, RESERVED = -1 };

/* A growable column of raw varint values (each field's type is applied where it is read). */
typedef struct {
    uint64_t *values;
    Py_ssize_t size, capacity;
} Column;

static int column_push(Column *c, uint64_t value) {
    if (c->size == c->capacity) {
        Py_ssize_t capacity = c->capacity ? c->capacity * 2 : 64;
        uint64_t *grown = PyMem_Realloc(c->values, (size_t)capacity * sizeof(uint64_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->values = grown;
        c->capacity = capacity;
    }
    c->values[c->size++] = value;
    return 0;
}

/* StepRequest's repeated fields 5..12, by field number less 5 (index 6, field 11, is the
 * cache_salts map and unused here). */
enum { KINDS, SEQ_IDS, TOKEN_COUNTS, TOKEN_IDS, PARENT_IDS, COMPUTED, SALTS_UNUSED, LOOKAHEADS,
       NUM_COLUMNS };

typedef struct {
    Column columns[NUM_COLUMNS];
} Parsed;

static void parsed_free(PyObject *capsule) {
    Parsed *parsed = PyCapsule_GetPointer(capsule, "stepwire.parsed");
    if (parsed == NULL)
        return;
    for (int i = 0; i < NUM_COLUMNS; i++)
        PyMem_Free(parsed->columns[i].values);
    PyMem_Free(parsed);
}

/* 1: read; 0: not a varint protobuf would take (the caller falls back). */
static int read_varint(const uint8_t **at, const uint8_t *end, uint64_t *out) {
    uint64_t value = 0;
    for (int shift = 0; shift < 70 && *at < end; shift += 7) {
        uint8_t byte = *(*at)++;
        value |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return 1;
        }
    }
    return 0;
}

/* A field's tag: 1 read; 0 where protobuf would refuse it (longer than 5 bytes, or past
 * 32 bits: its field number would be cut short). */
static int read_tag(const uint8_t **at, const uint8_t *end, unsigned *field,
                    unsigned *wire_type) {
    const uint8_t *start = *at;
    uint64_t tag;
    if (!read_varint(at, end, &tag) || *at - start > 5 || tag > UINT32_MAX) return 0;
    *field = (unsigned)(tag >> 3);
    *wire_type = (unsigned)(tag & 7);
    return 1;
}

/* Skips an unknown field's value; 0 for groups and anything malformed. */
static int skip_field(const uint8_t **at, const uint8_t *end, unsigned wire_type) {
    uint64_t length;
    switch (wire_type) {
    case 0:
        return read_varint(at, end, &length);
    case 1:
        if (end - *at < 8) return 0;
        *at += 8;
        return 1;
    case 2:
        if (!read_varint(at, end, &length) || length > (uint64_t)(end - *at)) return 0;
        *at += length;
        return 1;
    case 5:
        if (end - *at < 4) return 0;
        *at += 4;
        return 1;
    default:
        return 0;
    }
}

/* A length-delimited value: its bounds. */
static int read_bytes(const uint8_t **at, const uint8_t *end, const uint8_t **start,
                      Py_ssize_t *size) {
    uint64_t length;
    if (!read_varint(at, end, &length) || length > (uint64_t)(end - *at)) return 0;
    *start = *at;
    *size = (Py_ssize_t)length;
    *at += length;
    return 1;
}

/* A proto3 string: a new str, or NULL with no error set when it is not valid UTF-8. */
static PyObject *decode_text(const uint8_t *start, Py_ssize_t size) {
    PyObject *text = PyUnicode_DecodeUTF8((const char *)start, size, "strict");
    if (text == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        PyErr_Clear();
    return text;
}

/* One cache_salts entry (key 1: uint32, value 2: string) into `salts`. -1 error, 0 fall back. */
static int parse_salt(const uint8_t *at, const uint8_t *end, PyObject *salts) {
    uint64_t key = 0;
    const uint8_t *value_start = at;
    Py_ssize_t value_size = 0;
    while (at < end) {
        unsigned field, wire_type;
        if (!read_tag(&at, end, &field, &wire_type)) return 0;
        if (field == 1 && wire_type == 0) {
            if (!read_varint(&at, end, &key)) return 0;
        } else if (field == 2 && wire_type == 2) {
            if (!read_bytes(&at, end, &value_start, &value_size)) return 0;
        } else if (field == 1 || field == 2 || field == 0 || !skip_field(&at, end, wire_type)) {
            return 0;
        }
    }
    PyObject *value = decode_text(value_start, value_size);
    if (value == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *index = PyLong_FromUnsignedLong((uint32_t)key);
    int failed = index == NULL || PyDict_SetItem(salts, index, value) < 0;
    Py_XDECREF(index);
    Py_DECREF(value);
    return failed ? -1 : 1;
}

/* Header fields: 1 session_id, 2 pool_id (strings); 3 step_id, 4 epoch, 13 waiting (varint). */
typedef struct {
    PyObject *session_id, *pool_id;
    uint64_t step_id, epoch, num_waiting_tokens;
} Header;

/* -1 error, 0 fall back, 1 parsed. */
static int parse_fields(const uint8_t *at, const uint8_t *end, Header *header, Parsed *parsed,
                        PyObject *salts) {
    while (at < end) {
        uint64_t value;
        const uint8_t *start;
        Py_ssize_t size;
        unsigned field, wire_type;
        if (!read_tag(&at, end, &field, &wire_type) || field == 0) return 0;
        if (field == 1 || field == 2) {
            if (wire_type != 2 || !read_bytes(&at, end, &start, &size)) return 0;
            PyObject *text = decode_text(start, size);
            if (text == NULL) return PyErr_Occurred() ? -1 : 0;
            PyObject **slot = field == 1 ? &header->session_id : &header->pool_id;
            Py_XSETREF(*slot, text);
        } else if (field == 3 || field == 4 || field == 13) {
            if (wire_type != 0 || !read_varint(&at, end, &value)) return 0;
            *(field == 3 ? &header->step_id : field == 4 ? &header->epoch
                                                         : &header->num_waiting_tokens) = value;
        } else if (field == 11) {
            if (wire_type != 2 || !read_bytes(&at, end, &start, &size)) return 0;
            int done = parse_salt(start, start + size, salts);
            if (done <= 0) return done;
        } else if (field >= 5 && field <= 12) {
            Column *column = &parsed->columns[field - 5];
            if (wire_type == 0) {  /* one element, unpacked */
                if (!read_varint(&at, end, &value)) return 0;
                if (column_push(column, value) < 0) return -1;
            } else if (wire_type == 2) {  /* packed */
                if (!read_bytes(&at, end, &start, &size)) return 0;
                const uint8_t *packed_end = start + size;
                while (start < packed_end) {
                    if (!read_varint(&start, packed_end, &value)) return 0;
                    if (column_push(column, value) < 0) return -1;
                }
            } else {
                return 0;
            }
        } else if (!skip_field(&at, end, wire_type)) {
            return 0;
        }
    }
    return 1;
}

static PyObject *parse(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Parsed *parsed = PyMem_Calloc(1, sizeof(Parsed));
    PyObject *salts = PyDict_New();
    Header header = {NULL, NULL, 0, 0, 0};
    PyObject *result = NULL;
    if (parsed == NULL || salts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *at = view.buf;
    int outcome = parse_fields(at, at + view.len, &header, parsed, salts);
    if (outcome < 0) goto done;
    if (outcome == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    uint64_t token_sum = 0;
    Column *counts = &parsed->columns[TOKEN_COUNTS];
    for (Py_ssize_t i = 0; i < counts->size; i++)
        token_sum += (uint32_t)counts->values[i];
    PyObject *capsule = PyCapsule_New(parsed, "stepwire.parsed", parsed_free);
    if (capsule == NULL) goto done;
    parsed = NULL;  /* the capsule owns it */
    Column *c = ((Parsed *)PyCapsule_GetPointer(capsule, "stepwire.parsed"))->columns;
    result = Py_BuildValue(
        "(NNKKK(nnnnnnn)KON)",
        header.session_id ? header.session_id : PyUnicode_New(0, 0),
        header.pool_id ? header.pool_id : PyUnicode_New(0, 0),
        (unsigned long long)header.step_id, (unsigned long long)header.epoch,
        (unsigned long long)header.num_waiting_tokens,
        c[KINDS].size, c[SEQ_IDS].size, c[TOKEN_COUNTS].size, c[TOKEN_IDS].size,
        c[PARENT_IDS].size, c[COMPUTED].size, c[LOOKAHEADS].size,
        (unsigned long long)token_sum, salts, capsule);
    header.session_id = header.pool_id = NULL;  /* stolen by "N" (or freed on failure) */
done:
    Py_XDECREF(header.session_id);
    Py_XDECREF(header.pool_id);
    Py_XDECREF(salts);
    if (parsed != NULL) {
        for (int i = 0; i < NUM_COLUMNS; i++)
            PyMem_Free(parsed->columns[i].values);
        PyMem_Free(parsed);
    }
    PyBuffer_Release(&view);
    return result;
}

/* ---- the answer, written as protobuf writes it (fields in number order) ----------------- */

typedef struct {
    uint8_t *bytes;
    Py_ssize_t size, capacity;
} Out;

static int out_reserve(Out *out, Py_ssize_t more) {
    if (out->size + more <= out->capacity) return 0;
    Py_ssize_t capacity = out->capacity ? out->capacity : 256;
    while (capacity < out->size + more) capacity *= 2;
    uint8_t *grown = PyMem_Realloc(out->bytes, (size_t)capacity);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    out->bytes = grown;
    out->capacity = capacity;
    return 0;
}

static int varint_size(uint64_t value) {
    int size = 1;
    while (value >= 0x80) {
        value >>= 7;
        size++;
    }
    return size;
}

/* The caller has reserved room. */
static void put_varint(Out *out, uint64_t value) {
    while (value >= 0x80) {
        out->bytes[out->size++] = (uint8_t)(value | 0x80);
        value >>= 7;
    }
    out->bytes[out->size++] = (uint8_t)value;
}

static int write_varint_field(Out *out, unsigned field, uint64_t value) {
    if (value == 0) return 0;  /* proto3: a default scalar is not written */
    if (out_reserve(out, 20) < 0) return -1;
    put_varint(out, (uint64_t)field << 3);
    put_varint(out, value);
    return 0;
}

/* A packed repeated field; `values` as the field's varints (int64 / uint32 alike). */
static int write_packed(Out *out, unsigned field, const uint64_t *values, Py_ssize_t count) {
    if (count == 0) return 0;
    Py_ssize_t length = 0;
    for (Py_ssize_t i = 0; i < count; i++) length += varint_size(values[i]);
    if (out_reserve(out, 20 + length) < 0) return -1;
    put_varint(out, ((uint64_t)field << 3) | 2);
    put_varint(out, (uint64_t)length);
    for (Py_ssize_t i = 0; i < count; i++) put_varint(out, values[i]);
    return 0;
}

static int write_bytes_field(Out *out, unsigned field, const char *data, Py_ssize_t size) {
    if (out_reserve(out, 20 + size) < 0) return -1;
    put_varint(out, ((uint64_t)field << 3) | 2);
    put_varint(out, (uint64_t)size);
    memcpy(out->bytes + out->size, data, (size_t)size);
    out->size += size;
    return 0;
}

/* ---- the operations -------------------------------------------------------------------- */

static PyObject *str_tokens, *str_block_table, *str_num_computed, *str_num_published;
static PyObject *str_status, *str_error, *str_num_cached_tokens, *str_table_start,
    *str_table_block_ids, *str_slots, *str_copies;

/* Per-operation answer columns and the concatenated ones. */
typedef struct {
    Column statuses, cached, starts, table_counts, slot_counts, block_ids, slots, copies;
} Answer;

static void answer_free(Answer *a) {
    Column *all[] = {&a->statuses, &a->cached, &a->starts, &a->table_counts, &a->slot_counts,
                     &a->block_ids, &a->slots, &a->copies};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) PyMem_Free(all[i]->values);
}

/* Where a Sequence (block_service/sequence.py, a __slots__ class) keeps the attributes the
 * fast path reads: read and written in place, as its member descriptors would, without an
 * attribute lookup per token. Resolved from the first sequence's type; a sequence of any
 * other type takes the slow path. */
typedef struct {
    PyTypeObject *type;  /* a strong reference, once resolved */
    Py_ssize_t tokens, block_table, num_computed, num_published;
} SeqLayout;

static SeqLayout layout;

static Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name) {
    PyObject *descriptor = PyObject_GetAttr((PyObject *)type, name);
    if (descriptor == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_TYPE(descriptor) == &PyMemberDescr_Type) {
        PyMemberDef *member = ((PyMemberDescrObject *)descriptor)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READONLY))
            offset = member->offset;
    }
    Py_DECREF(descriptor);
    return offset;
}

/* Whether `seq` has the layout (resolving it from the first sequence seen). */
static int has_layout(PyObject *seq) {
    PyTypeObject *type = Py_TYPE(seq);
    if (layout.type != NULL) return layout.type == type;
    SeqLayout found = {type, slot_offset(type, str_tokens), slot_offset(type, str_block_table),
                       slot_offset(type, str_num_computed), slot_offset(type, str_num_published)};
    if (found.tokens < 0 || found.block_table < 0 || found.num_computed < 0
        || found.num_published < 0)
        return 0;
    Py_INCREF(type);
    layout = found;
    return 1;
}

/* A slot's value (borrowed; NULL while unset). */
static inline PyObject *slot_value(PyObject *object, Py_ssize_t offset) {
    return *(PyObject **)((char *)object + offset);
}

/* An int attribute as a C integer; -1 with an error set on failure. */
static int get_long_attr(PyObject *object, PyObject *name, long long *out) {
    PyObject *value = PyObject_GetAttr(object, name);
    if (value == NULL) return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Appends an int list's items (as varints of their C value) to a column. */
static int extend_from_list(Column *column, PyObject *list, Py_ssize_t *count) {
    PyObject *items = PySequence_Fast(list, "expected a sequence of ints");
    if (items == NULL) return -1;
    Py_ssize_t size = PySequence_Fast_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < size; i++) {
        long long value = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(items, i));
        if ((value == -1 && PyErr_Occurred()) || column_push(column, (uint64_t)value) < 0) {
            Py_DECREF(items);
            return -1;
        }
    }
    Py_DECREF(items);
    if (count != NULL) *count = size;
    return 0;
}

/* The fast path of one APPEND of one token; 1 done, 0 not this case, -1 error.
 * Mirrors the loop body of block_service/step.py run_step exactly. */
typedef struct {
    PyObject *refs, *take, *num_free, *set_computed;
    long long shift, capacity;
} Pool;

static int append_to(const Pool *pool, PyObject *seq, PyObject *tokens, PyObject *table,
                     PyObject *seq_computed_object, long long token, long long lookahead,
                     long long num_computed, Answer *a, Py_ssize_t i,
                     long long *computed_here) {
    Py_ssize_t position = PyList_GET_SIZE(tokens);
    if (position == 0) return 0;
    long long last_token = PyLong_AsLongLong(PyList_GET_ITEM(tokens, position - 1));
    if (last_token == -1 && PyErr_Occurred()) return -1;
    int filling = last_token == RESERVED;
    if (filling != lookahead || token < 0 || num_computed < -1 || num_computed > position)
        return 0;
    Py_ssize_t table_size = PyList_GET_SIZE(table);
    long long column = position & ((1LL << pool->shift) - 1);
    long long block;
    int new_block = column == 0;
    if (!new_block) {
        if (table_size == 0) return 0;
        block = PyLong_AsLongLong(PyList_GET_ITEM(table, table_size - 1));
        if (block == -1 && PyErr_Occurred()) return -1;
        if (block < 0 || block >= PyList_GET_SIZE(pool->refs)) return 0;
        long long refs = PyLong_AsLongLong(PyList_GET_ITEM(pool->refs, block));
        if (refs == -1 && PyErr_Occurred()) return -1;
        if (refs != 1) return 0;  /* shared: copy-on-write is the slow path's */
    } else {
        if (table_size >= pool->capacity) return 0;
        PyObject *free = PyObject_CallNoArgs(pool->num_free);
        if (free == NULL) return -1;
        int any_free = PyObject_IsTrue(free);
        Py_DECREF(free);
        if (any_free <= 0) return any_free;
    }
    /* From here on the append happens: the same changes, in the same order, as run_step. */
    if (filling) {
        PyObject *token_object = PyLong_FromLongLong(token);
        if (token_object == NULL || PyList_SetItem(tokens, position - 1, token_object) < 0)
            return -1;
    }
    long long seq_computed = PyLong_AsLongLong(seq_computed_object);
    if (seq_computed == -1 && PyErr_Occurred()) return -1;
    if (new_block || num_computed > seq_computed) {
        PyObject *published_object = slot_value(seq, layout.num_published);
        long long published = published_object ? PyLong_AsLongLong(published_object) : 0;
        if (published == -1 && PyErr_Occurred()) return -1;
        PyObject *n = PyLong_FromLongLong(num_computed);
        if (n == NULL) return -1;
        if (new_block || (num_computed >> pool->shift) > published) {  /* may publish */
            PyObject *r = PyObject_CallFunctionObjArgs(pool->set_computed, seq, n, NULL);
            Py_DECREF(n);
            if (r == NULL) return -1;
            Py_DECREF(r);
        } else {  /* seq.num_computed = num_computed */
            PyObject **field = (PyObject **)((char *)seq + layout.num_computed);
            Py_SETREF(*field, n);
            *computed_here += num_computed - seq_computed;
        }
    }
    if (new_block) {
        PyObject *taken = PyObject_CallNoArgs(pool->take);
        if (taken == NULL) return -1;
        block = PyLong_AsLongLong(taken);
        int failed = (block == -1 && PyErr_Occurred()) || PyList_Append(table, taken) < 0;
        Py_DECREF(taken);
        if (failed) return -1;
        a->table_counts.values[i] = 1;
        if (column_push(&a->block_ids, (uint64_t)block) < 0) return -1;
    }
    PyObject *appended = PyLong_FromLongLong(filling ? RESERVED : token);
    if (appended == NULL) return -1;
    int failed = PyList_Append(tokens, appended) < 0;
    Py_DECREF(appended);
    if (failed) return -1;
    a->starts.values[i] = (uint64_t)table_size;
    if (column_push(&a->slots, (uint64_t)((block << pool->shift) | column)) < 0) return -1;
    return 1;
}

static int fast_append(const Pool *pool, PyObject *seq, long long token, long long lookahead,
                       long long num_computed, Answer *a, Py_ssize_t i,
                       long long *computed_here) {
    if (!has_layout(seq)) return 0;
    PyObject *tokens = slot_value(seq, layout.tokens);
    PyObject *table = slot_value(seq, layout.block_table);
    PyObject *seq_computed_object = slot_value(seq, layout.num_computed);
    if (tokens == NULL || table == NULL || seq_computed_object == NULL
        || !PyList_CheckExact(tokens) || !PyList_CheckExact(table))
        return 0;
    /* Held while Python code runs in between (num_free, set_computed, take): code that
     * rebound these slots would otherwise free what the append goes on to use. */
    Py_INCREF(tokens);
    Py_INCREF(table);
    Py_INCREF(seq_computed_object);
    int done = append_to(pool, seq, tokens, table, seq_computed_object, token, lookahead,
                         num_computed, a, i, computed_here);
    Py_DECREF(seq_computed_object);
    Py_DECREF(table);
    Py_DECREF(tokens);
    return done;
}

/* An operation through `slow` (apply_op); its OpResult into the answer. 0 ok, -1 error. */
static int slow_op(PyObject *slow, PyObject *errors, const Parsed *p, Py_ssize_t i,
                   Py_ssize_t offset, long long lookahead, Answer *a) {
    const Column *c = p->columns;
    uint32_t count = (uint32_t)c[TOKEN_COUNTS].values[i];
    PyObject *token_list = PyList_New(count);
    if (token_list == NULL) return -1;
    for (uint32_t t = 0; t < count; t++) {
        PyObject *token = PyLong_FromLong((int32_t)(uint32_t)c[TOKEN_IDS].values[offset + t]);
        if (token == NULL) {
            Py_DECREF(token_list);
            return -1;
        }
        PyList_SET_ITEM(token_list, t, token);
    }
    PyObject *result = PyObject_CallFunction(
        slow, "nlKNKLL", i, (long)(int32_t)(uint32_t)c[KINDS].values[i],
        (unsigned long long)c[SEQ_IDS].values[i], token_list,
        (unsigned long long)c[PARENT_IDS].values[i], (long long)c[COMPUTED].values[i],
        lookahead);
    if (result == NULL) return -1;
    int failed = -1;
    long long status, value;
    if (get_long_attr(result, str_status, &status) < 0) goto done;
    a->statuses.values[i] = (uint64_t)status;
    if (status != STATUS_OK) {
        PyObject *error = PyObject_GetAttr(result, str_error);
        PyObject *index = PyLong_FromSsize_t(i);
        int set = error != NULL && index != NULL && PyDict_SetItem(errors, index, error) == 0;
        Py_XDECREF(error);
        Py_XDECREF(index);
        if (!set) goto done;
        a->slot_counts.values[i] = 0;
        failed = 0;
        goto done;
    }
    if (get_long_attr(result, str_num_cached_tokens, &value) < 0) goto done;
    a->cached.values[i] = (uint64_t)value;
    if (get_long_attr(result, str_table_start, &value) < 0) goto done;
    a->starts.values[i] = (uint64_t)value;
    PyObject *list = PyObject_GetAttr(result, str_table_block_ids);
    Py_ssize_t size = 0;
    int bad = list == NULL || extend_from_list(&a->block_ids, list, &size) < 0;
    Py_XDECREF(list);
    if (bad) goto done;
    a->table_counts.values[i] = (uint64_t)size;
    list = PyObject_GetAttr(result, str_slots);
    bad = list == NULL || extend_from_list(&a->slots, list, &size) < 0;
    Py_XDECREF(list);
    if (bad) goto done;
    a->slot_counts.values[i] = (uint64_t)size;
    list = PyObject_GetAttr(result, str_copies);
    if (list == NULL) goto done;
    PyObject *pairs = PySequence_Fast(list, "copies must be a sequence");
    Py_DECREF(list);
    if (pairs == NULL) goto done;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(pairs); k++) {
        if (extend_from_list(&a->copies, PySequence_Fast_GET_ITEM(pairs, k), NULL) < 0) {
            Py_DECREF(pairs);
            goto done;
        }
    }
    Py_DECREF(pairs);
    failed = 0;
done:
    Py_DECREF(result);
    return failed;
}

static int write_answer(Out *out, uint64_t step_id, uint64_t epoch, const Answer *a,
                        PyObject *errors) {
    if (write_varint_field(out, 1, step_id) < 0
        || write_packed(out, 2, a->statuses.values, a->statuses.size) < 0
        || write_packed(out, 3, a->cached.values, a->cached.size) < 0
        || write_packed(out, 4, a->starts.values, a->starts.size) < 0
        || write_packed(out, 5, a->table_counts.values, a->table_counts.size) < 0
        || write_packed(out, 6, a->block_ids.values, a->block_ids.size) < 0
        || write_packed(out, 7, a->slot_counts.values, a->slot_counts.size) < 0
        || write_packed(out, 8, a->slots.values, a->slots.size) < 0)
        return -1;
    for (Py_ssize_t k = 0; k + 1 < a->copies.size; k += 2) {
        Out copy = {NULL, 0, 0};
        int failed = write_varint_field(&copy, 1, (uint32_t)a->copies.values[k]) < 0
                     || write_varint_field(&copy, 2, (uint32_t)a->copies.values[k + 1]) < 0
                     || write_bytes_field(out, 9, (const char *)copy.bytes, copy.size) < 0;
        PyMem_Free(copy.bytes);
        if (failed) return -1;
    }
    PyObject *key, *value;
    Py_ssize_t position = 0;
    while (PyDict_Next(errors, &position, &key, &value)) {
        Py_ssize_t size;
        const char *text = PyUnicode_AsUTF8AndSize(value, &size);
        long long index = PyLong_AsLongLong(key);
        if (text == NULL || (index == -1 && PyErr_Occurred())) return -1;
        Out entry = {NULL, 0, 0};
        int failed = write_varint_field(&entry, 1, (uint32_t)index) < 0
                     || write_bytes_field(&entry, 2, text, size) < 0
                     || write_bytes_field(out, 10, (const char *)entry.bytes, entry.size) < 0;
        PyMem_Free(entry.bytes);
        if (failed) return -1;
    }
    return write_varint_field(out, 11, epoch);
}

static int fill(Column *column, Py_ssize_t count, uint64_t value) {
    for (Py_ssize_t i = 0; i < count; i++)
        if (column_push(column, value) < 0) return -1;
    return 0;
}

/* run(parsed, seqs, refs, take, num_free, set_computed, shift, capacity, slow, step_id,
 *     epoch) -> (answer bytes, appends done here, num_computed raised here). The caller has checked the columns'
 * lengths (Python: BlockServiceCore._check_columns) and holds the core's lock. */
static PyObject *run(PyObject *module, PyObject *args) {
    PyObject *capsule, *seqs, *slow;
    Pool pool;
    unsigned long long step_id, epoch;
    if (!PyArg_ParseTuple(args, "OO!O!OOOLLOKK", &capsule, &PyDict_Type, &seqs, &PyList_Type,
                          &pool.refs, &pool.take, &pool.num_free, &pool.set_computed,
                          &pool.shift, &pool.capacity, &slow, &step_id, &epoch))
        return NULL;
    const Parsed *p = PyCapsule_GetPointer(capsule, "stepwire.parsed");
    if (p == NULL) return NULL;
    const Column *c = p->columns;
    Py_ssize_t num_ops = c[KINDS].size;
    if (c[SEQ_IDS].size != num_ops || c[TOKEN_COUNTS].size != num_ops
        || c[PARENT_IDS].size != num_ops || c[COMPUTED].size != num_ops
        || (c[LOOKAHEADS].size && c[LOOKAHEADS].size != num_ops)) {
        PyErr_SetString(PyExc_ValueError, "columns of unequal length (not checked?)");
        return NULL;
    }
    Answer a;
    memset(&a, 0, sizeof a);
    PyObject *errors = PyDict_New(), *result = NULL;
    Out out = {NULL, 0, 0};
    if (errors == NULL) return NULL;
    if (fill(&a.statuses, num_ops, STATUS_OK) < 0 || fill(&a.cached, num_ops, 0) < 0
        || fill(&a.starts, num_ops, 0) < 0 || fill(&a.table_counts, num_ops, 0) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < num_ops; i++)  /* right for every successful op but ALLOCATE */
        if (column_push(&a.slot_counts, (uint32_t)c[TOKEN_COUNTS].values[i]) < 0) goto done;
    Py_ssize_t offset = 0, fast_appends = 0;
    long long computed_here = 0;  /* num_computed raised here, not through set_computed */
    for (Py_ssize_t i = 0; i < num_ops; i++) {
        uint32_t count = (uint32_t)c[TOKEN_COUNTS].values[i];
        long long lookahead = c[LOOKAHEADS].size ? (uint32_t)c[LOOKAHEADS].values[i] : 0;
        if (offset + (Py_ssize_t)count > c[TOKEN_IDS].size) {
            PyErr_SetString(PyExc_ValueError, "token_counts past token_ids (not checked?)");
            goto done;
        }
        if (count == 1 && (int32_t)(uint32_t)c[KINDS].values[i] == OP_APPEND) {
            PyObject *key = PyLong_FromUnsignedLongLong(c[SEQ_IDS].values[i]);
            if (key == NULL) goto done;
            PyObject *seq = PyDict_GetItemWithError(seqs, key);
            Py_DECREF(key);
            if (seq == NULL && PyErr_Occurred()) goto done;
            if (seq != NULL) {
                Py_INCREF(seq);
                int done_here = fast_append(
                    &pool, seq, (int32_t)(uint32_t)c[TOKEN_IDS].values[offset], lookahead,
                    (long long)c[COMPUTED].values[i], &a, i, &computed_here);
                Py_DECREF(seq);
                if (done_here < 0) goto done;
                if (done_here) {
                    offset += 1;
                    fast_appends += 1;
                    continue;
                }
            }
        }
        if (slow_op(slow, errors, p, i, offset, lookahead, &a) < 0) goto done;
        offset += count;
    }
    if (write_answer(&out, step_id, epoch, &a, errors) < 0) goto done;
    result = Py_BuildValue("(y#nL)", (const char *)out.bytes, out.size, fast_appends,
                           computed_here);
done:
    PyMem_Free(out.bytes);
    answer_free(&a);
    Py_DECREF(errors);
    return result;
}

static PyMethodDef methods[] = {
    {"parse", parse, METH_O,
     "parse(data) -> (session_id, pool_id, step_id, epoch, num_waiting_tokens, column "
     "lengths (kinds, seq_ids, token_counts, token_ids, parent_seq_ids, num_computed_tokens, "
     "num_lookahead_slots), sum of token_counts, cache_salts, parsed) or None"},
    {"run", run, METH_VARARGS,
     "run(parsed, seqs, refs, take, num_free, set_computed, shift, capacity, slow, step_id, "
     "epoch) -> (StepResponse bytes, fast appends, num_computed raised by them)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_stepwire", "A Step from request bytes to answer bytes.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__stepwire(void) {
    struct { PyObject **slot; const char *name; } names[] = {
        {&str_tokens, "tokens"}, {&str_block_table, "block_table"},
        {&str_num_computed, "num_computed"}, {&str_num_published, "num_published"},
        {&str_status, "status"}, {&str_error, "error"},
        {&str_num_cached_tokens, "num_cached_tokens"}, {&str_table_start, "table_start"},
        {&str_table_block_ids, "table_block_ids"}, {&str_slots, "slots"},
        {&str_copies, "copies"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].name);
        if (*names[i].slot == NULL) return NULL;
    }
    return PyModule_Create(&module_def);
}
