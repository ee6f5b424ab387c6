"""Spend a bit budget where it hurts: per-tensor settings for `vq-gguf quantize` from measured sensitivity.

    python -m vq_gguf.tools.sensitivity FILE --kinds ffn_down --each --json sens.json
    python -m vq_gguf.tools.allocate FILE --sensitivity sens.json --budget 2.07 --ladder v=4,k=128 v=4,k=256 v=4,k=512 v=4,k=1024 v=2,k=64

Model: tensor i taken alone from FILE costs the model a KL of s_i (tools.sensitivity). Quantized on rung r of the
ladder instead, it would cost s_i · e_i(r) / e_i(FILE), e being the tensor's held-out layer-output error
(tools.layer_proxy's figure, Hessians from the float model), measured here for FILE's tensor and for every rung.
Greedy: every tensor starts on the cheapest rung, then the move to a higher rung that saves the most KL per bit is
taken, as long as the bits (counted as the file counts them, codebooks included) stay within budget × weights.
Prints each tensor's rung and the `--tensor-config` arguments that give it.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from vq_gguf import source
from vq_gguf.cli import parse_config
from vq_gguf.default_model import fetch
from vq_gguf.names import parse_linear
from vq_gguf.paths import home
from vq_gguf.presets import PRESETS
from vq_gguf.reference import dequantize
from vq_gguf.tools.layer_proxy import FileWeights, float_hessians, tensor_bpw
from vq_gguf.vptq import VPTQ, output_error


def greedy(kl: dict[str, list[float]], bits: dict[str, list[float]], weights: dict[str, int], budget: float) -> dict[str, int]:
    """Rung of each tensor minimising Σ kl[i][r] with Σ bits[i][r]·weights[i] ≤ budget·Σ weights[i] (greedy on KL
    saved per bit; rungs need not be convex, every higher rung is a candidate move)."""
    rung = {n: min(range(len(bits[n])), key=lambda r: bits[n][r]) for n in kl}
    spent = sum(bits[n][rung[n]] * weights[n] for n in kl)
    limit = budget * sum(weights.values())
    if spent > limit:
        raise SystemExit(f"the cheapest rung already takes {spent / sum(weights.values()):.3f} bpw, over the budget of {budget}")
    while True:
        best = None
        for n in kl:
            for r in range(len(bits[n])):
                extra = (bits[n][r] - bits[n][rung[n]]) * weights[n]
                saved = kl[n][rung[n]] - kl[n][r]
                if extra > 0 and saved > 0 and spent + extra <= limit and (best is None or saved / extra > best[0]):
                    best = (saved / extra, n, r, extra)
        if best is None:
            return rung
        _, n, r, extra = best
        rung[n], spent = r, spent + extra


def tensor_configs(rung: dict[str, int], ladder: list[str]) -> list[str]:
    """['ffn_down@1,11:v=4,k=512', ...]: one --tensor-config argument per kind and rung."""
    blocks = defaultdict(list)
    for name, r in rung.items():
        block, kind = parse_linear(name)
        blocks[kind, r].append(block)
    return [f"{kind}@{','.join(map(str, sorted(b)))}:{ladder[r]}" for (kind, r), b in sorted(blocks.items())]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="the VQ file whose sensitivity was measured")
    ap.add_argument("--sensitivity", required=True, help="JSON of `tools.sensitivity FILE --each --json`")
    ap.add_argument("--budget", type=float, required=True, help="bits per weight over the measured tensors")
    ap.add_argument("--ladder", nargs="+", required=True, help="the settings a tensor may take, e.g. v=4,k=256")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="2bit", help="settings the ladder starts from")
    ap.add_argument("--model", default=None, help="the float source of FILE (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--calib-windows", type=int, default=32)
    ap.add_argument("--heldout-windows", type=int, default=4)
    args = ap.parse_args(argv)

    for path in (args.file, args.sensitivity):
        if not Path(path).is_file():
            raise SystemExit(f"{path}: no such file")
    try:
        s = json.loads(Path(args.sensitivity).read_text())["kl"]
    except (ValueError, KeyError) as e:
        raise SystemExit(f"{args.sensitivity}: not the JSON of `tools.sensitivity --each --json` ({e})")
    ladder = [(text, parse_config(text, PRESETS[args.preset].config)) for text in args.ladder]
    f = FileWeights(args.file)
    missing = [n for n in s if n not in f.bits]
    if missing:
        raise SystemExit(f"{args.file} has no tensor {missing[0]} of the sensitivity file")
    src = source.load(args.model or fetch(home()))
    kl, bits, weights = {}, {}, {}
    print("| tensor | KL alone | " + " | ".join(t for t, _ in ladder) + " |\n|" + " --- |" * (2 + len(ladder)))
    for name, W, H, Xv in float_hessians(src, [n.removesuffix(".weight") for n in s], args.calib_windows, args.heldout_windows):
        e0 = output_error(W, f.weight(name + ".weight"), Xv)
        rungs = [VPTQ(W, H, cfg).quantize() for _, cfg in ladder]
        errs = [output_error(W, dequantize(t), Xv) for t in rungs]
        kl[name] = [s[name + ".weight"] * e / e0 for e in errs]
        bits[name] = [tensor_bpw(t) for t in rungs]
        weights[name] = W.numel()
        print(f"| {name} | {s[name + '.weight']:.4f} | " + " | ".join(f"{e:.2%} → {k:.4f}" for e, k in zip(errs, kl[name])) + " |", flush=True)
    rung = greedy(kl, bits, weights, args.budget)
    total = sum(weights.values())
    print(f"\nbudget {args.budget} bpw: {sum(bits[n][r] * weights[n] for n, r in rung.items()) / total:.3f} bpw spent, "
          f"modelled KL {sum(kl[n][r] for n, r in rung.items()):.4f} (FILE's tensors alone add up to {sum(s.values()):.4f})")
    print("--tensor-config " + " ".join(tensor_configs(rung, args.ladder)))


if __name__ == "__main__":
    main()
