"""The fast CPU kernels of the VQ MUL_MAT (native/ggml/vq-cpu.c) equal the reference decoder.

Drives native/tests/test-vq-matmul.c, built with the patched llama.cpp: it runs ggml graphs with a VQ MUL_MAT
and compares every output with ggml_vq_dequantize (the plain C reference) times the activations in float64,
for random weights in every configuration of the format (vector lengths 1..16, main and residual index
widths 1..16 bits including widths that straddle bytes, column groups, permutation, column norm, row scale,
outliers), token counts 1..9, 16, 33, 512 and 3-D activations, odd row counts; and checks that 1, 2 and 3
threads give bitwise equal results. Each instruction-set level the build has is forced in turn with
GGML_VQ_ISA, so every fast path and its fallbacks are covered on one machine; the Arm (NEON) kernels are
tested the same way by the harness cross-compiled for aarch64 and run under qemu-user.
"""
import os
import subprocess

import pytest

from vq_gguf.native.build import bin_dir

ISAS = ["vbmi", "avx512", "avx2", "scalar", "ref"]


def harness():
    path = bin_dir() / "test-vq-matmul"
    assert path.is_file(), f"{path} is missing: build with `python -m vq_gguf.native.build`"
    return path


def run(args, isa, timeout=900, **env_extra):
    env = dict(os.environ, GGML_VQ_ISA=isa, **env_extra)
    p = subprocess.run([str(harness()), *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"GGML_VQ_ISA={isa} {' '.join(map(str, args))}:\n" + "\n".join(out.splitlines()[-40:])
    return out


@pytest.mark.parametrize("isa", ISAS)
def test_random_weights_every_configuration(isa):
    # the best instruction set gets the full sweep, the fallbacks the quick one (every third token count)
    full = isa == ISAS[0]
    out = run(["random", 7] + ([] if full else [7, "quick"]), isa)
    assert " 0 failed" in out


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_decx_for_the_layouts_centx_takes(isa):
    """One token with v in {2, 4, 8} and plain weights takes centx from AVX2 up (lutx first with VBMI);
    GGML_VQ_DECX=1 sends those calls through decx, which stays the path for the other layouts."""
    out = run(["random", 7, "quick"], isa, GGML_VQ_DECX="1")
    assert " 0 failed" in out


@pytest.mark.parametrize("isa", ISAS)
def test_file_with_every_format_feature(feature_files, isa):
    out = run(["file", feature_files[0]], isa)
    assert "0 failed" in out


def test_file_with_a_shared_side_tensor(tmp_path):
    """The tiny model's weights with every side tensor link one shared outlier codebook (format.md 4.1)."""
    from tests import tiny_model
    out = run(["file", tiny_model.write(tmp_path / "tiny.gguf")], "vbmi")
    assert "7 tensors" in out and "0 failed" in out


@pytest.mark.parametrize("isa", ["vbmi", "avx2"])
def test_real_quantized_ffn_down(ffn_down_file, isa):
    out = run(["file", ffn_down_file, 6], isa)
    assert "6 tensors" in out and "0 failed" in out


# --- Arm: the same harness cross-compiled for aarch64 (vq-gguf build --cross aarch64), run under qemu-user ------

def run_arm(args, isa, timeout=1800):
    from vq_gguf.native.build import cross_bin_dir
    exe = cross_bin_dir("aarch64") / "test-vq-matmul"
    assert exe.is_file(), f"{exe} is missing: run `vq-gguf build --cross aarch64`"
    p = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(exe), *map(str, args)], capture_output=True,
                       text=True, env=dict(os.environ, GGML_VQ_ISA=isa), timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"aarch64 GGML_VQ_ISA={isa} {' '.join(map(str, args))}:\n" + "\n".join(out.splitlines()[-40:])
    return out


# quick sweeps (every third token count), two seeds for NEON: qemu runs the harness ~20x slower than the host.
# The full sweep (`random 7` at neon, ~10 min under qemu): docs/kernels.md "Tests".
@pytest.mark.parametrize("isa, seed", [("neon", 7), ("neon", 8), ("scalar", 7)])
def test_arm_random_weights_every_configuration(isa, seed):
    assert " 0 failed" in run_arm(["random", seed, "quick"], isa)


def test_arm_file_with_every_format_feature(feature_files):
    assert "0 failed" in run_arm(["file", feature_files[0]], "neon")


def test_bandwidth_mode_reports_a_figure():
    out = run(["bandwidth", 64, 1, 1], "vbmi")
    assert float(out.split()[1]) > 0


def test_bench_counts_the_bytes_it_reads():
    """bench and bench-type report the weights' bits as stored (side tensors included), which the
    memory-bound benchmark divides by the time: q4_K is 4.5 bits, v4 k256 with F16 row scales 2 bits plus its
    codebook (256 x 4 halves) and row scales (one half per output) per weight, v6 k4096 on 64 outputs its codebook
    and a tail of 4 F16 rows; a shape a layout cannot take is refused, not aborted on."""
    def bits(out):
        return float(out.split(" bits/weight read")[0].split()[-1])
    assert bits(run(["bench-type", "q4_K", 512, 64, 1, 1, 2, 1], "vbmi")) == 4.5
    got = bits(run(["bench", 4, 256, 1, 512, 64, 1, 1, 2, 1, 1], "vbmi"))
    assert got == pytest.approx(2 + (256 * 4 * 16 + 64 * 16) / (512 * 64), abs=5e-4)
    got = bits(run(["bench", 6, 4096, 1, 512, 64, 1, 1, 2, 1], "vbmi"))
    assert got == pytest.approx(2 + (4096 * 6 * 16 + 4 * 512 * 16) / (512 * 64), abs=5e-4)
    for bad in (["bench", 6, 4096, 1, 512, 4, 1, 1, 2, 1], ["bench-type", "nonesuch", 512, 64, 1, 1]):
        p = subprocess.run([str(harness()), *map(str, bad)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and p.stdout.startswith("FAIL")


def test_decode_writes_the_reference_weights_as_f16(feature_files, tmp_path):
    # tools/gpu_check.sh quantizes llama.cpp's types from this file to compare speeds on the GPU
    import numpy as np
    from gguf import GGUFReader
    from vq_gguf.reference import dequantize
    vq_path, _, vq = feature_files
    out = tmp_path / "decoded.gguf"
    assert f"{len(vq)} VQ weights decoded to F16" in run(["decode", vq_path, out], "vbmi")
    tensors = {t.name: t for t in GGUFReader(out).tensors}
    assert not [n for n in tensors if ".vq_" in n]
    for name, t in vq.items():
        got = np.asarray(tensors[name].data).reshape(t.shape)
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float32), dequantize(t).astype(np.float16).astype(np.float32), rtol=2e-3, atol=1e-6)


def test_residual_adds_a_synthetic_residual_codebook(ffn_down_file, tmp_path):
    from gguf import GGUFReader
    from vq_gguf import ggml_vq
    out = tmp_path / "res16.gguf"
    assert "VQ weights with a synthetic residual codebook" in run(["residual", ffn_down_file, out, 16], "vbmi")
    tensors = {t.name: t for t in GGUFReader(out).tensors}
    downs = [n for n in tensors if n.endswith("ffn_down.weight")]
    assert downs and all(ggml_vq.rate_quarters(tensors[n].tensor_type) == 12 for n in downs)  # 8 + 4 bits per 4 weights
    assert all(int(tensors[n.replace(".weight", ".vq_res_codebook")].shape[1]) == 16 for n in downs)
    assert "0 failed" in run(["file", out, 3], "vbmi")


def test_residual_keeps_the_weights_it_cannot_widen(feature_files, tmp_path):
    # a preset's mix has tensors that already have a residual or whose wider rate has no VQ type: kept as they are
    from gguf import GGUFReader
    vq_path, _, vq = feature_files
    out = tmp_path / "res256.gguf"
    text = run(["residual", vq_path, out, 256], "vbmi")
    kept = [n for n, t in vq.items() if t.res_codebook is not None]
    assert kept and all(f"kept {n} as it is" in text for n in kept)
    before = {t.name: t for t in GGUFReader(vq_path).tensors}
    after = {t.name: t for t in GGUFReader(out).tensors}
    assert all(after[n].tensor_type == before[n].tensor_type and bytes(after[n].data) == bytes(before[n].data) for n in kept)
    assert "0 failed" in run(["file", out, 3], "vbmi")


def test_backend_option_runs_the_graph_through_ggml_backend():
    # the path tools/gpu_check.sh takes with --backend CUDA0, here on the CPU backend: tensors copied into a
    # backend buffer, the graph computed by ggml_backend_graph_compute, two runs bitwise equal
    out = run(["--backend", "CPU", "random", 7, "quick"], "vbmi")
    assert " 0 failed" in out


def test_backend_option_refuses_an_unknown_backend():
    p = subprocess.run([str(harness()), "--backend", "NOPE0", "random"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "no ggml backend named NOPE0" in p.stdout
