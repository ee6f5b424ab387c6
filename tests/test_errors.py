"""Bad input gets a clear error and no crash: the patched llama.cpp refuses malformed VQ files at load,
and the quantizer refuses bad sources."""
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from runtime.llama import LlamaError, Model
from vq_export import gguf_writer, source
from vq_export.vqtensor import VQTensor

NAME = "blk.0.attn_k.weight"  # 192 x 576


def small_vq(src, **overrides) -> VQTensor:
    """A cheap valid VQ tensor for blk.0.attn_k (v=4, k=16: 1 bit per weight)."""
    rng = np.random.default_rng(0)
    out_features, in_features = src.tensors[NAME].shape
    t = VQTensor(shape=(out_features, in_features),
                 codes=rng.integers(0, 16, (out_features // 4, in_features)).astype(np.uint32),
                 codebook=rng.normal(0, 0.05, (1, 16, 4)).astype(np.float16))
    for k, v in overrides.items():
        setattr(t, k, v)
    return t


class Tampered(VQTensor):
    """Writes its GGUF tensors through `edit`, to make files that the writer itself would never make."""
    edit = staticmethod(lambda tensors: tensors)

    def gguf_tensors(self, weight_name):
        return self.edit(super().gguf_tensors(weight_name))


def write_tampered(src, path, edit, **overrides) -> Path:
    t = Tampered(**small_vq(src, **overrides).__dict__)
    t.edit = edit
    return gguf_writer.write(path, src, vq={NAME: t}, other_type="q8_0")


def load_error(path) -> str:
    with pytest.raises(LlamaError) as e:
        Model(path, n_ctx=256)
    return str(e.value)


def test_valid_small_file_loads(src, tmp_path):
    path = gguf_writer.write(tmp_path / "ok.gguf", src, vq={NAME: small_vq(src)}, other_type="q8_0")
    with Model(path, n_ctx=256) as m:
        assert m.logits(m.tokenize("Hello"))[0].shape == (m.n_vocab,)


def test_missing_codebook(src, tmp_path):
    path = write_tampered(src, tmp_path / "a.gguf", lambda ts: [t for t in ts if not t[0].endswith("vq_codebook")])
    msg = load_error(path)
    assert "missing codebook" in msg and NAME in msg


def test_codebook_size_not_a_power_of_two(src, tmp_path):
    edit = lambda ts: [(n, a[:, :12] if n.endswith("vq_codebook") else a, r) for n, a, r in ts]
    assert "not a power of two" in load_error(write_tampered(src, tmp_path / "b.gguf", edit))


def test_codebook_vector_length_mismatch(src, tmp_path):
    edit = lambda ts: [(n, np.zeros((1, 16, 3), np.float16) if n.endswith("vq_codebook") else a, r) for n, a, r in ts]
    msg = load_error(write_tampered(src, tmp_path / "c.gguf", edit))
    assert "index bits" in msg or "does not divide" in msg


def test_side_tensor_of_wrong_shape(src, tmp_path):
    path = write_tampered(src, tmp_path / "d.gguf", lambda ts: ts, row_scale=np.ones(100, np.float32))
    assert "row scale" in load_error(path)


def test_bad_permutation_data(src, tmp_path):
    perm = np.arange(576, dtype=np.int32)
    perm[3] = 4
    path = write_tampered(src, tmp_path / "e.gguf", lambda ts: ts, perm=perm)
    assert "permutation" in load_error(path)


def test_outlier_index_out_of_range(src, tmp_path):
    path = write_tampered(src, tmp_path / "f.gguf", lambda ts: ts, outlier_cols=np.array([7], np.int32),
                          outlier_idx=np.full((1, 48), 40, np.int16), outlier_codebook=np.zeros((32, 4), np.float16))
    assert "outlier index" in load_error(path)


def set_tensor_type(path: Path, name: str, type_id: int) -> None:
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("type_id", [199, 230])
def test_unknown_vq_type_id(src, tmp_path, type_id):
    path = gguf_writer.write(tmp_path / "g.gguf", src, vq={NAME: small_vq(src)}, other_type="q8_0")
    set_tensor_type(path, NAME, type_id)
    msg = load_error(path)
    assert NAME in msg and ("invalid ggml type" in msg or "block size" in msg)


def test_missing_format_version(src, tmp_path):
    path = gguf_writer.write(tmp_path / "h.gguf", src, vq={NAME: small_vq(src)}, other_type="q8_0")
    data = path.read_bytes()
    path.write_bytes(data.replace(b"vq.format_version", b"vq.format_versioX"))
    assert "format version" in load_error(path)


def test_truncated_file(src, tmp_path):
    path = gguf_writer.write(tmp_path / "i.gguf", src, vq={NAME: small_vq(src)}, other_type="q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    load_error(path)


def test_vq_on_token_embedding_is_refused(src, tmp_path):
    out_features, in_features = src.tensors["token_embd.weight"].shape
    t = VQTensor(shape=(out_features, in_features), codes=np.zeros((out_features // 4, in_features), np.uint32),
                 codebook=np.zeros((1, 16, 4), np.float16))
    path = gguf_writer.write(tmp_path / "j.gguf", src, vq={"token_embd.weight": t}, other_type="q8_0")
    assert "only for the 2-D weights of block linears" in load_error(path)


def test_wrong_path():
    with pytest.raises(FileNotFoundError):
        Model("/nonexistent/model.gguf")


def test_source_errors(src, tmp_path):
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
