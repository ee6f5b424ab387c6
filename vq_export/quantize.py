"""Quantize a model's block linears to VQ and write the GGUF: presets, the block-by-block pipeline, resume.

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

from . import ggml_vq, gguf_writer, hessian
from .atomic import hold, is_held, replacing, sha256
from .finetune import LR
from .kmeans import kmeans, nearest
from .model import Llama
from .names import LINEAR_KINDS, block_of, kind_of, linear, parse_linear
from .reference import dequantize
from .source import SourceModel
from .vptq import VPTQ, VPTQConfig, proxy_loss, shared_codebook
from .vqtensor import VQTensor


@dataclass(frozen=True)
class VQConfig:
    """Plain k-means quantization of one weight (no calibration)."""
    v: int                 # vector length (output channels per vector)
    k: int                 # main codebook size
    k_res: int = 0         # residual codebook size (0: none)
    iters: int = 25        # k-means iterations


@dataclass(frozen=True)
class Preset:
    name: str
    method: str                                     # "kmeans" or "vptq"
    config: VQConfig | VPTQConfig                   # for every block linear ...
    overrides: tuple[tuple[str, VPTQConfig], ...] = ()  # ... except those a key KIND[@BLOCKS] selects (first match)
    n_calib: int = 128                              # calibration windows (vptq); 32 gave KLD 0.574, 128 0.501 (docs)
    seq_len: int = 512                              # tokens per window
    n_heldout: int = 4                              # windows kept out of the Hessians, for the error report
    sequential: bool = True                         # Hessians from the quantized earlier blocks
    finetune_steps: int = 0                         # end-to-end KL fine-tuning of codebooks and norms (0: none)
    finetune_lr: float = LR
    share: tuple[str, ...] = ()                     # kinds whose tensors of equal config share one main codebook
    channel_weights: str = "none"                   # "fisher": output channels weighted by the end loss (fisher.py)
    fisher_windows: int = 32                        # calibration windows the channel weights are taken from

    def config_for(self, name: str, n_blocks: int):
        """The config of block linear `name` (blk.N.KIND.weight) in a model of n_blocks blocks. Override keys:
        KIND (every block) or KIND@B,B,... with block numbers counted from the end when negative."""
        block, kind = parse_linear(name)
        for key, cfg in self.overrides:
            k, _, blocks = key.partition("@")
            if k == kind and (not blocks or block in {int(b) % n_blocks for b in blocks.split(",")}):
                return cfg
        return self.config


# the kinds the *-shared presets give one codebook each; attn_v keeps per-tensor ones (more bits, small codebooks)
SHARED_KINDS = ("ffn_down", "ffn_gate", "ffn_up", "attn_q", "attn_output", "attn_k")
# the extra bits of the 2-bit shared presets, per tensor: blk.0's and the last block's ffn_down, attn_v
SHARED_2BIT_OVERRIDES = (("ffn_down@0", VPTQConfig(v=2, k=64, row_scale=True)),
                         ("ffn_down@-1", VPTQConfig(v=2, k=32, row_scale=True)),
                         ("attn_v", VPTQConfig(v=2, k=64, row_scale=True)))
# and the quarter bit more of 2.25bit-shared: attn_k, blocks 1-8 and 11's ffn_down (the next most sensitive after
# blk.0 and the last), the first three blocks' ffn_gate and ffn_up
QUARTER_BIT_OVERRIDES = tuple((key, VPTQConfig(v=4, k=4096, row_scale=True))
                              for key in ("attn_k", "ffn_down@1,2,3,4,5,6,7,8,11", "ffn_up@0,1,2", "ffn_gate@0,1,2"))

TWO_BIT_SHARED = Preset("2bit-shared", "vptq", VPTQConfig(v=6, k=4096, row_scale=True),
                        overrides=SHARED_2BIT_OVERRIDES, share=SHARED_KINDS)

PRESETS = {
    "kmeans-2bit": Preset("kmeans-2bit", "kmeans", VQConfig(v=4, k=256)),
    # a few more bits where a bit buys the most KL per weight (tools.sensitivity; docs/results.md "Bits by kind"):
    # the first and last blocks' ffn_down, attn_v (3 bits), and at 3 and 4 bits attn_k and attn_v (4 and 5 bits)
    "2bit": Preset("2bit", "vptq", VPTQConfig(v=4, k=256),
                   overrides=(("ffn_down@0", VPTQConfig(v=2, k=64)), ("ffn_down@-1", VPTQConfig(v=2, k=32)),
                              ("attn_v", VPTQConfig(v=2, k=64)))),
    # the same bits, but one v6 k4096 codebook per kind (stored once) and a scale per row: a codebook of 4096 costs
    # nothing per tensor when shared, and is far better than 2bit before and after fine-tuning, at twice the
    # quantizing time and lower generation speed (docs/results.md "One codebook per kind", docs/kernels.md)
    "2bit-shared": TWO_BIT_SHARED,
    # a quarter bit more, where a bit buys the most: 2bit-shared, plus 3 bits (one v4 k4096 codebook per kind) for
    # attn_k and the early blocks' ffn tensors; spreading the same bits evenly (v4 k512 everywhere) gains almost
    # nothing (docs/results.md "A quarter bit more")
    "2.25bit-shared": dataclasses.replace(TWO_BIT_SHARED, name="2.25bit-shared",
                                          overrides=SHARED_2BIT_OVERRIDES + QUARTER_BIT_OVERRIDES),
    # at 3 and 4 bits, pairs of channels with a small codebook beat v4 with a residual codebook (docs/results.md
    # "Layouts on single weights")
    "3bit": Preset("3bit", "vptq", VPTQConfig(v=2, k=64),
                   overrides=(("attn_k", VPTQConfig(v=2, k=256)), ("attn_v", VPTQConfig(v=2, k=256)))),
    # shared at 3 bits: v4 k4096 per kind, row scales; attn_v per tensor at 4 bits (docs/results.md)
    "3bit-shared": Preset("3bit-shared", "vptq", VPTQConfig(v=4, k=4096, row_scale=True),
                          overrides=(("attn_v", VPTQConfig(v=2, k=256, row_scale=True)),),
                          share=SHARED_KINDS),
    "4bit": Preset("4bit", "vptq", VPTQConfig(v=2, k=256),
                   overrides=(("attn_k", VPTQConfig(v=2, k=1024)), ("attn_v", VPTQConfig(v=2, k=1024)))),
    # shared at 4 bits: triples of channels, v3 k4096 per kind, row scales; attn_v per tensor at 5 bits; better than
    # 4bit at slightly fewer bits, slower to quantize (docs/results.md)
    "4bit-shared": Preset("4bit-shared", "vptq", VPTQConfig(v=3, k=4096, row_scale=True),
                          overrides=(("attn_v", VPTQConfig(v=2, k=1024, row_scale=True)),),
                          share=SHARED_KINDS),
}


def to_vectors(W: torch.Tensor, v: int) -> torch.Tensor:
    """[out, in] -> [P*in, v]: row p*in + j is output channels p*v..p*v+v-1 at input column j."""
    out_features, in_features = W.shape
    return W.reshape(out_features // v, v, in_features).permute(0, 2, 1).reshape(-1, v)


def fit_codebook(X: torch.Tensor, k: int, iters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means, then the codebook rounded to F16 (as stored) and the vectors re-assigned to it."""
    C = kmeans(X, k, iters=iters, seed=seed).to(torch.float16).to(torch.float32)
    return C, nearest(X, C)[0]


def quantize_linear(W: np.ndarray, cfg: VQConfig, seed: int = 0) -> VQTensor:
    """The kmeans method for one weight: nearest-centroid codes, optional residual codebook."""
    out_features, in_features = W.shape
    if out_features % cfg.v:
        raise ValueError(f"vector length {cfg.v} does not divide {out_features} output channels")
    if in_features % ggml_vq.BLOCK_SIZE:
        raise ValueError(f"{in_features} input columns are not a multiple of {ggml_vq.BLOCK_SIZE}")
    P = out_features // cfg.v
    X = to_vectors(torch.from_numpy(np.ascontiguousarray(W, dtype=np.float32)), cfg.v)
    C, idx = fit_codebook(X, cfg.k, cfg.iters, seed)
    t = VQTensor(shape=(out_features, in_features), codes=idx.reshape(P, in_features).numpy().astype(np.uint32),
                 codebook=C.to(torch.float16).numpy()[None])
    if cfg.k_res:
        R, ridx = fit_codebook(X - C[idx], cfg.k_res, cfg.iters, seed + 1)
        t.res_codes = ridx.reshape(P, in_features).numpy().astype(np.uint32)
        t.res_codebook = R.to(torch.float16).numpy()[None]
    return t


# --- resumable parts -------------------------------------------------------------------------------------

def _save_part(path: Path, t: VQTensor, report: dict) -> None:
    arrays = {k: v for k, v in asdict(t).items() if isinstance(v, np.ndarray)}
    with replacing(path, ".npz") as tmp:
        np.savez(tmp, shape=np.array(t.shape), report=np.array(json.dumps(report)), shared=np.array(json.dumps(t.shared)), **arrays)


def _load_part(path: Path) -> tuple[VQTensor, dict]:
    with np.load(path) as z:
        fields = {k: z[k] for k in z.files if k not in ("shape", "report", "shared")}
        return (VQTensor(shape=tuple(int(x) for x in z["shape"]), shared=json.loads(str(z["shared"])), **fields),
                json.loads(str(z["report"])))


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

    @cached_property
    def key(self) -> str:
        """Hash of everything the output's bytes depend on; the resume parts and an existing output count only
        when made under the same key."""
        from .calib import read_texts
        calib_text = read_texts(self.calib) if self.preset.method == "vptq" else ""
        desc = {"source": sha256(self.source.path)[:16], "preset": repr(self.preset), "seed": self.seed,
                "other_type": self.other_type, "names": self.names,
                "calib": hashlib.sha256(calib_text.encode()).hexdigest()[:16],
                "format": ggml_vq.FORMAT_VERSION, "code": _code_version()}
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    @property
    def parts(self) -> Path:
        return self.out.with_name(f".{self.out.name}.parts-{self.key}")

    def part(self, name: str) -> Path:
        """Where a finished tensor is kept until the file is written."""
        return self.parts / f"{name}.npz"


def quantize_model(source: SourceModel, out: Path, preset: Preset | VQConfig, *, seed: int = 0,
                   other_type: str = "q8_0", only: list[str] | None = None, calib: list | None = None) -> Path:
    """Quantize every block linear (or those whose name contains one of `only`) and write the GGUF."""
    if isinstance(preset, VQConfig):
        preset = Preset("custom", "kmeans", preset)
    names = [n for n in source.linear_names() if not only or any(s in n for s in only)]
    if not names:
        raise ValueError("no block linear matches the selection")
    if preset.method == "vptq" and not calib:
        from .calib import DEFAULT_CALIB
        calib = [DEFAULT_CALIB]
    run = Run(source, Path(out), preset, names, list(calib or []), seed, other_type)
    if run.out.exists() and _file_key(run.out) == run.key:
        print(f"[quantize] {run.out} is up to date (made from the same source, calibration text, settings, seed "
              f"and code)", flush=True)
        return run.out
    gguf_writer.check_writable(run.out, 2 * estimate_bytes(run) + hessian_bytes(run) + 2**20)  # the GGUF's temporary copy and the parts
    hold(run.parts)
    _drop_torn_parts(run.parts)
    start = time.time()
    done, report = (_kmeans(run) if preset.method == "kmeans" else _vptq(run))
    if preset.finetune_steps:
        source = _finetune(run, done)
    elapsed = time.time() - start

    path = gguf_writer.write(run.out, source, vq=done, other_type=other_type, progress=False,
                             extra_kv={ggml_vq.METHOD_KEY: preset.method, ggml_vq.PRESET_KEY: preset.name,
                                       ggml_vq.INPUTS_KEY: run.key})
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    _write_report(run, report, elapsed, peak_gib)
    shutil.rmtree(run.parts)
    for stale in run.out.parent.glob(f".{run.out.name}.parts-*"):   # earlier runs' parts for this output
        if is_held(stale):
            continue
        print(f"[quantize] removing {stale.name}: parts of an earlier run with other inputs", flush=True)
        shutil.rmtree(stale, ignore_errors=True)
    print(f"[quantize] {len(names)} tensors in {elapsed:.0f} s, peak memory {peak_gib:.1f} GiB -> {path}", flush=True)
    return path


def estimate_bytes(run: Run) -> int:
    """About the size of the output GGUF: index bits and codebooks of the VQ weights, other tensors in their type."""
    other = GGML_QUANT_SIZES[gguf_writer.PLAIN_TYPES[run.other_type][0]]
    total = 0.0
    for name, W in run.source.tensors.items():
        if name in run.names:
            cfg = run.preset.config_for(name, run.source.n_blocks)
            bits = math.log2(cfg.k) + (math.log2(cfg.k_res) if cfg.k_res else 0)
            total += W.size * bits / cfg.v / 8 + 2 * cfg.v * (cfg.k + cfg.k_res) + 16 * sum(W.shape)
        else:
            total += W.size * (4 if W.ndim < 2 else other[1] / other[0])
    return int(total)


def hessian_bytes(run: Run) -> int:
    """The float Hessians that shared codebooks keep in the parts folder (F32)."""
    return sum(4 * run.source.tensors[n].shape[1] ** 2 for n in run.names
               if run.preset.method == "vptq" and kind_of(n) in run.preset.share)


def _kmeans(run: Run) -> tuple[dict[str, VQTensor], dict]:
    done, report = {}, {}
    for name in tqdm(run.names, desc=f"quantize {run.preset.name}", unit="tensor", dynamic_ncols=True):
        part = run.part(name)
        if part.exists():
            done[name], report[name] = _load_part(part)
            continue
        done[name] = quantize_linear(run.source.tensors[name], run.preset.config_for(name, run.source.n_blocks), seed=run.seed)
        report[name] = {}
        _save_part(part, done[name], report[name])
    return done, report


def _vptq(run: Run) -> tuple[dict[str, VQTensor], dict]:
    from .calib import calibration_tokens
    preset = run.preset
    tokens = calibration_tokens(run.source.path, run.calib, preset.n_calib + preset.n_heldout, preset.seq_len, run.seed)
    model = Llama(run.source)
    x = model.embed(tokens)                       # [N, L, d]: calibration windows, then held-out windows
    n_fit = preset.n_calib
    g = _channel_weights(run, model, tokens[: min(preset.fisher_windows, n_fit)])
    shared = _shared_codebooks(run, model, x[:n_fit], g)
    float_x = x if not preset.sequential else None
    done, report = {}, {}
    bar = tqdm(total=len(run.names), desc=f"quantize {preset.name}", unit="tensor", dynamic_ncols=True)
    last = max(block_of(n) for n in run.names)
    for i, blk in enumerate(model.blocks[: last + 1]):
        todo = [n for n in LINEAR_KINDS if linear(i, n) in run.names]
        float_w = dict(blk.w)
        if any(not run.part(f"blk.{i}.{n}.weight").exists() for n in todo):   # a resumed run skips done blocks
            H, _ = hessian.collect(blk, x[:n_fit])
            H_val, _ = hessian.collect(blk, x[n_fit:])
        for short in todo:
            name = f"blk.{i}.{short}.weight"
            part = run.part(name)
            bar.set_postfix_str(name)
            if part.exists():
                t, rep = _load_part(part)
            else:
                cfg = dataclasses.replace(preset.config_for(name, run.source.n_blocks), seed=run.seed)
                book_name, book = shared.get(name, (None, None))
                t = VPTQ(blk.w[short], H[hessian.INPUT_OF[short]], cfg, codebook=book, channel_weight=g.get(name)).quantize()
                if book_name:
                    t.shared = {"vq_codebook": book_name}
                W, Wq = blk.w[short], torch.from_numpy(dequantize(t))
                hv = H_val[hessian.INPUT_OF[short]]
                rep = {"rel_error_heldout": proxy_loss(W, Wq, hv) / proxy_loss(W, torch.zeros_like(W), hv),
                       "rel_error_calib": proxy_loss(W, Wq, H[hessian.INPUT_OF[short]]) /
                       proxy_loss(W, torch.zeros_like(W), H[hessian.INPUT_OF[short]]),
                       "config": asdict(cfg)}
                _save_part(part, t, rep)
            done[name], report[name] = t, rep
            blk.w[short] = torch.from_numpy(dequantize(t))
            bar.update(1)
        with torch.no_grad():
            if preset.sequential:
                x = torch.cat([blk(x[s:s + 8]) for s in range(0, x.shape[0], 8)])
            else:  # Hessians of the next block from the float model
                blk.w.update(float_w)
                float_x = torch.cat([blk(float_x[s:s + 8]) for s in range(0, float_x.shape[0], 8)])
                x = float_x
    bar.close()
    return done, report


def _channel_weights(run: Run, model: Llama, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The preset's output-channel weights of every tensor to quantize ({} for "none"), kept in the parts folder."""
    kind = run.preset.channel_weights
    if kind == "none":
        return {}
    if kind != "fisher":
        raise ValueError(f"unknown channel weights {kind!r} (none, fisher)")
    path = run.parts / "fisher.npz"
    if not path.exists():
        from .fisher import channel_fisher
        g = channel_fisher(model, tokens, run.names)
        with replacing(path, ".npz") as tmp:
            np.savez(tmp, **{n: v.numpy() for n, v in g.items()})
    with np.load(path) as z:
        return {n: torch.from_numpy(z[n]) for n in run.names}


def _shared_codebooks(run: Run, model: Llama, x: torch.Tensor, g: dict[str, torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
    """For the tensors of the preset's shared kinds: {name: (shared tensor name, codebook)}, one codebook per
    kind and config, fitted to the float model's Hessians (kept in the parts folder, one loaded at a time)."""
    groups: dict[tuple[str, VPTQConfig], list[str]] = {}
    for name in run.names:
        kind = kind_of(name)
        if kind in run.preset.share:
            groups.setdefault((kind, dataclasses.replace(run.preset.config_for(name, run.source.n_blocks), seed=run.seed)), []).append(name)
    hessian_of = {name: run.parts / f"H.{name}.npy" for names in groups.values() for name in names}
    if any(not (run.parts / f"shared.{kind}.{i}.npy").exists() for i, (kind, _) in enumerate(groups)) and \
            any(not h.exists() for h in hessian_of.values()):
        last = max(block_of(n) for n in hessian_of)
        for i, blk in enumerate(tqdm(model.blocks[: last + 1], desc="float Hessians (shared codebooks)", unit="block")):
            H, _ = hessian.collect(blk, x)
            for short in LINEAR_KINDS:
                if f"blk.{i}.{short}.weight" in hessian_of:
                    with replacing(hessian_of[f"blk.{i}.{short}.weight"], ".npy") as tmp:
                        np.save(tmp, H[hessian.INPUT_OF[short]].numpy().astype(np.float32))
            with torch.no_grad():
                x = torch.cat([blk(x[s:s + 8]) for s in range(0, x.shape[0], 8)])
    books = {}
    for i, ((kind, cfg), names) in enumerate(groups.items()):
        label, path = f"{kind}.{i}", run.parts / f"shared.{kind}.{i}.npy"
        if not path.exists():
            print(f"[quantize] one codebook v={cfg.v} k={cfg.k} for {len(names)} {kind} tensors", flush=True)
            layers = lambda: (VPTQ(run.source.tensors[n], np.load(hessian_of[n]), cfg, channel_weight=g.get(n))  # noqa: E731
                              for n in names)
            with replacing(path, ".npy") as tmp:
                np.save(tmp, shared_codebook(layers, cfg).numpy())
        C = torch.from_numpy(np.load(path))
        books.update({n: (ggml_vq.shared_name(label, "vq_codebook"), C) for n in names})
    return books


def _finetune(run: Run, done: dict[str, VQTensor]) -> SourceModel:
    """End-to-end KL fine-tuning (finetune.py) on the calibration windows, the held-out ones choosing the step
    kept; returns the source with the tuned norm weights, which the GGUF then carries."""
    from .calib import calibration_tokens
    from .finetune import Teacher, finetune
    p = run.preset
    tokens = calibration_tokens(run.source.path, run.calib, p.n_calib + p.n_heldout, p.seq_len, run.seed)
    norms = finetune(run.source, done, Teacher.run(run.source, tokens, p.n_heldout), steps=p.finetune_steps,
                     lr=p.finetune_lr, device=default_device(), checkpoint=run.parts / "finetune.pt", seed=run.seed)
    return dataclasses.replace(run.source, tensors={**run.source.tensors, **norms})


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _write_report(run: Run, report: dict, elapsed: float, peak_gib: float) -> None:
    rows = sorted(((n, r) for n, r in report.items() if "rel_error_heldout" in r),
                  key=lambda nr: -nr[1]["rel_error_heldout"])
    data = {"preset": repr(run.preset), "seconds": elapsed, "peak_rss_gib": peak_gib,
            "tensors": {n: r for n, r in rows}}
    path = run.out.with_suffix(".report.json")
    path.write_text(json.dumps(data, indent=1))
    if rows:
        mean = sum(r["rel_error_heldout"] for _, r in rows) / len(rows)
        worst = ", ".join(f"{n} {r['rel_error_heldout']:.2%}" for n, r in rows[:5])
        print(f"[quantize] output error on held-out windows: mean {mean:.2%}; worst: {worst}  ({path.name})", flush=True)
