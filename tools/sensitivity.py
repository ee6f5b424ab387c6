"""Which tensors of a VQ file hurt the model most: the KL-divergence from the float model when only one kind of
block linear (attn_q, ..., ffn_down) is taken from the file and every other weight stays float.

    python -m vq_gguf.tools.sensitivity FILE.vq.gguf [--kinds attn_k ffn_down] [--windows 4] [--each [--json OUT]]

The source is the default model (or --model); KL is per token, on held-out calibration windows (the same draw
`vq-gguf quantize` holds out). The kinds' KLs roughly add up to the whole file's: a guide for spending bits.
With --each, every tensor of the kinds alone, most harmful first: which layers deserve more bits (--json keeps
them for `python -m vq_gguf.tools.allocate`).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from gguf import GGUFReader

from vq_gguf import source
from vq_gguf.calib import DEFAULT_CALIB, calibration_tokens
from vq_gguf.default_model import fetch
from vq_gguf.finetune import kl_to_float
from vq_gguf.names import LINEAR_KINDS
from vq_gguf.paths import home
from vq_gguf.vqtensor import read_vq


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--model", default=None, help="the float source of FILE (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--kinds", nargs="*", default=list(LINEAR_KINDS))
    ap.add_argument("--windows", type=int, default=4, help="held-out windows of 512 tokens")
    ap.add_argument("--each", action="store_true", help="one tensor at a time instead of one kind at a time")
    ap.add_argument("--json", default=None, help="with --each: write {tensor: KL per token} here")
    args = ap.parse_args(argv)

    src = source.load(args.model or fetch(home()))
    vq = read_vq(GGUFReader(args.file), set(src.linear_names()).__contains__)
    tokens = calibration_tokens(src.path, [DEFAULT_CALIB], 32 + args.windows, 512)[32:]
    if args.each:
        rows = []
        for n in (n for n in vq if any(f".{kind}." in n for kind in args.kinds)):
            rows.append((kl_to_float(src, {n: vq[n]}, tokens), n))
            print(f"[sensitivity] {n}: {rows[-1][0]:.4f}", flush=True)
        print("| tensor | KL per token |\n| --- | ---: |")
        for kl, n in sorted(rows, reverse=True):
            print(f"| {n} | {kl:.4f} |")
        if args.json:
            Path(args.json).write_text(json.dumps({"file": str(args.file), "windows": args.windows,
                                                   "kl": {n: kl for kl, n in rows}}, indent=1))
        return
    print("| kind | tensors | KL per token | seconds |\n| --- | ---: | ---: | ---: |")
    for kind in ["all"] + args.kinds:
        part = {n: t for n, t in vq.items() if kind == "all" or f".{kind}." in n}
        start = time.time()
        print(f"| {kind} | {len(part)} | {kl_to_float(src, part, tokens):.4f} | {time.time() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
