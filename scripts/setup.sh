#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian machine: build tools, then the CPU build of torch
# (an unpinned torch would pull a CUDA build of several GB), then this package in editable mode.
#   scripts/setup.sh          what `make demo` needs
#   scripts/setup.sh --test   and what the tests need beyond it: clang-14 with libFuzzer, nvcc and cuBLAS headers
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
TEST=$([ "${1:-}" = --test ] && echo 1 || echo "")

SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
apt_install() {
    echo "[setup] installing $*"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq "$@" >/dev/null
}

missing=()
for tool in cmake ninja ccache patch g++ readelf; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] missing build tools: ${missing[*]}"
    apt_install cmake ninja-build ccache patch build-essential
fi

# the sanitizer and fuzzing build (make test, docs/hardening.md) needs clang with its runtime libraries (libFuzzer)
if [ -n "$TEST" ] && { ! command -v clang-14 >/dev/null || ! dpkg -s libclang-rt-14-dev >/dev/null 2>&1; }; then
    apt_install clang-14 libclang-rt-14-dev
fi
# the Arm kernels are tested on this x86 machine: cross-compiled, run under qemu-user (tests/test_kernels.py)
if [ -n "$TEST" ] && { ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; }; then
    apt_install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user
fi

PY=${PY:-python3}
# venv with pip: the llama-cpp-python test installs a wheel into a fresh virtual environment
if ! $PY -c "import ensurepip, venv" 2>/dev/null; then
    apt_install python3-venv
fi
if ! $PY -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch (CPU build)"
    $PY -m pip install -q torch==2.13.0
fi
# always (re)install: an editable install of another clone would otherwise shadow this one
echo "[setup] installing vq-gguf from $(pwd)"
$PY -m pip install -q -e ".${TEST:+[test]}"
if [ -n "$TEST" ]; then
    # microsoft/VPTQ's own package, the reference for `import-vptq` (tests/test_import_vptq.py): test-only and
    # without its requirements (gradio, datasets, pynvml…), of which the tests need only the [test] extra's
    $PY -m pip install -q --no-deps "vptq==0.0.5.post1"
    # nvcc and cuBLAS's headers for the CUDA compile check (tests/test_cuda_compile.py); no GPU needed
    $PY -m vq_gguf.native.cuda setup
fi
echo "[setup] done in $((SECONDS - start)) s"
