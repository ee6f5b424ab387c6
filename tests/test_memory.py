"""Bounded memory: the quantizer holds one block of a model, not the model. Two random llamas of SmolLM2's
tokenizer that differ only in depth (2 and 14 blocks of 768 x 3072, float32 safetensors) are quantized by the
same command, their first block by VPTQ, the rest copied to Q8_0; the deeper model's twelve extra blocks are
415 MB in float32, and its peak memory (the run's own figure, VmHWM) must stay within a quarter of that of
the shallow model's. Reading the whole source as float32, loading the whole transformers model or running
llama.cpp's agreement check in the quantizer's process each add about the extra blocks' float32 size or more.
About 2 minutes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

PRESET = """
["test-memory"]
method = "vptq"
config = { v = 4, k = 64, kmeans_iters = 4, refit_rounds = 1 }
n_calib = 8
seq_len = 128
n_heldout = 2
"""
HIDDEN, FFN = 768, 3072
BLOCK_FLOAT32 = 4 * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN // 3 + 3 * HIDDEN * FFN)   # q, o; k, v (4 of 12 heads); ffn


def llama(depth: int, out: Path, default_gguf: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=depth,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def peak_gib(model: Path, tmp_path: Path) -> float:
    preset = tmp_path / "presets.toml"
    preset.write_text(PRESET)
    out = tmp_path / f"{model.name}.gguf"
    cmd = [sys.executable, "-m", "vq_gguf.cli", "quantize", "--model", str(model), "--preset-file", str(preset),
           "--preset", "test-memory", "--only", "blk.0.", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.with_suffix(".report.json").read_text())["peak_rss_gib"]


@pytest.mark.parametrize("shallow, deep", [(2, 14)])
def test_peak_memory_does_not_grow_with_the_model(shallow, deep, default_gguf, tmp_path):
    peaks = {d: peak_gib(llama(d, tmp_path / f"llama-{d}", default_gguf), tmp_path) for d in (shallow, deep)}
    extra_gib = (deep - shallow) * BLOCK_FLOAT32 / 2**30
    print(f"peak {peaks[shallow]:.2f} GiB at {shallow} blocks, {peaks[deep]:.2f} GiB at {deep} "
          f"({extra_gib:.2f} GiB more float32 weights)")
    assert peaks[deep] - peaks[shallow] < extra_gib / 4
