"""Calibration text the model writes itself.

Austen's novels are one narrow domain; a model's own samples cover what it was trained on (data-free
calibration, as in LLM-QAT). The model samples at temperature 1 (min-p 0.02 keeps the rare broken token
out) from short generic openings, one sequence at a time, until the text holds the tokens asked for.
Measured against Austen in docs/results.md ("Calibration"); the text is an ordinary `--calib` file.
"""
from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from .atomic import replacing

OPENINGS = ("The", "In", "A", "It", "When", "This", "There", "He", "She", "According to", "One", "After", "We", "I",
            "If", "During", "For", "As", "My", "How", "Why", "What", "Today", "Many", "Although", "Some", "Chapter",
            "Introduction", "Once", "Recent", "Scientists", "History", "Since", "Most", "Every", "Our", "Their", "You")


def generate(model_gguf: Path, out: Path, tokens: int, seed: int = 0, sample_tokens: int = 1024) -> Path:
    """Write samples separated by blank lines to `out` until they hold `tokens` tokens."""
    from vq_gguf.runtime.llama import Model, SamplerConfig
    if tokens < 1 or sample_tokens < 1:
        raise ValueError(f"tokens ({tokens}) and sample_tokens ({sample_tokens}) must be positive")
    samples = []
    with Model(model_gguf, n_ctx=sample_tokens + 16) as m, \
            tqdm(total=tokens, desc="self-generated text", unit="tok", dynamic_ncols=True) as bar:
        while bar.n < tokens:
            i = len(samples)
            opening = OPENINGS[i * 7 % len(OPENINGS)]
            m.reset()
            sampler = SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.02, seed=(seed * 1_000_003 + i) % 2**32)
            text = opening + "".join(m.generate(m.tokenize(opening), max_tokens=sample_tokens, sampler=sampler))
            samples.append(text)
            bar.update(len(m.tokens))
    with replacing(out, ".txt") as tmp:
        tmp.write_text("\n\n".join(samples), encoding="utf-8")
    return out
