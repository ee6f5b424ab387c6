"""Writes that never leave a half-written file under the target's name, and what tells a saved result from a
stale one: content hashes, and the folders of work in progress a running process holds.

Every output of the project (GGUF files, resume parts, checkpoints, results) is written to a temporary file
beside its target, named for the writing process, and renamed over the target only when complete: a crash,
a kill or an error keeps the old file (if any) and the work it stands for. The file's data and then the folder
entry are flushed to disk (fsync) around the rename, so that a power cut cannot leave a renamed but empty file.
A killed writer's leftovers are removed by the next write of the same target.
"""
from __future__ import annotations

import glob
import hashlib
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
        _fsync(tmp)
        tmp.replace(path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(path: Path) -> None:
    """Remove the temporary files of earlier writes of `path` whose process is gone (killed before the rename)."""
    prefix = f".{path.name}."
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*.tmp*"):
        pid = tmp.name[len(prefix):].split(".tmp", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)


def sha256(path: str | os.PathLike) -> str:
    """Content hash of a file (hex): a saved result belongs to the bytes of its inputs, whatever their names; a
    download is the pinned one."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def hold(folder: Path) -> None:
    """Mark a folder of work in progress as this process's, so that `vq-gguf clean` leaves it alone."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pid").write_text(str(os.getpid()))


def is_held(folder: Path) -> bool:
    """Whether a live process holds the folder (see `hold`)."""
    try:
        pid = int((folder / "pid").read_text())
    except (OSError, ValueError):
        return False
    return pid != os.getpid() and Path(f"/proc/{pid}").exists()


def leftovers(folder: Path, recursive: bool = True) -> list[Path]:
    """Resume folders (`.NAME.parts-KEY`) in `folder` (and its subfolders) that no live process holds: what an
    interrupted run, or one with other inputs, left behind."""
    if not folder.is_dir():
        return []
    found = folder.rglob(".*.parts-*") if recursive else folder.glob(".*.parts-*")
    return sorted(p for p in found if p.is_dir() and not is_held(p))
