"""Logit bias and presence / frequency / repetition penalties, against references outside
pagewire: transformers' own RepetitionPenaltyLogitsProcessor, a plain-Python loop of OpenAI's
formula, and transformers' greedy generate with repetition_penalty through the runner.
Batch invariance: a row's token does not depend on the other rows nor on the row order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from gpu_runner.batch import ExecuteBatch
from gpu_runner.penalties import PenaltyTensors, pack, penalised
from gpu_runner.runner import ModelRunner
from gpu_runner.sampler import SamplingTensors, sample
from tests.gpu_runner.conftest import load_oracle, make_runner
from tests.gpu_runner.test_sampler import fixed_logits, make_params
from tests.helpers.paged_driver import PagedDriver, Penalties, Seq, with_penalties
from tests.helpers.tiny_models import make_tiny_model

VOCAB = 1000
Histories = list[list[int]]


def random_histories(rows: int, seed: int, vocab: int = VOCAB) -> tuple[Histories, list[int]]:
    """Histories with repeats (tokens drawn from a small range) and their prompt lengths."""
    rng = np.random.default_rng(seed)
    histories, prompt_lens = [], []
    for _ in range(rows):
        length = int(rng.integers(1, 40))
        histories.append(rng.integers(0, min(vocab, 60), length).tolist())
        prompt_lens.append(int(rng.integers(0, length + 1)))
    return histories, prompt_lens


def penalty_tensors(histories: Histories, prompt_lens: list[int], presence: list[float],
                    frequency: list[float], repetition: list[float],
                    biases: list[dict[int, float]] | None = None) -> PenaltyTensors | None:
    """The runner's packing (penalties.pack) of per-row parameters and histories; rows with
    nothing on are left out, None when none is left."""
    biases = biases or [{} for _ in histories]
    lens = np.array([len(h) for h in histories], dtype=np.int64)
    bias_counts = np.array([len(b) for b in biases], dtype=np.int64)
    return pack(
        presence=np.array(presence, np.float32), frequency=np.array(frequency, np.float32),
        repetition=np.array(repetition, np.float32),
        history_starts=np.cumsum(lens) - lens, history_lens=lens,
        history_ids=np.array([t for h in histories for t in h], dtype=np.int64),
        prompt_lens=np.array(prompt_lens, np.int64),
        bias_starts=np.cumsum(bias_counts) - bias_counts, bias_counts=bias_counts,
        bias_token_ids=np.array([t for b in biases for t in b], dtype=np.int64),
        bias_values=np.array([v for b in biases for v in b.values()], dtype=np.float32),
        device=torch.device("cpu"))


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors | None) -> torch.Tensor:
    """The logits the sampler sees inside ``penalised`` (the rows with something on
    processed); ``logits`` is left untouched."""
    assert penalties is not None
    processed = logits.clone()
    with penalised(processed, penalties):
        return processed.clone()


def openai_reference(logits: torch.Tensor, output: list[int], presence: float,
                     frequency: float) -> torch.Tensor:
    """logit[j] -= count[j] * frequency + (count[j] > 0) * presence, token by token, in
    float32 scalars (a plain loop, no pagewire code)."""
    result = logits.clone()
    f, p = np.float32(frequency), np.float32(presence)
    for token in set(output):
        count = np.float32(output.count(token))
        value = np.float32(result[token].item())
        result[token] = float(value - (count * f + np.float32(count > 0) * p))
    return result


def reference(logits: torch.Tensor, history: list[int], prompt_len: int, presence: float,
              frequency: float, repetition: float, bias: dict[int, float]) -> torch.Tensor:
    """vLLM's order from independent pieces: bias, transformers' repetition processor,
    OpenAI's loop."""
    row = logits.clone()
    for token, value in bias.items():
        row[token] += np.float32(value)
    if repetition != 1 and history:
        row = RepetitionPenaltyLogitsProcessor(repetition)(
            torch.tensor([history]), row[None])[0]
    return openai_reference(row, history[prompt_len:], presence, frequency)


def test_repetition_penalty_is_transformers_processor_bit_for_bit() -> None:
    logits = fixed_logits(5, VOCAB, seed=11)
    histories, prompt_lens = random_histories(5, seed=1)
    penalties = [1.3, 0.7, 1.0, 2.0, 1e-3]
    pt = penalty_tensors(histories, prompt_lens, [0.0] * 5, [0.0] * 5, penalties)
    assert pt is not None and pt.rows.tolist() == [0, 1, 3, 4]  # 1.0 is off: row 2 not copied
    result = apply_penalties(logits, pt)
    for row in range(5):
        expected = RepetitionPenaltyLogitsProcessor(penalties[row])(
            torch.tensor([histories[row]]), logits[row:row + 1].clone())[0]
        assert torch.equal(result[row], expected), row


def test_presence_and_frequency_are_openai_formula_over_output_tokens_only() -> None:
    logits = fixed_logits(4, VOCAB, seed=12)
    histories, prompt_lens = random_histories(4, seed=2)
    presence, frequency = [0.5, -2.0, 0.0, 1.25], [0.3, 0.0, -1.5, 2.0]
    pt = penalty_tensors(histories, prompt_lens, presence, frequency, [1.0] * 4)
    assert pt is not None
    result = apply_penalties(logits, pt)
    for row in range(4):
        expected = openai_reference(logits[row], histories[row][prompt_lens[row]:],
                                    presence[row], frequency[row])
        assert torch.equal(result[row], expected), row
    # A prompt-only history changes nothing.
    only_prompt = penalty_tensors([[5, 5, 6]], [3], [1.0], [1.0], [1.0])
    assert only_prompt is not None
    assert torch.equal(apply_penalties(logits[:1], only_prompt), logits[:1])


def test_all_together_in_vllm_order_and_logits_untouched() -> None:
    logits = fixed_logits(3, VOCAB, seed=13)
    original = logits.clone()
    histories, prompt_lens = random_histories(3, seed=3)
    biases = [{7: 100.0, 3: -100.0, 999: 2.5}, {}, {histories[2][0]: 1.5}]
    presence, frequency, repetition = [0.4, 0.0, -0.5], [0.2, 0.0, 0.9], [1.2, 1.0, 0.8]
    pt = penalty_tensors(histories, prompt_lens, presence, frequency, repetition, biases)
    assert pt is not None and pt.rows.tolist() == [0, 2]
    result = apply_penalties(logits, pt)
    assert torch.equal(logits, original)
    assert torch.equal(result[1], logits[1])  # no penalty: bit-identical
    for row in (0, 2):
        expected = reference(logits[row], histories[row], prompt_lens[row], presence[row],
                             frequency[row], repetition[row], biases[row])
        assert torch.equal(result[row], expected), row


def with_row_penalties(params: SamplingTensors, pt: PenaltyTensors | None) -> SamplingTensors:
    params.penalties = pt
    return params


def test_greedy_argmaxes_processed_logits_and_logprobs_stay_raw() -> None:
    logits = fixed_logits(3, VOCAB, seed=14)
    raw_top = logits.argmax(-1)
    # Row 0: bias forces token 5; row 1: the top token repeated, heavily penalised.
    histories = [[1], [int(raw_top[1])] * 3, [2]]
    pt = penalty_tensors(histories, [0, 0, 1], [0.0, 2.0, 0.0], [0.0, 2.0, 0.0],
                         [1.0, 2.0, 1.0], [{5: 100.0}, {}, {}])
    original = logits.clone()
    out = sample(logits, with_row_penalties(make_params(3, num_logprobs=[2, 2, 2]), pt))
    assert torch.equal(logits, original)  # processed in place while sampling, then restored
    assert pt is not None
    processed = apply_penalties(logits, pt)
    assert out.token_ids.tolist() == processed.argmax(-1).tolist()
    assert out.token_ids[0] == 5 and out.token_ids[1] != raw_top[1]
    assert out.token_ids[2] == raw_top[2]
    raw_logprobs = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_token_ids is not None
    assert torch.allclose(out.logprobs, raw_logprobs.gather(1, out.token_ids[:, None])[:, 0],
                          atol=1e-5)
    assert out.top_token_ids[:, 0].tolist() == raw_top.tolist()


def test_seeded_sampling_draws_from_processed_logits() -> None:
    logits = fixed_logits(4, VOCAB, seed=15, scale=1.0)
    histories, prompt_lens = random_histories(4, seed=4)
    pt = penalty_tensors(histories, prompt_lens, [0.5] * 4, [0.5] * 4, [1.3] * 4,
                         [{0: 3.0}] * 4)
    assert pt is not None
    processed = apply_penalties(logits, pt)
    for top_k in (0, 20):
        kwargs = dict(temperature=0.8, top_k=top_k, seeds=[1, 2, 3, 4], positions=[9] * 4)
        got = sample(logits, with_row_penalties(make_params(4, **kwargs), pt)).token_ids
        assert torch.equal(got, sample(processed, make_params(4, **kwargs)).token_ids)


ROWS = 6  # half with penalties or bias, half without; greedy and sampled


def _row_inputs() -> tuple[torch.Tensor, Histories, list[int], list[Penalties]]:
    logits = fixed_logits(ROWS, VOCAB, seed=16, scale=1.0)
    histories, prompt_lens = random_histories(ROWS, seed=5)
    settings = [Penalties(0.5, 0.5, 1.3), Penalties(), Penalties(bias={4: 5.0}),
                Penalties(), Penalties(-1.0, 0.7, 0.9, {1: -100.0}), Penalties()]
    return logits, histories, prompt_lens, settings


def _sample_rows(order: list[int]) -> list[int]:
    logits, histories, prompt_lens, settings = _row_inputs()
    rows = [settings[i] for i in order]
    biases = [s.bias for s in rows]
    pt = penalty_tensors([histories[i] for i in order], [prompt_lens[i] for i in order],
                         [s.presence for s in rows], [s.frequency for s in rows],
                         [s.repetition for s in rows], biases)
    params = make_params(len(order), temperature=[[0.0, 0.9][i % 2] for i in order],
                         top_p=[[1.0, 0.9, 1.0][i % 3] for i in order],
                         seeds=[100 + i for i in order], positions=[50 + i for i in order])
    return sample(logits[order], with_row_penalties(params, pt)).token_ids.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rows_token_is_the_same_alone_and_in_any_mixed_batch(seed: int) -> None:
    alone = [_sample_rows([i])[0] for i in range(ROWS)]
    order = np.random.default_rng(seed).permutation(ROWS).tolist()
    together = _sample_rows(order)
    assert [together[order.index(i)] for i in range(ROWS)] == alone


def test_rows_without_penalties_are_bit_identical_to_before() -> None:
    logits, histories, prompt_lens, settings = _row_inputs()
    before = sample(logits, make_params(ROWS, temperature=0.9, seeds=list(range(ROWS)),
                                        num_logprobs=[3] * ROWS))
    pt = penalty_tensors(histories, prompt_lens, [s.presence for s in settings],
                         [s.frequency for s in settings], [s.repetition for s in settings],
                         [s.bias for s in settings])
    after = sample(logits, with_row_penalties(make_params(
        ROWS, temperature=0.9, seeds=list(range(ROWS)), num_logprobs=[3] * ROWS), pt))
    plain = [i for i, s in enumerate(settings) if s == Penalties()]
    assert after.token_ids[plain].tolist() == before.token_ids[plain].tolist()
    assert after.logprobs is not None and before.logprobs is not None
    assert torch.equal(after.logprobs[plain], before.logprobs[plain])
    for name in ("top_token_ids", "top_logprobs"):  # of the raw logits: every row
        assert torch.equal(getattr(after, name), getattr(before, name)), name
    assert penalty_tensors(histories, prompt_lens, [0.0] * ROWS, [0.0] * ROWS,
                           [1.0] * ROWS) is None  # nothing on: nothing runs


# ---- through the runner (ExecuteBatch columns, histories, chunked prefill) --------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("penalties") / "llama", seed=7)


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return make_runner(model_dir, block_size=8, cache_bytes=4 << 20, max_model_len=256)


def _decode(runner: ModelRunner, prompts: list[list[int]], settings: list[Penalties],
            steps: int, chunk: int | None = None) -> list[Seq]:
    """Greedy decoding of all prompts together, penalty columns filled as the gateway does;
    the first prompt is prefilled in chunks of `chunk` tokens when given."""
    driver = PagedDriver(lambda batch: runner.execute(batch).token_ids, runner.block_size,
                         runner.num_blocks)
    seqs = [driver.add(p) for p in prompts]
    while active := [i for i, s in enumerate(seqs) if len(s.generated) < steps]:
        limits = {0: chunk} if chunk and 0 in active else None
        batch, sampled = driver.build([seqs[i] for i in active],
                                      {active.index(0): chunk} if limits else None)
        batch = with_penalties(batch, [seqs[i] for i in active], [settings[i] for i in active])
        tokens = runner.execute(batch).token_ids.tolist()
        for seq, token in zip(sampled, tokens, strict=True):
            seq.tokens.append(int(token))
    return seqs


def test_runner_greedy_repetition_penalty_equals_transformers_generate(
        runner: ModelRunner, model_dir: Path) -> None:
    prompts = [list(range(5, 25)), [7, 8, 9, 7, 8], [3, 3, 3]]
    settings = [Penalties(repetition=1.3), Penalties(), Penalties(repetition=1.3)]
    seqs = _decode(runner, prompts, settings, steps=8, chunk=8)
    oracle = load_oracle(model_dir)
    for seq, prompt, s in zip(seqs, prompts, settings, strict=True):
        with torch.inference_mode():
            out = oracle.model.generate(torch.tensor([prompt]), max_new_tokens=8,
                                        min_new_tokens=0, do_sample=False, eos_token_id=None,
                                        pad_token_id=0, repetition_penalty=s.repetition)
        assert seq.generated == out[0, len(prompt):].tolist(), prompt
    # The plain greedy output of [3, 3, 3] repeats a token: the penalty changes it.
    assert seqs[2].generated != oracle.generate(prompts[2], 8)[0]


def test_runner_presence_frequency_and_bias_equal_a_reference_loop(
        runner: ModelRunner, model_dir: Path) -> None:
    prompts = [[3, 3, 3], [20, 21], [30, 31, 32]]
    settings = [Penalties(presence=1.5, frequency=0.8), Penalties(bias={9: 100.0}),
                Penalties(0.3, -0.2, 1.1, {30: -5.0})]
    seqs = _decode(runner, prompts, settings, steps=6)
    assert seqs[1].generated == [9] * 6
    oracle = load_oracle(model_dir)
    for seq, prompt, s in zip(seqs, prompts, settings, strict=True):
        tokens = list(prompt)
        for _ in range(6):
            with torch.inference_mode():
                logits = oracle.model(torch.tensor([tokens])).logits[0, -1].float()
            processed = reference(logits, tokens, len(prompt), s.presence, s.frequency,
                                  s.repetition, s.bias)
            tokens.append(int(processed.argmax()))
        assert seq.generated == tokens[len(prompt):], prompt
    assert seqs[0].generated != oracle.generate(prompts[0], 6)[0]  # it repeats a token


def test_history_is_counted_once_whether_sent_or_new(runner: ModelRunner) -> None:
    """The same sequence state as a whole prompt (all new tokens) and as a decode (history
    sent, one new token) gives the same penalised logits: prompt_lens splits them right."""
    driver = PagedDriver(lambda batch: runner.execute(batch).token_ids, runner.block_size,
                         runner.num_blocks)
    seq = driver.add([4, 4, 5])
    seq.tokens += [6, 6]  # two "generated" tokens, computed with the prompt here
    batch, _ = driver.build([seq])
    batch = with_penalties(batch, [seq], [Penalties(0.0, 10.0, 1.0)])
    assert batch.penalty_history_lens.tolist() == [0]
    whole = runner.execute(batch).token_ids
    seq.computed = 4  # recompute the last token as a decode: history of 4 sent
    batch, _ = driver.build([seq])
    batch = with_penalties(batch, [seq], [Penalties(0.0, 10.0, 1.0)])
    assert batch.penalty_history_lens.tolist() == [4] and batch.num_new_tokens.tolist() == [1]
    assert runner.execute(batch).token_ids.tolist() == whole.tolist()
    assert int(whole[0]) != 6  # frequency 10 over two 6s


def test_batch_without_columns_builds_no_penalty_tensors(runner: ModelRunner) -> None:
    from gpu_runner.batch import build_inputs

    driver = PagedDriver(lambda batch: runner.execute(batch).token_ids, runner.block_size,
                         runner.num_blocks)
    batch: ExecuteBatch = driver.build([driver.add([1, 2, 3])])[0]
    inputs = build_inputs(batch, runner.block_size, runner.device)
    assert inputs.sampling is not None and inputs.sampling.penalties is None
