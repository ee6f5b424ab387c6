"""`vq-gguf serve`: the patched llama-server on a GGUF, its OpenAI-compatible API on loopback by default.

llama-server renders chats with the model's own chat template (tokenizer.chat_template, through its Jinja
engine). It is built without the web UI (which upstream downloads at build time), so it serves the API only.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .llama import check_model_file

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
READY_TIMEOUT_S = 120.0


class ServerError(RuntimeError):
    """llama-server did not start or stopped; the message ends with its log."""


def binary() -> Path:
    from native.build import bin_dir
    path = bin_dir() / "llama-server"
    if not path.exists():
        raise ServerError(f"{path} is not built: run `vq-gguf build --server`")
    return path


def command(model: Path, *, host: str, port: int, n_ctx: int, threads: int | None, alias: str | None = None) -> list[str]:
    return [str(binary()), "-m", str(model), "--host", host, "--port", str(port), "-c", str(n_ctx),
            "-t", str(threads or os.cpu_count() or 1), "--alias", alias or Path(model).name, "--no-webui", "--jinja"]


class Server:
    """A running llama-server whose output goes to `log_path`; a context manager that waits until it is ready
    and stops it on exit."""

    def __init__(self, model: str | os.PathLike, log_path: Path, *, host: str = DEFAULT_HOST,
                 port: int = DEFAULT_PORT, n_ctx: int = 2048, threads: int | None = None):
        model = check_model_file(model)
        self.base = f"http://{host}:{port}"
        self.url = f"{self.base}/v1"
        self.model_name = model.name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.cmd = command(model, host=host, port=port, n_ctx=n_ctx, threads=threads)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "Server":
        """Block until /health answers 200 (the model is loaded); raise if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"llama-server exited with code {self.proc.returncode}{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerError(f"llama-server was not ready after {timeout:.0f} s{self._log_tail()}")

    def _log_tail(self) -> str:
        self._log.flush()
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        return f"; the end of {self.log_path}:\n{tail}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Server":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


def run(model: str, *, host: str, port: int, n_ctx: int, threads: int | None) -> None:
    """Start the server, say where it listens, and keep it in the foreground until Ctrl-C or until it exits."""
    from native.build import home
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` too stops llama-server, through the finally below
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C even when started from a shell's background job,
                                                              # which inherits SIGINT ignored
    server = Server(model, home() / "logs" / f"llama-server-{port}.log", host=host, port=port, n_ctx=n_ctx,
                    threads=threads)
    try:
        server.wait_ready()
        print(f"llama-server is serving {server.model_name} (log: {server.log_path})\n"
              f"  OpenAI-compatible endpoint: {server.url} (model \"{server.model_name}\")\n"
              f"  e.g. curl {server.url}/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'\n"
              "  Ctrl-C stops it", flush=True)
        server.proc.wait()
        if server.proc.returncode:
            sys.exit(f"llama-server exited with code {server.proc.returncode}")
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
