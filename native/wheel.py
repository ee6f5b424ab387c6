"""`vq-gguf wheel`: a wheel of llama-cpp-python, the pinned release whose llama.cpp we patch, holding the patched
libraries, so that `from llama_cpp import Llama; Llama("model.vq.gguf")` reads VQ files.

The sdist's Python package is built by its own backend (scikit-build-core) without compiling llama.cpp
(LLAMA_BUILD=OFF); a CMake file included in its project installs the libraries of one of our build folders into
`llama_cpp/lib`, where the package loads them: on x86-64 Linux the portable build's (`vq-gguf build --portable`:
ggml's CPU backend as one library per instruction-set level, so the wheel runs on any x86-64 CPU), else, or with
`--native`, those of `vq-gguf build` (GGML_NATIVE: this CPU's instruction sets). The release loads only libllama
and never ggml's backend libraries, so the package's llama_cpp.py gets three lines that load them from its own
folder when libllama has none linked in. The version gets the local label `+vq.<patch sha256 prefix>`, so pip
never takes it for the PyPI release. The multimodal library (mtmd) is left out.

`--python-only` packages the Python code alone: that package loads the libraries named by LLAMA_CPP_LIB_PATH.
`--check MODEL` installs a wheel into a fresh virtual environment and prints a greedy answer; the tests do the same.
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

from .build import LLAMA_CPP_PYTHON_VERSION, PATCH, fetch_sdist, log

# after the release's own `_lib = load_shared_library(...)`: a portable build's CPU backend is loadable libraries
# (GGML_BACKEND_DL), which ggml looks for beside the executable (python); libllama of a native build has it linked in
LOAD_LIB = "_lib = load_shared_library(_lib_base_name, _base_path)\n"
LOAD_BACKENDS = """
# vq-gguf: ggml's backends as libraries (a portable build's CPU variants) load from the libraries' own folder
if _lib.ggml_backend_reg_count() == 0:
    _lib.ggml_backend_load_all_from_path(str(_base_path).encode())
"""

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


def source_tree(dest: Path) -> Path:
    """The sdist's Python package unpacked into dest (its vendor/llama.cpp left out: nothing is compiled), with
    our version label and the backend loading."""
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
    with tarfile.open(fetch_sdist()) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else ""
            if rel and not rel.startswith("vendor/"):
                m.name = rel
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    edit(dest / "llama_cpp" / "__init__.py", f'__version__ = "{LLAMA_CPP_PYTHON_VERSION}"', f'__version__ = "{version()}"')
    edit(dest / "llama_cpp" / "llama_cpp.py", LOAD_LIB, LOAD_LIB + LOAD_BACKENDS)
    return dest


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise RuntimeError(f"{path} does not hold {old.strip()!r} once: the sdist is not the one this script knows")
    path.write_text(text.replace(old, new))


def install_rules(libraries: dict[str, Path]) -> str:
    """CMake commands that put each file into the wheel's llama_cpp/lib under its name (the SONAME the others
    NEED; libllama as libllama.so, the name the package opens)."""
    rules = []
    for name, path in sorted(libraries.items()):
        name = "libllama.so" if name.startswith("libllama.so") else name
        rules.append(f'install(PROGRAMS "{path}" DESTINATION "${{SKBUILD_PLATLIB_DIR}}/llama_cpp/lib" RENAME "{name}")')
    return "\n".join(rules) + "\n"


def build_wheel(out_dir: Path, libraries: dict[str, Path] | None) -> Path:
    """Build the wheel into out_dir with `libraries` ({name: file}, bundle.shared_libraries of a build folder;
    None: Python only); returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = source_tree(Path(tmp) / "src")
        args = ["-DLLAMA_BUILD=OFF", "-DLLAVA_BUILD=OFF"]
        if libraries:
            rules = Path(tmp) / "vq-libraries.cmake"
            rules.write_text(install_rules(libraries))
            args.append(f"-DCMAKE_PROJECT_llama_cpp_INCLUDE={rules}")
        log(f"building the llama-cpp-python {version()} wheel "
            f"({'with ' + str(len(libraries)) + ' libraries' if libraries else 'Python only'}) in {src}")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out_dir), str(src)],
                       env={**os.environ, "CMAKE_ARGS": " ".join(args)}, check=True)
    made = list(out_dir.glob(f"llama_cpp_python-{version()}-*.whl"))
    if not made:
        raise RuntimeError(f"pip made no llama_cpp_python-{version()} wheel in {out_dir}")
    return max(made, key=lambda w: w.stat().st_mtime)


def check(wheel: Path, model: Path, messages: list[dict], *, max_tokens: int, venv: Path, seed: int = 0,
          threads: int | None = None, lib_path: Path | None = None, env: dict | None = None) -> dict:
    """Install the wheel into a fresh virtual environment (system site packages visible, for numpy and jinja2)
    and chat greedily with `model` through `llama_cpp.Llama` (libraries from lib_path if given, `env` added to
    the environment); returns {"content", "finish_reason"}."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True)
    env = {**{k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}, **(env or {})}
    if lib_path is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(lib_path)
    arg = {"model": str(model), "messages": messages, "max_tokens": max_tokens, "seed": seed, "n_ctx": 2048,
           "threads": threads or os.cpu_count() or 1}
    proc = subprocess.run([str(python), "-c", CHECK_SCRIPT, json.dumps(arg)], env=env, cwd=venv,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama_cpp in {venv} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
