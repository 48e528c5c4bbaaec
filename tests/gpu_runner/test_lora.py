"""LoRA adapters in the runner: greedy output equal to transformers + PEFT (unmerged and
merged) token for token in float32, alone and in batches mixing adapters and base rows, with
more adapters than slots; and every way an adapter can be refused."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from gpu_runner import cpu_kernels
from gpu_runner.batch import ExecuteBatch
from gpu_runner.lora.manager import AdapterConflictError, AdapterUnknownError
from gpu_runner.lora.peft_format import AdapterError, AdapterNotFoundError
from gpu_runner.merging import BatchError
from gpu_runner.runner import ModelRunner, RunnerOptions
from gpu_runner.servicer import RunnerServicer
from tests.gpu_runner.conftest import runner_driver
from tests.gpu_runner.test_parity import random_prompts
from tests.helpers.lora_adapters import ATTENTION, MLP, greedy, make_peft_adapter, peft_model
from tests.helpers.paged_driver import PagedDriver, Seq

STEPS = 12
# name -> (rank, targets, rslora): ranks, target sets and scalings that differ.
ADAPTERS = {
    "qv": (4, ("q_proj", "v_proj"), False),
    "all": (8, ATTENTION + MLP, True),
    "mlp": (2, ("o_proj", "gate_proj", "down_proj"), False),
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        (arch, name): make_peft_adapter(tiny_model_dirs[arch], root / arch / name, rank,
                                        targets, seed=seed, rslora=rslora)
        for arch in ("qwen2", "qwen3", "llama")
        for seed, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())
    }


def lora_runner(folder: Path, max_loras: int = 4, max_rank: int = 8) -> ModelRunner:
    return ModelRunner(RunnerOptions(model=str(folder), kv_cache_memory=16 << 20,
                                     max_model_len=512, max_loras=max_loras,
                                     max_lora_rank=max_rank))


def load(runner: ModelRunner, name: str, path: Path) -> None:
    assert runner.lora is not None
    runner.lora.register(runner.lora.read(name, str(path)))


@cache
def _peft(base: Path, adapter: Path | None, merged: bool) -> object:
    if adapter is None:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return peft_model(base, adapter, merged)


def expected(base: Path, adapter: Path | None, prompt: list[int], merged: bool = False
             ) -> list[int]:
    return greedy(_peft(base, adapter, merged), prompt, STEPS)


def run_staggered(driver: PagedDriver, prompts: list[list[int]], adapters: list[str]
                  ) -> list[Seq]:
    """Every prompt to STEPS tokens; the second half joins at step 2 (prefills beside
    decodes), each sequence on its own adapter."""
    seqs = [driver.add(prompt) for prompt in prompts]
    for seq, adapter in zip(seqs, adapters, strict=True):
        seq.adapter = adapter
    step = 0
    while True:
        started = seqs if step >= 2 else seqs[: (len(seqs) + 1) // 2]
        active = [seq for seq in started if len(seq.generated) < STEPS]
        if not active:
            return seqs
        driver.step(active)
        step += 1


@pytest.mark.parametrize("arch,kernel", [("qwen2", True), ("qwen3", True), ("llama", True),
                                         ("llama", False)])
def test_mixed_adapters_and_base_match_peft(tiny_model_dirs: dict[str, Path],
                                           adapter_dirs: dict, arch: str, kernel: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """kernel: the C++ LoRA kernel (float32 CPU); else torch's two matmuls per group."""
    assert cpu_kernels.available(), cpu_kernels.failure_reason()
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "available", lambda device="cpu": False)
    base = tiny_model_dirs[arch]
    runner = lora_runner(base)
    for name in ADAPTERS:
        load(runner, name, adapter_dirs[(arch, name)])
    prompts = random_prompts((5, 17, 9, 33, 1, 24, 40, 12), seed=7)
    names = ["qv", "all", "", "mlp", "all", "qv", "mlp", ""]
    seqs = run_staggered(runner_driver(runner), prompts, names)
    changed = 0
    for prompt, name, seq in zip(prompts, names, seqs, strict=True):
        adapter = adapter_dirs[(arch, name)] if name else None
        assert seq.generated == expected(base, adapter, prompt), f"{name or 'base'} " \
            f"prompt of {len(prompt)}"
        changed += name != "" and seq.generated != expected(base, None, prompt)
    # The adapters must matter, or equality with PEFT proves nothing.
    assert changed >= 4


def test_merged_adapter_gives_the_same_tokens(tiny_model_dirs: dict[str, Path],
                                              adapter_dirs: dict) -> None:
    """PEFT's merge_and_unload (the adapter folded into the weights) as a second oracle."""
    base = tiny_model_dirs["qwen3"]
    runner = lora_runner(base)
    load(runner, "all", adapter_dirs[("qwen3", "all")])
    prompts = random_prompts((11, 30), seed=8)
    seqs = run_staggered(runner_driver(runner), prompts, ["all", "all"])
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.generated == expected(base, adapter_dirs[("qwen3", "all")], prompt,
                                         merged=True)


def test_more_adapters_than_slots_evict_least_recently_used(
        tiny_model_dirs: dict[str, Path], adapter_dirs: dict) -> None:
    base = tiny_model_dirs["llama"]
    runner = lora_runner(base, max_loras=2)
    for name in ADAPTERS:
        load(runner, name, adapter_dirs[("llama", name)])
    driver = runner_driver(runner)
    prompts = random_prompts((6, 14, 21), seed=9)
    rounds = (["qv", "all", "qv"], ["mlp", "all", ""], ["qv", "mlp", "mlp"])
    for names in rounds:
        seqs = run_staggered(driver, prompts, names)
        for prompt, name, seq in zip(prompts, names, seqs, strict=True):
            adapter = adapter_dirs[("llama", name)] if name else None
            assert seq.generated == expected(base, adapter, prompt), name
            driver.free(seq)
    assert runner.lora is not None
    assert runner.lora.table.loads == 4  # qv, all; mlp evicts qv; qv evicts all
    assert runner.lora.table.evictions == 2


def test_batch_errors_touch_nothing(tiny_model_dirs: dict[str, Path],
                                    adapter_dirs: dict) -> None:
    runner = lora_runner(tiny_model_dirs["qwen3"], max_loras=2)
    for name in ADAPTERS:
        load(runner, name, adapter_dirs[("qwen3", name)])
    driver = runner_driver(runner)
    seqs = [driver.add([5, 6, 7]) for _ in range(3)]
    batch, _ = driver.build(seqs)
    cases = {
        ("qv", "nope", ""): "'nope' is not loaded",
        ("qv", "all", "mlp"): "names 3 adapters",
        ("qv", ""): "adapters has 2 entries",
    }
    before = runner.kv_cache.clone()
    for adapters, message in cases.items():
        with pytest.raises(BatchError, match=message):
            runner.execute(_with(batch, adapters))
    assert torch.equal(runner.kv_cache, before)
    base_runner = ModelRunner(RunnerOptions(model=str(tiny_model_dirs["qwen3"]),
                                            kv_cache_memory=4 << 20, max_model_len=512))
    with pytest.raises(BatchError, match="serves none"):
        base_runner.execute(_with(batch, ("qv", "", "")))


def _with(batch: ExecuteBatch, adapters: tuple[str, ...]) -> ExecuteBatch:
    from dataclasses import replace
    return replace(batch, adapters=adapters)


def test_refused_adapters(tiny_model_dirs: dict[str, Path], adapter_dirs: dict,
                          tmp_path: Path) -> None:
    base = tiny_model_dirs["qwen3"]
    runner = lora_runner(base, max_rank=4)
    manager = runner.lora
    assert manager is not None
    with pytest.raises(AdapterNotFoundError):
        manager.read("x", str(tmp_path / "missing"))
    with pytest.raises(AdapterError, match="rank 8 is over --max-lora-rank 4"):
        manager.read("x", str(adapter_dirs[("qwen3", "all")]))
    with pytest.raises(AdapterError, match="adapter name"):
        manager.read("bad name!", str(adapter_dirs[("qwen3", "qv")]))
    embed = make_peft_adapter(base, tmp_path / "embed", 2, ("embed_tokens", "q_proj"), seed=1)
    with pytest.raises(AdapterError, match="not a LoRA weight of a served projection"):
        manager.read("x", str(embed))
    corrupt = _copy(adapter_dirs[("qwen3", "qv")], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        manager.read("x", str(corrupt))
    dora = _copy(adapter_dirs[("qwen3", "qv")], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        manager.read("x", str(dora))
    other_model = _copy(adapter_dirs[("qwen2", "qv")], tmp_path / "qwen2_qv")
    with pytest.raises(AdapterError, match="do not fit"):
        manager.read("x", str(other_model)) if _shapes_differ(tiny_model_dirs) else \
            pytest.fail("the tiny qwen2 and qwen3 must differ in shape")
    # A name holds one adapter: the same files again are a no-op, other files a conflict.
    manager.register(manager.read("qv", str(adapter_dirs[("qwen3", "qv")])))
    manager.register(manager.read("qv", str(adapter_dirs[("qwen3", "qv")])))
    with pytest.raises(AdapterConflictError):
        manager.register(manager.read("qv", str(adapter_dirs[("qwen3", "mlp")])))
    assert [a.name for a in manager.adapters()] == ["qv"]
    manager.unload("qv")
    with pytest.raises(AdapterUnknownError):
        manager.unload("qv")


def _copy(source: Path, target: Path) -> Path:
    import shutil
    shutil.copytree(source, target)
    return target


def _shapes_differ(dirs: dict[str, Path]) -> bool:
    configs = [json.loads((dirs[a] / "config.json").read_text()) for a in ("qwen2", "qwen3")]
    return configs[0].get("head_dim", 16) != configs[1].get("head_dim", 16)


def test_adapter_rows_cost_nothing_for_base_rows(tiny_model_dirs: dict[str, Path],
                                                 adapter_dirs: dict) -> None:
    """A batch with no adapter builds no LoRA work; one with an adapter only groups its
    own rows."""
    runner = lora_runner(tiny_model_dirs["qwen3"])
    load(runner, "qv", adapter_dirs[("qwen3", "qv")])
    assert runner.lora is not None
    assert runner.lora.for_batch(("", ""), np.array([3, 1])) is None
    lora = runner.lora.for_batch(("", "qv", ""), np.array([3, 2, 4]))
    assert lora is not None and len(lora.groups) == 1
    assert lora.groups[0].rows == slice(3, 5)
    assert lora.groups[0].used == {"qkv": 8, "o": 0, "gate_up": 0, "down": 0}


def test_adapters_over_grpc(tiny_model_dirs: dict[str, Path], adapter_dirs: dict,
                            tmp_path: Path) -> None:
    """LoadAdapter / ListAdapters / UnloadAdapter and their status codes; an Execute naming
    an adapter answers PEFT's tokens."""
    from prometheus_client import REGISTRY

    from protos import runner_pb2
    from tests.gpu_runner.test_servicer import grpc_driver, serve_stub

    def adapter_bytes() -> float:
        return REGISTRY.get_sample_value("pagewire_runner_lora_adapter_bytes") or 0.0

    base = tiny_model_dirs["qwen2"]
    stubs = serve_stub(RunnerServicer(lora_runner(base, max_loras=2)))
    before = adapter_bytes()
    stub = next(stubs)
    info = stub.Info(runner_pb2.InfoRequest())
    assert (info.max_loras, info.max_lora_rank) == (2, 8)
    path = str(adapter_dirs[("qwen2", "all")])
    reply = stub.LoadAdapter(runner_pb2.LoadAdapterRequest(name="all", path=path))
    assert (reply.adapter.rank, len(reply.adapter.digest)) == (8, 32)
    assert list(reply.adapter.target_modules) == list(ATTENTION + MLP)
    assert stub.LoadAdapter(runner_pb2.LoadAdapterRequest(name="all", path=path)) == reply
    refusals = {
        ("all", str(adapter_dirs[("qwen2", "qv")])): grpc.StatusCode.FAILED_PRECONDITION,
        ("x", str(tmp_path)): grpc.StatusCode.NOT_FOUND,
        ("x", str(adapter_dirs[("qwen3", "qv")])): grpc.StatusCode.INVALID_ARGUMENT,
        ("", path): grpc.StatusCode.INVALID_ARGUMENT,
    }
    for (name, where), code in refusals.items():
        with pytest.raises(grpc.RpcError) as caught:
            stub.LoadAdapter(runner_pb2.LoadAdapterRequest(name=name, path=where))
        assert caught.value.code() == code, (name, where, caught.value.details())
    listed = stub.ListAdapters(runner_pb2.ListAdaptersRequest())
    assert [a.name for a in listed.adapters] == ["all"] and listed.max_loras == 2

    driver = grpc_driver(stub, info)
    prompt = random_prompts((13,), seed=4)[0]
    seq = driver.add(prompt)
    seq.adapter = "all"
    while len(seq.generated) < STEPS:
        driver.step([seq])
    assert seq.generated == expected(base, adapter_dirs[("qwen2", "all")], prompt)

    assert adapter_bytes() > before
    stub.UnloadAdapter(runner_pb2.UnloadAdapterRequest(name="all"))
    assert adapter_bytes() == before  # the adapter's host memory is let go
    with pytest.raises(grpc.RpcError) as caught:
        stub.UnloadAdapter(runner_pb2.UnloadAdapterRequest(name="all"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as caught:
        driver.step([seq])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not loaded" in (caught.value.details() or "")
    stubs.close()

    plain = serve_stub(RunnerServicer(ModelRunner(RunnerOptions(
        model=str(base), kv_cache_memory=4 << 20, max_model_len=512))))
    with pytest.raises(grpc.RpcError) as caught:
        next(plain).LoadAdapter(runner_pb2.LoadAdapterRequest(name="all", path=path))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    plain.close()


def test_bfloat16_is_close_to_peft_bfloat16(tiny_model_dirs: dict[str, Path],
                                            adapter_dirs: dict) -> None:
    """In bfloat16 (torch's LoRA path) greedy tokens follow PEFT's bfloat16 model by the
    close-logprobs rule (tests/e2e/close_logprobs.py): equal up to a first difference, where
    each side's token is among the other's top 5; a difference within the first 8 tokens
    only at a near tie (log-probs within 0.1: the tiny random models' distributions are
    nearly flat, tests/e2e/test_bf16_e2e.py)."""
    from tests.e2e.close_logprobs import check_logprobs_close

    base = tiny_model_dirs["qwen3"]
    runner = ModelRunner(RunnerOptions(model=str(base), kv_cache_memory=16 << 20,
                                       max_model_len=512, dtype="bfloat16", max_loras=2,
                                       max_lora_rank=8))
    names = ("all", "qv")
    for name in names:
        load(runner, name, adapter_dirs[("qwen3", name)])
    prompts = random_prompts((9, 21, 14), seed=11)
    adapters = ["all", "", "qv"]
    served = _generate_with_top(runner, prompts, adapters)
    for prompt, name, generation in zip(prompts, adapters, served, strict=True):
        model = (peft_model(base, adapter_dirs[("qwen3", name)], dtype=torch.bfloat16)
                 if name else _hf_bf16(base))
        check_logprobs_close(_peft_generation(model, prompt), generation, label=name or "base",
                             tie_tolerance=0.1)


def _generate_with_top(runner: ModelRunner, prompts: list[list[int]], adapters: list[str],
                       top: int = 5) -> list[object]:
    from dataclasses import replace

    from tests.e2e.close_logprobs import Generation

    driver = runner_driver(runner)
    seqs = [driver.add(prompt) for prompt in prompts]
    for seq, name in zip(seqs, adapters, strict=True):
        seq.adapter = name
    tops: list[list[list[tuple[int, float]]]] = [[] for _ in seqs]
    for _ in range(STEPS):
        batch, sampled = driver.build(seqs)
        batch = replace(batch, num_logprobs=np.full(len(seqs), top, dtype=np.int64))
        result = runner.execute(batch)
        assert result.top_token_ids is not None and result.top_logprobs is not None
        for row, seq in enumerate(sampled):
            seq.tokens.append(int(result.token_ids[row]))
            tops[seqs.index(seq)].append(list(zip(result.top_token_ids[row].tolist(),
                                                  result.top_logprobs[row].tolist(), strict=True)))
    return [Generation(seq.generated, top_rows) for seq, top_rows in zip(seqs, tops,
                                                                        strict=True)]


def _hf_bf16(base: Path) -> object:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()


def _peft_generation(model: object, prompt: list[int], top: int = 5) -> object:
    from tests.e2e.close_logprobs import Generation

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS,  # type: ignore[attr-defined]
                             min_new_tokens=0, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tops = []
    for logits in out.logits:
        values, ids = torch.log_softmax(logits[0].float(), dim=-1).topk(top)
        tops.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
    return Generation(out.sequences[0, len(prompt):].tolist(), tops)


def test_an_adapter_stays_while_any_holder_has_it(tiny_model_dirs: dict[str, Path],
                                                  adapter_dirs: dict) -> None:
    """Two gateways sharing a runner each hold what they loaded: one's unload leaves the
    adapter to the other (runner.proto's holder)."""
    runner = lora_runner(tiny_model_dirs["qwen3"])
    manager = runner.lora
    assert manager is not None
    path = str(adapter_dirs[("qwen3", "qv")])
    manager.register(manager.read("qv", path), holder="gateway/a")
    manager.register(manager.read("qv", path), holder="gateway/b")
    with pytest.raises(AdapterUnknownError):
        manager.unload("qv", holder="gateway/c")
    assert manager.unload("qv", holder="gateway/a") is False
    manager.check(("qv",))  # still served
    assert manager.unload("qv", holder="gateway/b") is True
    with pytest.raises(BatchError, match="not loaded"):
        manager.check(("qv",))
