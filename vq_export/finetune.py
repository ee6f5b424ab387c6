"""End-to-end fine-tuning with the indices fixed: train the codebooks and the norm weights so that the
quantized model's next-token distribution matches the float model's (KL-divergence on the logits). With
`row_scales`, every VQ weight's per-output-channel scale (format.md §5; ones where the file has none) is trained
too: one more value per row, where a codebook is shared by all rows of a tensor.

The float model runs once (`Teacher.run`): its output-norm states are kept, and each step rebuilds the float
logits from them with the head the quantized model uses too (the token embedding or output weight, the same
values at Q8_0). So a step costs one forward and backward pass of the student only, and training can run on a
machine that does not hold the float model: the default 320 + 8 windows of 512 tokens are 194 MB of F16 states.
A checkpoint is written atomically at every held-out evaluation (resume by running again), and the state with
the lowest KL on the teacher's held-out windows is the one kept.
"""
from __future__ import annotations

import hashlib
import json
import math
import pickle
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .atomic import hold, replacing, sha256
from .model import Model
from .vqtensor import Shared, VQTensor

LR = 1e-3   # Adam's starting rate; better than 3e-4 on every preset tried (docs/results.md "Learning rate")


class VQWeight(torch.nn.Module):
    """A VQ weight as a differentiable function of its codebooks, and of its row scales with `row_scales`
    (codes, permutation, column norms and outlier columns fixed). A codebook shared by several weights
    (format.md 4.1) is one Parameter in `shared`, keyed by its tensor name."""

    def __init__(self, t: VQTensor, shared: dict[str, torch.nn.Parameter] | None = None, row_scales: bool = False):
        super().__init__()
        if t.groups != 1:
            raise ValueError("fine-tuning supports one codebook group")
        shared = {} if shared is None else shared

        def book(side: str, values: np.ndarray) -> torch.nn.Parameter:
            p = torch.nn.Parameter(torch.from_numpy(values.astype(np.float32)))
            return shared.setdefault(t.shared[side].name, p) if side in t.shared else p

        self.shape = t.shape
        self.register_buffer("codes", torch.from_numpy(t.codes.astype(np.int64)))
        self.C = book("vq_codebook", t.codebook[0])
        self.R = None if t.res_codebook is None else book("vq_res_codebook", t.res_codebook[0])
        self.register_buffer("res_codes", None if t.res_codes is None else torch.from_numpy(t.res_codes.astype(np.int64)))
        self.register_buffer("perm", None if t.perm is None else torch.from_numpy(t.perm.astype(np.int64)))
        self.register_buffer("col_norm", None if t.col_norm is None else torch.from_numpy(t.col_norm.astype(np.float32)))
        if row_scales:
            u = np.ones(t.shape[0]) if t.row_scale is None else t.row_scale
            self.row_scale = torch.nn.Parameter(torch.from_numpy(u.astype(np.float32)))
        else:
            self.register_buffer("row_scale", None if t.row_scale is None else torch.from_numpy(t.row_scale.astype(np.float32)))
        self.O = None
        if t.outlier_cols is not None:
            self.O = book("vq_outlier_codebook", t.outlier_codebook)
        self.register_buffer("outlier_cols", None if t.outlier_cols is None else torch.from_numpy(t.outlier_cols.astype(np.int64)))
        self.register_buffer("outlier_idx", None if t.outlier_idx is None else torch.from_numpy(t.outlier_idx.astype(np.int64)))
        self.register_buffer("tail", None if t.tail is None else torch.from_numpy(t.tail.astype(np.float32)))

    def forward(self) -> torch.Tensor:
        out_features, in_features = self.shape
        vals = self.C[self.codes]                                             # [P, in, v]
        if self.R is not None:
            vals = vals + self.R[self.res_codes]
        W = vals.permute(0, 2, 1).reshape(-1, in_features)                    # stored column order, P·v rows
        if self.col_norm is not None:
            W = W * self.col_norm[0] + self.col_norm[1]
        if self.perm is not None:
            W = torch.empty_like(W).index_copy(1, self.perm, W)
        if self.O is not None:
            corr = self.O[self.outlier_idx].reshape(len(self.outlier_cols), out_features).T   # [out, n_o]
            W = W.index_add(1, self.outlier_cols, corr)
        if self.tail is not None:
            W = torch.cat([W, self.tail])
        if self.row_scale is not None:
            W = W * self.row_scale[:, None]
        return W

    def write_back(self, t: VQTensor, tuned: dict[str, Shared]) -> None:
        """Put the trained values into `t`; a shared side becomes the one tuned Shared of its name in `tuned`."""
        def f16(p: torch.Tensor) -> np.ndarray:
            return p.detach().cpu().to(torch.float16).numpy()

        values = {"vq_codebook": f16(self.C)[None], "vq_res_codebook": None if self.R is None else f16(self.R)[None],
                  "vq_outlier_codebook": None if self.O is None else f16(self.O),
                  "vq_row_scale": f16(self.row_scale) if isinstance(self.row_scale, torch.nn.Parameter) else None}
        for side, array in values.items():
            if array is None:
                continue
            if side in t.shared:
                name = t.shared[side].name
                t.shared[side] = tuned.setdefault(name, Shared(name, array))
                array = t.shared[side].data
            setattr(t, side.removeprefix("vq_"), array)


@dataclass
class Teacher:
    """The float model's output-norm states on calibration windows; the last `n_heldout` windows are never
    trained on and choose the step that is kept."""
    tokens: torch.Tensor      # [N, L] int64
    hidden: torch.Tensor      # [N, L, d] float16
    n_heldout: int

    @classmethod
    def run(cls, src, tokens: torch.Tensor, n_heldout: int) -> "Teacher":
        return cls(tokens, Model(src).final_hidden(tokens, desc="teacher (float model)").half(), n_heldout)

    def save(self, path: Path) -> Path:
        path = Path(path)
        with replacing(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, tokens=self.tokens.numpy().astype(np.int32), hidden=self.hidden.numpy(),
                     n_heldout=np.int64(self.n_heldout))
        return path

    @classmethod
    def load(cls, path: Path) -> "Teacher":
        with np.load(path) as z:
            tokens, hidden, n_heldout = z["tokens"], z["hidden"], int(z["n_heldout"])
        if hidden.shape[:2] != tokens.shape or not 0 < n_heldout < len(tokens):
            raise ValueError(f"{path}: teacher states {hidden.shape} do not match tokens {tokens.shape} "
                             f"with {n_heldout} held-out windows")
        return cls(torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(hidden), n_heldout)


def finetune(src, vq: dict[str, VQTensor], teacher: Teacher, *, steps: int, lr: float = LR, batch: int = 2,
             device: str = "cpu", checkpoint: Path | None = None, seed: int = 0, eval_every: int = 50,
             inputs: dict | None = None, row_scales: bool = False) -> dict[str, np.ndarray]:
    """Train in place: writes the tuned codebooks (and row scales) into `vq`; returns the tuned norm weights by
    GGUF name. `src` holds every other weight of the quantized model (its head makes the teacher's logits too).
    The learning rate follows a cosine from `lr` down to lr/10; row scales get lr · rms(scales) / rms(codebooks),
    so that they move as fast as the centroids relative to their size. `inputs` is stored in the checkpoint."""
    torch.backends.cuda.matmul.allow_tf32 = True   # on a GPU: TF32 products, F32 accumulation
    student, weights = _student(src, vq, device, row_scales)
    norm_offsets = student.norms()
    norms = {name: p.requires_grad_(True) for name, (p, _) in norm_offsets.items()}
    books = list({id(p): p for w in weights.values() for n, p in w.named_parameters() if n != "row_scale"}.values())
    scales = [w.row_scale for w in weights.values()] if row_scales else []
    scale_group = [{"params": scales, "lr": lr * float(_rms(scales) / _rms(books))}] if scales else []
    opt = torch.optim.Adam([{"params": books + list(norms.values())}] + scale_group, lr=lr)
    params = [p for g in opt.param_groups for p in g["params"]]   # the checkpoint's order
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    n_train = len(teacher.tokens) - teacher.n_heldout
    heldout = (teacher.tokens[n_train:], teacher.hidden[n_train:])

    def heldout_kl() -> float:
        with torch.no_grad():
            return sum(_kl(student, heldout[0][s:s + batch], heldout[1][s:s + batch], device).item() * len(heldout[0][s:s + batch])
                       for s in range(0, len(heldout[0]), batch)) / len(heldout[0])

    state = load_checkpoint(checkpoint, device) if checkpoint is not None else None
    if state is not None:
        with torch.no_grad():
            for p, saved in zip(params, state["params"]):
                p.copy_(saved)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start, best_kl, best, first_kl = state["step"], state["best_kl"], state["best"], state["first_kl"]
    else:
        start, best_kl, best = 0, heldout_kl(), [p.detach().clone() for p in params]
        first_kl = best_kl
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(n_train, generator=gen) for _ in range(steps * batch // n_train + 1)])
    bar = tqdm(range(start, steps), desc="fine-tune (KL to float)", unit="step", dynamic_ncols=True, initial=start, total=steps)
    t0, recent = time.time(), []
    for step in bar:
        pick = order[step * batch:(step + 1) * batch]
        loss = _kl(student, teacher.tokens[pick], teacher.hidden[pick], device)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        recent = (recent + [loss.item()])[-eval_every:]
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            kl = heldout_kl()
            if kl < best_kl:
                best_kl, best = kl, [p.detach().clone() for p in params]
            bar.write(f"[finetune] step {step + 1}: train KL {sum(recent) / len(recent):.4f}, held-out KL {kl:.4f} "
                      f"(best {best_kl:.4f})")
            if checkpoint is not None:
                with replacing(checkpoint) as tmp:
                    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict(), "sched": sched.state_dict(),
                                "step": step + 1, "best_kl": best_kl, "best": best, "first_kl": first_kl, "inputs": inputs}, tmp)
        bar.set_postfix(kl=f"{loss.item():.4f}")
    with torch.no_grad():
        for p, b in zip(params, best):
            p.copy_(b)
    tuned = {}
    for name, w in weights.items():
        w.write_back(vq[name], tuned)
    print(f"[finetune] {steps - start} steps in {time.time() - t0:.0f} s on {device}; "
          f"held-out KL {first_kl:.4f} -> {best_kl:.4f}", flush=True)
    return {n: p.detach().cpu().numpy() + np.float32(norm_offsets[n][1]) for n, p in norms.items()}


def _rms(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum((t.detach() ** 2).sum() for t in tensors) / sum(t.numel() for t in tensors))


def _kl(student: Model, tokens: torch.Tensor, hidden: torch.Tensor, device) -> torch.Tensor:
    """Mean per-token KL(teacher ‖ student), the teacher's logits rebuilt from its states with the student's head."""
    target = F.log_softmax(student.logits_of(hidden.to(device).float()), -1)
    logp = F.log_softmax(student.forward(tokens.to(device)), -1)
    return F.kl_div(logp, target, log_target=True, reduction="batchmean") / tokens.shape[1]


def _student(src, vq: dict[str, VQTensor], device="cpu", row_scales: bool = False) -> tuple[Model, dict[str, VQWeight]]:
    """The model with its VQ weights as functions of their codebooks; their float copies are dropped."""
    student = Model(src, device)
    shared = {}
    weights = {name: VQWeight(t, shared, row_scales) for name, t in vq.items()}
    for w in weights.values():
        w.to(device)   # in place: a shared codebook stays one Parameter
    for i, blk in enumerate(student.blocks):
        for kind in list(blk.names):   # never read: the VQ weights stand in for them
            if f"blk.{i}.{kind}.weight" in weights:
                del blk.names[kind]
        blk.linear = _linear(blk, i, weights)
    return student, weights


def _linear(blk, i: int, weights: dict[str, VQWeight]):
    def linear(name: str, x: torch.Tensor) -> torch.Tensor:
        w = weights.get(f"blk.{i}.{name}.weight")
        return x @ (w() if w is not None else blk.w[name]).T
    return linear


def kl_to_float(src, vq: dict[str, VQTensor], tokens: torch.Tensor, batch: int = 2) -> float:
    """Mean per-token KL-divergence of the quantized model (codebooks as they are now) from the float one."""
    teacher, (student, _) = Model(src), _student(src, vq)
    total = 0.0
    with torch.no_grad():
        for s in range(0, tokens.shape[0], batch):
            x = tokens[s:s + batch]
            total += float(F.kl_div(F.log_softmax(student(x), -1), F.log_softmax(teacher(x), -1),
                                    log_target=True, reduction="sum"))
    return total / tokens.numel()


def load_checkpoint(path: Path, device: str) -> dict | None:
    """A saved checkpoint, or None when there is none or it cannot be read whole (torn by a power cut, truncated):
    then it is removed with a notice and the fine-tuning starts over."""
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location=device)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        print(f"[finetune] checkpoint {path} cannot be read ({type(e).__name__}); starting over", flush=True)
        path.unlink()
        return None


def finetune_file(path: Path, teacher_path: Path, out: Path, *, steps: int, lr: float | None, batch: int, device: str,
                  checkpoint: Path | None = None, seed: int = 0, eval_every: int = 50, row_scales: bool = False) -> Path:
    """Fine-tune a VQ-GGUF file against a saved Teacher and write the result. The checkpoint (default: in a
    parts folder beside `out`) names its inputs; one that holds `steps` steps or more is only written out, so a
    checkpoint made on another machine (a GPU) turns into the same file here."""
    from . import ggml_vq, gguf_writer
    from .source import load_quantized
    path, teacher_path, out = Path(path), Path(teacher_path), Path(out)
    lr = LR if lr is None else lr
    inputs = {"file": sha256(path)[:16], "teacher": sha256(teacher_path)[:16], "lr": lr, "batch": batch, "seed": seed}
    if row_scales:
        inputs["row_scales"] = True
    key = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]
    parts = out.with_name(f".{out.name}.parts-{key}")
    checkpoint = Path(checkpoint) if checkpoint else parts / "finetune.pt"
    state = load_checkpoint(checkpoint, "cpu")
    if state is not None:
        saved = state.get("inputs")
        if saved != inputs:
            raise ValueError(f"checkpoint {checkpoint} was made from {saved}, not {inputs}")
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    if checkpoint.parent == parts:
        hold(parts)
    src, vq = load_quantized(path)
    teacher = Teacher.load(teacher_path)
    norms = finetune(src, vq, teacher, steps=steps, lr=lr, batch=batch, device=device, checkpoint=checkpoint,
                     seed=seed, eval_every=eval_every, inputs=inputs, row_scales=row_scales)
    kv = {kv.key: kv.value for kv in src.metadata}
    other_type = {"F32": "f32", "F16": "f16"}.get(src.source_types.get("token_embd.weight", ""), "q8_0")
    written = gguf_writer.write(out, src, vq=vq, override=norms, other_type=other_type, extra_kv={
        ggml_vq.METHOD_KEY: str(kv.get(ggml_vq.METHOD_KEY, "vptq")), ggml_vq.PRESET_KEY: str(kv.get(ggml_vq.PRESET_KEY, "")),
        ggml_vq.INPUTS_KEY: f"{kv.get(ggml_vq.INPUTS_KEY, '')}+finetune-{key}",
        ggml_vq.FINETUNE_KEY: "; then ".join(filter(None, [str(kv.get(ggml_vq.FINETUNE_KEY, "")),
            f"steps={steps} lr={lr} batch={batch} teacher={teacher_path.name} windows={len(teacher.tokens) - teacher.n_heldout}"
            + (" row_scales" if row_scales else "")]))})
    if checkpoint.parent == parts:
        shutil.rmtree(parts)
    return written

