"""Fetch, check, patch and build llama.cpp with the VQ type; build the cffi module of the runtime.

    python -m vq_gguf.native.build            # everything, reusing whatever is up to date
    python -m vq_gguf.native.build --server   # also llama-server
    python -m vq_gguf.native.build --cuda --cuda-arch 90   # with the CUDA backend (docs/cuda.md)
    python -m vq_gguf.native.build --sanitize # the hardening build: ASan/UBSan + libFuzzer (clang), docs/hardening.md
    python -m vq_gguf.native.build --cross aarch64   # the kernel test for Arm (cross-compiled; run it under qemu-user)
    python -m vq_gguf.native.build --portable # libraries for any x86-64 CPU: ggml's CPU backend as loadable variants

Steps (each skipped when its inputs have not changed):
1. `pip download` the sdist of the pinned llama-cpp-python release and check its sha256;
2. extract its vendor/llama.cpp, copy native/ggml and native/llama into it, apply native/patches/llama.cpp.patch;
3. configure native/CMakeLists.txt with ninja and ccache, build the libraries and tools;
4. compile runtime's cffi extension against the tree's llama.h (API mode: the C compiler checks every
   struct field the bindings use, so the layouts cannot drift).

Everything lives in a cache folder outside the repo: $VQ_GGUF_HOME, default ~/.cache/vq-gguf.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from vq_gguf.atomic import sha256
from vq_gguf.paths import home

NATIVE = Path(__file__).resolve().parent  # the patch, our C/CUDA sources and the CMakeLists.txt, inside the package
PATCH = NATIVE / "patches" / "llama.cpp.patch"

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_PYTHON_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # vendored by that release

# our files, and where they go in the llama.cpp tree
OWN_FILES = {
    "ggml/ggml-vq.h": "ggml/include/ggml-vq.h",
    "ggml/ggml-vq.c": "ggml/src/ggml-vq.c",
    "ggml/vq-cpu.h": "ggml/src/ggml-cpu/vq-cpu.h",
    "ggml/vq-cpu.c": "ggml/src/ggml-cpu/vq-cpu.c",
    "ggml/vq-cpu-impl.h": "ggml/src/ggml-cpu/vq-cpu-impl.h",
    "ggml/vq-cpu-avx2.c": "ggml/src/ggml-cpu/vq-cpu-avx2.c",
    "ggml/vq-cpu-avx512.c": "ggml/src/ggml-cpu/vq-cpu-avx512.c",
    "ggml/vq-cpu-neon.c": "ggml/src/ggml-cpu/vq-cpu-neon.c",
    "ggml/vq-cpu-cent.inc": "ggml/src/ggml-cpu/vq-cpu-cent.inc",
    "ggml/vq-cuda.cuh": "ggml/src/ggml-cuda/vq-cuda.cuh",
    "ggml/vq-cuda.cu": "ggml/src/ggml-cuda/vq-cuda.cu",
    "llama/llama-vq.h": "src/llama-vq.h",
    "llama/llama-vq.cpp": "src/llama-vq.cpp",
}
TARGETS = ["llama", "llama-quantize", "llama-perplexity", "llama-imatrix", "llama-bench", "llama-completion", "test-vq-matmul"]
# the sanitizer build: static libraries with ASan, UBSan and fuzzing coverage, the loader driver, the fuzz harnesses
SANITIZE_TARGETS = ["vq-load", "fuzz-vq-load", "fuzz-vq-file", "fuzz-vq-matmul"]
SANITIZE_CC = ("clang-14", "clang++-14")  # libFuzzer ships with clang (Debian: clang-14 libclang-rt-14-dev)
# cross builds of the kernel test: architecture -> Debian's cross compilers (gcc-aarch64-linux-gnu g++-aarch64-linux-gnu)
CROSS = {"aarch64": ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++")}
# the portable build: libllama and the CPU backend as one loadable library per instruction-set level
# (GGML_BACKEND_DL, GGML_CPU_ALL_VARIANTS; ggml loads the best one the CPU runs, and our VQ kernels are compiled
# into each with its flags). These are the x86-64 levels of ggml's list that change our kernels or llama.cpp's
# (baseline, SSE4.2, AVX2, AVX-512, AVX-512 VBMI + VNNI, AVX-VNNI); `--variants` names others of ggml's list.
X86_VARIANTS = ("x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell", "skylakex", "cannonlake", "cascadelake",
                "icelake", "cooperlake", "zen4", "alderlake", "sapphirerapids")  # ggml's list, ggml/src/CMakeLists.txt
PORTABLE_VARIANTS = ("x64", "sse42", "haswell", "skylakex", "icelake", "alderlake")
PORTABLE_TOOLS = ["llama-bench", "llama-perplexity"]  # only for measuring a variant (tools/bench.py --cpu-variant)


def tree_dir() -> Path:
    return home() / "llama.cpp"


def build_dir() -> Path:
    return home() / "build"


def bin_dir() -> Path:
    return build_dir() / "bin"


def sanitize_bin_dir() -> Path:
    return home() / "build-asan" / "bin"


def cross_bin_dir(arch: str) -> Path:
    return home() / f"build-{arch}" / "bin"


def portable_bin_dir() -> Path:
    return home() / "build-portable" / "bin"


def cpu_variants(bin_dir: Path) -> list[str]:
    """The CPU backend variants of a portable build folder (libggml-cpu-TAG.so), by tag."""
    return sorted(p.name.removeprefix("libggml-cpu-").removesuffix(".so") for p in bin_dir.glob("libggml-cpu-*.so"))


def log(msg: str) -> None:
    print(f"[build] {msg}", flush=True)


def fetch_sdist() -> Path:
    dl = home() / "dl"
    sdist = dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        log(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} source from PyPI")
        dl.mkdir(parents=True, exist_ok=True)
        # --no-binary for this package only: pip prepares the sdist's metadata in a build environment, whose
        # own requirements may then come as wheels (":all:" would build each of them from source: minutes)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dl)], check=True)
    digest = sha256(sdist)
    if digest != LLAMA_CPP_PYTHON_SHA256:
        sdist.unlink()
        raise SystemExit(f"{sdist.name}: sha256 {digest} does not match the pinned {LLAMA_CPP_PYTHON_SHA256}; removed it")
    return sdist


def copy_if_changed(src: Path, dst: Path) -> bool:
    if dst.exists() and dst.read_bytes() == src.read_bytes():
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return True


def prepare_tree(sdist: Path) -> Path:
    """Extract and patch the tree when the sdist or the patch changed; refresh our own files always."""
    tree = tree_dir()
    stamp = tree / ".vq-stamp"
    want = f"{LLAMA_CPP_PYTHON_SHA256}\n{sha256(PATCH)}\n"
    if not (stamp.exists() and stamp.read_text() == want):
        log(f"extracting vendor/llama.cpp and applying {PATCH}")
        tmp = tree.with_name(tree.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and len(m.name) > len(prefix):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        (tmp / ".git").unlink(missing_ok=True)  # a submodule pointer that leads nowhere outside the sdist
        for src, dst in OWN_FILES.items():
            copy_if_changed(NATIVE / src, tmp / dst)
        subprocess.run(["patch", "-p1", "--forward", "--quiet", "-d", str(tmp), "-i", str(PATCH)], check=True)
        shutil.rmtree(tree, ignore_errors=True)
        tmp.rename(tree)
        stamp.write_text(want)
    for src, dst in OWN_FILES.items():
        if copy_if_changed(NATIVE / src, tree / dst):
            log(f"updated {dst}")
    return tree


def cmake_build(tree: Path, build: Path, opts: dict[str, str], targets: list[str], jobs: int, env: dict | None = None) -> None:
    """Configure `build` from native/CMakeLists.txt with the cache entries `opts` (NAME:TYPE -> value; again
    whenever one differs from the cache, from scratch when another checkout or install configured it), then build
    `targets`."""
    cache = build / "CMakeCache.txt"
    if cache.exists() and f"CMAKE_HOME_DIRECTORY:INTERNAL={NATIVE}\n" not in cache.read_text():
        log(f"the build folder was configured from another checkout or install; reconfiguring it for {NATIVE}")
        cache.unlink()
        shutil.rmtree(build / "CMakeFiles", ignore_errors=True)
    opts = {"VQ_LLAMA_SOURCE_DIR:PATH": str(tree), "GGML_NATIVE:BOOL": "ON", **opts}
    if not cache.exists() or any(f"{k}={v}\n" not in cache.read_text() for k, v in opts.items()):
        log(f"configuring {build}")
        subprocess.run(["cmake", "-S", str(NATIVE), "-B", str(build), "-G", "Ninja", *(f"-D{k}={v}" for k, v in opts.items()),
                        "-DGGML_CCACHE=ON", f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT[:9]}"],
                       check=True, stdout=subprocess.DEVNULL, env=env)
    log(f"building {' '.join(targets)} with {jobs} jobs")
    env = dict(env or os.environ)
    base = Path(os.path.commonpath([tree, build]))
    if base != Path(base.anchor):
        # ccache hashes the compile command, whose paths name this folder: relative to it, a build in another
        # $VQ_GGUF_HOME (an installed copy, a test's venv) finds the objects this one compiled
        env.setdefault("CCACHE_BASEDIR", str(base))
    subprocess.run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *targets], check=True, env=env)


def ensure_tools(compilers: tuple[str, ...] = ("cc", "c++"), patching: bool = True) -> None:
    missing = [t for t in ("cmake", "ninja", *compilers) + (("patch",) if patching else ()) if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"missing build tools: {', '.join(missing)} (Debian: apt-get install cmake ninja-build build-essential "
                         f"patch ccache, and clang-14 libclang-rt-14-dev for --sanitize; or run scripts/setup.sh)")


def build(server: bool = False, jobs: int | None = None, cuda_arch: str | None = None,
          tree: Path | None = None, runtime: bool = True, defines: dict[str, str] | None = None,
          rpc: bool = False) -> Path:
    """Make sure the patched libraries, tools and the runtime's cffi module are built; returns bin/.
    server: llama-server too; rpc: the RPC backend and rpc-server too;
    tree: an already patched tree (tools/gpu_check.sh carries one to a machine without network);
    defines: more CMake cache entries, NAME:TYPE -> value."""
    from vq_gguf.native import cuda
    ensure_tools(patching=tree is None)
    tree = tree or prepare_tree(fetch_sdist())
    cache = build_dir() / "CMakeCache.txt"
    configured = cache.read_text() if cache.exists() else ""
    # once configured with the server or RPC, stay so: a plain build then only skips their targets
    server = server or "VQ_BUILD_SERVER:BOOL=ON" in configured
    rpc = rpc or "VQ_RPC:BOOL=ON" in configured
    opts = {"CMAKE_BUILD_TYPE:STRING": "Release", "VQ_BUILD_SERVER:BOOL": "ON" if server else "OFF",
            "VQ_RPC:BOOL": "ON" if rpc else "OFF",
            **(cuda.cmake_options(cuda_arch) if cuda_arch else {"VQ_CUDA:BOOL": "OFF"}), **(defines or {})}
    targets = TARGETS + (["llama-server"] if server else []) + (["ggml-rpc-server"] if rpc else [])
    cmake_build(tree, build_dir(), opts, targets, jobs or os.cpu_count() or 2)
    if runtime:
        from vq_gguf.runtime import ffi_build
        ffi_build.build(tree, bin_dir())
    return bin_dir()


def build_sanitize(jobs: int | None = None) -> Path:
    """The hardening build in $VQ_GGUF_HOME/build-asan (clang, ASan + UBSan + libFuzzer): vq-load and the
    fuzz harnesses; returns its bin/."""
    ensure_tools(SANITIZE_CC)
    tree = prepare_tree(fetch_sdist())
    env = {**os.environ, "CC": SANITIZE_CC[0], "CXX": SANITIZE_CC[1]}
    cmake_build(tree, sanitize_bin_dir().parent, {"CMAKE_BUILD_TYPE:STRING": "Release", "VQ_SANITIZE:BOOL": "ON",
                 # -O1: half the compile time of -O3 for the same checks; fuzzing speed is in the same range
                 "CMAKE_C_FLAGS_RELEASE:STRING": "-O1", "CMAKE_CXX_FLAGS_RELEASE:STRING": "-O1"},
                SANITIZE_TARGETS, jobs or os.cpu_count() or 2, env)
    return sanitize_bin_dir()


def build_cross(arch: str, jobs: int | None = None) -> Path:
    """The kernel test test-vq-matmul and its ggml libraries for another architecture, in $VQ_GGUF_HOME/build-ARCH
    (for the CPU the architecture's baseline: no GGML_NATIVE); returns its bin/. Run it with qemu-user:
    `qemu-aarch64 -L /usr/aarch64-linux-gnu bin/test-vq-matmul random` (tests/test_kernels.py)."""
    if arch not in CROSS:
        raise SystemExit(f"no cross build for {arch!r} (known: {', '.join(CROSS)})")
    cc, cxx = CROSS[arch]
    if shutil.which(cc) is None or shutil.which(cxx) is None:
        raise SystemExit(f"missing {cc} / {cxx} (Debian: apt-get install gcc-{arch}-linux-gnu g++-{arch}-linux-gnu)")
    ensure_tools()
    tree = prepare_tree(fetch_sdist())
    opts = {"CMAKE_BUILD_TYPE:STRING": "Release", "GGML_NATIVE:BOOL": "OFF", "CMAKE_SYSTEM_NAME:STRING": "Linux",
            "CMAKE_SYSTEM_PROCESSOR:STRING": arch, "CMAKE_C_COMPILER:FILEPATH": shutil.which(cc),
            "CMAKE_CXX_COMPILER:FILEPATH": shutil.which(cxx), "GGML_OPENMP:BOOL": "OFF"}
    cmake_build(tree, cross_bin_dir(arch).parent, opts, ["test-vq-matmul"], jobs or os.cpu_count() or 2)
    return cross_bin_dir(arch)


def build_portable(variants: tuple[str, ...] = PORTABLE_VARIANTS, jobs: int | None = None, tools: bool = False) -> Path:
    """The portable build in $VQ_GGUF_HOME/build-portable: libllama, no GGML_NATIVE, the CPU backend as one
    loadable library per variant (tags of ggml's GGML_CPU_ALL_VARIANTS list); tools: llama-bench and
    llama-perplexity too. Returns its bin/, which then holds exactly these variants."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise SystemExit("the portable build is made for x86-64 Linux (ggml's variants for other platforms are not wired up here)")
    unknown = sorted(set(variants) - set(X86_VARIANTS))
    if unknown or not variants:
        raise SystemExit(f"unknown CPU variants {', '.join(unknown) or '(none given)'}; ggml's are {', '.join(X86_VARIANTS)}")
    ensure_tools()
    tree = prepare_tree(fetch_sdist())
    opts = {"CMAKE_BUILD_TYPE:STRING": "Release", "GGML_NATIVE:BOOL": "OFF", "GGML_BACKEND_DL:BOOL": "ON",
            "GGML_CPU_ALL_VARIANTS:BOOL": "ON", "GGML_CPU_VARIANTS:STRING": ";".join(variants),
            "VQ_CUDA:BOOL": "OFF", "VQ_RPC:BOOL": "OFF", "VQ_BUILD_SERVER:BOOL": "OFF"}
    bins = portable_bin_dir()
    for stale in set(cpu_variants(bins)) - set(variants):  # ggml loads every variant it finds: keep only those asked for
        (bins / f"libggml-cpu-{stale}.so").unlink()
    targets = ["llama"] + (PORTABLE_TOOLS if tools else []) + [f"ggml-cpu-{v}" for v in variants]
    cmake_build(tree, bins.parent, opts, targets, jobs or os.cpu_count() or 2)
    return bins


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="store_true", help="also build llama-server")
    ap.add_argument("--rpc", action="store_true", help="also build the RPC backend and rpc-server (docs/rpc.md)")
    ap.add_argument("--sanitize", action="store_true", help="only the sanitizer and fuzzing build (build-asan)")
    ap.add_argument("--cross", choices=sorted(CROSS), default=None,
                    help="only the kernel test for this architecture (build-ARCH; run under qemu-user)")
    ap.add_argument("--cuda", action="store_true", help="build the CUDA backend (needs nvcc and cuBLAS)")
    ap.add_argument("--cuda-arch", default="90", help="CUDA architectures, CMake syntax (default 90: Hopper)")
    ap.add_argument("--cuda-check", action="store_true",
                    help="only compile the CUDA sources we touch with nvcc (no GPU needed; native/cuda.py)")
    ap.add_argument("--portable", action="store_true",
                    help="only the portable build (build-portable): the CPU backend as loadable variants, for any x86-64 CPU")
    ap.add_argument("--variants", default=",".join(PORTABLE_VARIANTS),
                    help="with --portable: the CPU variants, tags of ggml's GGML_CPU_ALL_VARIANTS (default: %(default)s)")
    ap.add_argument("--tree", type=Path, default=None, help="use this patched llama.cpp tree instead of fetching one")
    ap.add_argument("--no-runtime", action="store_true", help="skip the runtime's cffi module")
    ap.add_argument("--define", action="append", default=[], metavar="NAME:TYPE=VALUE",
                    help="another CMake cache entry, e.g. GGML_CUDA_FA:BOOL=OFF")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    args = ap.parse_args(argv)
    if args.sanitize:
        print(build_sanitize(jobs=args.jobs))
        return
    if args.portable:
        print(build_portable(tuple(v for v in args.variants.split(",") if v), jobs=args.jobs))
        return
    if args.cross:
        print(build_cross(args.cross, jobs=args.jobs))
        return
    if args.cuda_check:
        from vq_gguf.native import cuda
        cuda.check(prepare_tree(fetch_sdist()), args.cuda_arch)
        return
    defines = dict(d.split("=", 1) for d in args.define)
    print(build(server=args.server, jobs=args.jobs, cuda_arch=args.cuda_arch if args.cuda else None,
                tree=args.tree, runtime=not args.no_runtime, defines=defines, rpc=args.rpc))


if __name__ == "__main__":
    main()
