"""llama.cpp on a VQ file gives the logits of the same model with its VQ weights decoded to F32 by the
numpy reference and stored in a stock GGUF: kernel, codebook plumbing and loader are right together.
Results do not depend on the thread count or on how the tokens are batched."""
import numpy as np
import pytest

from vq_gguf.runtime.llama import Model


def logits(path, tokens, *, threads=2, n_batch=512):
    with Model(path, n_ctx=1024, n_threads=threads, n_batch=n_batch) as m:
        return m.logits(tokens)


@pytest.fixture(scope="module")
def tokens(feature_files, eval_text):
    with Model(feature_files[0], n_ctx=1024) as m:
        toks = m.tokenize(eval_text)
    assert len(toks) >= 520
    return toks[:520]


def scale(x):
    return float(np.abs(x).max())


@pytest.fixture(scope="module")
def decoded(feature_files, tokens):
    """The float model through ggml's plainest F32 path, one token per batch, and with its batch sizes."""
    return {n_batch: logits(feature_files[1], tokens, n_batch=n_batch) for n_batch in (1, 7, 512)}


def test_vq_file_equals_decoded_float_file(feature_files, tokens, decoded):
    # one token per batch, both files take one dot product per output: equal up to fused multiply-adds
    a, b = logits(feature_files[0], tokens, n_batch=1), decoded[1]
    assert np.abs(a - b).max() <= 1e-4 * scale(b), np.abs(a - b).max()
    assert (a.argmax(1) == b.argmax(1)).all()


@pytest.mark.parametrize("n_batch", [7, 512])
def test_batch_size_does_not_change_results(feature_files, tokens, decoded, n_batch):
    """Batched, llama.cpp's own float path already moves the logits of this model (attention and F32
    matmuls sum in other orders); the VQ file must move no more than that."""
    a = logits(feature_files[0], tokens, n_batch=n_batch)
    noise = np.abs(decoded[n_batch] - decoded[1]).mean()
    assert np.abs(a - decoded[1]).mean() <= 1.5 * noise + 1e-3, (np.abs(a - decoded[1]).mean(), noise)
    agree = (a.argmax(1) == decoded[1].argmax(1)).mean()
    assert agree >= (decoded[n_batch].argmax(1) == decoded[1].argmax(1)).mean() - 0.03, agree


def test_threads_do_not_change_results(feature_files, tokens):
    runs = [logits(feature_files[0], tokens[:64], threads=t) for t in (1, 2, 4)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])  # each output is one dot product, whatever the split


def test_ffn_down_file_matches_its_decoding(ffn_down_file, src, tmp_path, tokens):
    from gguf import GGUFReader
    from vq_gguf import gguf_writer
    from vq_gguf.reference import dequantize
    from vq_gguf.vqtensor import VQTensor
    by_name = {t.name: t for t in GGUFReader(ffn_down_file).tensors}
    dec = {n: dequantize(VQTensor.from_gguf(n, by_name)) for n in by_name if n.endswith("ffn_down.weight")}
    dec_path = gguf_writer.write(tmp_path / "dec.gguf", src, override=dec, other_type="q8_0")
    a = logits(ffn_down_file, tokens[:32], n_batch=1)
    b = logits(dec_path, tokens[:32], n_batch=1)
    assert np.abs(a - b).max() <= 1e-4 * scale(b)
