"""The Python API, beside the `vq-gguf` command (the functions below do what its subcommands do):

    from vq_gguf.api import build, chat, load, quantize
    build()                                                      # the patched llama.cpp, once (minutes)
    path = quantize("default", "smollm2.vq.gguf", preset="4bit")
    print(chat(path, "What is the capital of France?"))
    with load(path) as model:                                    # the runtime's Model: tokenize, logits, generate
        print(model.logits(model.tokenize("Hello"))[-1].argmax())
"""
from __future__ import annotations

import os
from pathlib import Path


def build(server: bool = False) -> Path:
    """Fetch, patch and build llama.cpp with the VQ types (a no-op when up to date); returns its bin folder."""
    from .native.build import build as build_native
    return build_native(server=server)


def quantize(model: str | os.PathLike = "default", out: str | os.PathLike | None = None, preset: str = "4bit", *,
             calib: list[str | os.PathLike] | None = None, seed: int = 0, other_type: str = "q8_0",
             only: list[str] | None = None, device: str | None = None) -> Path:
    """Quantize `model` ("default", a GGUF file or a Hugging Face folder) with a preset of `vq-gguf quantize`
    (docs/quantizer.md) and write `out` (default: <preset>.vq.gguf here); returns the path. Builds llama.cpp
    first when needed (its tokenizer reads the calibration text). Resumes an interrupted run of the same inputs.
    `device`: where the arithmetic runs (default: a GPU that torch sees, else the CPU)."""
    from .presets import PRESETS
    from .quantize import quantize_model
    from .source import load_model
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; the presets are {', '.join(PRESETS)}")
    build()
    out = Path(out) if out is not None else Path(f"{preset}.vq.gguf")
    return quantize_model(load_model(model), out, PRESETS[preset], seed=seed, other_type=other_type,
                          only=only, calib=calib, device=device)


def load(path: str | os.PathLike, **options):
    """The runtime's `Model` for a GGUF file (a context manager); options as `vq_gguf.runtime.llama.Model`
    (n_ctx, n_threads, verbose, ...). Needs `build()` once."""
    from .runtime.llama import Model
    return Model(path, **options)


def chat(model, prompt: str, *, system: str | None = None, max_tokens: int = 256, temperature: float = 0.0,
         seed: int = 0) -> str:
    """One answer to `prompt` from `model` (a path, or a Model from `load`), rendered with the model's chat
    template; greedy unless a temperature is given."""
    from .runtime.llama import Chat, Model, SamplerConfig
    sampler = SamplerConfig(temperature=temperature, seed=seed)
    if isinstance(model, Model):
        return "".join(Chat(model, system=system, sampler=sampler).send(prompt, max_tokens=max_tokens))
    with Model(model) as m:
        return "".join(Chat(m, system=system, sampler=sampler).send(prompt, max_tokens=max_tokens))
