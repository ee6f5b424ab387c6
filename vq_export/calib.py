"""Calibration data: text files (or a Hugging Face dataset when one is reachable), tokenized by llama.cpp's
own tokenizer for the model, cut into fixed-length windows drawn with a seed."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

# The texts the defaults use (calib/, eval/; data/README.md: sources and licenses): shipped in the package,
# or $VQ_GGUF_DATA, a folder of the same layout.
DATA_DIR = Path(os.environ.get("VQ_GGUF_DATA") or Path(__file__).resolve().parent / "data")
DEFAULT_CALIB = DATA_DIR / "calib"
EVAL_TEXT = DATA_DIR / "eval" / "wikitext-2-raw-test.txt"

HOW_TO_SUPPLY = ("pass text files or folders of .txt files (--calib, --eval), or set VQ_GGUF_DATA to a folder "
                 "with calib/ and eval/ as in the package's data/README.md")


def check_sources(sources: list[str | Path], what: str = "calibration text") -> None:
    """Fail at once, before any long work, when a text file or folder is missing: the message says how to
    supply one. `hf:` datasets are checked when they are read (they need a reachable hub)."""
    for s in sources:
        p = Path(s)
        if str(s).startswith("hf:") or p.is_file() or (p.is_dir() and any(p.glob("*.txt"))):
            continue
        problem = "has no .txt files" if p.is_dir() else "does not exist"
        raise FileNotFoundError(f"{what} {p} {problem}: {HOW_TO_SUPPLY}")


def read_texts(sources: list[str | Path]) -> str:
    """Concatenated text of files, folders (their *.txt, sorted) and `hf:NAME[:SPLIT[:FIELD]]` datasets."""
    parts = []
    for s in sources:
        s = str(s)
        if s.startswith("hf:"):
            from datasets import load_dataset  # optional dependency, needs a reachable hub
            name, split, field = (s[3:].split(":") + ["train", "text"])[:3]
            parts += [row[field] for row in load_dataset(name, split=split)]
            continue
        check_sources([s])
        p = Path(s)
        files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
        parts += [f.read_text(encoding="utf-8") for f in files]
    return "\n\n".join(parts)


def windows(tokens: list[int], n: int, length: int, seed: int) -> torch.Tensor:
    """n non-overlapping windows of `length` tokens, chosen uniformly with a seed: LongTensor [n, length]."""
    available = len(tokens) // length
    if available < n:
        raise ValueError(f"calibration text gives {available} windows of {length} tokens, {n} requested")
    pick = np.sort(np.random.default_rng(seed).choice(available, n, replace=False))
    arr = np.asarray(tokens[: available * length], dtype=np.int64).reshape(available, length)
    return torch.from_numpy(arr[pick])


def calibration_tokens(model_gguf: Path, sources: list[str | Path], n: int, length: int, seed: int = 0) -> torch.Tensor:
    from vq_gguf.runtime.llama import Model
    with Model(model_gguf, vocab_only=True) as tok:
        tokens = tok.tokenize(read_texts(sources), add_special=False)
    return windows(tokens, n, length, seed)
