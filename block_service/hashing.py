"""Chained prefix hashes of full blocks.

A full block's hash is xxh3_128 over its parent block's hash (16 bytes) followed by the block's
token ids packed as native-endian int32. The first block's parent is ROOT_HASH, or, with a
cache salt, a hash of the salt, so prefixes are shared only between requests with the same
salt. Because each hash covers its parent's, equal hashes mean equal whole prefixes up to
128-bit collisions.

Collision guard: the block pool also keeps, for every cached block, its token ids and its
parent's hash, and a lookup hits only when both equal the looked-up block's (see
BlockPool.lookup). A block-level collision is therefore always caught; two different whole
prefixes with the same 128-bit parent hash is what remains, at a probability of about 2**-128
per pair of prefixes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

HASH_BYTES = 16
ROOT_HASH = bytes(HASH_BYTES)
_SALT_PREFIX = b"pagewire.block.v1/cache_salt:"
_digest = xxhash.xxh3_128_digest


def root_hash(cache_salt: str = "") -> bytes:
    """The parent hash of a sequence's first block: ROOT_HASH, or one derived from the salt."""
    if not cache_salt:
        return ROOT_HASH
    return _digest(_SALT_PREFIX + cache_salt.encode("utf-8"))


def block_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full block."""
    return _digest(parent_hash + array("i", token_ids).tobytes())


def chain_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int, parent_hash: bytes
) -> list[bytes]:
    """Hashes of the first `num_blocks` full blocks of `token_ids`, chained from `parent_hash`."""
    # The tokens packed once; each block's bytes are a slice of them (as block_hash packs).
    packed = array("i", token_ids[:num_blocks * block_size]).tobytes()
    step = block_size * 4
    hashes: list[bytes] = []
    for start in range(0, num_blocks * step, step):
        parent_hash = _digest(parent_hash + packed[start:start + step])
        hashes.append(parent_hash)
    return hashes
