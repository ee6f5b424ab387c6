"""Python bindings to the patched libllama through cffi: load, tokenize, decode, sample, chat templates.

One `Model` owns a llama_model and one llama_context. The context's KV cache holds `self.tokens`; `feed`
appends to it and reuses whatever prefix is already there, so a chat that re-sends its whole history only
decodes the new turn.
"""
from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

_lib = None


class LlamaError(RuntimeError):
    """llama.cpp refused or failed; the message carries llama.cpp's own error lines."""


def max_threads() -> int:
    """The most threads worth asking for: beyond a few per logical core, llama.cpp's threads only wait for
    each other at every barrier (thousands of them make one token take minutes)."""
    return 4 * (os.cpu_count() or 1)


def check_threads(n: int) -> int:
    if not 1 <= n <= max_threads():
        raise ValueError(f"{n} threads: give 1 to {max_threads()} (4 x the {os.cpu_count()} logical cores)")
    return n


def thread_count(text: str) -> int:
    """A --threads value, checked; argparse shows the error as a usage error."""
    import argparse
    try:
        return check_threads(int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def check_model_file(path: str | os.PathLike) -> Path:
    """A model path that is a file, or FileNotFoundError saying what it is instead."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} {'is a folder, not a GGUF file' if path.is_dir() else 'does not exist'}")
    return path


def lib_dir() -> Path:
    """Folder of the patched shared libraries: $VQ_GGUF_LIB_DIR, or the build folder of native.build."""
    if os.environ.get("VQ_GGUF_LIB_DIR"):
        return Path(os.environ["VQ_GGUF_LIB_DIR"])
    from vq_gguf.native.build import bin_dir
    return bin_dir()


def load_lib(verbose: bool = False):
    """The cffi module (ffi, lib), built by `python -m vq_gguf.native.build`."""
    global _lib
    if _lib is None:
        folder = lib_dir() / "python"
        if not any(folder.glob("_vq_llama*.so")):
            raise LlamaError(f"the patched llama.cpp is not built (no {folder}/_vq_llama*.so): run `vq-gguf build`")
        sys.path.insert(0, str(folder))
        try:
            _lib = importlib.import_module("_vq_llama")
        finally:
            sys.path.remove(str(folder))
        _lib.lib.llama_backend_init()
    _lib.lib.vq_log_setup(1 if verbose else 0)
    return _lib


def _error(what: str) -> LlamaError:
    text = _lib.ffi.string(_lib.lib.vq_log_text()).decode("utf-8", "replace").strip()
    _lib.lib.vq_log_clear()
    return LlamaError(f"{what}\n{text}" if text else what)


@dataclass
class SamplerConfig:
    temperature: float = 0.8   # <= 0: greedy
    top_k: int = 40            # 0: no top-k cut
    top_p: float = 0.95        # in (0, 1]; 1: no nucleus cut
    min_p: float = 0.0         # in [0, 1): drop tokens below min_p times the top one's probability; 0: none
    seed: int = 0              # 0 .. 2^32 - 1

    def __post_init__(self):
        """Refuse values llama.cpp's samplers would take silently (NaN, negative counts) or C cannot hold."""
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, not {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, not {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), not {self.min_p}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2^32), not {self.seed!r}")


_rpc_regs: dict[str, object] = {}   # endpoint -> its devices' registry entry; llama.cpp's registry is per process


def add_rpc_servers(ffi, lib, servers: list[str]) -> None:
    """Register each server's devices once per process (runtime/rpc.py checks that it answers first)."""
    from .rpc import RpcError, check_reachable
    check_reachable(servers)
    if servers and lib.ggml_backend_reg_by_name(b"RPC") == ffi.NULL:
        raise RpcError("this build has no RPC backend: run `vq-gguf build --rpc`")
    for s in servers:
        if s not in _rpc_regs:
            reg = lib.vq_add_rpc_server(s.encode())
            if reg == ffi.NULL:
                raise RpcError(f"RPC server {s} offers no device")
            _rpc_regs[s] = reg


def model_devices(ffi, lib, servers: list[str]):
    """llama_model_params.devices as llama.cpp's default picks them, but of the RPC servers only `servers`: the
    registry keeps every server added in this process, and one that has gone away aborts any load that asks it
    for its memory. NULL-terminated; keep it alive until the model is loaded."""
    rpc = [lib.ggml_backend_reg_dev_get(_rpc_regs[s], i) for s in servers
           for i in range(lib.ggml_backend_reg_dev_count(_rpc_regs[s]))]
    local = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    local = [d for d in local if not ffi.string(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(d))).startswith(b"RPC")]
    gpus = [d for d in local if lib.ggml_backend_dev_type(d) == lib.GGML_BACKEND_DEVICE_TYPE_GPU]
    igpus = [d for d in local if lib.ggml_backend_dev_type(d) == lib.GGML_BACKEND_DEVICE_TYPE_IGPU]
    return ffi.new("ggml_backend_dev_t[]", rpc + (gpus or igpus) + [ffi.NULL])


DEFAULT_CTX = 2048  # tokens, or the model's training context if that is smaller


class Model:
    def __init__(self, path: str | os.PathLike, *, n_ctx: int | None = None, n_batch: int = 512, n_ubatch: int = 512,
                 n_threads: int | None = None, verbose: bool = False, check_tensors: bool = True,
                 vocab_only: bool = False, rpc: list[str] | None = None):
        """n_ctx: context in tokens, at most the model's training context (default: DEFAULT_CTX or that).
        vocab_only: load just the tokenizer (tokenize/detokenize/chat template; no decoding).
        rpc: HOST:PORT of rpc-servers (runtime/rpc.py) that hold and run the layers, split by their memory.
        check_tensors: refuse NaN/Inf and invalid quantized blocks in the data (llama.cpp's check; NaN weights
        would otherwise reach kernel assertions)."""
        for name, value in (("n_ctx", 1 if n_ctx is None else n_ctx), ("n_batch", n_batch), ("n_ubatch", n_ubatch),
                            ("n_threads", 1 if n_threads is None else n_threads)):
            if not isinstance(value, int) or not 1 <= value < 2**31:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if n_threads is not None:
            check_threads(n_threads)
        m = load_lib(verbose)
        self.ffi, self.lib = m.ffi, m.lib
        path = check_model_file(path)
        self.lib.vq_log_clear()
        mp = self.lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        if rpc:
            add_rpc_servers(self.ffi, self.lib, rpc)
            mp.n_gpu_layers = 999   # every layer on the RPC devices
        if _rpc_regs:
            self._devices = model_devices(self.ffi, self.lib, rpc or [])
            mp.devices = self._devices
        mp.check_tensors = check_tensors
        mp.vocab_only = vocab_only
        self.ctx = None
        self.model = self.lib.llama_model_load_from_file(str(path).encode(), mp)
        if self.model == self.ffi.NULL:
            raise _error(f"llama.cpp could not load {path}")
        self.vocab = self.lib.llama_model_get_vocab(self.model)
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.vocab)
        self.has_text = self.lib.llama_vocab_type(self.vocab) != self.lib.LLAMA_VOCAB_TYPE_NONE
        self.tokens: list[int] = []  # what the KV cache holds
        if vocab_only:
            return
        n_train = self.lib.llama_model_n_ctx_train(self.model)
        if n_ctx is not None and n_ctx > n_train:
            self.close()
            raise LlamaError(f"a context of {n_ctx} tokens is larger than the {n_train} the model was trained for")
        n_ctx = n_ctx or min(DEFAULT_CTX, n_train)
        threads = n_threads or os.cpu_count() or 1
        cp = self.lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, min(n_ubatch, n_batch)
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = self.lib.llama_init_from_model(self.model, cp)
        if self.ctx == self.ffi.NULL:
            self.lib.llama_model_free(self.model)
            self.model = self.ffi.NULL
            raise _error("llama.cpp could not create a context")
        self.n_ctx = self.lib.llama_n_ctx(self.ctx)
        self.n_batch = n_batch

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- text <-> tokens -------------------------------------------------------------------------------

    def _need_text(self) -> None:
        # llama.cpp aborts on text calls to a model without a tokenizer (tokenizer.ggml.model = no_vocab)
        if not self.has_text:
            raise LlamaError("the model has no tokenizer (tokenizer.ggml.model is no_vocab): it takes token ids, not text")

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._need_text()
        data = text.encode()
        cap = len(data) + 8
        buf = self.ffi.new("llama_token[]", cap)
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = self.ffi.new("llama_token[]", cap)
            n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise _error("tokenization failed")
        return list(buf[0:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        self._need_text()
        if not 0 <= token < self.n_vocab:
            raise LlamaError(f"token id {token} is outside the vocabulary of {self.n_vocab}")
        buf = self.ffi.new("char[]", 64)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = self.ffi.new("char[]", -n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return self.ffi.buffer(buf, n)[:]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def meta(self, key: str) -> str | None:
        buf = self.ffi.new("char[]", 512)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, 512)
        return None if n < 0 else self.ffi.string(buf).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    @property
    def chat_template(self) -> str | None:
        t = self.lib.llama_model_chat_template(self.model, self.ffi.NULL)
        return None if t == self.ffi.NULL else self.ffi.string(t).decode()

    def apply_chat_template(self, messages: Sequence[dict], add_assistant: bool = True) -> str:
        """The model's own chat template (Jinja) applied to [{"role": ..., "content": ...}] as llama-server applies
        it (chat_template.py); tokenize the result with add_special=True, as llama-server does."""
        from .chat_template import TemplateError, render
        tmpl = self.chat_template
        if tmpl is None:
            raise LlamaError("the model has no chat template (tokenizer.chat_template)")

        def text(token: int) -> str:
            return "" if token < 0 else self.token_bytes(token, special=True).decode("utf-8", "replace")
        try:
            return render(tmpl, messages, bos_token=text(self.lib.llama_vocab_bos(self.vocab)),
                          eos_token=text(self.lib.llama_vocab_eos(self.vocab)),
                          add_bos=bool(self.lib.llama_vocab_get_add_bos(self.vocab)),
                          add_eos=bool(self.lib.llama_vocab_get_add_eos(self.vocab)), add_generation_prompt=add_assistant)
        except TemplateError as e:
            raise LlamaError(str(e)) from e

    # --- decoding --------------------------------------------------------------------------------------

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        self.tokens = []

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        if len(tokens) > self.n_ctx:
            raise LlamaError(f"{len(tokens)} tokens do not fit the context of {self.n_ctx}")
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise LlamaError(f"token id {bad[0]} is outside the vocabulary of {self.n_vocab}")

    def _decode(self, tokens: Sequence[int], pos0: int, all_logits: bool) -> None:
        batch = self.lib.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or i == len(tokens) - 1
            rc = self.lib.llama_decode(self.ctx, batch)
        finally:
            self.lib.llama_batch_free(batch)
        if rc != 0:
            raise _error(f"llama_decode failed with code {rc}")

    def feed(self, tokens: Sequence[int]) -> None:
        """Make the KV cache hold exactly `tokens`, decoding only what differs from what it holds."""
        tokens = list(tokens)
        self._check_tokens(tokens)
        keep = 0
        while keep < min(len(tokens), len(self.tokens)) and tokens[keep] == self.tokens[keep]:
            keep += 1
        if keep == len(tokens) and keep > 0:
            keep -= 1  # re-decode the last token so that its logits are current
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), 0, keep, -1)
        self.tokens = self.tokens[:keep]
        for s in range(keep, len(tokens), self.n_batch):
            chunk = tokens[s : s + self.n_batch]
            self._decode(chunk, s, all_logits=False)
            self.tokens += chunk

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 [len(tokens), n_vocab]: the logits after every token of a fresh sequence."""
        self._check_tokens(tokens)
        self.reset()
        out = np.empty((len(tokens), self.n_vocab), dtype=np.float32)
        for s in range(0, len(tokens), self.n_batch):
            chunk = list(tokens[s : s + self.n_batch])
            self._decode(chunk, s, all_logits=True)
            for i in range(len(chunk)):
                ptr = self.lib.llama_get_logits_ith(self.ctx, i)
                out[s + i] = np.frombuffer(self.ffi.buffer(ptr, 4 * self.n_vocab), dtype=np.float32)
            self.tokens += chunk
        return out

    def generate(self, prompt_tokens: Sequence[int], *, max_tokens: int = 256,
                 sampler: SamplerConfig | None = None) -> Iterator[str]:
        """Stream the text of the tokens sampled after the prompt, until end of generation or max_tokens."""
        cfg = sampler or SamplerConfig()
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, not {max_tokens}")
        self._need_text()
        chain = self.lib.llama_sampler_chain_init(self.lib.llama_sampler_chain_default_params())
        if cfg.temperature <= 0:
            self.lib.llama_sampler_chain_add(chain, self.lib.llama_sampler_init_greedy())
        else:
            self.lib.llama_sampler_chain_add(chain, self.lib.llama_sampler_init_top_k(cfg.top_k))
            self.lib.llama_sampler_chain_add(chain, self.lib.llama_sampler_init_top_p(cfg.top_p, 1))
            if cfg.min_p > 0:
                self.lib.llama_sampler_chain_add(chain, self.lib.llama_sampler_init_min_p(cfg.min_p, 1))
            self.lib.llama_sampler_chain_add(chain, self.lib.llama_sampler_init_temp(cfg.temperature))
            self.lib.llama_sampler_chain_add(chain, self.lib.llama_sampler_init_dist(cfg.seed))
        try:
            self.feed(prompt_tokens)
            pending = b""
            for _ in range(max_tokens):
                if len(self.tokens) >= self.n_ctx:
                    break
                token = self.lib.llama_sampler_sample(chain, self.ctx, -1)
                if self.is_eog(token):
                    break
                self._decode([token], len(self.tokens), all_logits=False)
                self.tokens.append(token)
                pending += self.token_bytes(token)
                try:
                    text, pending = pending.decode("utf-8"), b""
                except UnicodeDecodeError:  # a multi-byte character split across tokens
                    continue
                yield text
            if pending:
                yield pending.decode("utf-8", "replace")
        finally:
            self.lib.llama_sampler_free(chain)


class Chat:
    """A conversation with a model: the whole history is re-rendered with the chat template each turn,
    and the KV cache keeps the common prefix, so only the new turn is decoded."""

    def __init__(self, model: Model, system: str | None = None, sampler: SamplerConfig | None = None):
        self.model = model
        self.sampler = sampler or SamplerConfig()
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    def send(self, text: str, max_tokens: int = 256) -> Iterator[str]:
        self.messages.append({"role": "user", "content": text})
        prompt = self.model.apply_chat_template(self.messages, add_assistant=True)
        tokens = self.model.tokenize(prompt, add_special=True, parse_special=True)
        reply = []
        for piece in self.model.generate(tokens, max_tokens=max_tokens, sampler=self.sampler):
            reply.append(piece)
            yield piece
        self.messages.append({"role": "assistant", "content": "".join(reply)})
