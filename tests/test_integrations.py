"""A VQ file used from the tools people already have: llama-server, llama-cpp-python, and the C API in an
exported bundle. Each must give, for the same chat and greedy decoding, the same answer as our own
`vq-gguf chat` (the reference below), and the bundle must reject files that do not match its manifest.

Needs `vq-gguf build --server` (make test runs it; the serve command would build it too).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests import REPO
from vq_gguf import bundle, model_card
from vq_gguf.bpw import count
from vq_gguf.native.build import PORTABLE_VARIANTS, bin_dir, portable_bin_dir, tree_dir
from vq_gguf.native.wheel import build_wheel, check

PROMPT = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": PROMPT}]   # SmolLM2's template adds its own system turn: both must render it
# the C example renders with libllama's built-in template matcher (the C API has no Jinja), which knows no default
# system turn: it is given one explicitly, and so is its reference
SYSTEM = "You are a helpful assistant."
N_TOKENS = 24
THREADS = 2


def chat_answer(model: Path, *system: str) -> str:
    """The answer of `vq-gguf chat` (greedy by default), as the command prints it."""
    proc = subprocess.run([sys.executable, "-m", "vq_gguf.cli", "chat", str(model), "--prompt", PROMPT,
                           "--max-tokens", str(N_TOKENS), "--threads", str(THREADS), *(["--system", *system] if system else [])],
                          cwd=REPO, capture_output=True, text=True, check=True)
    answer = proc.stdout.removesuffix("\n")
    assert len(answer) > 10
    return answer


@pytest.fixture(scope="module")
def reference(ffn_down_file) -> str:
    return chat_answer(ffn_down_file)


def decodable(text: str) -> str:
    """The text without the bytes of a token that ends inside a UTF-8 character: `vq-gguf chat` shows them as
    U+FFFD, llama-cpp-python drops them, the C example writes them raw; the tokens are the same."""
    return text.replace("\ufffd", "")


# --- llama-server ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(ffn_down_file):
    """`vq-gguf serve` running in the background: (its process, the endpoint it printed, its port)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vq_gguf.cli", "serve", str(ffn_down_file), "--port", str(port),
                             "--threads", str(THREADS), "--parallel", str(SLOTS), "--", "--temp", str(DEFAULT_TEMP)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    printed = []
    for line in proc.stdout:
        printed.append(line)
        if "OpenAI-compatible endpoint:" in line:
            break
    else:
        pytest.fail(f"vq-gguf serve exited with {proc.wait()} before serving:\n{''.join(printed)}")
    yield proc, line.split("endpoint:")[1].split()[0], port
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[1]


CONVERSATIONS = [MESSAGES, [{"role": "system", "content": "Answer in one word."}, *MESSAGES],
                 [*MESSAGES, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]]


def test_chat_renders_the_template_as_llama_server_does(url, ffn_down_file):
    from vq_gguf.runtime.llama import Model
    with Model(ffn_down_file, n_ctx=256) as m:
        for messages in CONVERSATIONS:
            with post(url.removesuffix("/v1") + "/apply-template", {"messages": messages}) as r:
                assert m.apply_chat_template(messages) == json.load(r)["prompt"]


SLOTS, DEFAULT_TEMP = 2, 0.25   # --parallel, and an option after -- that llama-server takes as it is


def test_serve_passes_llama_server_options(url):
    with urllib.request.urlopen(url.removesuffix("/v1") + "/props", timeout=60) as r:
        props = json.load(r)
    assert props["total_slots"] == SLOTS
    assert props["default_generation_settings"]["params"]["temperature"] == pytest.approx(DEFAULT_TEMP)


# cache_prompt off: a server that kept the previous request's prompt re-decodes only its last token, through
# the one-token kernels instead of the prompt ones; they round differently, which can flip a nearly tied
# greedy choice (it does on this 2-bit file). Every request then decodes its prompt as `vq-gguf chat` does.
REQUEST = {"messages": MESSAGES, "temperature": 0, "max_tokens": N_TOKENS, "seed": 0, "cache_prompt": False}


def post(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300)


def test_serve_prints_a_loopback_endpoint(served):
    _, url, port = served
    assert url == f"http://127.0.0.1:{port}/v1"


def test_server_chat_completion(url, reference):
    with post(f"{url}/chat/completions", REQUEST) as r:
        answer = json.load(r)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert decodable(answer["choices"][0]["message"]["content"]) == decodable(reference)
    assert answer["usage"]["completion_tokens"] <= N_TOKENS


def test_server_streaming_completion(url, reference):
    pieces, done = [], False
    with post(f"{url}/chat/completions", {**REQUEST, "stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            for choice in json.loads(line[len("data: "):])["choices"]:
                pieces.append(choice["delta"].get("content") or "")
    assert done and len([p for p in pieces if p]) > 1  # really streamed, piece by piece
    assert decodable("".join(pieces)) == decodable(reference)


def test_serve_stops_on_ctrl_c(served, ffn_down_file):
    proc, url, port = served
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # llama-server went with it


def test_serve_refuses_a_missing_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vq_gguf.cli", "serve", str(tmp_path / "missing.gguf")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "missing.gguf does not exist" in proc.stderr and "Traceback" not in proc.stderr


# --- llama-cpp-python ------------------------------------------------------------------------------------

def test_llama_cpp_python_in_a_fresh_venv(ffn_down_file, reference, tmp_path):
    """`vq-gguf wheel`: the pinned release's Python package with the portable build's libraries, installed into a
    new virtual environment, answers as `vq-gguf chat` does, with the CPU variant ggml loaded from the package."""
    wheel = build_wheel(tmp_path / "wheels", bundle.shared_libraries(portable_bin_dir()))
    assert wheel.name.endswith("-linux_x86_64.whl")
    with zipfile.ZipFile(wheel) as z:
        libs = {n.removeprefix("llama_cpp/lib/") for n in z.namelist() if n.startswith("llama_cpp/lib/")}
    assert libs == {"libllama.so", "libggml.so.0", "libggml-base.so.0", *(f"libggml-cpu-{v}.so" for v in PORTABLE_VARIANTS)}
    venv = tmp_path / "venv"
    answer = check(wheel, ffn_down_file, MESSAGES, max_tokens=N_TOKENS, venv=venv, threads=THREADS,
                   env={"LD_DEBUG": "files", "LD_DEBUG_OUTPUT": str(tmp_path / "ld")})
    assert decodable(answer["content"]) == decodable(reference)
    log = "".join(p.read_text() for p in tmp_path.glob("ld.*"))
    variant = loaded_cpu_variant(log)
    assert re.search(rf"file={re.escape(str(venv))}/\S*/llama_cpp/lib/libggml-cpu-{variant}\.so \[0\];", log)


def test_llama_cpp_python_with_the_native_build(ffn_down_file, reference, tmp_path):
    """The Python-only wheel, its libraries named by LLAMA_CPP_LIB_PATH: those of `vq-gguf build`, whose CPU
    backend is linked in (nothing to load)."""
    wheel = build_wheel(tmp_path / "wheels", None)
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if ".so" in n]  # so the VQ file can only load through our libllama
    answer = check(wheel, ffn_down_file, MESSAGES, max_tokens=N_TOKENS, venv=tmp_path / "venv", threads=THREADS,
                   lib_path=bin_dir())
    assert decodable(answer["content"]) == decodable(reference)


# --- the bundle ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(ffn_down_file, tmp_path_factory) -> Path:
    return bundle.export(ffn_down_file, tmp_path_factory.mktemp("export") / "smollm2-ffn-down", bundle=True)


def test_bundle_manifest(exported, ffn_down_file):
    manifest = json.loads((exported / "manifest.json").read_text())
    files = manifest["files"]
    assert {"README.md", ffn_down_file.name, "lib/libllama.so.0", "lib/libggml.so.0", "lib/libggml-base.so.0",
            "include/llama.h", "include/ggml.h", "example/generate.c"} <= set(files)
    # on x86-64 the portable build's libraries: the CPU backend as one loadable library per variant, no other
    variants = manifest["library"]["cpu variants"]
    assert variants == sorted(PORTABLE_VARIANTS) and "portable" in manifest["library"]["cpu flags"]
    assert {f for f in files if f.startswith("lib/libggml-cpu")} == {f"lib/libggml-cpu-{v}.so" for v in variants}
    assert files["lib/libllama.so"] == {"symlink": "libllama.so.0"}  # the name `cc -lllama` looks for
    assert files[ffn_down_file.name]["sha256"] == bundle.sha256(ffn_down_file)
    bits = count(ffn_down_file)
    assert manifest["model"]["bits"]["bpw_block_linears"] == round(bits.linear_bpw, 4)
    assert manifest["model"]["metadata"]["vq.format_version"] == 1
    assert manifest["model"]["metadata"]["general.architecture"] == "llama"
    lib = manifest["library"]
    assert len(lib["patch sha256"]) == 64 and len(lib["llama.cpp commit"]) == 40
    assert bundle.verify(exported)["files"] == files


def test_bundle_model_card(exported, ffn_down_file):
    card = (exported / "README.md").read_text()
    assert f"{count(ffn_down_file).linear_bpw:.3f}" in card
    assert "Not measured for this file" in card  # no comparison ever ran on this file
    for how in ("vq-gguf chat", "vq-gguf serve", "from llama_cpp import Llama", "./generate", "vq-gguf verify"):
        assert how in card


@pytest.fixture(scope="module")
def app(exported, tmp_path_factory) -> Path:
    """The bundle moved elsewhere, where the libraries must still find each other, and its example compiled."""
    moved = shutil.copytree(exported, tmp_path_factory.mktemp("app") / "moved", symlinks=True)
    subprocess.run(model_card.EXAMPLE_CC, cwd=moved, check=True)
    return moved


def test_bundle_c_example(app, ffn_down_file):
    loaded = subprocess.run(["ldd", "generate"], cwd=app, capture_output=True, text=True, check=True).stdout
    ours = [Path(line.split("=>")[1].split("(")[0].strip()).resolve() for line in loaded.splitlines()
            if "libllama" in line or "libggml" in line]
    assert len(ours) >= 3 and all(p.parent == (app / "lib").resolve() for p in ours), loaded
    proc = subprocess.run(["./generate", ffn_down_file.name, PROMPT, str(N_TOKENS), SYSTEM], cwd=app,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert decodable(proc.stdout.decode("utf-8", errors="replace").removesuffix("\n")) == decodable(chat_answer(ffn_down_file, SYSTEM))


def loaded_cpu_variant(ld_log: str) -> str:
    """The CPU backend variant a process kept, from the dynamic loader's LD_DEBUG=files log: ggml opens every
    variant to score it against the CPU and closes it again, then opens the best one a last time."""
    opened = re.findall(r"file=\S*/libggml-cpu-(\w+)\.so \[0\];\s+dynamically loaded", ld_log)
    assert opened, ld_log[-2000:]
    return opened[-1]


# qemu-user's CPU models without AVX-512 and without AVX at all, and the variant ggml must pick for each
OLDER_CPUS = {"Haswell-v4": "haswell", "Nehalem-v2": "sse42"}


@pytest.fixture(scope="module")
def ffn_down_4bit_file(src, tmp_path_factory) -> Path:
    """The default model with every ffn_down at 4 bits (k-means v2 k256): VQ kernels in every layer, answers
    close to the source model's."""
    from vq_gguf.config import VQConfig
    from vq_gguf.quantize import quantize_model
    return quantize_model(src, tmp_path_factory.mktemp("ffn4") / "ffn_down-4bit.vq.gguf",
                          VQConfig(v=2, k=256, kmeans_iters=8), only=["ffn_down"])


@pytest.mark.parametrize("cpu", OLDER_CPUS)
def test_bundle_runs_on_an_older_cpu(app, ffn_down_4bit_file, cpu, tmp_path):
    """The moved folder on another CPU, emulated by qemu-user: ggml loads the variant that CPU runs, and the model
    answers. The text is not compared with this CPU's: without FMA (Nehalem) or AVX-512 every sum rounds
    differently, and greedy decoding follows the difference into other words after a few tokens."""
    if shutil.which("qemu-x86_64") is None:
        pytest.fail("qemu-x86_64 is missing (Debian: apt-get install qemu-user; scripts/setup.sh --test installs it)")
    env = {**os.environ, "LD_DEBUG": "files", "LD_DEBUG_OUTPUT": str(tmp_path / "ld")}
    proc = subprocess.run(["qemu-x86_64", "-cpu", cpu, "./generate", str(ffn_down_4bit_file),
                           PROMPT + " Answer in one word.", str(N_TOKENS), SYSTEM],
                          cwd=app, capture_output=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr
    assert loaded_cpu_variant("".join(p.read_text() for p in tmp_path.glob("ld.*"))) == OLDER_CPUS[cpu]
    assert "Paris" in proc.stdout.decode("utf-8", errors="replace")


def test_c_example_reports_a_bad_model(app, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    proc = subprocess.run([str(app / "generate"), str(bad), PROMPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"could not load {bad}" in proc.stderr


def verify_cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vq_gguf.cli", "verify", str(path)], cwd=REPO,
                          capture_output=True, text=True)


def test_verify_rejects_a_tampered_bundle(exported, tmp_path):
    ok = verify_cli(exported)
    assert ok.returncode == 0 and "match manifest.json" in ok.stdout
    bad = shutil.copytree(exported, tmp_path / "bad", symlinks=True)
    lib = bad / "lib" / "libllama.so.0"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    lib.write_bytes(bytes(data))
    (bad / "example" / "generate.c").unlink()
    (bad / "extra.txt").write_text("not shipped")
    proc = verify_cli(bad)
    assert proc.returncode != 0
    assert "does not match its manifest.json" in proc.stderr
    assert "changed: lib/libllama.so.0" in proc.stderr
    assert "missing: example/generate.c" in proc.stderr
    assert "not in the manifest: extra.txt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_verify_without_manifest(tmp_path):
    proc = verify_cli(tmp_path)
    assert proc.returncode != 0 and "no manifest.json" in proc.stderr


def test_archive_round_trip(ffn_down_file, tmp_path):
    tar = bundle.export(ffn_down_file, tmp_path / "plain", archive=True)
    assert tar.name == "plain.tar.gz" and tar.is_file()
    manifest = bundle.verify(tar)
    assert "library" not in manifest and set(manifest["files"]) == {"README.md", ffn_down_file.name}


def test_headers_are_the_patched_trees(exported):
    assert (exported / "include" / "llama.h").read_bytes() == (tree_dir() / "include" / "llama.h").read_bytes()
    assert "MOSTLY_VQ" in (exported / "include" / "llama.h").read_text()
