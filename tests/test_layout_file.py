"""tools/layout_file.py: a file in a preset's layout with random codes must be that layout (what the speed
benchmark stands it in for) and run in llama.cpp."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from vq_gguf import ggml_vq
from vq_gguf.presets import PRESETS
from vq_gguf.runtime.llama import Model
from vq_gguf.tools import layout_file
from vq_gguf.vqtensor import read_vq


@pytest.mark.parametrize("preset", ["2bit", "2.25bit-shared"])
def test_layout_file_has_the_presets_layout(default_gguf, src, preset, tmp_path):
    path = layout_file.write(default_gguf, PRESETS[preset], tmp_path / f"{preset}.gguf")
    reader = GGUFReader(path)
    vq = read_vq(reader)
    assert sorted(vq) == sorted(src.linear_names())
    for name, t in vq.items():
        cfg = PRESETS[preset].config_for(name, src.n_blocks)
        assert (t.v, t.codebook.shape[1], t.row_scale is not None) == (cfg.v, cfg.k, cfg.row_scale), name
        assert t.codes.max() < cfg.k
    shared = {t.name for t in reader.tensors if t.name.startswith(ggml_vq.SHARED_PREFIX)}
    groups = {(n.split(".")[2], PRESETS[preset].config_for(n, src.n_blocks)) for n in vq
              if n.split(".")[2] in PRESETS[preset].share}
    assert len(shared) == len(groups)  # one codebook per shared kind and settings, stored once
    model = Model(path, n_ctx=64)
    logits = model.logits(model.tokenize("The capital of France is"))
    assert np.isfinite(logits).all()


def test_layout_file_takes_a_tail_and_refuses_a_shape_the_layout_cannot_take():
    cfg, rng = PRESETS["2bit-shared"].config, np.random.default_rng(0)
    t = layout_file.random_tensor((4096, 576), cfg, rng)        # Llama's width at v = 6: a tail of 4 rows
    assert t.shape == (4096, 576) and t.P == 682 and t.tail.shape == (4, 576) and t.row_scale.shape == (4096,)
    with pytest.raises(ValueError, match="whole blocks"):
        layout_file.random_tensor((4096, 100), cfg, rng)
