"""`vq-gguf demo`, the README's first command: build the patched llama.cpp, quantize the default model with one
preset, compare it with llama.cpp's own quantizations of the same model, then chat with the file just made.

The comparison makes the VQ file itself (from its float reference, as it makes llama.cpp's files), so nothing
is quantized twice; the chat then loads that very file. Each step prints its time and what it produced.
`--quick` runs the same steps on a slice (a few tensors, calibration windows and evaluation chunks): what CI
runs from a clone with nothing beside it, to prove the first command works for a user.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from .paths import checkout

# `4bit`: on the 135M default model its answer is right and reads well, it lands on the frontier of llama.cpp's
# files, and it quantizes within the demo's half hour on two cores; at 2 bits a model this small answers
# nonsense, and the shared-codebook presets take 28-90 minutes (README). The llama.cpp types framing it: its
# 2-bit types, which on this model's 576-wide rows fall back to 4-bit types for most tensors, Q2_K, IQ4_NL, and
# Q4_K_M, the usual choice.
PRESET = "4bit"
LLAMA_TYPES = ["IQ2_XXS", "IQ2_S", "Q2_K", "IQ4_NL", "Q4_K_M"]
CHUNKS = 40

# the slice --quick measures: two blocks, a few calibration windows and chunks, one llama.cpp type
QUICK_ARGS = ["--only", "blk.0.", "blk.1.", "--quantize-args=--calib-windows 8", "--llama-types", "Q4_K_M",
              "--chunks", "4", "--imatrix-chunks", "4", "--bench-prompt", "64", "--bench-gen", "16", "--bench-reps", "1"]

README = (checkout() or Path("/nonexistent")) / "README.md"  # its results section, on a checkout


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=PRESET, help=f"the VQ preset to make and chat with (default: {PRESET})")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chunks", type=int, default=CHUNKS,
                   help=f"evaluation chunks of 512 tokens for the comparison (default: {CHUNKS})")
    p.add_argument("--quick", action="store_true",
                   help="the same steps on a slice (blocks 0-1, 8 calibration windows, 4 chunks, one llama.cpp "
                        "type): minutes instead of half an hour; the README is left as it is")


def compare_args(args: argparse.Namespace) -> argparse.Namespace:
    """The `vq-gguf compare` run of the demo: its defaults, the demo's preset and llama.cpp types."""
    from vq_gguf.paths import home
    from vq_gguf.tools import compare

    from .default_model import NAME
    if args.quick:   # in a folder of its own: its importance matrix and files are not the full run's
        argv = ["--presets", args.preset, "--out", str(home() / "compare" / f"{NAME}-quick"), *QUICK_ARGS]
    else:
        argv = ["--presets", args.preset, "--llama-types", *LLAMA_TYPES, "--chunks", str(args.chunks)]
        argv += ["--readme", str(README)] if README.is_file() else []
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    return p.parse_args(argv)


class Clock:
    """Prints each step's title, then its time and what it produced; keeps the times for the recap."""

    def __init__(self, n: int):
        self.n, self.done, self.start = n, [], time.time()

    def step(self, title: str):
        print(f"\n[demo {len(self.done) + 1}/{self.n}] {title}", flush=True)
        self.done.append([title, time.time()])

    def result(self, text: str) -> None:
        self.done[-1][1] = time.time() - self.done[-1][1]
        print(f"[demo {len(self.done)}/{self.n}] {self.done[-1][0]}: {self.done[-1][1]:.0f} s -> {text}", flush=True)

    def recap(self) -> str:
        lines = [f"  {seconds:6.0f} s  {title}" for title, seconds in self.done]
        return "\n".join(["[demo] steps:", *lines, f"  {time.time() - self.start:6.0f} s  in all (set-up before it not counted)"])


def run(args: argparse.Namespace) -> None:
    from vq_gguf.native.build import build
    from vq_gguf.runtime.chat import run as chat
    from vq_gguf.runtime.llama import SamplerConfig
    from vq_gguf.tools import compare

    from .calib import DEFAULT_CALIB, check_sources
    from .bpw import describe

    c_args = compare_args(args)
    check_sources([DEFAULT_CALIB, *c_args.calib])      # before the build: missing data stops the demo at once
    check_sources([c_args.eval_text], "evaluation text")
    clock = Clock(4)

    clock.step("build the patched llama.cpp")
    clock.result(str(build()))

    clock.step(f"quantize ({args.preset}), compare with llama.cpp's {' '.join(c_args.llama_types)}")
    compare.run(c_args)
    settings = compare.settings(c_args)
    vq = compare.vq_file(settings, args.preset)
    clock.result(f"{settings['report_dir']}/results.md")

    clock.step("the VQ file")
    print(describe(vq))
    clock.result(str(vq))

    clock.step("chat with it (greedy)")
    print(f"> {args.prompt}", flush=True)
    answer = chat(str(vq), prompt=args.prompt, system=None, sampler=SamplerConfig(temperature=0.0),
                  max_tokens=args.max_tokens, n_ctx=None, threads=None, verbose=False)
    clock.result(f"{len(answer)} characters")
    print("\n" + clock.recap(), flush=True)
