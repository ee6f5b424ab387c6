import numpy as np
import pytest

from vq_gguf import ggml_vq
from vq_gguf.pack import pack_codes, unpack_codes


@pytest.mark.parametrize("b", list(range(1, 33)))
def test_roundtrip_every_width(b):
    rng = np.random.default_rng(b)
    codes = rng.integers(0, 2 ** b, size=(3, 64), dtype=np.uint64)
    data = pack_codes(codes, b)
    assert data.shape == (3, 64 * b // 8)
    assert (unpack_codes(data, 3, 64, b) == codes).all()


def test_layout_is_little_endian_bit_stream():
    # docs/format.md §3: code j at bits [j*b, j*b+b) of the row's stream, bit 0 = LSB of byte 0
    codes = np.array([[0b101, 0b011, 0b110, 0b001, 0, 0, 0, 0]], dtype=np.uint64)
    data = pack_codes(codes, 3)
    # bits (LSB first): 101 110 011 100 000 000 000 000 -> byte0 = 0b10_011_101? build it explicitly
    stream = 0
    for j, c in enumerate(codes[0]):
        stream |= int(c) << (3 * j)
    assert data.tobytes() == stream.to_bytes(3, "little")


def test_code_too_wide_is_refused():
    with pytest.raises(ValueError):
        pack_codes(np.array([[8] * 8], dtype=np.uint64), 3)


def test_type_names_and_ids():
    assert ggml_vq.type_id(8) == 208 and ggml_vq.type_name(8) == "vq2_00"
    assert ggml_vq.type_name(3) == "vq0_75" and ggml_vq.type_name(13) == "vq3_25"
    assert ggml_vq.type_id(20) == 220 and ggml_vq.type_name(20) == "vq5_00" and ggml_vq.type_name(32) == "vq8_00"
    assert ggml_vq.is_vq(232) and not ggml_vq.is_vq(42) and not ggml_vq.is_vq(233) and not ggml_vq.is_vq(201)
    for n in (1, 33):
        with pytest.raises(ValueError):
            ggml_vq.type_id(n)
    assert ggml_vq.side_name("blk.3.ffn_up.weight", "vq_codebook") == "blk.3.ffn_up.vq_codebook"
