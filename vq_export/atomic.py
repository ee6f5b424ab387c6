"""Writes that never leave a half-written file under the target's name.

Every output of the project (GGUF files, resume parts, checkpoints, results) is written to a temporary file
beside its target, named for the writing process, and renamed over the target only when complete: a crash,
a kill or an error keeps the old file (if any) and the work it stands for. A killed writer's leftovers are
removed by the next write of the same target.
"""
from __future__ import annotations

import glob
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def replacing(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yields the temporary path to write; it replaces `path` when the block ends without an error and is
    removed otherwise. `suffix` ends the temporary name, for writers that add their own (np.save: ".npy")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{suffix}")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale(path: Path) -> None:
    """Remove the temporary files of earlier writes of `path` whose process is gone (killed before the rename)."""
    prefix = f".{path.name}."
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*.tmp*"):
        pid = tmp.name[len(prefix):].split(".tmp", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)
