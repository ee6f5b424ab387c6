"""Before a weight is quantized: do transformers (which calibrates) and the patched llama.cpp (which runs the
file) compute the same float model? Both take the same token windows; their logits must agree on the top
token and stay close, else the Hessians would come from another model than the one the user runs.

The tolerance covers arithmetic, not a different model: a llama.cpp-quantized source (the default model is
Q4_1) is run by llama.cpp with 8-bit activations, and transformers runs its dequantized weights in float32.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .source import SourceError

MIN_TOP1 = 0.9          # fraction of positions where both pick the same most likely token
MAX_MEAN_DIFF = 0.1     # mean |Δlogit| as a fraction of the logits' standard deviation


@dataclass
class Agreement:
    top1: float         # fraction of positions with the same argmax
    max_abs: float      # largest |Δlogit|
    mean_abs: float     # mean |Δlogit|
    spread: float       # standard deviation of llama.cpp's logits, the scale of the above

    @property
    def ok(self) -> bool:
        return self.top1 >= MIN_TOP1 and self.mean_abs <= MAX_MEAN_DIFF * self.spread

    def __str__(self) -> str:
        return (f"top-1 agreement {self.top1:.1%}, |Δlogit| mean {self.mean_abs:.3g} max {self.max_abs:.3g} "
                f"(logits' std {self.spread:.3g})")


def llama_cpp_logits(gguf: Path, tokens: np.ndarray) -> np.ndarray:
    """llama.cpp's logits for every window of tokens [N, L], computed by `python -m vq_gguf.agreement` in a
    process of its own: the whole model llama.cpp maps never counts in the quantizer's memory."""
    with tempfile.TemporaryDirectory(prefix="vq-agreement-") as tmp:
        np.save(Path(tmp) / "tokens.npy", tokens)
        proc = subprocess.run([sys.executable, "-m", "vq_gguf.agreement", str(gguf), tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SourceError(f"llama.cpp could not run {gguf}: {proc.stderr[-2000:]}")
        return np.load(Path(tmp) / "logits.npy")


def measure(model, gguf: Path, tokens: torch.Tensor) -> Agreement:
    """The logits of `model` (model.Model) and of llama.cpp on the GGUF file, for every window of tokens [N, L]."""
    ours = model(tokens).float().cpu().numpy()
    theirs = llama_cpp_logits(gguf, tokens.numpy())
    diff = np.abs(ours - theirs)
    return Agreement(top1=float((ours.argmax(-1) == theirs.argmax(-1)).mean()), max_abs=float(diff.max()),
                     mean_abs=float(diff.mean()), spread=float(theirs.std()))


def check(model, gguf: Path, tokens: torch.Tensor) -> Agreement:
    """measure, printed; a SourceError naming the architecture and the figures when they disagree."""
    a = measure(model, gguf, tokens)
    if not a.ok:
        raise SourceError(f"{model.arch}: transformers and llama.cpp do not run the same model on {gguf.name}: {a} "
                          f"(needed: top-1 >= {MIN_TOP1:.0%}, mean |Δ| <= {MAX_MEAN_DIFF} std). The Hessians "
                          f"would describe another model than the file's; this architecture is not supported")
    print(f"[quantize] transformers and llama.cpp agree on {tokens.numel()} tokens of {gguf.name}: {a}", flush=True)
    return a


if __name__ == "__main__":   # llama_cpp_logits' worker: python -m vq_gguf.agreement GGUF FOLDER
    from vq_gguf.runtime.llama import Model as LlamaCpp
    gguf, folder = Path(sys.argv[1]), Path(sys.argv[2])
    windows = np.load(folder / "tokens.npy")
    with LlamaCpp(gguf, n_ctx=windows.shape[1]) as m:
        np.save(folder / "logits.npy", np.stack([m.logits(window.tolist()) for window in windows]))
