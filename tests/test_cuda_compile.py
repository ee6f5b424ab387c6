"""The CUDA side compiles: our kernels (native/ggml/vq-cuda.cu) and the hooked ggml-cuda.cu, with nvcc, against the
patched tree's headers (ggml-cuda/common.cuh, cuBLAS's from the toolkit or the pinned PyPI wheel), for Hopper.

No GPU is needed, so CI runs this on every change: a syntax or type error in the CUDA code cannot land. Without nvcc
the tests fail (CI machines have the CUDA toolkit); running the kernels is tools/gpu_check.sh's job (docs/cuda.md).
"""
import pytest

from vq_gguf.native import build, cuda


@pytest.fixture(scope="module")
def tree():
    assert cuda.nvcc() is not None, "nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda): install the CUDA toolkit"
    return build.prepare_tree(build.fetch_sdist())


@pytest.mark.parametrize("source", cuda.CHECKED_SOURCES)
def test_compiles_for_hopper(tree, source, tmp_path):
    out = tmp_path / "k.o"
    # our own file also with nvcc's warnings as errors
    extra = ["-Werror", "all-warnings"] if source.endswith("vq-cuda.cu") else []
    secs = cuda.compile_object(tree, source, out, cuda.DEFAULT_ARCH, extra)
    assert out.stat().st_size > 0
    print(f"{source}: {secs:.1f} s")


def test_a_type_error_fails_the_check(tree, tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('#include "vq-cuda.cuh"\nvoid f(ggml_backend_cuda_context & ctx) { ggml_cuda_mul_mat_vq(ctx, 1.0f); }\n')
    with pytest.raises(RuntimeError, match="nvcc failed"):
        cuda.compile_object(tree, str(bad), tmp_path / "bad.o")
