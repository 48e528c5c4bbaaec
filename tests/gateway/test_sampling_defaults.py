"""Default sampling parameters: generation config, override, and the order they apply in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.sampling_defaults import (
    GenerationConfigError,
    SamplingDefaults,
    load_defaults,
    parse_override,
)
from gateway.validation import Limits, sampling_config
from protos import gateway_pb2

LIMITS = Limits(vocab_size=1000, max_len=512, max_n=4)


def model_folder(tmp_path: Path, generation: dict[str, object] | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def effective(defaults: SamplingDefaults, request: gateway_pb2.SamplingParams,
              prompt_len: int = 10, endpoint_cap: int | None = None) -> dict[str, float]:
    """The SamplingConfig the servicer builds from a request under these defaults."""
    config = sampling_config(defaults.apply(request), prompt_len, LIMITS, 1,
                             defaults.max_tokens or endpoint_cap)
    return {"temperature": config.temperature, "top_p": round(config.top_p, 6),
            "top_k": config.top_k, "min_p": config.min_p,
            "repetition_penalty": round(config.repetition_penalty, 6),
            "max_tokens": config.max_tokens}


def test_request_beats_generation_config_beats_openai_defaults(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                     "top_k": 20, "bos_token_id": 1, "eos_token_id": 2})
    defaults = load_defaults(folder)
    assert defaults.as_dict() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    # Unset: the model's values, and OpenAI's where the model says nothing.
    assert effective(defaults, gateway_pb2.SamplingParams()) == {
        "temperature": pytest.approx(0.6), "top_p": 0.95, "top_k": 20, "min_p": 0.0,
        "repetition_penalty": 1.0, "max_tokens": 502}
    # Set: the request's, 0 included (greedy), whatever the model says.
    asked = gateway_pb2.SamplingParams(temperature=0, top_p=1.0, top_k=0, max_tokens=7)
    assert effective(defaults, asked) == {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
        "repetition_penalty": 1.0, "max_tokens": 7}
    assert not asked.HasField("min_p")  # the request itself is left as sent


def test_override_applies_on_top_and_null_drops_a_default(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, {"temperature": 0.6, "top_p": 0.95})
    override = parse_override('{"temperature": 0, "top_p": null, "repetition_penalty": 1.1}')
    defaults = load_defaults(folder, "auto", override)
    assert defaults.as_dict() == {"temperature": 0.0, "repetition_penalty": 1.1}
    assert "--override-generation-config" in defaults.source


def test_openai_mode_ignores_the_model_and_a_folder_mode_reads_another(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, {"temperature": 0.6})
    assert load_defaults(folder, "openai").as_dict() == {}
    assert load_defaults(folder, "vllm").as_dict() == {}  # vLLM's name for the same
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"min_p": 0.05}')
    assert load_defaults(folder, str(other)).as_dict() == {"min_p": 0.05}
    with pytest.raises(GenerationConfigError, match="does not exist"):
        load_defaults(folder, str(tmp_path / "absent"))


def test_no_generation_config_means_openai_defaults(tmp_path: Path) -> None:
    defaults = load_defaults(model_folder(tmp_path, None))
    assert defaults.as_dict() == {}
    assert effective(defaults, gateway_pb2.SamplingParams())["temperature"] == 1.0


def test_max_new_tokens_caps_an_unset_max_tokens_and_never_refuses(tmp_path: Path) -> None:
    defaults = load_defaults(model_folder(tmp_path, {"max_new_tokens": 100}))
    assert defaults.max_tokens == 100
    assert effective(defaults, gateway_pb2.SamplingParams())["max_tokens"] == 100
    # A long prompt: what fits, not a refusal for 100 not fitting.
    assert effective(defaults, gateway_pb2.SamplingParams(), prompt_len=480)["max_tokens"] == 32
    # It also wins over an endpoint's own default (completions' 16).
    assert effective(defaults, gateway_pb2.SamplingParams(), endpoint_cap=16)["max_tokens"] == 100
    assert effective(load_defaults(tmp_path / "model", "openai"), gateway_pb2.SamplingParams(),
                     endpoint_cap=16)["max_tokens"] == 16


def test_top_k_off_values_set_nothing(tmp_path: Path) -> None:
    assert load_defaults(model_folder(tmp_path, {"top_k": -1})).as_dict() == {}
    assert load_defaults(tmp_path / "model", "auto", {"top_k": 0}).as_dict() == {}


@pytest.mark.parametrize(("text", "match"), [
    ("{", "not JSON"),
    ("[1]", "not a JSON object"),
    ('{"temprature": 0.5}', "unknown field 'temprature'"),
    # Values are checked when the flag is read, not at the first request.
    ('{"top_p": 1.5}', r"the override: top_p must be in \(0, 1\]"),
    ('{"top_k": 5000000000}', "top_k in the override is too large"),
    ('{"temperature": 1e39}', "temperature in the override is too large"),
])
def test_bad_overrides_are_named(text: str, match: str) -> None:
    with pytest.raises(GenerationConfigError, match=match):
        parse_override(text)


@pytest.mark.parametrize(("generation", "match"), [
    ({"temperature": "hot"}, "temperature .* must be a number"),
    ({"temperature": -1}, "temperature .* must be >= 0"),
    ({"top_k": 2.5}, "top_k .* must be an integer"),
    ({"max_new_tokens": 0}, "max_new_tokens .* must be >= 1"),
    ({"temperature": True}, "temperature .* must be a number"),
])
def test_bad_generation_configs_are_named(tmp_path: Path, generation: dict[str, object],
                                          match: str) -> None:
    with pytest.raises(GenerationConfigError, match=match):
        load_defaults(model_folder(tmp_path, generation))


def test_unreadable_generation_config_is_named(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, None)
    (folder / "generation_config.json").write_text("{broken")
    with pytest.raises(GenerationConfigError, match=r"generation_config\.json"):
        load_defaults(folder)
