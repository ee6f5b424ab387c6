"""The model the quantizer calibrates and fine-tunes: transformers' own class for the architecture, with every
block linear computed from the GGUF's tensor.

transformers runs the architecture (embedding scale, RoPE ordering, biases, q/k norms, residual and logit
multipliers, where the norms sit); each block linear that the quantizer may replace becomes a `Tap` that
computes with the GGUF tensor (rows in llama.cpp's order: the values the writer writes) through its block's
`linear`, so that Hessians, channel weights and fine-tuning observe or replace it by GGUF name. A module is
matched to its tensor by gguf-py's tensor-name map, and its row order by the values themselves (llama.cpp's
converter reorders Q/K rows for some architectures); a module that no row order of its tensor reproduces is
refused by name. Whether transformers and llama.cpp then run the same model is measured by agreement.py.

A block's weights are read from the source when the block is first used and forgotten after it, so the model
holds one block and its non-linear weights (docs/quantizer.md, "Memory").
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from .names import is_linear, parse_linear
from .source import SourceError, SourceModel


def load_transformers(src: SourceModel) -> torch.nn.Module:
    """src's model as a whole transformers model in float32: from its Hugging Face directory, from its GGUF
    through transformers' GGUF support, or (a model made in memory, a VQ file decoded) from its tensors written
    to a temporary float GGUF."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if src.hf_source is not None and src.hf_source.is_dir():
        return _from_pretrained(src.hf_source)
    if src.arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise SourceError(f"transformers cannot read a {src.arch} GGUF: quantize from the model's Hugging Face "
                          f"directory instead")
    if src.hf_source is not None:
        return _from_pretrained(src.hf_source.parent, gguf_file=src.hf_source.name)
    from . import gguf_writer
    with tempfile.TemporaryDirectory(prefix="vq-float-") as tmp:
        path = gguf_writer.write(Path(tmp) / "float.gguf", src, other_type="f32")
        return _from_pretrained(path.parent, gguf_file=path.name)


def _from_pretrained(path: Path, **kw) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    return model.eval().requires_grad_(False)


class Checkpoint:
    """A Hugging Face directory's safetensors, read one tensor at a time (as float32)."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open
        self.files = {}
        for f in sorted(hf_dir.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                self.files.update(dict.fromkeys(st.keys(), f))

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open
        with safe_open(self.files[key], framework="pt") as st:
            return st.get_tensor(key).to(torch.float32)


def _skeleton(hf_dir: Path) -> tuple[torch.nn.Module, Checkpoint] | None:
    """The transformers model of a Hugging Face directory with no parameter loaded yet (on the meta device;
    buffers real), and its checkpoint, when every parameter is stored under its own name (else None: some
    architectures' checkpoints are renamed or fused on load, and those are loaded whole)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    ck = Checkpoint(hf_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
    model.tie_weights()   # a tied head is the embedding's parameter, stored once
    if any(n not in ck for n, _ in model.named_parameters()):
        return None
    return model.eval().requires_grad_(False), ck


def row_order(W_gguf: np.ndarray, W_hf: np.ndarray) -> np.ndarray | None:
    """The permutation p with W_gguf == W_hf[p] exactly (identity first), or None when there is none."""
    if W_gguf.shape != W_hf.shape:
        return None
    if np.array_equal(W_gguf, W_hf):
        return np.arange(len(W_hf))
    key = lambda W: [r.tobytes() for r in np.ascontiguousarray(W, dtype=np.float32)]  # noqa: E731
    rows: dict[bytes, list[int]] = {}
    for i, r in enumerate(key(W_hf)):
        rows.setdefault(r, []).append(i)
    try:
        return np.array([rows[r].pop() for r in key(W_gguf)])
    except (KeyError, IndexError):
        return None


class Tap(torch.nn.Module):
    """A block linear as its block's `linear(kind, x)` (GGUF row order), put back in the module's order."""

    def __init__(self, block: "Block", kind: str, order: np.ndarray, bias: torch.Tensor | None):
        super().__init__()
        self.block, self.kind, self.bias = [block], kind, bias   # a list: the block is not a submodule
        identity = bool((order == np.arange(len(order))).all())
        self.register_buffer("inverse", None if identity else torch.from_numpy(np.argsort(order)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block[0].linear(self.kind, x)
        if self.inverse is not None:
            y = y.index_select(-1, self.inverse)
        return y if self.bias is None else y + self.bias


class Block:
    """One decoder layer. `w` maps the kinds of its block linears (attn_q, ...) to their GGUF tensors, read
    from the source at first use and held until `release`; `linear` can be swapped to observe or replace each
    matmul."""

    def __init__(self, model: "Model", index: int, layer: torch.nn.Module):
        self.model, self.index, self.layer = model, index, layer
        self.names: dict[str, str] = {}       # kind -> GGUF tensor name
        self._w: dict[str, torch.Tensor] | None = None

    @property
    def w(self) -> dict[str, torch.Tensor]:
        if self._w is None:
            read = self.model.source.tensors.__getitem__
            self._w = {kind: torch.from_numpy(read(name)).to(self.model.device) for kind, name in self.names.items()}
        return self._w

    @property
    def held(self) -> bool:
        return self._w is not None

    def release(self) -> None:
        """Forget the weights (read again at next use): what keeps one block in memory at a time."""
        self._w = None

    def linear(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[kind].T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x, **self.model.layer_kwargs(self.index, x.shape[1]))
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def push(self, x: torch.Tensor, batch: int = 8) -> torch.Tensor:
        """The block's output for many windows x [N, L, d], `batch` windows at a time (as hessian.collect)."""
        return torch.cat([self(x[s:s + batch]) for s in range(0, x.shape[0], batch)])


class _Stop(Exception):
    pass


class Model:
    """The whole model: embed → blocks → final_hidden_of → logits_of, each step as transformers computes it."""

    def __init__(self, src: SourceModel, device: str | torch.device = "cpu"):
        self.arch, self.source, self.device = src.arch, src, device
        skeleton = _skeleton(src.hf_source) if src.hf_source is not None and src.hf_source.is_dir() else None
        self.hf, checkpoint = skeleton or (load_transformers(src), None)
        base = getattr(self.hf, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
            raise SourceError(f"{src.arch}: transformers' {type(self.hf).__name__} has no model.layers and model.norm")
        self.base, self.config = base, self.hf.config
        arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[src.arch]
        self.names = gguf.get_tensor_name_map(arch, len(base.layers))
        self.blocks = [Block(self, i, layer) for i, layer in enumerate(base.layers)]
        for blk in self.blocks:
            for path, module in list(blk.layer.named_modules()):
                if isinstance(module, torch.nn.Linear):
                    self._tap(blk, path, module, checkpoint)
        if checkpoint is not None:   # every parameter left is small (norms, embeddings, biases, head)
            self.hf.load_state_dict({n: checkpoint[n] for n, _ in self.hf.named_parameters() if n in checkpoint},
                                    strict=False, assign=True)
            self.hf.tie_weights()
            self.hf.requires_grad_(False)
            empty = [n for n, p in self.hf.named_parameters() if p.is_meta]
            if empty:
                raise SourceError(f"{self.arch}: {src.hf_source} does not hold {', '.join(empty[:3])}")
        self.hf.to(device)
        self._kwargs: dict[int, list[dict]] = {}

    def _tap(self, blk: Block, path: str, module: torch.nn.Linear, checkpoint: Checkpoint | None) -> None:
        hf_name = f"model.layers.{blk.index}.{path}"
        name = self.names.get_name(hf_name + ".weight", try_suffixes=(".weight",))
        tensors = self.source.tensors
        if name in tensors and not is_linear(name):
            return   # a router or shared-expert linear: transformers' own, llama.cpp's type in the file
        if name is None or name not in tensors:
            raise SourceError(f"{self.arch}: block linear {hf_name} has no GGUF tensor "
                              f"({name or 'no name in gguf-py tensor map'})")
        W_hf = module.weight.detach().numpy() if checkpoint is None else checkpoint[hf_name + ".weight"].numpy()
        order = row_order(tensors[name], W_hf)
        if order is None:
            raise SourceError(f"{self.arch}: GGUF tensor {name} does not hold the values of {hf_name} in any row order")
        kind = parse_linear(name)[1]
        blk.names[kind] = name
        parent, _, child = path.rpartition(".")
        tap = Tap(blk, kind, order, module.bias)
        blk.layer.get_submodule(parent).register_module(child, tap)

    def release(self) -> None:
        """Every block's weights forgotten (read again at next use)."""
        for blk in self.blocks:
            blk.release()

    def drop_ends(self) -> None:
        """Free the embedding and the head: the quantize loop runs blocks only once the windows are embedded
        (at Llama-3-8B's vocabulary each is 2.1 GB in float32). The model cannot embed or give logits after."""
        for module in (self.hf.get_input_embeddings(), self.hf.get_output_embeddings()):
            if module is not None:
                module.to("meta")

    def norms(self) -> dict[str, tuple[torch.nn.Parameter, float]]:
        """The norm weights by GGUF name, with the constant the GGUF adds to transformers' value (Gemma's
        converter stores 1 + w): fine-tuning trains the parameters and writes parameter + offset."""
        found = {}
        for hf_name, p in self.hf.named_parameters():
            name = self.names.get_name(hf_name, try_suffixes=(".weight",))
            if p.ndim != 1 or name is None or not name.endswith("norm.weight") or name not in self.source.tensors:
                continue
            stored = self.source.tensors[name]
            diff = stored - p.detach().cpu().numpy()
            if np.abs(diff - diff.mean()).max() > 1e-6 * max(1.0, float(np.abs(stored).max())):
                raise SourceError(f"{self.arch}: GGUF tensor {name} is not {hf_name} plus a constant")
            found[name] = (p, round(float(diff.mean()), 6))
        return found

    def layer_kwargs(self, index: int, length: int) -> list[dict]:
        """What the model's forward passes to layer `index` besides the hidden states for windows of `length`
        tokens (position embeddings, masks), captured once from the model's own forward with every layer
        replaced by the identity (batch 1: the tensors broadcast over any batch)."""
        if length not in self._kwargs:
            seen: list[dict] = []

            def record(hidden_states, *args, **kwargs):
                if args:
                    raise SourceError(f"{self.arch}: a decoder layer takes positional arguments besides the hidden states")
                seen.append(kwargs)
                if len(seen) == len(self.blocks):
                    raise _Stop
                return hidden_states

            zeros = torch.zeros(1, length, self.config.hidden_size, device=self.device)   # not the embedding: drop_ends
            self._each_layer(record, lambda: self.hf(inputs_embeds=zeros, use_cache=False))
            self._kwargs[length] = seen
        return self._kwargs[length][index]

    def _each_layer(self, forward, run) -> None:
        layers = [blk.layer for blk in self.blocks]
        for layer in layers:
            layer.forward = forward
        try:
            run()
        except _Stop:
            pass
        finally:
            for layer in layers:
                del layer.forward

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first layer's input for tokens [N, L] (embedding and the architecture's scale)."""
        got = []

        def first(hidden_states, *args, **kwargs):
            got.append(hidden_states)
            raise _Stop

        with torch.no_grad():
            self._each_layer(first, lambda: self.hf(tokens.to(self.device), use_cache=False))
        return got[0]

    def final_hidden_of(self, x: torch.Tensor) -> torch.Tensor:
        """What the head multiplies, from the first layer's input x [N, L, d] (which may require grad)."""
        for blk in self.blocks:
            x = blk(x)
        return self.base.norm(x)

    @torch.no_grad()
    def final_hidden(self, tokens: torch.Tensor, desc: str | None = None) -> torch.Tensor:
        """final_hidden_of for tokens [N, L] without gradients, all windows through one block before the next:
        a block not held before is read once and released after (one block in memory at a time). `desc`: a
        progress bar's label."""
        x = self.embed(tokens)
        for blk in tqdm(self.blocks, desc=desc, unit="block", disable=desc is None, dynamic_ncols=True):
            held = blk.held
            x = blk.push(x)
            if not held:
                blk.release()
        return self.base.norm(x)

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """The logits from final_hidden, with the architecture's logit scale (Granite) or soft cap (Gemma)."""
        y = self.hf.lm_head(h)
        scale = getattr(self.config, "logits_scaling", None)
        if scale:
            y = y / scale
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            y = torch.tanh(y / cap) * cap
        return y

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits_of(self.final_hidden_of(self.embed(tokens)))

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits_of(self.final_hidden(tokens))
