"""Run the libFuzzer harnesses of the sanitizer build and report executions, coverage and crashes.

    python -m tests.fuzz --seconds 60                  # every harness, 60 s each (what CI runs, shorter)
    python -m tests.fuzz --harness matmul --runs 1000000 --seconds 7200
    nice python -m tests.fuzz --harness file --model my.vq.gguf --seconds 3600 --json fuzz.json

Harnesses (native/fuzz/, built by `python -m vq_gguf.native.build --sanitize`): `matmul` (VQ layout validation, reference
decoder, every CPU MUL_MAT path), `load` (a small GGUF from bytes through libllama's loader and a decode) and
`file` (edits aimed at the fields of a real-size VQ file, through the loader; the default model's file from
`make demo` unless --model). Each keeps its corpus in $VQ_GGUF_HOME/fuzz/<harness>/corpus, so coverage
accumulates over runs; an empty one starts from the minimized corpus of the long runs (tests/fuzz-corpus/,
written by `--save-corpus`) and the harness's seeds (`load`: the tiny valid model and the malformed-file corpus
of tests/malformed.py). Inputs that crash, time out or trip a sanitizer are saved in
$VQ_GGUF_HOME/fuzz/<harness>/crashes/ and listed; the exit status is 1 if there are any. Every crash found
becomes a case of the malformed-file corpus once fixed. docs/hardening.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vq_gguf.native.build import build_sanitize
from vq_gguf.paths import home

HARNESSES = {"matmul": "fuzz-vq-matmul", "load": "fuzz-vq-load", "file": "fuzz-vq-file"}
MAX_LEN = {"matmul": 4096, "load": 65536, "file": 80}  # bytes; the tiny model is ~36 KB; file: 8 edits of 8 bytes + 16
ARCHIVES = Path(__file__).resolve().parent / "fuzz-corpus"
DEFAULT_FILE = "compare/SmolLM2-135M-Instruct/vq-4bit.gguf"  # under $VQ_GGUF_HOME: the default model's, made by `make demo`
MANY = 12  # fields with more parts (the vocabulary's arrays): the first and last few only


@dataclass
class Result:
    harness: str
    seconds: float
    execs: int = 0
    execs_per_s: float = 0.0
    cov: int = 0                 # coverage points (edges) of the instrumented code reached
    features: int = 0            # libFuzzer's finer coverage features
    corpus: int = 0              # inputs in the corpus afterwards
    crashes: list[str] = field(default_factory=list)
    exit_status: int = 0


def seed_load(corpus: Path) -> None:
    """The tiny valid model and every file of the malformed corpus."""
    from tests import malformed
    for i, case in enumerate(malformed.corpus()):
        case.make(corpus / f"seed-{i:03d}.gguf")


def seed_matmul(corpus: Path) -> None:
    """A few valid configurations in the byte layout that fuzz-vq-matmul.c reads, so that runs start deep."""
    # v-1, K1 (2^(1+b%12)), K2, G-1, in/32-1, out/v-1, rate (0: from the codebooks), flags (perm 1, norm 4,
    # row scale 8), outliers (n_o + 8 (v0-1) + 32 (log2 K0 - 1)), malform (20: none), tokens, ne2, threads, isa, scale
    configs = [(3, 7, 0, 0, 1, 5, 0, 0x00, 0x00, 20, 0, 1, 0, 4, 8),   # v4 k256: the 2bit preset
               (3, 3, 1, 1, 2, 7, 0, 0x0d, 0x0b, 20, 3, 1, 1, 4, 8),   # v4 k16 + k4 residual, 2 groups, every side
               (7, 11, 0, 0, 5, 3, 0, 0x05, 0x00, 20, 7, 1, 0, 3, 8),  # v8 k4096, perm + norm, 9 tokens
               (1, 2, 0, 2, 2, 9, 0, 0x0c, 0x0a, 20, 9, 1, 1, 2, 8),   # v2 k8, 3 groups, 33 tokens
               (5, 5, 4, 0, 3, 4, 0, 0x09, 0x2b, 20, 1, 0, 0, 4, 8),   # v6 k64 + k8, 3-D activations
               (0, 1, 0, 0, 0, 2, 0, 0x00, 0x00, 20, 5, 1, 0, 1, 8)]   # v1 k4
    for i, c in enumerate(configs):
        (corpus / f"seed-{i}").write_bytes(bytes(c) + bytes(range(i, i + 8)) + bytes((j * 37 + i) % 256 for j in range(256)))


def write_regions(model: Path) -> Path:
    """The region map of fuzz-vq-file.c beside `model`: every header field, key and value, every tensor info
    field, the data of every VQ side tensor and the first bytes of every VQ weight's codes, as
    "offset length width" lines (width: 8 or 4 for an integer, 4 or 2 for float or half data, 0 for bytes)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from vq_gguf import ggml_vq
    reader = GGUFReader(model)
    base = reader.data.ctypes.data
    regions = [(0, 4, 0)]  # the magic

    def part_region(part: np.ndarray) -> tuple[int, int, int]:
        scalar = part.size == 1 and part.dtype.kind in "iu" and part.dtype.itemsize in (4, 8)
        return part.ctypes.data - base, part.nbytes, part.dtype.itemsize if scalar else 0

    for f in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        parts = f.parts if len(f.parts) <= 2 * MANY else f.parts[:MANY] + f.parts[-MANY // 2:]
        regions += [part_region(p) for p in parts if p.nbytes]
    for t in reader.tensors:
        offset = int(t.data_offset)
        if t.name.rsplit(".", 1)[-1] in ggml_vq.SIDES:
            width = {GGMLQuantizationType.F32: 4, GGMLQuantizationType.I32: 4, GGMLQuantizationType.F16: 2}.get(t.tensor_type, 0)
            regions.append((offset, int(t.n_bytes), width))
        elif ggml_vq.is_vq(t.tensor_type):
            regions.append((offset, min(int(t.n_bytes), 256), 0))
    path = model.with_name(model.name + ".regions")
    path.write_text("".join(f"{o} {n} {w}\n" for o, n, w in regions))
    return path


def seed_file(corpus: Path) -> None:
    """The file as it is, and one edit of each kind to the first fields, so that runs start with loads that pass."""
    (corpus / "seed-0").write_bytes(b"")
    for i, rec in enumerate([(1, 1, 0), (2, 1, 11), (3, 1, 12), (5, 0, 3), (40, 3, 7), (300, 2, 7)], start=1):
        region, op, arg = rec
        (corpus / f"seed-{i}").write_bytes(region.to_bytes(2, "little") + bytes([op, arg]) + (5).to_bytes(4, "little"))


def seed_corpus(harness: str, corpus: Path) -> None:
    """An empty corpus starts from the minimized corpus of the long runs (tests/fuzz-corpus/, when there is one)
    and the harness's own seeds."""
    if any(corpus.iterdir()):
        return
    archive = ARCHIVES / f"{harness}.tar.xz"
    if archive.is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(corpus, filter="data")
    {"load": seed_load, "matmul": seed_matmul, "file": seed_file}[harness](corpus)


def environment(harness: str, model: Path | None) -> dict[str, str]:
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
    if harness == "file":
        model = Path(model or home() / DEFAULT_FILE)
        if not model.is_file():
            raise FileNotFoundError(f"{model} does not exist: give --model, or run `make demo`, which makes it")
        write_regions(model)
        env["VQ_FUZZ_FILE"] = str(model)
    return env


def save_corpus(harness: str, model: Path | None = None) -> Path:
    """Minimize the harness's corpus (libFuzzer's -merge=1: the fewest inputs that keep its coverage) into
    tests/fuzz-corpus/<harness>.tar.xz, the evidence of a long run and the start of the next ones."""
    exe = build_sanitize() / HARNESSES[harness]
    corpus = home() / "fuzz" / harness / "corpus"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(exe), "-merge=1", f"-max_len={MAX_LEN[harness]}", tmp, str(corpus)], check=True,
                       env=environment(harness, model), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ARCHIVES.mkdir(exist_ok=True)
        out = ARCHIVES / f"{harness}.tar.xz"
        with tarfile.open(out, "w:xz", preset=9) as tar:
            for f in sorted(Path(tmp).iterdir()):
                tar.add(f, arcname=f.name)
        print(f"[fuzz] {harness}: {len(list(Path(tmp).iterdir()))} inputs keep the coverage of {corpus}: {out}")
    return out


def parse_output(text: str, r: Result) -> None:
    m = re.findall(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)", text)
    if m:
        execs, cov, ft, corp = (int(x) for x in m[-1])
        r.execs, r.cov, r.features, r.corpus = execs, cov, ft, corp
    m = re.search(r"stat::number_of_executed_units: (\d+)", text)
    if m:
        r.execs = int(m.group(1))


def run(harness: str, seconds: float, runs: int | None = None, workdir: Path | None = None,
        log: Path | None = None, seed: int = 0, model: Path | None = None) -> Result:
    """One libFuzzer run of `harness` for `seconds` (or `runs` executions, whichever first); seed 0: random.
    `model`: the VQ file that the `file` harness edits (default: DEFAULT_FILE)."""
    exe = build_sanitize() / HARNESSES[harness]
    base = workdir or home() / "fuzz" / harness
    corpus, crashes = base / "corpus", base / "crashes"
    corpus.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    seed_corpus(harness, corpus)
    env = environment(harness, model)
    before = set(crashes.iterdir())
    cmd = [str(exe), str(corpus), f"-max_total_time={int(seconds)}", f"-max_len={MAX_LEN[harness]}",
           "-print_final_stats=1", "-timeout=60", "-rss_limit_mb=4096", f"-artifact_prefix={crashes}/", f"-seed={seed}"]
    if runs is not None:  # 0: run the corpus once, no mutations
        cmd.append(f"-runs={runs}")
    if harness == "file":  # edit lists of any length from the start (libFuzzer grows its length limit slowly)
        cmd.append("-len_control=0")
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        out.seek(0)
        text = out.read()
    r = Result(harness, time.time() - t0, exit_status=p.returncode)
    parse_output(text, r)
    r.execs_per_s = r.execs / max(r.seconds, 1e-9)
    r.crashes = sorted(str(f) for f in set(crashes.iterdir()) - before)
    if log:
        log.write_text(text)
    if p.returncode != 0 and not r.crashes:  # libFuzzer failed without an artifact: keep its output visible
        r.crashes.append(f"exit status {p.returncode}: {text[-2000:]}")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", choices=[*HARNESSES, "all"], default="all")
    ap.add_argument("--seconds", type=float, default=60, help="per harness")
    ap.add_argument("--runs", type=int, default=None, help="stop after this many executions")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--model", type=Path, default=None, help=f"the VQ file of the file harness (default: $VQ_GGUF_HOME/{DEFAULT_FILE})")
    ap.add_argument("--save-corpus", action="store_true", help="only minimize each corpus into tests/fuzz-corpus/")
    args = ap.parse_args(argv)
    if args.save_corpus:
        for h in (HARNESSES if args.harness == "all" else [args.harness]):
            save_corpus(h, args.model)
        return 0
    results = []
    for h in (HARNESSES if args.harness == "all" else [args.harness]):
        r = run(h, args.seconds, args.runs, log=home() / "fuzz" / f"{h}.log", model=args.model)
        results.append(r)
        print(f"[fuzz] {h}: {r.execs} executions in {r.seconds:.0f} s ({r.execs_per_s:.0f}/s), coverage {r.cov} edges, "
              f"{r.features} features, corpus {r.corpus}, crashes {len(r.crashes)}", flush=True)
        for c in r.crashes:
            print(f"[fuzz]   crash: {c}", flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 1 if any(r.crashes for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
