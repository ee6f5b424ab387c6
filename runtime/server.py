"""`vq-gguf serve`: the patched llama-server on a GGUF, its OpenAI-compatible API on loopback by default.

llama-server renders chats with the model's own chat template (tokenizer.chat_template, through its Jinja
engine). It is built without the web UI (which upstream downloads at build time), so it serves the API only.
Beyond loopback it serves only with an API key (llama-server then answers 401 to any request without it,
/health excepted), unless told otherwise: a model server on a network is a free compute service otherwise.
The key reaches llama-server through its environment, not its command line, which `ps` shows to every user.
"""
from __future__ import annotations

import os
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

from .llama import check_model_file
from .network import is_loopback
from .process import LoggedProcess

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
READY_TIMEOUT_S = 120.0


class ServerError(RuntimeError):
    """llama-server did not start or stopped; the message ends with its log."""


def binary() -> Path:
    from vq_gguf.native.build import bin_dir
    path = bin_dir() / "llama-server"
    if not path.exists():
        raise ServerError(f"{path} is not built: run `vq-gguf build --server`")
    return path


def check_bind(host: str, port: int, api_key: str | None, public_without_key: bool) -> None:
    """Refuse a port outside 1..65535, and an address beyond loopback without an API key unless told to."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port}: give 1 to 65535")
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty")
    if not api_key and not public_without_key and not is_loopback(host):
        raise ValueError(f"{host} is reachable beyond this machine: give an API key (--api-key, or VQ_GGUF_API_KEY), "
                         "or --public-without-key to serve anyone who can reach it")


# options that `vq-gguf serve` sets itself (the API key through the environment): not accepted after --
OWN_OPTIONS = ("-m", "--model", "--host", "--port", "-c", "--ctx-size", "-t", "--threads", "--alias", "-a",
               "--api-key", "--api-key-file", "--rpc", "-ngl", "--gpu-layers", "--n-gpu-layers", "-np", "--parallel")


def check_extra(extra: list[str]) -> list[str]:
    """llama-server options passed through: refused where `vq-gguf serve` has its own option for them."""
    own = [a for a in extra if a.split("=")[0] in OWN_OPTIONS]
    if own:
        raise ValueError(f"{', '.join(own)}: give these as vq-gguf serve's own options (before --), not to llama-server")
    return extra


def command(model: Path, *, host: str, port: int, n_ctx: int, threads: int | None, alias: str | None = None,
            rpc: list[str] | None = None, gpu_layers: int | None = None, parallel: int | None = None,
            extra: list[str] | None = None) -> list[str]:
    """llama-server's command line; with `rpc`, every layer on those rpc-servers (runtime/rpc.py) unless
    gpu_layers says otherwise; `extra`: further llama-server options (check_extra)."""
    if gpu_layers is None and rpc:
        gpu_layers = 999
    return [str(binary()), "-m", str(model), "--host", host, "--port", str(port), "-c", str(n_ctx),
            "-t", str(threads or os.cpu_count() or 1), "--alias", alias or Path(model).name, "--no-webui", "--jinja",
            *(["--rpc", ",".join(rpc)] if rpc else []), *(["-ngl", str(gpu_layers)] if gpu_layers is not None else []),
            *(["--parallel", str(parallel)] if parallel is not None else []), *check_extra(extra or [])]


class Server(LoggedProcess):
    """A running llama-server whose output goes to `log_path`; a context manager that waits until it is ready
    and stops it on exit."""
    error, name = ServerError, "llama-server"

    def __init__(self, model: str | os.PathLike, log_path: Path, *, host: str = DEFAULT_HOST,
                 port: int = DEFAULT_PORT, n_ctx: int = 2048, threads: int | None = None,
                 api_key: str | None = None, public_without_key: bool = False, rpc: list[str] | None = None,
                 gpu_layers: int | None = None, parallel: int | None = None, extra: list[str] | None = None):
        model = check_model_file(model)
        check_bind(host, port, api_key, public_without_key)
        if rpc:
            from .rpc import check_reachable
            check_reachable(rpc)
        self.base = f"http://{host}:{port}"
        self.url = f"{self.base}/v1"
        self.model_name = model.name
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}  # only the key given here
        if api_key:
            env["LLAMA_API_KEY"] = api_key
        super().__init__(command(model, host=host, port=port, n_ctx=n_ctx, threads=threads, rpc=rpc,
                                 gpu_layers=gpu_layers, parallel=parallel, extra=extra), log_path, env)

    def ready(self) -> bool:
        """/health answers 200: the model is loaded."""
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "Server":
        return super().wait_ready(timeout)


def run(model: str, *, host: str, port: int, n_ctx: int, threads: int | None, api_key: str | None = None,
        public_without_key: bool = False, rpc: list[str] | None = None, gpu_layers: int | None = None,
        parallel: int | None = None, extra: list[str] | None = None) -> None:
    """Start the server, say where it listens, and keep it in the foreground until Ctrl-C or until it exits."""
    from vq_gguf.paths import home
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` too stops llama-server, through the finally below
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C even when started from a shell's background job,
                                                              # which inherits SIGINT ignored
    server = Server(model, home() / "logs" / f"llama-server-{port}.log", host=host, port=port, n_ctx=n_ctx,
                    threads=threads, api_key=api_key, public_without_key=public_without_key, rpc=rpc,
                    gpu_layers=gpu_layers, parallel=parallel, extra=extra)
    auth = " -H 'Authorization: Bearer $VQ_GGUF_API_KEY'" if api_key else ""
    try:
        server.wait_ready()
        print(f"llama-server is serving {server.model_name} (log: {server.log_path})\n"
              f"  OpenAI-compatible endpoint: {server.url} (model \"{server.model_name}\")\n"
              f"  e.g. curl {server.url}/chat/completions{auth} -H 'Content-Type: application/json' "
              f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'\n"
              "  Ctrl-C stops it", flush=True)
        server.proc.wait()
        if server.proc.returncode:
            sys.exit(f"llama-server exited with code {server.proc.returncode}")
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
