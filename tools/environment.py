"""The versions and the machine behind a comparison's figures: speed means nothing without the machine, and
quality figures mean nothing without the exact code that made the files."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

from vq_gguf.native.build import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION
from vq_gguf.paths import checkout


def _git(*args: str) -> str | None:
    if checkout() is None:
        return None
    try:
        proc = subprocess.run(["git", "-C", str(checkout()), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _package(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "vq-gguf": _package("vq-gguf"),
        "vq-gguf git commit": _git("rev-parse", "HEAD"),
        "vq-gguf uncommitted changes": None if status is None else bool(status),
        "llama.cpp commit": LLAMA_CPP_COMMIT,
        "llama.cpp source": f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist (vendor/llama.cpp), patched",
        "python": platform.python_version(),
        **{name: _package(name) for name in ("numpy", "torch", "gguf", "matplotlib")},
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return round(kib / 2**20, 1)


def machine() -> dict:
    return {
        "cpu": _cpu_model(),
        "logical cores": os.cpu_count(),
        "memory GiB": _memory_gib(),
        "os": platform.platform(),
        "load average at start (1, 5, 15 min)": [round(x, 2) for x in os.getloadavg()],
    }


def describe(m: dict) -> str:
    """One line for a table's caption."""
    mem = f", {m['memory GiB']} GiB" if m.get("memory GiB") else ""
    return f"{m['cpu']}, {m['logical cores']} logical cores{mem}, {m['os']}"
