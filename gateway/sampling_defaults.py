"""Default sampling parameters: the model's generation config, then the operator's override.

Each sampling field of a request takes, in this order (docs/api.md):
1. the request's own value;
2. the default here: the model folder's `generation_config.json` (`--generation-config auto`,
   as vLLM's), or another folder's (`--generation-config FOLDER`), or none
   (`--generation-config openai`), with `--override-generation-config` (JSON) on top;
3. OpenAI's documented default (temperature 1, top_p 1, ...: gateway/validation.py).

Like vLLM, only these generation-config fields are read, and `do_sample` is not: a model that
asks for temperature 0.6 gets it whether or not its config also says do_sample.
`max_new_tokens` becomes a cap on an unset max_tokens (what fits in max_model_len, capped),
never a refusal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.validation import InvalidRequest, Limits, sampling_config
from protos import gateway_pb2

GENERATION_CONFIG_FILE = "generation_config.json"
# --generation-config values besides a folder ("vllm" is vLLM's name for "openai": its own
# defaults, which are OpenAI's).
FROM_MODEL = "auto"
OPENAI_DEFAULTS = "openai"
_OPENAI_ALIASES = (OPENAI_DEFAULTS, "vllm")
# generation_config.json name -> SamplingParams field.
GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_INTEGER_FIELDS = {"top_k", "max_new_tokens"}


class GenerationConfigError(ValueError):
    """A generation config or override that cannot be served; the message names the field."""


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults of the sampling fields a request leaves unset."""

    params: gateway_pb2.SamplingParams  # only the fields with a default are set
    source: str  # where they come from, for the start-up log

    @classmethod
    def none(cls) -> SamplingDefaults:
        return cls(gateway_pb2.SamplingParams(), "OpenAI's defaults")

    @property
    def max_tokens(self) -> int | None:
        """The cap on an unset max_tokens (None: what fits)."""
        return self.params.max_tokens if self.params.HasField("max_tokens") else None

    def apply(self, params: gateway_pb2.SamplingParams) -> gateway_pb2.SamplingParams:
        """`params` with the defaults in the fields it leaves unset (max_tokens excepted: a
        cap, see `max_tokens`). `params` itself is not changed."""
        merged = gateway_pb2.SamplingParams()
        merged.CopyFrom(self.params)
        merged.ClearField("max_tokens")
        merged.MergeFrom(params)  # a field set in the request wins
        return merged

    def as_dict(self) -> dict[str, float | int]:
        """The defaults by their request field names (what /v1/models shows); floats as the
        shortest decimal of their float32 value (0.2, not 0.20000000298023224)."""
        return {field.name: float(f"{value:.7g}") if isinstance(value, float) else value
                for field, value in self.params.ListFields()}

    def describe(self) -> str:
        shown = ", ".join(f"{name}={value:g}" for name, value in self.as_dict().items())
        return f"{shown or 'none'} (from {self.source})"


def load_defaults(model_folder: Path, generation_config: str = FROM_MODEL,
                  override: dict[str, Any] | None = None) -> SamplingDefaults:
    """The defaults that `--generation-config` and `--override-generation-config` give for the
    model in `model_folder`; GenerationConfigError names what is wrong."""
    if generation_config in _OPENAI_ALIASES:
        values: dict[str, Any] = {}
        source = "OpenAI's defaults"
    else:
        folder = model_folder if generation_config == FROM_MODEL else Path(generation_config)
        path = folder / GENERATION_CONFIG_FILE
        values = _read_generation_config(path, required=generation_config != FROM_MODEL)
        source = str(path) if values else "OpenAI's defaults"
    if override:
        values.update(override)
        source += " with --override-generation-config"
    return SamplingDefaults(_sampling_params(values, source), source)


def parse_override(text: str) -> dict[str, Any]:
    """--override-generation-config: a JSON object of generation-config fields (null drops
    the model's default of a field). Errors leave the flag's name to argparse."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        raise GenerationConfigError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise GenerationConfigError('not a JSON object: give one like \'{"temperature": 0.5}\'')
    unknown = sorted(set(value) - set(GENERATION_FIELDS))
    if unknown:
        raise GenerationConfigError(
            f"unknown field {unknown[0]!r}; it takes {', '.join(GENERATION_FIELDS)}")
    _sampling_params(value, "the override")  # its values alone must be valid: said now
    return value


def _read_generation_config(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise GenerationConfigError(
                f"--generation-config: {path} does not exist (give {FROM_MODEL}, "
                f"{OPENAI_DEFAULTS} or a folder holding {GENERATION_CONFIG_FILE})")
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise GenerationConfigError(f"{path} cannot be read as JSON: {error}") from None
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path} is not a JSON object")
    return {name: config[name] for name in GENERATION_FIELDS if name in config}


def _sampling_params(values: dict[str, Any], source: str) -> gateway_pb2.SamplingParams:
    """The set fields as SamplingParams; null and "off" values (top_k <= 0) set nothing."""
    params = gateway_pb2.SamplingParams()
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value):
            raise GenerationConfigError(f"{name} in {source} must be a number, got {value!r}")
        if name in _INTEGER_FIELDS:
            if value != int(value):
                raise GenerationConfigError(
                    f"{name} in {source} must be an integer, got {value!r}")
            if value <= 0:
                if name == "top_k":  # 0 / -1: off
                    continue
                raise GenerationConfigError(f"{name} in {source} must be >= 1, got {value}")
            value = int(value)
        elif value < 0:
            raise GenerationConfigError(f"{name} in {source} must be >= 0, got {value}")
        field = GENERATION_FIELDS[name]
        try:
            setattr(params, field, value)
        except ValueError:  # past uint32
            raise GenerationConfigError(f"{name} in {source} is too large: {value}") from None
        if not math.isfinite(getattr(params, field)):  # past float32
            raise GenerationConfigError(f"{name} in {source} is too large: {value}")
    _check_ranges(params, source)
    return params


# The model-independent checks of a request's sampling parameters (top_k against the
# vocabulary waits for the runner's; the servicer checks the whole).
_ANY_MODEL = Limits(vocab_size=(1 << 32) - 1, max_len=1 << 31, max_n=1)


def _check_ranges(params: gateway_pb2.SamplingParams, source: str) -> None:
    without_cap = gateway_pb2.SamplingParams()
    without_cap.CopyFrom(params)
    without_cap.ClearField("max_tokens")  # a cap, never a request's max_tokens
    try:
        sampling_config(without_cap, 0, _ANY_MODEL, 0)
    except InvalidRequest as error:
        raise GenerationConfigError(f"{source}: {error}") from None
