"""Layers on other machines through llama.cpp's RPC backend (docs/rpc.md): start the patched `rpc-server` on
each machine that lends its memory and cores, then give their HOST:PORT list to `vq-gguf chat/serve --rpc`.

RPC has no authentication and no encryption: anyone who reaches a server's port can run graphs on it and read
what it holds. A server binds to loopback unless told to bind elsewhere, and then only on a private network.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

from .network import is_loopback
from .process import LoggedProcess

DEFAULT_PORT = 50052
READY_TIMEOUT_S = 60.0


class RpcError(RuntimeError):
    """An RPC server that cannot be started, reached or parsed."""


def binary() -> Path:
    from vq_gguf.native.build import bin_dir
    path = bin_dir() / "ggml-rpc-server"   # llama.cpp's rpc-server
    if not path.exists():
        raise RpcError(f"{path} is not built: run `vq-gguf build --rpc`")
    return path


def parse_servers(text: str) -> list[str]:
    """'host:port,host:port' -> the endpoints, each checked for a host and a port in 1..65535."""
    servers = [s.strip() for s in text.split(",") if s.strip()]
    if not servers:
        raise ValueError("no RPC server given: expected HOST:PORT[,HOST:PORT...]")
    for s in servers:
        host, sep, port = s.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"RPC server {s!r}: expected HOST:PORT with a port in 1..65535")
    return servers


def check_reachable(servers: list[str], timeout: float = 5.0) -> None:
    """Raise RpcError naming the first server that does not accept a connection (llama.cpp aborts the process
    on one it cannot reach, so this is checked first)."""
    for s in servers:
        host, _, port = s.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except OSError as e:
            raise RpcError(f"RPC server {s} cannot be reached ({e.strerror or e}); is `vq-gguf rpc-server` "
                           "running there?") from None


def check_bind(host: str, port: int, private_network: bool) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port}: give 1 to 65535")
    if not private_network and not is_loopback(host):
        raise ValueError(f"{host} is reachable beyond this machine and RPC has no authentication: bind to an address "
                         "of a private network only, and say so with --private-network")


class RpcServer(LoggedProcess):
    """A running rpc-server (CPU backend) whose output goes to `log_path`; a context manager that waits until
    it accepts connections and stops it on exit."""
    error, name = RpcError, "rpc-server"

    def __init__(self, log_path: Path, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 threads: int | None = None, private_network: bool = False):
        check_bind(host, port, private_network)
        self.endpoint = f"{host}:{port}"
        super().__init__([str(binary()), "--host", host, "--port", str(port),
                          "--threads", str(threads or os.cpu_count() or 1)], log_path)

    def ready(self) -> bool:
        try:
            check_reachable([self.endpoint], timeout=1)
            return True
        except RpcError:
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "RpcServer":
        return super().wait_ready(timeout)


def run(*, host: str, port: int, threads: int | None, private_network: bool) -> None:
    """`vq-gguf rpc-server`: serve in the foreground until Ctrl-C or until the server exits."""
    from vq_gguf.paths import home
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server = RpcServer(home() / "logs" / f"rpc-server-{port}.log", host=host, port=port, threads=threads,
                       private_network=private_network)
    try:
        server.wait_ready()
        print(f"rpc-server listens on {server.endpoint} (log: {server.log_path}); on the machine that runs the "
              f"model: vq-gguf chat FILE --rpc {server.endpoint}\n  Ctrl-C stops it", flush=True)
        server.proc.wait()
        if server.proc.returncode:
            sys.exit(f"rpc-server exited with code {server.proc.returncode}")
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
