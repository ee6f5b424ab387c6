"""Calibration text the model writes itself: deterministic under a seed, as long as asked, read by --calib."""
from vq_gguf.calib import calibration_tokens, read_texts
from vq_gguf.selfgen import generate


def test_selfgen_is_deterministic_and_long_enough(default_gguf, tmp_path):
    a, b, c = (generate(default_gguf, tmp_path / f"{name}.txt", tokens=600, seed=seed, sample_tokens=200)
               for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    assert a.read_text() == b.read_text() != c.read_text()
    assert not list(tmp_path.glob(".*tmp*"))
    assert len(read_texts([a]).split()) > 300
    assert tuple(calibration_tokens(default_gguf, [a], 1, 512, seed=0).shape) == (1, 512)
