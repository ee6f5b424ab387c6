"""tools/gguf_diff: the check that a refactor leaves the quantizer's files unchanged finds every difference."""
import subprocess
import sys

import numpy as np
from gguf import GGUFReader

from tests import tiny_model
from vq_gguf import ggml_vq
from vq_gguf.tools.gguf_diff import differences


def test_same_files_and_each_kind_of_difference(tmp_path):
    a, b = tiny_model.write(tmp_path / "a.gguf"), tiny_model.write(tmp_path / "b.gguf")
    assert differences(GGUFReader(a), GGUFReader(b)) == []
    vq = tiny_model.vq_tensors()
    name = "blk.0.attn_k.weight"
    vq[name].codebook = vq[name].codebook + np.float16(1)
    c = tiny_model.write(tmp_path / "c.gguf", vq)
    assert differences(GGUFReader(a), GGUFReader(c)) == ["tensor blk.0.attn_k.vq_codebook: other values"]
    vq = tiny_model.vq_tensors()
    vq[name].row_scale = np.ones(vq[name].shape[0], np.float16)
    d = tiny_model.write(tmp_path / "d.gguf", vq)
    assert differences(GGUFReader(a), GGUFReader(d)) == ["tensor blk.0.attn_k.vq_row_scale: only in the second"]
    e = tiny_model.write(tmp_path / "e.gguf", arch="qwen2")
    assert any(x.startswith("key general.architecture") for x in differences(GGUFReader(a), GGUFReader(e)))
    run = [sys.executable, "-m", "vq_gguf.tools.gguf_diff"]
    assert subprocess.run(run + [str(a), str(b)], capture_output=True).returncode == 0
    proc = subprocess.run(run + [str(a), str(c)], capture_output=True, text=True)
    assert proc.returncode == 1 and "vq_codebook: other values" in proc.stdout
    assert ggml_vq.INPUTS_KEY not in "".join(differences(GGUFReader(a), GGUFReader(b)))
