"""A llama.cpp server process (llama-server, rpc-server) whose output goes to a log file: started, waited for
until it answers, stopped. Subclasses say how to tell it is ready and which error to raise."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path


class LoggedProcess:
    error = RuntimeError   # raised when the process exits or is not ready in time; the message ends with its log
    name = "process"

    def __init__(self, cmd: list[str], log_path: Path, env: dict | None = None):
        self.cmd = cmd
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def ready(self) -> bool:
        raise NotImplementedError

    def wait_ready(self, timeout: float):
        """Block until ready(); raise if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.error(f"{self.name} exited with code {self.proc.returncode}{self._log_tail()}")
            if self.ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise self.error(f"{self.name} was not ready after {timeout:.0f} s{self._log_tail()}")

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

    def __enter__(self):
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
