"""Every shipped command on the malformed files that the loader refuses, while other processes keep every core
busy: `vq-gguf inspect`, `chat`, `export` and `verify` (a bundle whose manifest matches a malformed model), and
the patched llama.cpp's `llama-completion`, `llama-perplexity`, `llama-bench` and `llama-server`. Each must exit
with a non-zero status of its own (no signal), within the time limit, with the loader's words for the problem
on stderr (tests/malformed.py says which words).

CI runs a fixed sample of the corpus; `VQ_GGUF_SWEEP=all python -m pytest tests/test_commands.py` runs all of it
(docs/hardening.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests import malformed, tiny_model
from tests.test_integrations import free_port
from vq_gguf import bundle
from vq_gguf.native.build import bin_dir

REFUSED = [c for c in malformed.corpus() if c.expect is not None]
CASES = REFUSED if os.environ.get("VQ_GGUF_SWEEP") == "all" else REFUSED[::10]
TIMEOUT = 120  # seconds per command, under load
TEXT = "a b c d e f g h i j k l m n\n" * 40


def vq_gguf(*args: str) -> list[str]:
    return [sys.executable, "-m", "vq_gguf.cli", *args]


def commands(model: Path, tmp: Path, check_tensors: bool = False) -> dict[str, list[str]]:
    text = tmp / "text.txt"
    text.write_text(TEXT)
    b = bin_dir()
    check = ["--check-tensors"] if check_tensors else []
    return {
        "inspect": vq_gguf("inspect", str(model)),
        "chat": vq_gguf("chat", str(model), "--prompt", "a b", "--max-tokens", "2", "--threads", "1"),
        "export": vq_gguf("export", str(model), "--out", str(tmp / "exported")),
        "verify": vq_gguf("verify", str(bundle_with(model, tmp / "bundle"))),
        "llama-completion": [str(b / "llama-completion"), "-m", str(model), "-p", "a b", "-n", "2", "-t", "1",
                             "-no-cnv", *check],
        "llama-perplexity": [str(b / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", "16", "-t", "1",
                             *check],
        "llama-bench": [str(b / "llama-bench"), "-m", str(model), "-p", "0", "-n", "1", "-r", "1", "-t", "1"],
        "llama-server": [str(b / "llama-server"), "-m", str(model), "--port", str(free_port()), "-t", "1",
                         "--no-webui", *check],
    }


def bundle_with(model: Path, out: Path) -> Path:
    """An exported folder of the valid tiny model whose model file is then replaced by `model`, manifest and
    all: every byte matches the manifest, so only the load can refuse it."""
    valid = tiny_model.write(out.parent / "valid" / "tiny.gguf")
    bundle.export(valid, out)
    (out / valid.name).write_bytes(model.read_bytes())
    manifest = json.loads((out / bundle.MANIFEST).read_text())
    manifest["files"][valid.name] = bundle._entry(out / valid.name)
    (out / bundle.MANIFEST).write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def busy_cores():
    """One spinning process per core for the whole module: load-time races (a log thread not flushed before
    exit) show under load."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    yield
    for p in spinners:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def built():
    for tool in ("llama-completion", "llama-perplexity", "llama-bench", "llama-server"):
        if not (bin_dir() / tool).exists():
            pytest.fail(f"{bin_dir() / tool} is missing: run `vq-gguf build --server`")


@pytest.mark.parametrize("command", ["inspect", "chat", "export", "verify", "llama-completion", "llama-perplexity",
                                     "llama-bench", "llama-server"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_command_refuses_with_the_loaders_words(case, command, tmp_path, busy_cores, built):
    model = tmp_path / "case.gguf"
    case.make(model)
    argv = commands(model, tmp_path, check_tensors=case.data_check)[command]
    try:
        r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, errors="replace", timeout=TIMEOUT,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} did not stop within {TIMEOUT} s on {case.name}")
    said = f"{command} on {case.name}: exit {r.returncode}\n{r.stderr[-3000:]}"
    if case.data_check and command == "llama-bench":
        assert r.returncode == 0, said   # it has no data check: it runs the file, and must not crash on it
        return
    assert r.returncode > 0, said  # negative: killed by a signal
    assert all(word in r.stderr for word in case.expect), said
    assert "Traceback" not in r.stderr, said
    if not command.startswith("llama-"):
        assert f"vq-gguf {command}: " in r.stderr, said
