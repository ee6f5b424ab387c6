"""vq-gguf installed from its wheel, away from the checkout: one package (vq_gguf) in site-packages, nothing
generic beside it; `vq-gguf build` finds the patch, the C sources and CMakeLists.txt inside the installed
package; `quantize` and `chat` work; the Python API does the same.

The virtual environment sees the system's packages (torch, numpy, ...: nothing is downloaded) but has the wheel
installed in its own site-packages, which come first; its cache folder is its own (the llama.cpp sdist is copied
in, ccache makes the compile quick), so the build folders of the other tests are left alone.
"""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests import REPO
from vq_gguf.paths import home

# "Answer in one word." keeps the first token well ahead of the next (by about 1.5 logits, float and 4bit):
# the bare question is a near-tie between "The" and "L'" for this model, which float rounding on another CPU
# turns into an answer in French
PROMPT = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(python, environment) of a venv with the project's wheel installed, and a cache folder of its own."""
    root = tmp_path_factory.mktemp("install")
    src, dist = root / "src", root / "dist"   # the files git tracks (as a clone has them), built away from the checkout
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.decode()
    for name in filter(None, tracked.split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True)
    wheel, = dist.glob("vq_gguf-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    cache = root / "home"
    shutil.copytree(home() / "dl", cache / "dl", ignore=shutil.ignore_patterns("cublas"))  # the sdist and the model wheel
    env = {**os.environ, "VQ_GGUF_HOME": str(cache), "PATH": f"{python.parent}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    return python, env, wheel, root


def run(venv, *args, **kw):
    python, env, _, root = venv
    return subprocess.run(list(args), env=env, cwd=root, capture_output=True, text=True, timeout=1800, **kw)


def test_the_wheel_holds_one_package(venv):
    _, _, wheel, _ = venv
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith((".dist-info", ".data"))} == {"vq_gguf"}
    for part in ("vq_gguf/native/CMakeLists.txt", "vq_gguf/native/patches/llama.cpp.patch",
                 "vq_gguf/native/ggml/vq-cpu.c", "vq_gguf/native/fuzz/vq-load.c", "vq_gguf/data/eval/wikitext-2-raw-test.txt",
                 "vq_gguf/runtime/llama.py", "vq_gguf/tools/compare.py", "vq_gguf/cli.py"):
        assert part in names


def test_installed_outside_the_checkout(venv):
    python = venv[0]
    r = run(venv, str(python), "-c", "import vq_gguf, vq_gguf.native.build as b; print(vq_gguf.__file__); print(b.NATIVE)")
    assert r.returncode == 0, r.stderr
    for line in r.stdout.split():
        assert str(python.parent.parent) in line and str(REPO) not in line
    r = run(venv, "vq-gguf", "--version")
    assert r.returncode == 0 and r.stdout.startswith("vq-gguf ")
    shown = run(venv, str(python), "-m", "pip", "show", "-f", "vq-gguf").stdout
    files = shown.split("Files:", 1)[1].split()
    assert {f.split("/")[0] for f in files if not f.startswith("..")} <= {"vq_gguf", "vq_gguf-0.1.0.dist-info"}, shown


def test_build_quantize_chat_from_the_installed_package(venv):
    r = run(venv, "vq-gguf", "build")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = venv[3] / "tiny.vq.gguf"
    r = run(venv, "vq-gguf", "quantize", "--preset", "4bit", "--only", "blk.0.", "--calib-windows", "8", "--out", str(out))
    assert r.returncode == 0 and out.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    r = run(venv, "vq-gguf", "chat", str(out), "--prompt", PROMPT, "--max-tokens", "12", "--threads", "2")
    assert r.returncode == 0 and "Paris" in r.stdout, r.stdout + r.stderr[-2000:]
    api = ("from vq_gguf.api import chat, load; import sys; p = sys.argv[1]; print(chat(p, sys.argv[2], max_tokens=12)); "
           "m = load(p, n_ctx=64); print(m.n_vocab); m.close()")
    r = run(venv, str(venv[0]), "-c", api, str(out), PROMPT)
    assert r.returncode == 0 and "Paris" in r.stdout, r.stderr[-2000:]
