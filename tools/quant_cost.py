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


def synthetic_llama(width_mult: int, folder: Path, tokenizer_gguf: Path) -> Path:
    """A two-block llama of SmolLM2's shape scaled `width_mult` times in width, random weights, HF layout."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    out = folder / f"synthetic-x{width_mult}"
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_gguf.parent, gguf_file=tokenizer_gguf.name)
    torch.manual_seed(width_mult)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=SMOL_WIDTH * width_mult, intermediate_size=SMOL_FFN * width_mult,
                      num_hidden_layers=2, num_attention_heads=SMOL_HEADS * width_mult,
                      num_key_value_heads=SMOL_KV * width_mult, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="*", default=["2bit", "3bit", "4bit"], help="presets on the default model")
    ap.add_argument("--widths", nargs="*", type=int, default=[1, 2], help="width multiples of the synthetic models")
    ap.add_argument("--scale-preset", default="2bit", help="preset of the scale-up runs")
    ap.add_argument("--workdir", type=Path, default=home() / "cost")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--keep", type=Path, default=None, help="keep the quantized files in this folder (default: deleted)")
    args = ap.parse_args(argv)

    from vq_gguf.default_model import fetch
    default = fetch(home())
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        runs = [("default", p, Path(tmp) / f"default-{p}.gguf") for p in args.presets]
        runs += [(w, args.scale_preset, Path(tmp) / f"synthetic-x{w}.gguf") for w in args.widths]
        for model, preset, out in runs:
            if model != "default":
                model = synthetic_llama(model, args.workdir, default)
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
