"""The C reference decoder (ggml-vq.c) equals the numpy reference decoder, tensor by tensor."""
import numpy as np
from gguf import GGUFReader

from tests.native import c_check_data, c_dequantize
from vq_gguf.reference import dequantize
from vq_gguf.vqtensor import VQTensor, read_vq


def vq_tensors(path):
    return read_vq(GGUFReader(path))


def assert_same_decode(t: VQTensor, name: str):
    ref = dequantize(t)
    nat = c_dequantize(t)
    # the same float32 operations; the C compiler may fuse a multiply-add, hence a last-bit tolerance
    np.testing.assert_allclose(nat, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()), err_msg=name)


def test_real_weights_every_ffn_down(ffn_down_file):
    tensors = vq_tensors(ffn_down_file)
    assert len(tensors) == 30
    for name, t in tensors.items():
        assert_same_decode(t, name)


def test_every_format_feature(feature_files):
    vq_path, _, written = feature_files
    tensors = vq_tensors(vq_path)
    assert set(tensors) == set(written)
    for name, t in tensors.items():
        np.testing.assert_array_equal(dequantize(t), dequantize(written[name]), err_msg=f"{name}: file round trip")
        assert_same_decode(t, name)


def test_row_scale_f16_and_f32_decode_alike(feature_files):
    """Files write F16 row scales; those of older files are F32. Both decode to the same weights."""
    _, _, written = feature_files
    t = written["blk.0.ffn_down.weight"]
    assert t.row_scale.dtype == np.float16
    t32 = VQTensor(**{**t.__dict__, "row_scale": t.row_scale.astype(np.float32)})
    assert_same_decode(t, "F16 row scale")
    assert_same_decode(t32, "F32 row scale")
    np.testing.assert_array_equal(c_dequantize(t32), c_dequantize(t))


def test_decoded_weights_are_close_to_source(ffn_down_file, src):
    # a sanity bound on the quantizer: 2-bit k-means error is large but far below the weights themselves
    for name, t in list(vq_tensors(ffn_down_file).items())[:3]:
        w = src.tensors[name]
        rel = np.linalg.norm(dequantize(t) - w) / np.linalg.norm(w)
        assert 0 < rel < 0.6, (name, rel)


def test_c_validator_rejects_bad_side_data(feature_files):
    _, _, written = feature_files
    t = written["blk.0.ffn_down.weight"]
    assert c_check_data(t) is None
    bad = VQTensor(**{**t.__dict__, "perm": t.perm.copy()})
    bad.perm[5] = bad.perm[6]
    assert "permutation" in c_check_data(bad)
    bad = VQTensor(**{**t.__dict__, "outlier_cols": t.outlier_cols.copy()})
    bad.outlier_cols[0] = t.shape[1]
    assert "outlier column" in c_check_data(bad)
    bad = VQTensor(**{**t.__dict__, "outlier_idx": t.outlier_idx.copy()})
    bad.outlier_idx[0, 0] = 16
    assert "outlier index" in c_check_data(bad)
