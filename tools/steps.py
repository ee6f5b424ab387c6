"""The comparison's steps, resumable: each finished step's result is saved at once, keyed by its inputs.

A comparison runs for an hour or more on a small machine; an interruption (or a failing tool) must not cost
the steps already done. `Steps` keeps `steps.json` in the output folder: for each step, a hash of everything
it depends on (input files by name, size and modification time; the exact command; options) and its result.
A rerun reuses a step whose key is unchanged and whose output file is still the one it wrote. The file is
rewritten (to a temporary name, then renamed) after every step, so it is never half-written.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from vq_gguf.atomic import replacing


def identity(path: Path) -> dict[str, Any]:
    """What tells a file (or a directory's files) apart from its next version, without reading it."""
    path = Path(path)
    if path.is_dir():
        return {"name": path.name, "files": [identity(p) for p in sorted(path.iterdir()) if p.is_file()]}
    st = path.stat()
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def digest(value: Any) -> str:
    """A short stable hash of a JSON-able value (a step's inputs)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]



def write_json(path: Path, data: Any) -> None:
    """Write to a temporary file, then rename: a crash never leaves a half-written file under `path`."""
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")


def _fmt_seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


class Steps:
    """Run the planned steps in order, skipping those already done; print a line per step with an ETA."""

    def __init__(self, path: Path, plan: list[tuple[str, str]]):
        self.path = path
        self.plan = plan                      # (name, kind) of every step this run will go through
        self.records: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
        self.position = 0

    def _estimate(self, kind: str) -> float | None:
        """Mean duration of the steps of this kind that ran, in this run or an earlier one."""
        seconds = [r["seconds"] for r in self.records.values() if r.get("kind") == kind]
        return sum(seconds) / len(seconds) if seconds else None

    def _eta(self) -> str:
        """Time left for the steps after this one that have no saved result (those that have one are most
        likely reused), at the mean duration of their kind."""
        remaining: dict[str, int] = defaultdict(int)
        for name, kind in self.plan[self.position:]:
            if name not in self.records:
                remaining[kind] += 1
        if not remaining:
            return "little left"
        estimates = {kind: self._estimate(kind) for kind in remaining}
        if any(e is None for e in estimates.values()):
            return f"{sum(remaining.values())} steps to run"
        return f"about {_fmt_seconds(sum(n * estimates[k] for k, n in remaining.items()))} left"

    def run(self, name: str, kind: str, key: Any, fn: Callable[[], dict], output: Path | None = None) -> dict:
        """The result of step `name`: the saved one when `key` and `output` are unchanged, else fn()'s.
        A `key` of None means the step always runs (it decides about reuse itself)."""
        self.position = next((i for i, (n, _) in enumerate(self.plan) if n == name), self.position) + 1
        label = f"[compare {self.position}/{len(self.plan)}] {name}"
        key_hash = None if key is None else digest(key)
        rec = self.records.get(name)
        if (key_hash is not None and rec and rec["key"] == key_hash
                and (output is None or (output.exists() and rec.get("output") == identity(output)))):
            print(f"{label}: done before, reused", flush=True)
            return rec["result"]
        print(f"{label} ...", flush=True)
        start = time.time()
        result = fn()
        seconds = time.time() - start
        self.records[name] = {"kind": kind, "key": key_hash, "result": result, "seconds": seconds,
                              "output": identity(output) if output else None}
        write_json(self.path, self.records)
        print(f"{label}: done in {_fmt_seconds(seconds)}; {self._eta()}", flush=True)
        return result
