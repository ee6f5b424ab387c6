"""Calibration data: text files (or a Hugging Face dataset when one is reachable), tokenized by llama.cpp's
own tokenizer for the model, cut into fixed-length windows drawn with a seed."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

# The shared text data (calib/, eval/): $VQ_GGUF_DATA, or ../shared/data beside the checkout.
DATA_DIR = Path(os.environ.get("VQ_GGUF_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
DEFAULT_CALIB = DATA_DIR / "calib"


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
        p = Path(s)
        if p.is_dir():
            files = sorted(p.glob("*.txt"))
            if not files:
                raise FileNotFoundError(f"calibration folder {p} has no .txt files")
            parts += [f.read_text(encoding="utf-8") for f in files]
        elif p.is_file():
            parts.append(p.read_text(encoding="utf-8"))
        else:
            raise FileNotFoundError(f"calibration text {p} does not exist")
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
    from runtime.llama import Model
    with Model(model_gguf, vocab_only=True) as tok:
        tokens = tok.tokenize(read_texts(sources), add_special=False)
    return windows(tokens, n, length, seed)
