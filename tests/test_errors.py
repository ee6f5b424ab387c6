"""Bad input gets a clear error and no crash: the runtime refuses bad parameters and files that are not models
it can run, and the quantizer refuses bad sources. Malformed VQ files: tests/test_malformed.py."""
import math
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFWriter

from tests import tiny_model
from vq_gguf import source
from vq_gguf.runtime.llama import LlamaError, Model, SamplerConfig, check_threads


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model.write(tmp_path_factory.mktemp("tiny") / "tiny.vq.gguf")


def test_wrong_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Model("/nonexistent/model.gguf")
    with pytest.raises(FileNotFoundError, match="is a folder, not a GGUF file"):
        Model(tmp_path)


@pytest.mark.parametrize("threads", [0, -1, 10_000])
def test_thread_count_is_bounded(tiny, threads):
    """Thousands of threads would make llama.cpp spin for minutes before the first token: refused at once."""
    with pytest.raises(ValueError, match=f"{threads} threads: give 1 to"):
        Model(tiny, n_threads=threads) if threads > 0 else check_threads(threads)
    r = subprocess.run([sys.executable, "-m", "vq_gguf.cli", "chat", str(tiny), "--prompt", "hi", "--threads", str(threads)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"argument --threads: {threads} threads: give 1 to" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("data", [b"", b"GGUF", b"not a gguf at all" * 100, b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4])
def test_not_a_gguf(tmp_path, data):
    path = tmp_path / "junk.gguf"
    path.write_bytes(data)
    with pytest.raises(LlamaError, match="could not load"):
        Model(path)


def test_unsupported_architecture(tmp_path):
    path = tiny_model.write(tmp_path / "arch.gguf", arch="nosucharch")
    with pytest.raises(LlamaError, match="unknown model architecture: 'nosucharch'"):
        Model(path)


def test_context_larger_than_the_model_allows(tiny):
    with pytest.raises(LlamaError, match=f"larger than the {tiny_model.N_CTX}"):
        Model(tiny, n_ctx=tiny_model.N_CTX + 1)
    with Model(tiny) as m:  # the default fits the model (llama.cpp rounds the context up to a multiple of 256)
        assert m.n_ctx >= tiny_model.N_CTX


@pytest.mark.parametrize("kwargs", [{"n_ctx": 0}, {"n_ctx": -5}, {"n_ctx": 2**40}, {"n_batch": 0}, {"n_ubatch": -1},
                                    {"n_threads": 0}, {"n_ctx": 1.5}])
def test_invalid_model_parameters(tiny, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Model(tiny, **kwargs)


def test_prompt_longer_than_the_context(tiny):
    with Model(tiny, n_ctx=32, n_batch=16) as m:  # llama.cpp rounds the context up (to 256)
        n = m.n_ctx
        too_long = [t % m.n_vocab for t in range(n + 1)]
        for call in (m.logits, m.feed, lambda t: list(m.generate(t, max_tokens=1))):
            with pytest.raises(LlamaError, match=f"{n + 1} tokens do not fit the context of {n}"):
                call(too_long)
        # a prompt that fills the context exactly still runs, and generation stops at the end of the context
        assert m.logits(too_long[:n]).shape == (n, m.n_vocab)
        assert len(list(m.generate(too_long[:n - 1], max_tokens=10, sampler=SamplerConfig(temperature=0)))) <= 1


def test_token_outside_the_vocabulary(tiny):
    with Model(tiny, n_ctx=32) as m:
        for bad in (m.n_vocab, -1, 2**31 - 1):
            with pytest.raises(LlamaError, match="outside the vocabulary"):
                m.logits([1, bad])


@pytest.mark.parametrize("kwargs", [{"temperature": math.nan}, {"temperature": math.inf}, {"top_k": -1}, {"top_k": 2.5},
                                    {"top_p": 0}, {"top_p": 1.5}, {"top_p": math.nan},
                                    {"min_p": -0.1}, {"min_p": 1}, {"min_p": math.nan}, {"seed": -1}, {"seed": 2**32}])
def test_invalid_sampling_parameters(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplerConfig(**kwargs)


def test_sampling_edge_values_run(tiny):
    with Model(tiny, n_ctx=32) as m:
        for cfg in (SamplerConfig(temperature=0), SamplerConfig(temperature=-1), SamplerConfig(top_k=0, top_p=1, seed=2**32 - 1),
                    SamplerConfig(temperature=1e-6, top_k=1), SamplerConfig(temperature=1e6)):
            list(m.generate([1, 2, 3], max_tokens=3, sampler=cfg))
        with pytest.raises(ValueError, match="max_tokens"):
            list(m.generate([1, 2, 3], max_tokens=-1))


def test_source_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        source.load(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(source.SourceError):
        source.load(junk)
    # an unsupported architecture, and NaN weights
    for arch, value in (("bert", 0.0), ("llama", np.nan)):
        w = GGUFWriter(tmp_path / f"{arch}.gguf", arch)
        w.add_tensor("blk.0.ffn_down.weight", np.full((64, 64), value, np.float32))
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        with pytest.raises(source.SourceError, match="not supported" if arch == "bert" else "NaN"):
            source.load(tmp_path / f"{arch}.gguf")


@pytest.mark.parametrize("device, says", [("mps", "runs on cpu or cuda"), ("gpu0", "unknown device 'gpu0'"),
                                          ("cuda:64", "torch sees")])
def test_quantize_device_refused_before_any_work(src, tmp_path, device, says):
    """A device the quantizer cannot use is refused at once, with the reason, before the source is read."""
    from vq_gguf.quantize import quantize_model
    from vq_gguf.presets import PRESETS
    with pytest.raises(ValueError, match=says):
        quantize_model(src, tmp_path / "out.gguf", PRESETS["2bit"], device=device)
    assert list(tmp_path.iterdir()) == []


def test_model_without_tokenizer(tmp_path):
    with Model(tiny_model.write(tmp_path / "no-vocab.gguf", vocab=False), n_ctx=32) as m:
        assert m.logits([0, 1, 31]).shape == (3, tiny_model.N_VOCAB)
        for call in (lambda: m.tokenize("a"), lambda: m.token_bytes(1), lambda: list(m.generate([1, 2]))):
            with pytest.raises(LlamaError, match="no tokenizer"):
                call()
