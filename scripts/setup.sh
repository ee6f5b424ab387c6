#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian machine: build tools, then the CPU build of torch
# (an unpinned torch would pull a CUDA build of several GB), then this package in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for tool in cmake ninja ccache patch g++; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] installing build tools (missing: ${missing[*]})"
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq cmake ninja-build ccache patch build-essential >/dev/null
fi

# the sanitizer and fuzzing build (make test, docs/hardening.md) needs clang with its runtime libraries (libFuzzer)
if ! command -v clang-14 >/dev/null || ! dpkg -s libclang-rt-14-dev >/dev/null 2>&1; then
    echo "[setup] installing clang-14 and its sanitizer/libFuzzer runtime"
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq clang-14 libclang-rt-14-dev >/dev/null
fi

PY=${PY:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch (CPU build)"
    $PY -m pip install -q torch==2.13.0
fi
# always (re)install: an editable install of another clone would otherwise shadow this one
echo "[setup] installing vq-gguf from $(pwd)"
$PY -m pip install -q -e ".[test]"
