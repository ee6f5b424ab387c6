"""What quantizing costs: wall time and peak memory of `vq-gguf quantize`, per preset on the default model, and
how both grow with model size (synthetic random llamas of growing width).

    python -m vq_gguf.tools.quant_cost                                   # presets 2bit 3bit 4bit, widths x1 x2
    python -m vq_gguf.tools.quant_cost --presets 2bit --widths 1 2 3 --json cost.json
    python -m vq_gguf.tools.quant_cost --widths 1 2 3 --keep cost     # keep the files (to measure their quality after)

Every quantization runs in a fresh process (so its peak resident memory is its own) and the figures come from
the report it writes (`seconds`: calibration, Hessians and quantization, not the writing of the file;
`peak_rss_gib`). The scale-up models are Hugging Face llamas with random weights, SmolLM2's layout (head size 64,
3 KV heads per 9 heads scaled alike, FFN 8/3 × width) and two blocks, converted by llama.cpp's converter:
random weights cost what real ones do, and two blocks are enough to see the cost per block. Timings depend on
what else the machine runs: the load average is printed beside them.

    python -m vq_gguf.tools.quant_cost --shapes smollm2-135m llama3-8b --preset 2bit --json shapes.json

`--shapes` measures real models' block shapes without the models: each distinct block linear (its shape and
the preset's settings for it in a middle block) quantized by VPTQ from random weights and a Hessian of random
activations, in its own process (seconds and peak memory); the Hessian products and the two forward passes
of a block (one with the Hessians, one through the quantized block) as the matrix products of the preset's
calibration tokens, in 4096-token batches as hessian.py takes them. A block's cost is the sum, a model's the
block's times its depth: an extrapolation (the default model's row can be set against its measured run).
A kind the preset shares is assigned to a random fixed codebook: the shared k-means is not included.

    python -m vq_gguf.tools.quant_cost --whole llama3-8b --blocks 1 --preset 2bit

`--device cuda` runs `--shapes` (VPTQ and the products) on a GPU, and adds its peak memory there.

    python -m vq_gguf.tools.quant_cost --agree cuda --preset 2bit

`--agree DEVICE` quantizes one random weight on the CPU with seeds 0 and 1 and on DEVICE with seed 0: the two
seeds' proxy losses are the run spread the device's must stay within (docs/quantizer.md, "Devices").

`--whole` runs the whole command (agreement check, Hessians, every linear, the file) on a random llama of a
real model's block shapes, a few blocks deep, with SmolLM2's tokenizer: the peak memory of a real run, which
does not grow with depth.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vq_gguf.paths import home
from vq_gguf.tools.shapes import SHAPES, block_linears

SMOL_WIDTH, SMOL_FFN, SMOL_HEADS, SMOL_KV = 576, 1536, 9, 3


def quantize(model: str | Path, preset: str, out: Path, extra: list[str] = ()) -> dict:
    """One `vq-gguf quantize` in its own process; its report's cost figures and the block linears' weights."""
    cmd = [sys.executable, "-m", "vq_gguf.cli", "quantize", "--model", str(model), "--preset", preset,
           "--out", str(out), *extra]
    load = os.getloadavg()[0]
    start = time.time()
    subprocess.run(cmd, check=True)
    report = json.loads(out.with_suffix(".report.json").read_text())
    from vq_gguf import bpw
    bits = bpw.count(out)
    return {"preset": preset, "model": str(model), "seconds": report["seconds"], "wall_s": time.time() - start,
            "peak_rss_gib": report["peak_rss_gib"], "linear_params": sum(t.elements for t in bits.linears()),
            "linear_bpw": bits.linear_bpw, "load_before": load, "command": " ".join(cmd)}


def synthetic_llama(out: Path, tokenizer_gguf: Path, hidden: int, ffn: int, heads: int, kv: int, blocks: int, *,
                    tied: bool = True, seed: int = 0) -> Path:
    """A llama of these widths and depth with random weights, Hugging Face layout, SmolLM2's tokenizer (made once)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_gguf.parent, gguf_file=tokenizer_gguf.name)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=blocks,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


BATCH_TOKENS = 4096    # tokens per Hessian product: hessian.collect's 8 windows of 512


def random_linear(out_features: int, in_features: int):
    """A random weight [out, in] and the Hessian of random activations, the same on every machine."""
    import torch
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(out_features, in_features, generator=gen) * 0.02
    # activations of a real residual stream are far from white: a few strong channels, a decaying spectrum
    scale = torch.rand(in_features, generator=gen).pow(4) * 4 + 0.1
    X = torch.randn(max(BATCH_TOKENS, in_features + 512), in_features, generator=gen) * scale   # H of full rank
    return W, (X.T @ X).double(), gen


def one_linear(out_features: int, in_features: int, preset_name: str, kind: str, n_blocks: int,
               device: str = "cpu") -> dict:
    """VPTQ of one random [out, in] weight with the preset's settings for a middle block's `kind`, on `device`:
    seconds and this process's peak memory (and the GPU's)."""
    import torch
    from vq_gguf.hessian import INPUT_OF
    from vq_gguf.presets import PRESETS
    from vq_gguf.quantize import gpu_peak_gib, peak_memory_gib
    from vq_gguf.vptq import VPTQ
    preset = PRESETS[preset_name]
    cfg = preset.config_for(f"blk.{n_blocks // 2}.{kind}.weight", n_blocks)
    W, H, gen = random_linear(out_features, in_features)
    book = None
    if kind in preset.share:
        book = torch.randn(1, cfg.k, cfg.v, generator=gen).half().float() * 0.02
    start = time.time()
    VPTQ(W, H, cfg, codebook=book, device=device).quantize()   # the codes come back to the CPU: synchronised
    seconds = time.time() - start
    return {"kind": kind, "shape": [out_features, in_features], "input": INPUT_OF[kind], "seconds": seconds,
            "peak_rss_gib": peak_memory_gib(), "peak_gpu_gib": gpu_peak_gib(device),
            "config": f"v{cfg.v} k{cfg.k}" + (f" k_res{cfg.k_res}" if cfg.k_res else "") + (" shared" if book is not None else "")}


def agree(out_features: int, in_features: int, preset_name: str, device: str) -> dict:
    """One random weight quantized with the preset's settings for an ffn_up on the CPU with seeds 0 and 1 and on
    `device` with seed 0: relative proxy loss tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) of each, and the share of the device
    run's codes equal to the CPU run's."""
    import dataclasses
    import numpy as np
    import torch
    from vq_gguf.presets import PRESETS
    from vq_gguf.reference import dequantize
    from vq_gguf.vptq import VPTQ, proxy_loss
    cfg = PRESETS[preset_name].config_for("blk.1.ffn_up.weight", 3)
    W, H, _ = random_linear(out_features, in_features)
    whole = proxy_loss(W, torch.zeros_like(W), H)
    r = {"shape": [out_features, in_features], "preset": preset_name, "device": device, "rel_loss": {}, "seconds": {}}
    codes = []
    for label, dev, seed in (("cpu, seed 0", "cpu", 0), ("cpu, seed 1", "cpu", 1), (f"device {device}, seed 0", device, 0)):
        start = time.time()
        t = VPTQ(W, H, dataclasses.replace(cfg, seed=seed), device=dev).quantize()
        r["seconds"][label] = time.time() - start
        r["rel_loss"][label] = proxy_loss(W, torch.from_numpy(dequantize(t)), H) / whole
        codes.append(t.codes)
    r["codes_equal"] = float(np.mean(codes[0] == codes[2]))
    return r


def products(shape: str, tokens: int, device: str = "cpu") -> dict:
    """Seconds of one block's Hessian products (XᵀX of each distinct linear input, over `tokens`) and of one
    forward pass's linear products, from a timed 4096-token batch of each (after one untimed, on a GPU)."""
    import torch
    from vq_gguf.hessian import INPUT_OF
    linears = block_linears(SHAPES[shape])
    batches = tokens / BATCH_TOKENS

    def timed(f) -> float:
        gpu = torch.device(device).type == "cuda"
        for _ in range(2 if gpu else 1):   # on a GPU the first call loads the library's kernels: timed is the second
            start = time.time()
            f()
            if gpu:
                torch.cuda.synchronize(device)
        return time.time() - start

    hessian = forward = 0.0
    for name in sorted({INPUT_OF[k] for k in linears}):
        n = next(linears[k][1] for k in linears if INPUT_OF[k] == name)
        X = torch.randn(BATCH_TOKENS, n, device=device)
        hessian += timed(lambda: (X.T @ X).to(torch.float64)) * batches
    for out_features, in_features in linears.values():
        X, W = torch.randn(BATCH_TOKENS, in_features, device=device), torch.randn(out_features, in_features, device=device)
        forward += timed(lambda: X @ W.T) * batches
    return {"hessian_s": hessian, "forward_s": forward}


def measure_shape(shape: str, preset_name: str, device: str = "cpu") -> dict:
    """A block of model `shape` under the preset: each distinct linear in its own process, then the products."""
    from vq_gguf.presets import PRESETS
    preset = PRESETS[preset_name]
    n_blocks = SHAPES[shape].blocks
    units: dict[tuple, list[str]] = {}
    for kind, (o, i) in block_linears(SHAPES[shape]).items():
        cfg = preset.config_for(f"blk.{n_blocks // 2}.{kind}.weight", n_blocks)
        units.setdefault((o, i, cfg, kind in preset.share), []).append(kind)
    rows = []
    for (o, i, _, _), kinds in units.items():
        cmd = [sys.executable, "-m", "vq_gguf.tools.quant_cost", "--one-linear", str(o), str(i), kinds[0],
               str(n_blocks), "--preset", preset_name, "--device", device]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        r["kinds"] = kinds
        rows.append(r)
        gpu = f", GPU peak {r['peak_gpu_gib']:.2f} GiB" if r["peak_gpu_gib"] is not None else ""
        print(f"[cost] {shape} {'/'.join(kinds)} {o}x{i} {r['config']} on {device}: {r['seconds']:.1f} s, "
              f"peak {r['peak_rss_gib']:.2f} GiB{gpu}", flush=True)
    tokens = (preset.n_calib + preset.n_heldout) * preset.seq_len
    prod = products(shape, tokens, device)
    linear_s = sum(r["seconds"] * len(r["kinds"]) for r in rows)
    block_s = linear_s + prod["hessian_s"] + 2 * prod["forward_s"]
    weights = sum(o * i for o, i in block_linears(SHAPES[shape]).values())
    return {"shape": shape, "preset": preset_name, "tokens": tokens, "linears": rows, **prod,
            "linear_s": linear_s, "block_s": block_s, "blocks": n_blocks, "model_h": block_s * n_blocks / 3600,
            "block_weights": weights, "peak_rss_gib": max(r["peak_rss_gib"] for r in rows),
            "peak_gpu_gib": max((r["peak_gpu_gib"] or 0) for r in rows), "device": device,
            "load_before": os.getloadavg()[0]}


def shape_row(r: dict) -> str:
    return (f"| {r['shape']} | {r['preset']} | {r['device']} | {r['block_weights'] / 1e6:.0f} M | {r['linear_s']:.0f} | "
            f"{r['hessian_s']:.0f} | {2 * r['forward_s']:.0f} | {r['block_s']:.0f} | "
            f"{r['block_s'] / (r['block_weights'] / 1e6):.2f} | {r['peak_rss_gib']:.2f} | {r['peak_gpu_gib']:.2f} | "
            f"{r['blocks']} | {r['model_h']:.2f} | {r['load_before']:.1f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="*", default=["2bit", "3bit", "4bit"], help="presets on the default model")
    ap.add_argument("--widths", nargs="*", type=int, default=[1, 2], help="width multiples of the synthetic models")
    ap.add_argument("--scale-preset", default="2bit", help="preset of the scale-up runs")
    ap.add_argument("--workdir", type=Path, default=home() / "cost")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--keep", type=Path, default=None, help="keep the quantized files in this folder (default: deleted)")
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=None,
                    help="measure these models' block shapes instead (see above); with --preset")
    ap.add_argument("--preset", default="2bit", help="preset of --shapes and --whole")
    ap.add_argument("--whole", choices=SHAPES, default=None,
                    help="instead: the whole quantize command on a random llama of this shape (untied head, "
                         "SmolLM2's tokenizer), --blocks deep: its time and peak memory")
    ap.add_argument("--blocks", type=int, default=1, help="depth of --whole's model")
    ap.add_argument("--device", default="cpu", help="torch device of --shapes (cpu, cuda, cuda:1)")
    ap.add_argument("--agree", metavar="DEVICE", default=None,
                    help="instead: one random weight (--agree-shape) on the CPU (seeds 0 and 1) and on DEVICE (seed 0)")
    ap.add_argument("--agree-shape", nargs=2, type=int, default=[1024, 2048], metavar=("OUT", "IN"))
    ap.add_argument("--one-linear", nargs=4, metavar=("OUT", "IN", "KIND", "BLOCKS"), default=None,
                    help=argparse.SUPPRESS)   # one process of --shapes
    args = ap.parse_args(argv)

    if args.one_linear:
        o, i, kind, n_blocks = args.one_linear
        print(json.dumps(one_linear(int(o), int(i), args.preset, kind, int(n_blocks), args.device)))
        return
    from vq_gguf.quantize import check_device
    check_device(args.agree or args.device)   # before minutes of work on the CPU
    if args.agree:
        r = agree(*args.agree_shape, args.preset, args.agree)
        print(json.dumps(r, indent=1))
        print("\n| run | relative proxy loss | seconds |\n| --- | ---: | ---: |")
        print("\n".join(f"| {k} | {v:.5f} | {r['seconds'][k]:.1f} |" for k, v in r["rel_loss"].items()))
        print(f"\n{r['codes_equal']:.1%} of the codes equal between the CPU and {args.agree} runs of seed 0")
        if args.json:
            args.json.write_text(json.dumps(r, indent=1))
        return
    if args.shapes:
        rows = []
        for shape in args.shapes:
            rows.append(measure_shape(shape, args.preset, args.device))
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
        print("\n| shape | preset | device | weights per block | linears s | Hessians s | forward s | block s | "
              "s per M weights | peak GiB | GPU peak GiB | blocks | model h | load before |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print("\n".join(shape_row(r) for r in rows))
        return

    from vq_gguf.default_model import fetch
    default = fetch(home())
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.whole:
        s = SHAPES[args.whole]
        model = synthetic_llama(args.workdir / f"{args.whole}-{args.blocks}", default, s.hidden, s.ffn, s.heads, s.kv,
                                args.blocks, tied=False)
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            r = quantize(model, args.preset, Path(tmp) / "whole.gguf")
        print("\n| model | preset | block-linear weights | bpw | quantize s | s per M weights | peak GiB | load before |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        print(row(r))
        return
    rows = []
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        runs = [("default", p, Path(tmp) / f"default-{p}.gguf") for p in args.presets]
        runs += [(w, args.scale_preset, Path(tmp) / f"synthetic-x{w}.gguf") for w in args.widths]
        for model, preset, out in runs:
            if model != "default":   # SmolLM2's layout, `model` times as wide, two blocks
                model = synthetic_llama(args.workdir / f"synthetic-x{model}", default, SMOL_WIDTH * model,
                                        SMOL_FFN * model, SMOL_HEADS * model, SMOL_KV * model, 2, seed=model)
            rows.append(quantize(model, preset, out))
            print(f"[cost] {row(rows[-1])}", flush=True)     # at once: a later failure keeps what was measured
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
    print("\n| model | preset | block-linear weights | bpw | quantize s | s per M weights | peak GiB | load before |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(row(r) for r in rows))


def row(r: dict) -> str:
    name = "default" if r["model"] == "default" else Path(r["model"]).name
    return (f"| {name} | {r['preset']} | {r['linear_params'] / 1e6:.1f} M | {r['linear_bpw']:.3f} | {r['seconds']:.0f} | "
            f"{r['seconds'] / (r['linear_params'] / 1e6):.1f} | {r['peak_rss_gib']:.2f} | {r['load_before']:.1f} |")


if __name__ == "__main__":
    main()
