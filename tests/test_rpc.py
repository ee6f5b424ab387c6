"""Layers on other machines through llama.cpp's RPC backend, on loopback: two rpc-servers hold and run every
layer of a VQ file (its VQ tensors and their codebooks travel as any other tensor), and llama-perplexity and the
runtime give exactly what they give locally. A server that goes away mid-run stops the run with an error, not a
hang; one that is not there is refused before llama.cpp would abort on it.

Needs `vq-gguf build --rpc` (make test runs it).
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import EVAL_TEXT
from tests.test_integrations import free_port
from vq_gguf.runtime.llama import Model, lib_dir
from vq_gguf.runtime.rpc import RpcError, RpcServer, check_bind, parse_servers

TIMEOUT = 300


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rpc")
    with RpcServer(folder / "a.log", port=free_port(), threads=1) as a, RpcServer(folder / "b.log", port=free_port(), threads=1) as b:
        yield [a, b]


def perplexity(model, *extra: str, chunks: int = 3) -> subprocess.CompletedProcess:
    return subprocess.run([str(lib_dir() / "llama-perplexity"), "-m", str(model), "-f", str(EVAL_TEXT), "-c", "128",
                           "--chunks", str(chunks), "-t", "2", *extra], capture_output=True, text=True, timeout=TIMEOUT)


def final_ppl(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return re.findall(r"Final estimate: PPL = [0-9.]+ \+/- [0-9.]+", proc.stdout + proc.stderr)[0]


def test_perplexity_through_two_rpc_servers_equals_local(ffn_down_file, servers):
    local = perplexity(ffn_down_file)
    remote = perplexity(ffn_down_file, "--rpc", ",".join(s.endpoint for s in servers), "-ngl", "999", "-lv", "4")
    assert final_ppl(remote) == final_ppl(local)
    log = remote.stdout + remote.stderr
    done, total = re.findall(r"offloaded (\d+)/(\d+) layers", log)[0]
    assert done == total, log[-3000:]
    for s in servers:   # each server holds part of the model, VQ tensors included
        assert re.search(rf"\[{re.escape(s.endpoint)}\] model buffer size = +[1-9]", log), log[-3000:]


def test_runtime_logits_through_rpc_equal_local(ffn_down_file, servers):
    with Model(ffn_down_file, n_ctx=128, n_threads=2) as m:
        tokens = m.tokenize("It is a truth universally acknowledged, that a single man")
        local = m.logits(tokens)
    with Model(ffn_down_file, n_ctx=128, n_threads=2, rpc=[s.endpoint for s in servers]) as m:
        assert np.array_equal(m.logits(tokens), local)


def test_server_gone_midway_stops_the_run_with_an_error(ffn_down_file, tmp_path):
    with RpcServer(tmp_path / "a.log", port=free_port(), threads=1) as a, RpcServer(tmp_path / "b.log", port=free_port(), threads=1) as b:
        proc = subprocess.Popen([str(lib_dir() / "llama-perplexity"), "-m", str(ffn_down_file), "-f", str(EVAL_TEXT),
                                 "-c", "128", "-b", "128", "--chunks", "300", "-t", "2", "--rpc", f"{a.endpoint},{b.endpoint}",
                                 "-ngl", "999"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        for line in proc.stdout:   # until the model is on the servers and the chunks are being computed
            seen.append(line)
            if "calculating perplexity" in line:
                break
        time.sleep(2)
        assert proc.poll() is None, "".join(seen)[-2000:]
        b.stop()
        start = time.monotonic()
        try:
            rest = proc.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("llama-perplexity hung after an RPC server went away")
    assert proc.returncode != 0 and time.monotonic() - start < 120
    assert "RPC" in rest, "".join(seen)[-2000:] + rest[-2000:]


def test_unreachable_or_malformed_servers_are_refused(ffn_down_file):
    closed = f"127.0.0.1:{free_port()}"
    with pytest.raises(RpcError, match="cannot be reached"):
        Model(ffn_down_file, rpc=[closed])
    proc = subprocess.run([sys.executable, "-m", "vq_gguf.cli", "chat", str(ffn_down_file), "--prompt", "Hi",
                           "--rpc", closed], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and "cannot be reached" in proc.stderr and "Traceback" not in proc.stderr
    for bad in ("", "host", "host:0", "host:70000", ":80", "a:1,b"):
        with pytest.raises(ValueError, match="RPC server"):
            parse_servers(bad)
    assert parse_servers("10.0.0.2:50052, 10.0.0.3:50052") == ["10.0.0.2:50052", "10.0.0.3:50052"]
    with pytest.raises(ValueError, match="no authentication"):
        check_bind("0.0.0.0", 50052, private_network=False)
    check_bind("0.0.0.0", 50052, private_network=True)
