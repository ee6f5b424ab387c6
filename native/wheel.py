"""`vq-gguf wheel`: a wheel of llama-cpp-python, the pinned release whose llama.cpp we patch, built from the
patched tree, so that `from llama_cpp import Llama; Llama("model.vq.gguf")` reads VQ files.

The sdist is unpacked, its vendor/llama.cpp replaced by the patched tree of `native.build`, and pip builds it
with scikit-build-core: a full compile of ggml, llama and llama.cpp's common library (several minutes; ccache
helps on a rebuild). The multimodal library (mtmd, LLAVA_BUILD) is left out. The version gets the local label
`+vq.<patch sha256 prefix>`, so pip never takes it for the PyPI release.

`--python-only` packages the same Python code without compiling anything (LLAMA_BUILD=OFF): that package loads
the libraries named by LLAMA_CPP_LIB_PATH, e.g. those of `vq-gguf build`. The tests use it that way, in a fresh
virtual environment; `--check MODEL` does the same for any wheel and prints a greedy answer.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .build import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION, PATCH, fetch_sdist, log, prepare_tree

CMAKE_ARGS = ["-DLLAVA_BUILD=OFF", "-DGGML_NATIVE=ON", "-DGGML_CCACHE=ON", f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT[:9]}"]

# run by the virtual environment's Python: a greedy chat completion, printed as JSON. flash_attn=True: Llama
# turns flash attention off by default, while llama.cpp (server, C API, our runtime) picks it on the CPU; the
# two sum in another order, which is enough to change a greedy answer after a few dozen tokens
CHECK_SCRIPT = """
import json, sys
from llama_cpp import Llama
a = json.loads(sys.argv[1])
llm = Llama(a["model"], n_ctx=a["n_ctx"], n_threads=a["threads"], seed=a["seed"], flash_attn=True, verbose=False)
out = llm.create_chat_completion(a["messages"], temperature=0.0, max_tokens=a["max_tokens"], seed=a["seed"])
print(json.dumps({"content": out["choices"][0]["message"]["content"], "finish_reason": out["choices"][0]["finish_reason"]}))
"""


def version() -> str:
    return f"{LLAMA_CPP_PYTHON_VERSION}+vq.{hashlib.sha256(PATCH.read_bytes()).hexdigest()[:8]}"


def source_tree(dest: Path, python_only: bool) -> Path:
    """The sdist unpacked into dest, with the patched llama.cpp as its vendor/llama.cpp (not needed, hence not
    copied, for a Python-only build) and our version label."""
    sdist = fetch_sdist()
    tree = None if python_only else prepare_tree(sdist)
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else ""
            if rel and not rel.startswith("vendor/"):
                m.name = rel
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    if tree is not None:
        shutil.copytree(tree, dest / "vendor" / "llama.cpp", ignore=shutil.ignore_patterns(".vq-stamp"))
    init = dest / "llama_cpp" / "__init__.py"
    old = f'__version__ = "{LLAMA_CPP_PYTHON_VERSION}"'
    if old not in init.read_text():
        raise RuntimeError(f"{init} does not set {old}: the sdist is not the one this script knows")
    init.write_text(init.read_text().replace(old, f'__version__ = "{version()}"'))
    return dest


def build_wheel(out_dir: Path, *, python_only: bool = False, jobs: int | None = None) -> Path:
    """Build the wheel into out_dir; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = source_tree(Path(tmp) / "src", python_only)
        args = ["-DLLAMA_BUILD=OFF"] if python_only else CMAKE_ARGS
        env = {**os.environ, "CMAKE_ARGS": " ".join(args), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs or os.cpu_count() or 2)}
        log(f"building the llama-cpp-python {version()} wheel{' (Python only)' if python_only else ''} in {src}")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out_dir), str(src)], env=env,
                       check=True)
    made = list(out_dir.glob(f"llama_cpp_python-{version()}-*.whl"))
    if not made:
        raise RuntimeError(f"pip made no llama_cpp_python-{version()} wheel in {out_dir}")
    return max(made, key=lambda w: w.stat().st_mtime)


def check(wheel: Path, model: Path, messages: list[dict], *, max_tokens: int, venv: Path, seed: int = 0,
          threads: int | None = None, lib_path: Path | None = None) -> dict:
    """Install the wheel into a fresh virtual environment (system site packages visible, for numpy and jinja2)
    and chat greedily with `model` through `llama_cpp.Llama`; returns {"content", "finish_reason"}."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    if lib_path is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(lib_path)
    arg = {"model": str(model), "messages": messages, "max_tokens": max_tokens, "seed": seed, "n_ctx": 2048,
           "threads": threads or os.cpu_count() or 1}
    proc = subprocess.run([str(python), "-c", CHECK_SCRIPT, json.dumps(arg)], env=env, cwd=venv,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama_cpp in {venv} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
