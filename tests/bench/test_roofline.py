"""bench/roofline.py counts a forward's FLOPs as an outside oracle does: torch's FlopCounterMode
over the Hugging Face model of the same weights shapes, for a prefill and for a decode step;
its bytes on a case small enough to derive by hand; and its roofline arithmetic.

FlopCounterMode counts the projections and the LM head as aten.mm exactly as we do (2 per
multiply-add). Attention is compared on its own: on CPU, SDPA's fused kernel has no FLOP
formula registered, so the oracle runs the eager attention, whose two batched matmuls
(aten.bmm under each self_attn) cover every query against every key — the causal mask is
applied to the scores, not to the work. A decode query sees every key anyway, so there the
counts agree exactly; a prefill of L tokens computes L * L scores per head where causal
attention needs L * (L + 1) / 2, which is the correction applied."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import roofline
from bench.roofline import GemmPeak, MachinePeaks, Work
from gpu_runner.batch import ExecuteBatch
from gpu_runner.config import ModelConfig, RopeScaling, load_model_config
from tests.helpers.tiny_models import make_tiny_model

BLOCK = 16


def batch(starts: list[int], new: list[int], sample: list[bool] | None = None) -> ExecuteBatch:
    """Sequences whose new tokens sit at start .. start + new - 1 (token ids are all 3)."""
    n = len(new)
    tables = [np.arange(i * 64, i * 64 + -(-(s + c) // BLOCK)) for i, (s, c)
              in enumerate(zip(starts, new, strict=True))]
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, s, c in zip(tables, starts, new, strict=True)
             for p in [np.arange(s, s + c)]]
    return ExecuteBatch(
        num_new_tokens=np.array(new), start_positions=np.array(starts),
        token_ids=np.full(sum(new), 3), slot_mapping=np.concatenate(slots),
        block_table_lens=np.array([len(t) for t in tables]),
        block_tables=np.concatenate(tables),
        do_sample=np.array(sample if sample is not None else [True] * n),
        temperatures=np.zeros(n, np.float32), top_ps=np.ones(n, np.float32),
        top_ks=np.zeros(n, np.int64), min_ps=np.zeros(n, np.float32),
        seeds=np.zeros(n, np.uint64))


def oracle(model: torch.nn.Module, **inputs: object) -> tuple[int, int]:
    """(aten.mm FLOPs of the whole forward, aten.bmm FLOPs inside the attention modules)."""
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    counts = counter.get_flop_counts()
    matmuls = sum(n for op, n in counts["Global"].items() if "aten.mm" in str(op)
                  or "aten.addmm" in str(op))
    attention = sum(n for name, ops in counts.items() if name.endswith("self_attn")
                    for op, n in ops.items() if "aten.bmm" in str(op))
    return matmuls, attention


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_flops_match_flop_counter_mode_for_a_prefill_and_a_decode_step(
        arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, DynamicCache

    folder = make_tiny_model(arch, tmp_path / arch)
    config = load_model_config(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    length = 37
    ids = torch.full((1, length), 3)
    cache = DynamicCache(config=model.config)

    # Prefill, logits only at the last position (the runner's one sampled row).
    mm, bmm = oracle(model, input_ids=ids, cache=cache, use_cache=True,
                     logits_to_keep=1)
    ours = roofline.forward_work(config, batch([0], [length]), torch.float32)
    assert ours.flops - ours.attention_flops == mm
    assert ours.attention_flops == bmm * (length + 1) / (2 * length)  # causal half, see above

    # One decode step at position `length`: it sees length + 1 keys, as every eager query does.
    mm, bmm = oracle(model, input_ids=ids[:, :1], cache=cache, use_cache=True)
    ours = roofline.forward_work(config, batch([length], [1]), torch.float32)
    assert (ours.flops - ours.attention_flops, ours.attention_flops) == (mm, bmm)


def test_a_mixed_batch_counts_the_lm_head_only_for_sampling_rows(tmp_path: Path) -> None:
    config = load_model_config(make_tiny_model("llama", tmp_path / "llama"))
    prefill_chunk = roofline.forward_work(config, batch([32], [16], [False]), "float32")
    decode = roofline.forward_work(config, batch([100], [1]), "float32")
    both = roofline.forward_work(config, batch([32, 100], [16, 1], [False, True]), "float32")
    assert prefill_chunk.lm_head_flops == 0
    assert both.flops == prefill_chunk.flops + decode.flops
    assert both.lm_head_flops == 2 * config.vocab_size * config.hidden_size
    # A chunk at 32..47 sees 33 + 34 + ... + 48 keys.
    assert prefill_chunk.attention_flops == (
        config.num_layers * 4 * config.q_size * sum(range(33, 49)))


def _hand_config(**changes: object) -> ModelConfig:
    fields: dict[str, object] = dict(
        architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4, intermediate_size=8,
        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-6,
        rope=RopeScaling(10000.0), max_position_embeddings=64, tie_word_embeddings=True,
        attention_bias=False, qk_norm=False)
    return ModelConfig(**{**fields, **changes})  # type: ignore[arg-type]


def test_bytes_of_a_hand_derivable_case() -> None:
    config = _hand_config()
    # One sequence, 2 new tokens at positions 3 and 4, sampling; bfloat16 (2 bytes).
    work = roofline.forward_work(config, batch([3], [2]), torch.bfloat16)
    # Per layer: qkv 4x(2*2+2*1*2=8) = 32, o 4x4 = 16, gate_up 4x16 = 64, down 8x4 = 32,
    # two norms of 4 -> 152 elements; 2 layers -> 304; the final norm 4; 2 embedding rows
    # of 4 = 8; the tied LM head's 10x4 = 40: weights 356 elements.
    weights = 2 * (32 + 16 + 64 + 32 + 8) + 4 + 2 * 4 + 10 * 4
    # KV per layer: K and V of 1 head x 2 dims, read for the 5 keys of the sequence (3 old,
    # 2 new) and written for the 2 new: 2 * 2 * (5 + 2) = 28; 2 layers -> 56.
    kv = 2 * 2 * 2 * (5 + 2)
    assert weights == 356 and kv == 56
    assert work.bytes == 2 * (weights + kv)
    # FLOPs: 2 tokens through 144 weights per layer, 2 layers: 2*2*144*2 = 1152; attention:
    # keys seen 4 + 5 = 9, x 4 x 2 heads x 2 dims x 2 layers = 288; LM head 2*1*10*4 = 80.
    assert (work.flops, work.attention_flops, work.lm_head_flops) == (1152 + 288 + 80, 288, 80)
    # Biases and q/k norms are weights read too; float32 doubles every byte.
    qwen = _hand_config(attention_bias=True, qk_norm=True)
    extra = 2 * (8 + 2 * 2)
    assert roofline.forward_work(qwen, batch([3], [2]), "float32").bytes == 4 * (
        weights + extra + kv)


def _peaks() -> MachinePeaks:
    return MachinePeaks(2, {"bfloat16": GemmPeak("bfloat16", 100.0, "plain", "x")},
                        copy_gbs=9.0, triad_gbs=8.0, read_gbs=10.0)


def test_the_roofline_takes_the_larger_bound_per_forward() -> None:
    peaks = _peaks()
    assert peaks.bandwidth_gbs == 10.0  # the best of copy, triad and read
    prefill = Work(flops=100e9, bytes=1e9)  # 1 s of compute, 0.1 s of traffic
    decode = Work(flops=1e9, bytes=2e9)  # 0.01 s of compute, 0.2 s of traffic
    line = roofline.roofline([prefill, decode, decode], 2.8, peaks, torch.bfloat16)
    assert line.attainable_s == pytest.approx(1.0 + 0.2 + 0.2)
    assert line.fraction == pytest.approx(0.5)
    assert line.bound == "compute-bound"
    assert line.gflops == pytest.approx(102e9 / 2.8 / 1e9)
    assert line.describe() == (
        "bfloat16: 36 GFLOP/s (36 % of 100 GFLOP/s GEMM peak), 1.8 GB/s (18 % of 10.0 GB/s); "
        "roofline bound 1.40 s of 2.80 s measured → 50 % (compute-bound)")
    decodes = roofline.roofline([decode] * 6, 1.2, peaks, "bfloat16")
    assert decodes.bound == "bandwidth-bound" and decodes.fraction == pytest.approx(1.0)
    summed = line + decodes
    assert (summed.attainable_s, summed.measured_s, summed.forwards) == pytest.approx(
        (2.6, 4.0, 9))
    assert roofline.Roofline.from_dict(summed.as_dict()) == summed
    assert MachinePeaks.from_dict(peaks.as_dict()) == peaks


def test_a_tally_adds_each_way_over_rounds() -> None:
    tally = roofline.RooflineTally("bfloat16", _peaks())
    for _ in range(2):
        tally.add("ceiling", [Work(1e9, 2e9)], 0.4)
        tally.add("pagewire", [Work(1e9, 2e9)], 0.5)
    assert tally.by_way["ceiling"].fraction == pytest.approx(0.5)
    assert tally.as_dict()["pagewire"]["measured_s"] == pytest.approx(1.0)


def test_the_peak_gemm_uses_only_kernels_that_compute_the_product() -> None:
    weight = torch.randn(48, 32)
    kernels = roofline._kernels(weight)
    assert "plain" in kernels
    x = torch.randn(5, 32)
    for run in kernels.values():
        assert roofline._computes_the_product(run, x, weight)
    assert "plain" in roofline._kernels(weight.to(torch.bfloat16))

    def skips_the_last_row(x: torch.Tensor) -> torch.Tensor:
        y = x @ weight.T
        y[-1] = 0
        return y

    def raises(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("dtype not supported")

    assert not roofline._computes_the_product(skips_the_last_row, x, weight)
    assert not roofline._computes_the_product(raises, x, weight)


def test_the_runner_bench_puts_batch_1_decode_and_prefill_under_the_roofline(
        capsys: pytest.CaptureFixture[str]) -> None:
    from argparse import Namespace

    from bench import runner as runner_bench

    config = _hand_config()
    rows = [runner_bench.Row("decode batch  1 ctx 8", 2.0, 3.0, "ms"),
            runner_bench.Row("decode batch  8 ctx 8", 4.0, 5.0, "ms"),
            runner_bench.Row("prefill 2x4", 8.0, 4.0, "tok/s")]
    args = Namespace(context=8, prefill_prompts=2, prefill_len=4)
    runner_bench.print_roofline(config, _peaks(), torch.bfloat16, rows, args)
    printed = capsys.readouterr().out.splitlines()
    decode = roofline.forward_work(config, batch([8], [1]), torch.bfloat16)
    prefill = roofline.forward_work(config, batch([0, 0], [4, 4]), torch.bfloat16)
    assert printed[-2] == "  decode batch 1: " + roofline.roofline(
        [decode], 2e-3, _peaks(), "bfloat16").describe()
    assert printed[-1] == "  prefill 2x4: " + roofline.roofline(
        [prefill], 1.0, _peaks(), "bfloat16").describe()  # 8 tokens at 8 tok/s
