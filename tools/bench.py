"""Generation and prompt speed of the VQ presets against llama.cpp's quants, in one run (docs/kernels.md).

    python -m vq_gguf.tools.bench                                  # make what is missing, measure, print the table
    python -m vq_gguf.tools.bench --vq 2bit=FILE --vq 3bit=FILE    # use existing VQ files
    python -m vq_gguf.tools.bench --threads 2 --reps 3 --rounds 2 --wait-idle 120 --json out.json --md out.md
    python -m vq_gguf.tools.bench --vq 2bit=FILE --synthetic 3bit 4bit   # residual presets by geometry (see --help)
    python -m vq_gguf.tools.bench --micro                          # kernel micro-benchmark, ns per weight per token
    python -m vq_gguf.tools.bench --memory-bound 4096 14336 --threads 1   # one token at 8B's shapes vs bandwidth
    python -m vq_gguf.tools.bench --cpu-variant haswell            # llama-bench of the portable build, AVX2 only
    python -m vq_gguf.tools.bench --layout --presets 2bit-shared   # presets' layouts with random codes (speed only)
    python -m vq_gguf.tools.bench --shape llama3-8b --blocks 2      # a random model of Llama-3-8B's shapes (speed only)
    python -m vq_gguf.tools.bench --shape llama3-8b --blocks 8 --ngl 99 --presets 2bit 4bit   # the same on a GPU (CUDA build)

Files (made once from the default model and cached in --workdir, default $VQ_GGUF_HOME/bench):
  float.gguf          the default model, every matrix F16 (vq_export's writer); with --shape a synthetic model
                      of that shape, random F16 weights (tools/synthetic_model.py), in the folder SHAPE-BLOCKS
  F16, Q2_K, IQ2_XXS, Q4_K_M
                      llama-quantize from float.gguf with the token embedding and output tensor Q8_0;
                      IQ2_XXS with an importance matrix (llama-imatrix on the calibration text)
  vq-<preset>         `vq-gguf quantize --preset <preset> --other-type q8_0`, unless given with --vq;
                      with --layout vq-<preset>.layout: the preset's layout with random codes (tools/layout_file.py)
  ffn_down only       VQ: the ffn_down weights of the 2bit file, every other matrix Q8_0;
                      IQ2_XXS: llama-quantize Q8_0 with --tensor-type ffn_down=iq2_xxs (same imatrix)

Measured in the same run: the machine's memory read bandwidth (`test-vq-matmul bandwidth`, before and after),
then `llama-bench -t T -p 512 -n 128 -r R -o json` over every file, repeated --rounds times with the files
interleaved, and the load average. For each file: tokens/s (mean and sd over all samples), ratio to the
Q2_K file (and, for the ffn_down-only pair, VQ to IQ2_XXS), and generation as a fraction of the bandwidth
bound: bytes of every weight that a generated token reads (all tensors, less the token embedding when the
model has a separate output matrix) against the measured bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vq_gguf.atomic import replacing
from vq_gguf.calib import DEFAULT_CALIB
from vq_gguf.tools.shapes import SHAPES

CALIB = DEFAULT_CALIB / "austen-prideprejudice.txt"
LLAMA_TYPES = ["F16", "Q4_K_M", "Q2_K", "IQ2_XXS"]
PRESETS = ["2bit", "3bit", "4bit"]
# each preset's peer: the llama.cpp file nearest to it in quality from above (docs/results.md), which it should
# match in speed
PEERS = {"2bit": "IQ2_XXS", "2bit-shared": "IQ2_XXS", "3bit-shared": "IQ2_S", "4bit": "IQ4_NL", "4bit-shared": "IQ4_NL"}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def bin_dir() -> Path:
    from vq_gguf.native.build import bin_dir as b
    return b()


def only_variant(tag: str) -> Path:
    """A folder with the portable build's tools and libraries (hard links) and one CPU backend variant, `tag`:
    ggml loads the variants it finds beside the executable, so a tool run from there uses that instruction set
    for llama.cpp's types and our kernels alike."""
    from vq_gguf.native.build import PORTABLE_VARIANTS, build_portable
    src = build_portable(tuple(sorted(set(PORTABLE_VARIANTS) | {tag})), tools=True)
    dst = src.parent / f"only-{tag}"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    for p in src.iterdir():
        if p.name.startswith("libggml-cpu-") and p.name != f"libggml-cpu-{tag}.so":
            continue
        if p.is_symlink():
            (dst / p.name).symlink_to(os.readlink(p))
        elif p.is_file():
            os.link(p, dst / p.name)
    return dst


BENCH_BIN: Path | None = None  # where llama-bench runs from: --cpu-variant's folder, else the native build
SYNTHETIC: tuple[str, int] | None = None  # --shape and --blocks: the files come from a synthetic model of that shape
TOKENIZER: Path | None = None             # --tokenizer: the synthetic model's (default: the default model's)
NGL = 0                                   # --ngl: layers on the GPU in llama-bench and llama-imatrix


def tool(name: str) -> Path:
    path = (BENCH_BIN if BENCH_BIN and name == "llama-bench" else bin_dir()) / name
    if not path.is_file():
        raise SystemExit(f"{path} not found: build the patched llama.cpp first (python -m vq_gguf.native.build)")
    return path


def run(cmd: list, logfile: Path | None = None) -> str:
    log(" ".join(str(c) for c in cmd))
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if logfile:
        logfile.write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-30:])
        raise SystemExit(f"command failed ({p.returncode}): {' '.join(str(c) for c in cmd)}\n{tail}")
    return p.stdout


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())   # Linux and macOS alike
    except OSError:
        return "n/a"


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of the machine's CPU time spent outside idle over `seconds` (from /proc/stat)."""
    def read():
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return sum(vals), vals[3] + (vals[4] if len(vals) > 4 else 0)
    try:
        t0, i0 = read()
        time.sleep(seconds)
        t1, i1 = read()
    except (OSError, ValueError, IndexError):
        return float("nan")
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_idle(limit_s: float, threshold: float = 0.15) -> float:
    """Waits (up to limit_s) until the CPUs have been idle for 3 s in a row; returns the last busy fraction."""
    deadline = time.time() + limit_s
    quiet, busy = 0, cpu_busy()
    while time.time() < deadline:
        quiet = quiet + 1 if busy < threshold else 0
        if quiet >= 3:
            break
        busy = cpu_busy()
    return busy


# --- files --------------------------------------------------------------------------------------------

def float_file(work: Path) -> Path:
    """The float model every file is made from: the default model as F16, or with --shape a synthetic model."""
    out = work / "float.gguf"
    if not out.exists():
        from vq_gguf.paths import home
        from vq_gguf import default_model, gguf_writer, source
        if SYNTHETIC:
            from . import synthetic_model
            log(f"writing a synthetic {SYNTHETIC[0]} of {SYNTHETIC[1]} blocks (random F16 weights)")
            synthetic_model.write(*SYNTHETIC, out, TOKENIZER or default_model.fetch(home()))
        else:
            log("writing the default model as F16")
            gguf_writer.write(out, source.load(default_model.fetch(home())), other_type="f16")
    return out


def imatrix_file(work: Path, threads: int, chunks: int) -> Path:
    out = work / "imatrix.gguf"
    if not out.exists():
        run([tool("llama-imatrix"), "-m", float_file(work), "-f", CALIB, "-o", out, "-c", 512,
             "--chunks", chunks, "-t", threads, "-ngl", NGL], work / "imatrix.log")
    return out


def llama_file(work: Path, qtype: str, threads: int, imatrix_chunks: int, only_ffn_down: bool = False) -> Path:
    out = work / (f"{qtype}.only-ffn_down.gguf" if only_ffn_down else f"{qtype}.gguf")
    if out.exists():
        return out
    cmd = [tool("llama-quantize"), "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0"]
    if qtype.startswith("IQ") or only_ffn_down:
        cmd += ["--imatrix", imatrix_file(work, threads, imatrix_chunks)]
    if only_ffn_down:
        cmd += ["--tensor-type", f"ffn_down={qtype.lower()}"]
        target = "Q8_0"
    else:
        target = qtype
    with replacing(out, ".gguf") as tmp:
        run(cmd + [float_file(work), tmp, target, threads], work / f"quantize-{out.stem}.log")
    return out


def vq_file(work: Path, preset: str, given: dict[str, Path], layout: bool = False) -> Path:
    if preset in given:
        return given[preset]
    if layout:
        from vq_gguf.presets import PRESETS
        from . import layout_file
        out = work / f"vq-{preset}.layout.gguf"
        if not out.exists():
            log(f"writing {out.name}: the {preset} layout with random codes")
            layout_file.write(float_file(work), PRESETS[preset], out)
        return out
    out = work / f"vq-{preset}.gguf"
    if not out.exists():
        run([sys.executable, "-m", "vq_gguf.cli", "quantize", "--preset", preset, "--other-type", "q8_0",
             "--out", out], work / f"quantize-vq-{preset}.log")
    return out


def vq_residual_file(work: Path, vq_full: Path, k_res: int) -> Path:
    """A file with the geometry of a residual preset made from a file without residual: the same main codes
    and codebooks plus a residual codebook of k_res small random centroids and random residual codes. Its
    speed is that of a real file of that geometry (the kernels do not depend on the values); its output is
    not meaningful."""
    out = work / f"{vq_full.stem}.synthetic-res{k_res}.gguf"
    if out.exists() and out.stat().st_mtime >= vq_full.stat().st_mtime:
        return out
    import numpy as np
    from gguf import GGUFReader
    from vq_gguf import gguf_writer, source
    from vq_gguf.vqtensor import read_vq
    log(f"writing {out.name}: {vq_full.name} with a synthetic residual codebook of {k_res}")
    rng = np.random.default_rng(0)
    vq = read_vq(GGUFReader(vq_full))
    for q in vq.values():
        if q.res_codebook is not None or q.shared:
            raise SystemExit(f"{vq_full} already has residual codebooks or shares side tensors")
        scale = 0.1 * float(np.abs(q.codebook.astype(np.float32)).mean())
        q.res_codebook = (rng.normal(0, scale, (q.groups, k_res, q.v))).astype(np.float16)
        q.res_codes = rng.integers(0, k_res, q.codes.shape).astype(np.uint32)
    gguf_writer.write(out, source.load(float_file(work)), vq=vq, other_type="q8_0")
    return out


def vq_ffn_down_file(work: Path, vq_full: Path) -> Path:
    """The ffn_down weights of a full VQ file (not quantized again), every other matrix Q8_0."""
    out = work / f"{vq_full.stem}.only-ffn_down.gguf"
    if out.exists() and out.stat().st_mtime >= vq_full.stat().st_mtime:
        return out
    from gguf import GGUFReader
    from vq_gguf import gguf_writer, source
    from vq_gguf.vqtensor import read_vq
    log(f"writing {out.name}: the ffn_down weights of {vq_full.name}, the rest Q8_0")
    vq = read_vq(GGUFReader(vq_full), lambda n: ".ffn_down." in n)
    gguf_writer.write(out, source.load(float_file(work)), vq=vq, other_type="q8_0")
    return out


def bytes_per_token(path: Path) -> tuple[int, dict[str, float]]:
    """Bytes of the weights one generated token reads, and the share of each tensor type in the linears."""
    from gguf import GGUFReader
    from vq_gguf import ggml_vq  # noqa: F401  (registers the VQ type ids with the gguf package)
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    total, linear, types = 0, 0, {}
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # a lookup of one row; the output matrix is read instead
        total += int(t.n_bytes)
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2:
            tname = t.tensor_type.name if hasattr(t.tensor_type, "name") else f"vq{int(t.tensor_type)}"
            types[tname] = types.get(tname, 0) + int(t.n_elements)
            linear += int(t.n_elements)
    return total, {k: v / linear for k, v in sorted(types.items(), key=lambda kv: -kv[1])}


# --- measurements -------------------------------------------------------------------------------------

def bandwidth(threads: int) -> float:
    """Memory bandwidth in GB/s: the CPU's for reading at `threads` (test-vq-matmul), or with --ngl the GPU's (a
    device-to-device copy of 1 GiB in torch, best of 10: bytes read and written, both of which the memory moves)."""
    if NGL:
        import torch
        x = torch.empty(2**28, dtype=torch.float32, device="cuda")
        y = torch.empty_like(x)
        best = float("inf")
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            y.copy_(x)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return 2 * x.nbytes / best / 1e9
    out = run([tool("test-vq-matmul"), "bandwidth", 1024, threads, 5])
    return float(out.split()[1])


MICRO_LAYOUTS = [  # (label, v, K1, K2)
    ("v4 k256 (2bit)", 4, 256, 1), ("v4 k256 + 16 (3bit)", 4, 256, 16), ("v4 k256 + 256 (4bit)", 4, 256, 256),
    ("v8 k4096", 8, 4096, 1), ("v6 k4096", 6, 4096, 1), ("v8 k256 + 256", 8, 256, 256),
]


def micro(threads: int = 1, in_out: tuple[int, int] = (576, 1536), tokens=(1, 2, 8, 512)) -> str:
    """ns per weight per token of one MUL_MAT (test-vq-matmul bench, 64 weights, best of 5) for each layout and
    token count, with the best instruction set; and the plain reference path for comparison."""
    def one(v, k1, k2, n, isa=None):
        env = dict(os.environ, **({"GGML_VQ_ISA": isa} if isa else {}))
        nm, reps = (64, 5) if n <= 8 else (4, 3)
        out = subprocess.run([str(tool("test-vq-matmul")), "bench", str(v), str(k1), str(k2), str(in_out[0]),
                              str(in_out[1]), str(n), str(threads), str(nm), str(reps)],
                             capture_output=True, text=True, env=env).stdout
        return float(out.split("ns/weight/token")[0].split()[-1]) if "ns/weight/token" in out else float("nan")
    lines = [f"| layout ({in_out[0]} inputs x {in_out[1]} outputs, {threads} thread(s)) | "
             + " | ".join(f"{n} token{'s' if n > 1 else ''}" for n in tokens) + " |",
             "| --- |" + " ---: |" * len(tokens)]
    for label, v, k1, k2 in MICRO_LAYOUTS:
        lines.append(f"| {label} | " + " | ".join(f"{one(v, k1, k2, n):.4f}" for n in tokens) + " |")
    for isa, how in (("scalar", "portable decoder"), ("ref", "reference decoder")):
        lines.append(f"| v4 k256, {how} + ggml_vec_dot_f32 (GGML_VQ_ISA={isa}) | "
                     + " | ".join(f"{one(4, 256, 1, n, isa):.4f}" if n <= 8 else "" for n in tokens) + " |")
    return "\n".join(lines)


# the presets' layouts at real shapes, against llama.cpp's types of the nearest sizes (bars in docs/kernels.md)
MEMORY_BOUND_PRESETS = ["2bit", "2bit-shared", "3bit", "3bit-shared", "4bit", "4bit-shared"]
MEMORY_BOUND_TYPES = ["iq2_xxs", "iq2_s", "q2_K", "iq3_s", "iq4_nl", "q4_K"]
MEMORY_BOUND_BYTES = 512 << 20   # weights read per MUL_MAT round: far more than any cache


def memory_bound(threads: int, in_out: tuple[int, int], reps: int = 5) -> str:
    """One token through weights of in x out (e.g. Llama-3-8B's ffn_up, 4096 x 14336), enough of them that
    every round reads them from memory: each preset's layout for such a weight (ffn_up in the middle of a
    32-block model) and llama.cpp's types, as the fraction of the memory read bandwidth measured with as many
    threads just before (test-vq-matmul bench and bench-type: the weights' bytes, side tensors included, over
    the best round's time)."""
    from vq_gguf.presets import PRESETS
    bw = bandwidth(threads)

    def row(label: str, args: list) -> str:
        out = run([tool("test-vq-matmul"), *args])
        ns, bits, rate = (float(re.search(rf"([0-9.]+) {unit}", out).group(1))
                          for unit in ("ns/weight/token", "bits/weight read", "GB/s read"))
        return f"| {label} | {bits:.3f} | {ns:.4f} | {rate:.1f} | {rate / bw:.2f} |"

    lines = [f"memory read bandwidth, {threads} thread(s): {bw:.1f} GB/s", "",
             f"| weight {in_out[0]} x {in_out[1]}, 1 token, {threads} thread(s) | bits/weight read | ns/weight "
             "| GB/s read | of bandwidth |", "| --- | ---: | ---: | ---: | ---: |"]
    for name in MEMORY_BOUND_PRESETS:
        cfg = PRESETS[name].config_for("blk.16.ffn_up.weight", 32)
        if cfg.groups != 1 or cfg.outlier_frac or cfg.col_norm:
            raise SystemExit(f"preset {name}: test-vq-matmul bench has no groups, outliers or column norms")
        if not cfg.fits(in_out[1], in_out[0]):
            lines.append(f"| {name}: v{cfg.v} does not fit {in_out[1]} outputs (the preset refuses this shape) | | | | |")
            continue
        bits = cfg.index_bits / cfg.v
        mats = max(2, round(MEMORY_BOUND_BYTES * 8 / (bits * in_out[0] * in_out[1])))
        label = f"{name}: v{cfg.v} k{cfg.k}" + (f" + {cfg.k_res}" if cfg.k_res else "") + (", row scales" if cfg.row_scale else "")
        lines.append(row(label, ["bench", cfg.v, cfg.k, cfg.k_res or 1, *in_out, 1, threads, mats, reps, int(cfg.row_scale)]))
    for t in MEMORY_BOUND_TYPES:
        mats = max(2, round(MEMORY_BOUND_BYTES / (in_out[0] * in_out[1] / 2)))   # as many bytes as 4-bit weights
        lines.append(row(f"llama.cpp {t}", ["bench-type", t, *in_out, 1, threads, mats, reps]))
    return "\n".join(lines)


def llama_bench(files: list[Path], threads: int, reps: int, n_prompt: int, n_gen: int) -> list[dict]:
    cmd = [tool("llama-bench"), "-t", threads, "-p", n_prompt, "-n", n_gen, "-r", reps, "-ngl", NGL, "-o", "json"]
    for f in files:
        cmd += ["-m", f]
    return json.loads(run(cmd))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vq", action="append", default=[], metavar="PRESET=FILE", help="an existing VQ file of a preset")
    ap.add_argument("--presets", nargs="*", default=PRESETS)
    ap.add_argument("--synthetic", nargs="*", default=[], metavar="PRESET",
                    help="residual presets (3bit, 4bit) to stand in for by the 2bit file plus a synthetic residual "
                         "codebook of the preset's size: same geometry and speed, meaningless output")
    ap.add_argument("--llama-types", nargs="*", default=LLAMA_TYPES)
    ap.add_argument("--no-ffn-down", action="store_true", help="skip the ffn_down-only pair")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions per round")
    ap.add_argument("--rounds", type=int, default=1, help="llama-bench runs over all files, interleaved")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("--imatrix-chunks", type=int, default=20)
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each round, wait up to this long for the CPUs to be idle (other jobs skew 2-thread runs)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--md", type=Path, default=None, help="write the markdown table here")
    ap.add_argument("--micro", action="store_true", help="only the kernel micro-benchmark (ns per weight per token)")
    ap.add_argument("--memory-bound", nargs=2, type=int, default=None, metavar=("IN", "OUT"),
                    help="only one token through weights of IN x OUT (e.g. 4096 14336) against the memory bandwidth, "
                         "each preset's layout and llama.cpp's types, at --threads")
    ap.add_argument("--layout", action="store_true",
                    help="VQ files in the presets' layouts with random codes and codebooks (tools/layout_file.py): the "
                         "same speed as quantized ones, made in seconds, meaningless output")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="make every file from a synthetic model of this real model's shapes, --blocks deep, with random "
                         "weights (tools/synthetic_model.py), in --workdir's SHAPE-BLOCKS folder; implies --layout")
    ap.add_argument("--blocks", type=int, default=2, help="depth of --shape's model")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a GGUF whose tokenizer --shape's model takes (default: the default model's)")
    ap.add_argument("--ngl", type=int, default=0,
                    help="layers on the GPU (llama-bench, llama-imatrix: a CUDA build); the bandwidth is then the GPU's")
    ap.add_argument("--cpu-variant", default=None, metavar="TAG",
                    help="run llama-bench from the portable build (vq-gguf build --portable) with only this CPU variant, "
                         "e.g. haswell: AVX2 for llama.cpp's types and ours (docs/kernels.md)")
    args = ap.parse_args(argv)
    global BENCH_BIN, SYNTHETIC, TOKENIZER, NGL
    BENCH_BIN = only_variant(args.cpu_variant) if args.cpu_variant else None
    TOKENIZER, NGL = args.tokenizer, args.ngl
    if args.shape:
        SYNTHETIC, args.layout = (args.shape, args.blocks), True
    if args.micro or args.memory_bound:
        busy = wait_idle(args.wait_idle) if args.wait_idle else cpu_busy()
        print(f"test-vq-matmul; load average {load_average()}; CPU busy before {busy:.0%}\n")
        print(memory_bound(args.threads, tuple(args.memory_bound)) if args.memory_bound else micro(1))
        return

    from vq_gguf.paths import home
    work = (args.workdir or home() / "bench") / (f"{args.shape}-{args.blocks}" if args.shape else "")
    work.mkdir(parents=True, exist_ok=True)
    given = {}
    for item in args.vq:
        preset, _, path = item.partition("=")
        if not path or not Path(path).is_file():
            raise SystemExit(f"--vq {item}: expected PRESET=FILE with an existing file")
        given[preset] = Path(path)

    files: dict[str, Path] = {}
    peer: dict[str, str] = {}   # label of a VQ file -> label of its peer's file, where measured
    for q in args.llama_types:
        files[q] = llama_file(work, q, args.threads, args.imatrix_chunks)
    for p in args.presets:
        if p in args.synthetic:
            k_res = {"3bit": 16, "4bit": 256}[p]
            files[f"VQ {p} (geometry: 2bit + synthetic residual {k_res})"] = vq_residual_file(work, vq_file(work, "2bit", given, args.layout), k_res)
        else:
            label = f"VQ {p}" + (" (random codes)" if args.layout and p not in given else "")
            files[label] = vq_file(work, p, given, args.layout)
            if PEERS.get(p) in files:
                peer[label] = PEERS[p]
    if not args.no_ffn_down:
        files["IQ2_XXS, ffn_down only"] = llama_file(work, "IQ2_XXS", args.threads, args.imatrix_chunks, only_ffn_down=True)
        files["VQ 2bit, ffn_down only"] = vq_ffn_down_file(work, vq_file(work, "2bit", given, args.layout))

    info = {label: bytes_per_token(path) for label, path in files.items()}
    load_before = load_average()
    bw = [bandwidth(args.threads)]
    samples: dict[tuple[str, str], list[float]] = {}
    paths = list(files.values())
    label_of = {str(p.resolve()): lbl for lbl, p in files.items()}
    t0 = time.time()
    busy = []
    for r in range(args.rounds):
        if args.wait_idle:
            busy.append(wait_idle(args.wait_idle))
        order = paths if r % 2 == 0 else paths[::-1]
        for row in llama_bench(order, args.threads, args.reps, args.n_prompt, args.n_gen):
            label = label_of[str(Path(row["model_filename"]).resolve())]
            test = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
            samples.setdefault((label, test), []).extend(row["samples_ts"])
    bw.append(bandwidth(args.threads))
    load_after = load_average()
    bw_gbs = statistics.mean(bw)

    pp, tg = f"pp{args.n_prompt}", f"tg{args.n_gen}"

    def stat(label, test):
        s = samples.get((label, test), [])
        return (statistics.mean(s), statistics.stdev(s) if len(s) > 1 else 0.0) if s else (float("nan"), 0.0)

    ref = "Q2_K" if "Q2_K" in files else None
    results = []
    for label, path in files.items():
        nbytes, types = info[label]
        (ppm, pps), (tgm, tgs) = stat(label, pp), stat(label, tg)
        bound = bw_gbs * 1e9 / nbytes
        pair = "IQ2_XXS, ffn_down only" if label == "VQ 2bit, ffn_down only" else None
        results.append({
            "file": label, "path": str(path), "size_mib": path.stat().st_size / 2**20,
            "bytes_per_token": nbytes, "linear_types": types,
            pp: [ppm, pps], tg: [tgm, tgs],
            f"{pp}_vs_Q2_K": ppm / stat(ref, pp)[0] if ref else None,
            f"{tg}_vs_Q2_K": tgm / stat(ref, tg)[0] if ref else None,
            f"{tg}_vs_IQ2_XXS_ffn_down": tgm / stat(pair, tg)[0] if pair in files else None,
            "peer": peer.get(label),
            f"{pp}_vs_peer": ppm / stat(peer[label], pp)[0] if label in peer else None,
            f"{tg}_vs_peer": tgm / stat(peer[label], tg)[0] if label in peer else None,
            "tg_bound": bound, "tg_fraction_of_bound": tgm / bound,
        })

    head = ((f"CPU variant {args.cpu_variant} of the portable build; " if args.cpu_variant else "")
            + (f"synthetic {args.shape}, {args.blocks} blocks, random weights; " if args.shape else "")
            + f"llama-bench -t {args.threads} -ngl {NGL} -p {args.n_prompt} -n {args.n_gen} -r {args.reps}, {args.rounds} round(s); "
            f"{'GPU' if NGL else 'memory'} read bandwidth {bw_gbs:.1f} GB/s ({', '.join(f'{b:.1f}' for b in bw)}); "
            f"load average before {load_before}, after {load_after}"
            + (f"; CPU busy before each round (other jobs) {', '.join(f'{b:.0%}' for b in busy)}" if busy else "")
            + f"; {time.time() - t0:.0f} s")
    lines = [head, "",
             f"| file | linear types | MiB | MB read / token | {pp} t/s | {tg} t/s | {pp} / Q2_K | {tg} / Q2_K | "
             f"peer: {pp}, {tg} | {tg} bound t/s | {tg} / bound |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in results:
        types = ", ".join(f"{k.lower()} {v:.2f}" for k, v in list(r["linear_types"].items())[:3])
        ratio = lambda x: f"{x:.2f}" if x is not None else "-"
        extra = f" (vs IQ2_XXS: {r[f'{tg}_vs_IQ2_XXS_ffn_down']:.2f})" if r[f"{tg}_vs_IQ2_XXS_ffn_down"] else ""
        lines.append(f"| {r['file']} | {types} | {r['size_mib']:.1f} | {r['bytes_per_token'] / 1e6:.1f} | "
                     f"{r[pp][0]:.0f} ± {r[pp][1]:.0f} | {r[tg][0]:.1f} ± {r[tg][1]:.1f} | "
                     f"{ratio(r[f'{pp}_vs_Q2_K'])} | {ratio(r[f'{tg}_vs_Q2_K'])}{extra} | "
                     + (f"{r['peer']}: {r[f'{pp}_vs_peer']:.2f}, {r[f'{tg}_vs_peer']:.2f} | " if r["peer"] else "- | ")
                     + f"{r['tg_bound']:.0f} | "
                     f"{r['tg_fraction_of_bound']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.md:
        args.md.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({"header": head, "bandwidth_gbs": bw, "results": results,
                                         "samples": {f"{k[0]}|{k[1]}": v for k, v in samples.items()}}, indent=1))


if __name__ == "__main__":
    main()
