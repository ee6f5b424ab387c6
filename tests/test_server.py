"""`vq-gguf serve` under bad clients: llama-server on the tiny VQ model (tests/tiny_model.py: 128-token context),
on loopback with an API key, fed malformed and hostile requests, many clients at once, clients that leave
mid-stream and a slow one. After each round the server must still answer, and its memory must not grow from
round to round. And the serve command refuses an address beyond loopback without a key.

Needs `vq-gguf build --server` (make test runs it).
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import REPO
from tests import tiny_model
from tests.test_integrations import free_port
from vq_gguf.runtime.network import is_loopback
from vq_gguf.runtime.server import Server, check_bind

KEY = "test-key-5ba1"
N_CTX = tiny_model.N_CTX
PROMPT = "a b c d"  # words of the tiny vocabulary
TIMEOUT = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    model = tiny_model.write(folder / "tiny.gguf")
    with Server(model, folder / "llama-server.log", port=free_port(), n_ctx=N_CTX, threads=1, api_key=KEY) as s:
        yield s
    assert s.proc.returncode is not None  # stopped by the context manager


def request(server: Server, method: str, path: str, body: bytes | str | dict | None = None, *,
            key: str | None = KEY, headers: dict | None = None) -> tuple[int, dict]:
    """One request on its own connection: (status, the JSON body)."""
    if isinstance(body, dict):
        body = json.dumps(body)
    conn = http.client.HTTPConnection("127.0.0.1", int(server.base.rsplit(":", 1)[1]), timeout=TIMEOUT)
    try:
        h = {"Content-Type": "application/json", **(headers or {})}
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data)
        except json.JSONDecodeError:
            return r.status, {"raw": data.decode(errors="replace")}
    finally:
        conn.close()


def completion(server: Server, **fields) -> tuple[int, dict]:
    return request(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields})


def rss_kib(server: Server) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def assert_alive(server: Server) -> None:
    assert server.proc.poll() is None, f"llama-server exited with {server.proc.returncode}"
    status, body = completion(server)
    assert status == 200 and body["choices"][0]["text"], body


def error_message(body: dict) -> str:
    return body.get("error", {}).get("message", "") or body.get("raw", "")


# --- the address and the key ----------------------------------------------------------------------------

def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.10") and not is_loopback("no-such-host.invalid")


def test_check_bind():
    check_bind("127.0.0.1", 8080, None, False)
    check_bind("0.0.0.0", 8080, KEY, False)
    check_bind("0.0.0.0", 8080, None, True)
    for host, port, key, message in (("0.0.0.0", 8080, None, "reachable beyond this machine"),
                                     ("127.0.0.1", 0, None, "port 0"), ("127.0.0.1", 70000, KEY, "port 70000"),
                                     ("0.0.0.0", 8080, " ", "API key is empty")):
        with pytest.raises(ValueError, match=message):
            check_bind(host, port, key, False)


@pytest.mark.parametrize("args, message", [(["--host", "0.0.0.0"], "reachable beyond this machine"),
                                           (["--port", "70000"], "port 70000"),
                                           (["--", "--port", "1"], "as vq-gguf serve's own options")])
def test_serve_refuses_before_starting(tmp_path, args, message):
    model = tiny_model.write(tmp_path / "tiny.gguf")
    proc = subprocess.run([sys.executable, "-m", "vq_gguf.cli", "serve", str(model), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT,
                          env={k: v for k, v in os.environ.items() if k != "VQ_GGUF_API_KEY"})
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_api_key_is_enforced(server):
    assert request(server, "GET", "/health", key=None)[0] == 200  # health stays open, for load balancers
    for key in (None, "wrong", KEY + "x"):
        status, body = request(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, key=key)
        assert status == 401 and "API Key" in error_message(body)
    assert completion(server)[0] == 200


# --- bad requests ----------------------------------------------------------------------------------------

BAD_REQUESTS = [  # (body, words the error must contain)
    ('{"prompt": "a b", "max_tokens": ', "parse error"),
    ("not json at all", "parse error"),
    ("", "parse error"),
    ('{"prompt": 5}', "prompt"),
    ('{"prompt": "a b", "max_tokens": "many"}', ""),
    ('{"prompt": "a b", "temperature": "hot"}', ""),
    ('{"prompt": {"nested": [1, 2, 3]}}', "prompt"),
    ('[1, 2, 3]', ""),
    (json.dumps({"prompt": " ".join([PROMPT] * N_CTX)}), "exceeds the available context size"),
    (json.dumps({"prompt": [[99999, 100000]]}), ""),
]


@pytest.mark.parametrize("body, words", BAD_REQUESTS, ids=[f"bad{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_request_is_an_error_not_a_crash(server, body, words):
    status, answer = request(server, "POST", "/v1/completions", body)
    assert 400 <= status < 600 and error_message(answer), (status, answer)
    assert words.lower() in error_message(answer).lower()
    assert_alive(server)


def test_huge_max_tokens_stops_at_the_context(server):
    status, body = completion(server, max_tokens=10**9, ignore_eos=True)
    assert status == 200 and body["usage"]["total_tokens"] <= N_CTX
    assert body["choices"][0]["finish_reason"] == "length"


def test_wrong_endpoint_and_method(server):
    assert request(server, "POST", "/v1/no-such-endpoint", {})[0] == 404
    assert request(server, "DELETE", "/v1/completions")[0] in (404, 405)
    assert_alive(server)


# --- many, leaving and slow clients ----------------------------------------------------------------------

def many_clients(server: Server, n: int = 64) -> list[int]:
    with ThreadPoolExecutor(n) as pool:
        return [s for s, _ in pool.map(lambda i: completion(server, max_tokens=8, seed=i), range(n))]


def leave_mid_stream(server: Server, n: int = 8) -> None:
    """Clients that start a long stream, read its first event and close the connection."""
    port = int(server.base.rsplit(":", 1)[1])
    for _ in range(n):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 10**6, "stream": True,
                                                             "ignore_eos": True}),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()


def test_64_concurrent_clients(server):
    assert many_clients(server) == [200] * 64
    assert_alive(server)


def test_clients_that_leave_mid_stream(server):
    leave_mid_stream(server)
    assert_alive(server)


def test_a_slow_client_does_not_block_others(server):
    """A client that sends its request a few bytes at a time, while others are served in full."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    port = int(server.base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as slow:
        for i in range(0, len(raw), 16):
            slow.sendall(raw[i:i + 16])
            if i % 64 == 0:
                assert completion(server)[0] == 200  # the others go on meanwhile
            time.sleep(0.05)
        answer = b""
        while chunk := slow.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and b'"choices"' in answer


def test_memory_stays_bounded(server):
    """Rounds of everything above: the resident memory after the last round is within a few MB of the first."""
    def one_round():
        for body, _ in BAD_REQUESTS:
            request(server, "POST", "/v1/completions", body)
        assert many_clients(server, 32) == [200] * 32
        leave_mid_stream(server, 4)
    one_round()
    first = rss_kib(server)
    for _ in range(3):
        one_round()
    assert_alive(server)
    grown = rss_kib(server) - first
    print(f"RSS after the first round {first} KiB, grown {grown} KiB")
    assert grown < 16 * 1024, f"llama-server grew by {grown} KiB over three rounds"
    log = server.log_path.read_text(errors="replace")
    assert "Sanitizer" not in log and "terminate called" not in log
