"""Quantize a model's block linears to VQ and write the GGUF: the block-by-block pipeline, and resume.

Two methods share the VPTQ layout (a vector is v consecutive output channels at one input column):
- `kmeans`: plain k-means codebooks and nearest-centroid codes, no calibration (the baseline);
- `vptq`: calibration Hessians, Hessian-weighted k-means, second-order assignment, residual/outlier codebooks
  and codebook refit (vptq.py). Blocks are processed in order; in sequential mode (the default) each block's
  Hessians come from the activations of the already-quantized blocks before it.

Finished tensors are saved one file each in a parts folder next to the output, so an interrupted run resumes
where it stopped (in sequential mode the finished blocks are replayed from their parts); the parts are removed
once the GGUF is written. The folder is named by the run's key, a hash of everything the file's bytes depend on
(the source's and the calibration text's contents, every setting, this package's code), so a run never picks up
parts of another; a part that cannot be read whole is redone. A JSON report beside the GGUF lists each tensor's
output error on held-out calibration windows, worst first.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import resource
import shutil
import time
import zipfile
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader
from tqdm import tqdm

from . import agreement, ggml_vq, gguf_writer, hessian
from .atomic import hold, is_held, replacing, sha256
from .config import VQConfig
from .distributed import Ranks, ranks
from .kmeans import kmeans, nearest
from .model import Model
from .names import LINEAR_KINDS, block_of, is_linear, kind_of, linear
from .presets import PRESETS, Preset
from .reference import dequantize
from .source import SourceModel
from .vptq import VPTQ, output_error, shared_codebook
from .vqtensor import Shared, VQTensor, split_tail, to_vectors


def fit_codebook(X: torch.Tensor, k: int, iters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means, then the codebook rounded to F16 (as stored) and the vectors re-assigned to it."""
    C = kmeans(X, k, iters=iters, seed=seed).to(torch.float16).to(torch.float32)
    return C, nearest(X, C)[0]


def quantize_linear(W: np.ndarray, cfg: VQConfig) -> VQTensor:
    """The kmeans method for one weight: nearest-centroid codes, optional residual codebook (cfg's v, k, k_res,
    kmeans_iters and seed; the settings that need calibration are refused)."""
    if cfg.calibrated():
        raise ValueError(f"the kmeans method has no calibration for {', '.join(cfg.calibrated())}; use vptq")
    if not cfg.fits(*W.shape):
        raise ValueError(f"v = {cfg.v} does not fit a weight of {W.shape[0]} output channels and {W.shape[1]} input "
                         f"columns (a multiple of {ggml_vq.BLOCK_SIZE})")
    W, tail = split_tail(np.asarray(W), cfg.v)
    out_features, in_features = W.shape
    P = out_features // cfg.v
    X = to_vectors(torch.from_numpy(np.ascontiguousarray(W, dtype=np.float32)), cfg.v)

    def codes(idx: torch.Tensor) -> np.ndarray:
        return idx.reshape(in_features, P).T.numpy().astype(np.uint32)

    C, idx = fit_codebook(X, cfg.k, cfg.kmeans_iters, cfg.seed)
    t = VQTensor(shape=(out_features, in_features), codes=codes(idx), codebook=C.to(torch.float16).numpy()[None])
    if cfg.k_res:
        R, ridx = fit_codebook(X - C[idx], cfg.k_res, cfg.kmeans_iters, cfg.seed + 1)
        t.res_codes, t.res_codebook = codes(ridx), R.to(torch.float16).numpy()[None]
    return t.add_tail(tail)


# --- resumable parts -------------------------------------------------------------------------------------

def _save_part(path: Path, t: VQTensor, report: dict) -> None:
    """A finished tensor without its shared sides (the run holds those: _load_part links them again)."""
    arrays = {k: getattr(t, k) for k in ("codes", "res_codes", *(s.removeprefix("vq_") for s in ggml_vq.SIDES))
              if getattr(t, k) is not None and "vq_" + k not in t.shared}
    shared = {side: s.name for side, s in t.shared.items()}
    with replacing(path, ".npz") as tmp:
        np.savez(tmp, shape=np.array(t.shape), report=np.array(json.dumps(report)), shared=np.array(json.dumps(shared)), **arrays)


def _load_part(path: Path, shared: dict[str, Shared]) -> tuple[VQTensor, dict]:
    """A tensor _save_part wrote, its shared sides taken from `shared` (by name)."""
    with np.load(path) as z:
        fields = {k: z[k] for k in z.files if k not in ("shape", "report", "shared")}
        links = {side: shared[name] for side, name in json.loads(str(z["shared"])).items()}
        t = VQTensor(shape=tuple(int(x) for x in z["shape"]), **fields,
                     **{side.removeprefix("vq_"): s.data for side, s in links.items()})
        for s in links.values():
            t.link(s)
        return t, json.loads(str(z["report"]))


def _drop_torn_parts(parts: Path) -> None:
    """Remove, with a notice, every saved file of the parts folder that cannot be read whole (torn by a power
    cut, truncated, overwritten): the run then redoes what it held. npz members carry a CRC, checked on read."""
    for path in sorted(parts.glob("*.np[yz]")):   # tensors, Hessians, shared codebooks, channel weights
        try:
            loaded = np.load(path)                     # a .npy is read whole here
            if path.suffix == ".npz":
                with loaded:
                    for name in loaded.files:          # each member read whole: its CRC checked
                        loaded[name]
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
            print(f"[quantize] {path.name} in {parts.name} cannot be read ({type(e).__name__}: {e}); redoing it", flush=True)
            path.unlink()


def _file_key(path: Path) -> str | None:
    """The key an existing output was made with; None for a file that is not a readable GGUF (then replaced)."""
    try:
        field_ = GGUFReader(path).get_field(ggml_vq.INPUTS_KEY)
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"[quantize] {path} is not a readable GGUF ({type(e).__name__}); it will be replaced", flush=True)
        return None
    return None if field_ is None else field_.contents()


def _code_version() -> str:
    """Hash of this package's code: a change anywhere in the quantizer may change the bytes it writes."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class Run:
    """What one quantization run reads and where it keeps its state."""
    source: SourceModel
    out: Path
    preset: Preset
    names: list[str]
    calib: list[str] = field(default_factory=list)
    seed: int = 0
    other_type: str = "q8_0"
    ranks: Ranks = field(default_factory=Ranks)     # the processes sharing the work (distributed.py)
    device: str = "cpu"                             # where the calibration and VPTQ's arithmetic run

    def mine(self, names: list[str]) -> list[str]:
        """The weights of `names` this process quantizes. A weight's cost grows with its size and, through the
        refit's normal equations, its input width: size × (in + 2048) follows `quant_cost --shapes` (an
        ffn_down costs 1.4 times an ffn_up of the same size at SmolLM2's shapes, 3.3 times at Llama-3-8B's)."""
        shape = self.source.shape
        return self.ranks.mine(names, {n: math.prod(shape(n)) * (shape(n)[1] + 2048) for n in names})

    def blocks(self) -> list[list[str]]:
        """The selected weights, block by block: the units the processes split among them."""
        by_block: dict[int, list[str]] = {}
        for name in self.names:
            by_block.setdefault(block_of(name), []).append(name)
        return list(by_block.values())

    @cached_property
    def key(self) -> str:
        """Hash of everything the output's bytes depend on; the resume parts and an existing output count only
        when made under the same key."""
        from .calib import read_texts
        calib_text = read_texts(self.calib) if self.preset.method == "vptq" else ""
        desc = {"source": sha256(self.source.path)[:16], "preset": repr(self.preset), "seed": self.seed,
                "other_type": self.other_type, "names": self.names,
                "calib": hashlib.sha256(calib_text.encode()).hexdigest()[:16],
                "format": ggml_vq.FORMAT_VERSION, "code": _code_version(),
                "device": torch.device(self.device).type}   # a GPU rounds sums in another order (VPTQ)
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    @property
    def parts(self) -> Path:
        return self.out.with_name(f".{self.out.name}.parts-{self.key}")

    def part(self, name: str) -> Path:
        """Where a finished tensor is kept until the file is written."""
        return self.parts / f"{name}.npz"


def quantize_model(source: SourceModel, out: Path, preset: Preset | VQConfig, *, seed: int = 0,
                   other_type: str = "q8_0", only: list[str] | None = None, calib: list | None = None,
                   device: str | None = None) -> Path:
    """Quantize every block linear (or those whose name contains one of `only`) and write the GGUF, the
    arithmetic on `device` (default: default_device())."""
    device = check_device(device or default_device())
    if isinstance(preset, VQConfig):
        preset = Preset("custom", "kmeans", preset)
    names = [n for n in source.linear_names() if not only or any(s in n for s in only)]
    if not names:
        raise ValueError("no block linear matches the selection")
    if preset.method == "vptq" and not calib:
        from .calib import DEFAULT_CALIB
        calib = [DEFAULT_CALIB]
    run = Run(source, Path(out), preset, names, list(calib or []), seed, other_type, ranks(), device)
    check_fits(run)
    kept = sorted({n.split(".", 2)[2] for n in source.tensors
                   if n.startswith("blk.") and len(source.shape(n)) >= 2 and not is_linear(n)})
    if kept and run.ranks.main:
        print(f"[quantize] stay in {other_type}: {', '.join(kept)} (mixture-of-experts tensors: llama.cpp runs "
              f"experts through MUL_MAT_ID, which has no VQ kernel, and routers decide which experts run)", flush=True)
    if run.out.exists() and _file_key(run.out) == run.key:
        if run.ranks.main:
            print(f"[quantize] {run.out} is up to date (made from the same source, calibration text, settings, "
                  f"seed and code)", flush=True)
        return run.out
    gguf_writer.check_writable(run.out, 2 * estimate_bytes(run) + hessian_bytes(run) + 2**20)  # the GGUF's temporary copy and the parts
    if run.ranks.main:
        hold(run.parts)
        _drop_torn_parts(run.parts)
    run.ranks.barrier()
    start = time.time()
    done, report = (_kmeans(run) if preset.method == "kmeans" else _vptq(run))
    if not run.ranks.main:   # its weights are in the parts folder: rank 0 fine-tunes and writes the file
        print(f"[quantize] rank {run.ranks.rank}: {sum(len(run.mine(b)) for b in run.blocks())} tensors in "
              f"{time.time() - start:.0f} s on {run.device}, {peaks(run.device)}", flush=True)
        return run.out
    if preset.finetune_steps:
        source = _finetune(run, done)
    elapsed = time.time() - start

    path = gguf_writer.write(run.out, source, vq=done, other_type=other_type, progress=False,
                             extra_kv={ggml_vq.METHOD_KEY: preset.method, ggml_vq.PRESET_KEY: preset.name,
                                       ggml_vq.INPUTS_KEY: run.key})
    peak_gib = peak_memory_gib()
    _write_report(run, report, elapsed, peak_gib)
    shutil.rmtree(run.parts)
    for stale in run.out.parent.glob(f".{run.out.name}.parts-*"):   # earlier runs' parts for this output
        if is_held(stale):
            continue
        print(f"[quantize] removing {stale.name}: parts of an earlier run with other inputs", flush=True)
        shutil.rmtree(stale, ignore_errors=True)
    world = f" over {run.ranks.world} processes, rank 0's" if run.ranks.world > 1 else ","
    print(f"[quantize] {len(names)} tensors in {elapsed:.0f} s on {run.device}{world} {peaks(run.device)} -> {path}",
          flush=True)
    return path


def peak_memory_gib() -> float:
    """This process's peak resident memory: VmHWM, the high-water mark of its own address space. ru_maxrss
    (the fallback where there is no /proc) also counts the parent's memory at the moment it started this
    process, so a run started by a large process would report that process's size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def gpu_peak_gib(device: str) -> float | None:
    """What torch allocated at most on a CUDA device, in GiB (None for the CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if torch.device(device).type == "cuda" else None


def peaks(device: str) -> str:
    """This process's peak memory, and the GPU's where it ran on one: for the closing line of a run."""
    gpu = gpu_peak_gib(device)
    return f"peak memory {peak_memory_gib():.1f} GiB" + (f", GPU peak {gpu:.1f} GiB" if gpu is not None else "")


def check_fits(run: Run) -> None:
    """Before any work: every tensor's settings fit its shape (VQConfig.fits: whole blocks of input columns, at
    least v outputs, v dividing them where there are outliers); a ValueError lists the tensors that do not and
    the shipped presets that fit them all."""
    misfits = _misfits(run.preset, run)
    if misfits:
        fitting = [name for name, p in PRESETS.items() if not _misfits(p, run)]
        raise ValueError(f"preset {run.preset.name} does not fit {len(misfits)} tensors of this model (the input "
                         f"columns must be a multiple of {ggml_vq.BLOCK_SIZE}, the outputs at least the vector length "
                         f"and, with outlier codebooks, a multiple of it): {'; '.join(misfits[:5])}{' ...' if len(misfits) > 5 else ''}. "
                         f"Presets that fit this model: {', '.join(fitting) or 'none'}")


def _misfits(preset: Preset, run: Run) -> list[str]:
    out = []
    for name in run.names:
        out_features, in_features = run.source.shape(name)
        cfg = preset.config_for(name, run.source.n_blocks)
        if not cfg.fits(out_features, in_features):
            out.append(f"{name} [{out_features}, {in_features}] with v={cfg.v}")
    return out


def estimate_bytes(run: Run) -> int:
    """About the size of the output GGUF: index bits and codebooks of the VQ weights, other tensors in their type."""
    other = GGML_QUANT_SIZES[gguf_writer.PLAIN_TYPES[run.other_type][0]]
    total = 0.0
    for name in run.source.tensors:
        shape = run.source.shape(name)
        if name in run.names:
            cfg = run.preset.config_for(name, run.source.n_blocks)
            bits = math.log2(cfg.k) + (math.log2(cfg.k_res) if cfg.k_res else 0)
            total += math.prod(shape) * bits / cfg.v / 8 + 2 * cfg.v * (cfg.k + cfg.k_res) + 16 * sum(shape) + 2 * (shape[0] % cfg.v) * shape[1]
        else:
            total += math.prod(shape) * (4 if len(shape) < 2 else other[1] / other[0])
    return int(total)


def hessian_bytes(run: Run) -> int:
    """The float Hessians that shared codebooks keep in the parts folder (F32)."""
    return sum(4 * run.source.shape(n)[1] ** 2 for n in run.names
               if run.preset.method == "vptq" and kind_of(n) in run.preset.share)


def _kmeans(run: Run) -> tuple[dict[str, VQTensor], dict]:
    done, report = {}, {}
    mine = [n for b in run.blocks() for n in run.mine(b)]
    for name in tqdm(mine, desc=f"quantize {run.preset.name}", unit="tensor", dynamic_ncols=True, disable=not run.ranks.main):
        part = run.part(name)
        if part.exists():
            continue
        cfg = dataclasses.replace(run.preset.config_for(name, run.source.n_blocks), seed=run.seed)
        done[name] = quantize_linear(run.source.tensors[name], cfg)
        report[name] = {}
        _save_part(part, done[name], report[name])
    _gather_parts(run, run.names, done, report, {})
    return done, report


def _gather_parts(run: Run, names: list[str], done: dict, report: dict, shared: dict[str, Shared]) -> None:
    """Once every rank has saved its weights of `names`: those not in `done` read from their parts."""
    run.ranks.barrier()
    for name in names:
        if name not in done:
            done[name], report[name] = _load_part(run.part(name), shared)


def _vptq(run: Run) -> tuple[dict[str, VQTensor], dict]:
    from .calib import calibration_tokens
    preset = run.preset
    tokens = calibration_tokens(run.source.path, run.calib, preset.n_calib + preset.n_heldout, preset.seq_len, run.seed)
    model = Model(run.source, run.device)
    if run.ranks.main:
        agreement.check(model, run.source.path, tokens[-2:])
    x = model.embed(tokens)                       # [N, L, d]: calibration windows, then held-out windows
    n_fit = preset.n_calib
    g = _channel_weights(run, model, tokens[: min(preset.fisher_windows, n_fit)])
    model.drop_ends()
    shared = _shared_codebooks(run, model, x[:n_fit], g)
    books = {s.name: s for s in shared.values()}
    done, report = {}, {}
    bar = tqdm(total=len(run.names), desc=f"quantize {preset.name}", unit="tensor", dynamic_ncols=True,
               disable=not run.ranks.main)
    todo_of = {block_of(b[0]): b for b in run.blocks()}
    for i, blk in enumerate(model.blocks[: max(todo_of) + 1]):
        todo = todo_of.get(i, [])
        mine = [n for n in run.mine(todo) if not run.part(n).exists()]   # a resumed run skips saved weights
        # the narrowest inputs first, a Hessian handed to its last weight (which frees it): the widest one
        # (1.6 GB at Llama-3-8B's ffn_down) is then the only one left while it is factored
        mine.sort(key=lambda n: (run.source.shape(n)[1], hessian.INPUT_OF[kind_of(n)]))
        last = {hessian.INPUT_OF[kind_of(n)]: n for n in mine}
        if mine:
            H, _ = hessian.collect(blk, x[:n_fit])
            X_val = hessian.inputs(blk, x[n_fit:])
        for name in mine:
            short = kind_of(name)
            key = hessian.INPUT_OF[short]
            bar.set_postfix_str(name)
            cfg = dataclasses.replace(preset.config_for(name, run.source.n_blocks), seed=run.seed)
            book = shared.get(name)
            t = VPTQ(blk.w[short], H.pop(key) if last[key] == name else H[key], cfg, channel_weight=g.get(name),
                     codebook=None if book is None else torch.from_numpy(book.data.astype(np.float32)),
                     device=run.device).quantize()
            if book is not None:
                t.link(book)
            report[name] = {"rel_error_heldout": output_error(blk.w[short], dequantize(t), X_val[key]),
                            "config": asdict(cfg)}
            done[name] = t
            _save_part(run.part(name), t, report[name])
            bar.update(1)
        if preset.sequential:   # the next block's Hessians from this block quantized
            _gather_parts(run, todo, done, report, books)
            bar.update(len(done) - bar.n)
            for name in todo:
                blk.w[kind_of(name)] = torch.from_numpy(dequantize(done[name])).to(run.device)
        x = blk.push(x)
        blk.release()
    _gather_parts(run, run.names, done, report, books)
    bar.update(len(done) - bar.n)
    bar.close()
    return done, report


def _channel_weights(run: Run, model: Model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The preset's output-channel weights of every tensor to quantize ({} for "none"), kept in the parts folder."""
    kind = run.preset.channel_weights
    if kind == "none":
        return {}
    if kind != "fisher":
        raise ValueError(f"unknown channel weights {kind!r} (none, fisher)")
    path = run.parts / "fisher.npz"
    if run.ranks.main and not path.exists():
        from .fisher import channel_fisher
        g = channel_fisher(model, tokens, run.names)
        model.release()
        with replacing(path, ".npz") as tmp:
            np.savez(tmp, **{n: v.cpu().numpy() for n, v in g.items()})
    run.ranks.barrier()
    with np.load(path) as z:
        return {n: torch.from_numpy(z[n]) for n in run.names}


def _shared_codebooks(run: Run, model: Model, x: torch.Tensor, g: dict[str, torch.Tensor]) -> dict[str, Shared]:
    """For the tensors of the preset's shared kinds: {name: its Shared codebook}, one per kind and config,
    fitted to the float model's Hessians (kept in the parts folder, each saved by the rank that quantizes its
    weight, one loaded at a time)."""
    groups: dict[tuple[str, VQConfig], list[str]] = {}
    for name in run.names:
        kind = kind_of(name)
        if kind in run.preset.share:
            groups.setdefault((kind, dataclasses.replace(run.preset.config_for(name, run.source.n_blocks), seed=run.seed)), []).append(name)
    label = {group: f"{group[0]}.{i}" for i, group in enumerate(groups)}
    book_of = {group: run.parts / f"shared.{label[group]}.npy" for group in groups}
    hessian_of = {name: run.parts / f"H.{name}.npy" for names in groups.values() for name in names}
    # every rank decides from the same state (nothing is written between the barrier before and these checks)
    to_fit = [group for group, path in book_of.items() if not path.exists()]
    mine = [n for n in run.mine(list(hessian_of)) if not hessian_of[n].exists()]
    if to_fit and mine:
        last = max(block_of(n) for n in mine)
        for i, blk in enumerate(tqdm(model.blocks[: last + 1], desc="float Hessians (shared codebooks)", unit="block",
                                     disable=not run.ranks.main)):
            H, _ = hessian.collect(blk, x)
            for short in LINEAR_KINDS:
                if linear(i, short) in mine:
                    with replacing(hessian_of[linear(i, short)], ".npy") as tmp:
                        np.save(tmp, H[hessian.INPUT_OF[short]].cpu().numpy().astype(np.float32))
            x = blk.push(x)
            blk.release()
    run.ranks.barrier()
    for group in to_fit:
        (kind, cfg), names = group, groups[group]
        if run.ranks.main:
            print(f"[quantize] one codebook v={cfg.v} k={cfg.k} for {len(names)} {kind} tensors", flush=True)
        layers = [lambda n=n: VPTQ(run.source.tensors[n], np.load(hessian_of[n]), cfg, channel_weight=g.get(n),
                                   device=run.device) for n in names]
        C = shared_codebook(layers, cfg, ranks=run.ranks).numpy()
        if run.ranks.main:
            with replacing(book_of[group], ".npy") as tmp:
                np.save(tmp, C)
    run.ranks.barrier()
    books = {}
    for group, names in groups.items():
        book = Shared(ggml_vq.shared_name(label[group], "vq_codebook"), np.load(book_of[group]).astype(np.float16))
        books.update({n: book for n in names})
    return books


def _finetune(run: Run, done: dict[str, VQTensor]) -> SourceModel:
    """End-to-end KL fine-tuning (finetune.py) on the calibration windows, the held-out ones choosing the step
    kept; returns the source with the tuned norm weights, which the GGUF then carries."""
    from .calib import calibration_tokens
    from .finetune import Teacher, finetune
    p = run.preset
    tokens = calibration_tokens(run.source.path, run.calib, p.n_calib + p.n_heldout, p.seq_len, run.seed)
    norms = finetune(run.source, done, Teacher.run(run.source, tokens, p.n_heldout), steps=p.finetune_steps,
                     lr=p.finetune_lr, device=run.device, checkpoint=run.parts / "finetune.pt", seed=run.seed)
    return run.source.replacing(norms)


def check_device(device: str) -> str:
    """device, or a ValueError saying why the quantizer cannot run there: it needs float64 linear algebra
    (Cholesky factors of the Hessians), which torch has on the CPU and on CUDA."""
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r} ({e})") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device}: the quantizer runs on cpu or cuda (it factors Hessians in float64)")
    if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count():
        build = "" if torch.version.cuda else " (this torch is a CPU-only build)"
        raise ValueError(f"device {device}: torch sees {torch.cuda.device_count()} CUDA devices{build}")
    return device


def default_device() -> str:
    """CUDA where torch sees a GPU (under torchrun, the rank's own: cuda:LOCAL_RANK), else the CPU."""
    if not torch.cuda.is_available():
        return "cpu"
    local = os.environ.get("LOCAL_RANK")
    return "cuda" if local is None else f"cuda:{local}"


def _write_report(run: Run, report: dict, elapsed: float, peak_gib: float) -> None:
    rows = sorted(((n, r) for n, r in report.items() if "rel_error_heldout" in r),
                  key=lambda nr: -nr[1]["rel_error_heldout"])
    data = {"preset": repr(run.preset), "device": run.device, "seconds": elapsed, "peak_rss_gib": peak_gib,
            "peak_gpu_gib": gpu_peak_gib(run.device),
            "tensors": {n: r for n, r in rows}}
    path = run.out.with_suffix(".report.json")
    path.write_text(json.dumps(data, indent=1))
    if rows:
        mean = sum(r["rel_error_heldout"] for _, r in rows) / len(rows)
        worst = ", ".join(f"{n} {r['rel_error_heldout']:.2%}" for n, r in rows[:5])
        print(f"[quantize] output error on held-out windows: mean {mean:.2%}; worst: {worst}  ({path.name})", flush=True)
