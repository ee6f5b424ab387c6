"""Where things are: the cache folder that holds everything the project builds, downloads and measures
($VQ_GGUF_HOME, default ~/.cache/vq-gguf), and the source checkout when the package runs from one."""
from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("VQ_GGUF_HOME", Path.home() / ".cache" / "vq-gguf"))


def checkout() -> Path | None:
    """The root of the git checkout this package runs from (an editable install), or None when installed."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "vq_export").is_dir() else None
