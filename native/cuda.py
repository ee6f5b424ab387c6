"""The CUDA toolchain for the VQ kernels: nvcc, cuBLAS's headers and libraries, and an nvcc compile check.

    python -m vq_gguf.native.cuda setup                  # make sure nvcc and cuBLAS's headers are there (scripts/setup.sh)
    python -m vq_gguf.native.build --cuda-check [--cuda-arch 90]   # compile our .cu file and the hooked ggml-cuda.cu

nvcc is the CUDA toolkit's (PATH, $CUDA_HOME, /usr/local/cuda); where there is none, `setup` installs the pinned
CUDA 13.0 compiler wheels from PyPI into $VQ_GGUF_HOME/cuda-toolkit. cuBLAS is looked up in the toolkit, then in an
installed PyPI package (nvidia-cublas: nvidia/cu13/...), then in $VQ_GGUF_HOME/cuda, where `setup` extracts the
include folder of the pinned nvidia-cublas wheel: machines without a GPU compile the CUDA code too.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from vq_gguf.paths import home

CUBLAS_WHEEL = "nvidia-cublas==13.0.2.14"   # the cuBLAS of CUDA 13.0, the nvcc CI has
# nvcc 13.0 as PyPI wheels (all under nvidia/cu13/, which nvcc.profile takes as the toolkit's root)
TOOLKIT_WHEELS = ["nvidia-cuda-nvcc==13.0.88", "nvidia-nvvm==13.0.88", "nvidia-cuda-crt==13.0.88",
                  "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cccl==13.0.85"]
DEFAULT_ARCH = "90"                          # Hopper (H100, H200)
# what ggml-cuda's CMakeLists.txt passes to nvcc for every source (GGML_CUDA_GRAPHS on, shared build)
NVCC_FLAGS = ["-std=c++17", "-O3", "-use_fast_math", "-extended-lambda",
              "-DGGML_CUDA_USE_GRAPHS", "-DGGML_SHARED", "-DGGML_BACKEND_SHARED", "-DGGML_BACKEND_BUILD"]
# our sources and the hooked upstream file, relative to the llama.cpp tree
CHECKED_SOURCES = ["ggml/src/ggml-cuda/vq-cuda.cu", "ggml/src/ggml-cuda/ggml-cuda.cu"]


def _pip_toolkit() -> Path:
    return home() / "cuda-toolkit" / "nvidia" / "cu13"


def nvcc() -> Path | None:
    """A toolkit's nvcc (its root is two folders up), before any nvcc on PATH, which may be a wrapper script."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return (Path(root) / "bin" / "nvcc").resolve()
    found = shutil.which("nvcc") or (_pip_toolkit() / "bin" / "nvcc")
    return Path(found).resolve() if Path(found).is_file() else None


def toolkit_root() -> Path | None:
    exe = nvcc()
    return exe.parent.parent if exe else None


def _wheel_dir() -> Path:
    return home() / "cuda"


def _cublas_roots() -> list[Path]:
    """Folders that may hold include/cublas_v2.h and lib/libcublas.so*, most preferred first."""
    roots = []
    if toolkit_root():
        roots += [toolkit_root(), toolkit_root() / "targets" / "x86_64-linux"]
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec and spec.submodule_search_locations else []):
        roots += [Path(base) / "cu13", Path(base) / "cublas"]
    roots.append(_wheel_dir() / "nvidia" / "cu13")
    return roots


def cublas_include() -> Path | None:
    return next((r / "include" for r in _cublas_roots() if (r / "include" / "cublas_v2.h").is_file()), None)


def cublas_libs() -> dict[str, Path]:
    """libcublas and libcublasLt where the toolkit has none (a PyPI package): CMake cache entries for them."""
    for r in _cublas_roots():
        for libdir in (r / "lib64", r / "lib"):
            libs = {name: next(iter(sorted(libdir.glob(f"lib{name}.so*"))), None) for name in ("cublas", "cublasLt")}
            if all(libs.values()):
                return {f"CUDA_{name}_LIBRARY": path for name, path in libs.items()}
    return {}


def cmake_options(arch: str) -> dict[str, str]:
    """CMake cache entries (NAME:TYPE -> value) of a build with the CUDA backend for the architectures arch."""
    exe, root = nvcc(), toolkit_root()
    if exe is None:
        raise SystemExit("--cuda: nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda): install the CUDA toolkit")
    opts = {"VQ_CUDA:BOOL": "ON", "VQ_CUDA_ARCHITECTURES:STRING": arch, "CMAKE_CUDA_COMPILER:FILEPATH": str(exe)}
    if not any((r / "include" / "cublas_v2.h").is_file() for r in (root, root / "targets" / "x86_64-linux")):
        inc, libs = cublas_include(), cublas_libs()
        if inc is None or not libs:
            raise SystemExit("--cuda: cuBLAS is in neither the CUDA toolkit nor an installed nvidia-cublas package")
        opts["VQ_CUDA_EXTRA_INCLUDE:PATH"] = str(inc)
        opts.update({f"{name}:FILEPATH": str(path) for name, path in libs.items()})
    return opts


def fetch_headers() -> Path:
    """cuBLAS's include folder, extracting it from the pinned wheel into $VQ_GGUF_HOME/cuda when missing."""
    found = cublas_include()
    if found:
        return found
    dl = home() / "dl" / "cublas"
    wheels = sorted(dl.glob("nvidia_cublas-*.whl"))
    if not wheels:
        print(f"[cuda] downloading {CUBLAS_WHEEL} (for its headers)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        CUBLAS_WHEEL, "-d", str(dl)], check=True)
        wheels = sorted(dl.glob("nvidia_cublas-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        members = [m for m in z.namelist() if "/include/" in m]
        z.extractall(_wheel_dir(), members=members)
    found = cublas_include()
    if not found:
        raise SystemExit(f"{wheels[-1].name} holds no cublas_v2.h")
    return found


def compile_object(tree: Path, source: str, out: Path, arch: str = DEFAULT_ARCH, extra: list[str] | None = None) -> float:
    """nvcc -c one source of the tree for one architecture; returns the seconds it took, raises with nvcc's output."""
    exe = nvcc()
    if exe is None:
        raise RuntimeError("nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda): install the CUDA toolkit")
    inc = fetch_headers()
    cmd = [str(exe), *NVCC_FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}", *(extra or []),
           "-I", str(tree / "ggml" / "include"), "-I", str(tree / "ggml" / "src"), "-I", str(tree / "ggml" / "src" / "ggml-cuda"),
           "-I", str(inc), "-c", str(tree / source), "-o", str(out)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source}:\n{p.stdout}{p.stderr}")
    return time.monotonic() - t0


def setup() -> None:
    """nvcc (the toolkit's, else the pinned wheels) and cuBLAS's headers, for the compile check."""
    if nvcc() is None:
        print(f"[cuda] no CUDA toolkit: installing nvcc 13.0 from PyPI into {_pip_toolkit().parent.parent}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                        str(_pip_toolkit().parent.parent), *TOOLKIT_WHEELS], check=True)
    print(f"[cuda] nvcc {nvcc()}, cuBLAS headers {fetch_headers()}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["setup"])
    ap.parse_args(argv)
    setup()


def check(tree: Path, arch: str = DEFAULT_ARCH) -> None:
    """nvcc -c of each of CHECKED_SOURCES in the patched tree, into $VQ_GGUF_HOME/cuda-check."""
    out = home() / "cuda-check"
    out.mkdir(parents=True, exist_ok=True)
    for src in CHECKED_SOURCES:
        secs = compile_object(tree, src, out / (Path(src).stem + ".o"), arch)
        print(f"[cuda] {src}: compiled for sm_{arch} in {secs:.1f} s")


if __name__ == "__main__":
    main()
