"""The README written beside an exported model: what it is, how it was made, its bits per weight, its quality
and speed when `vq-gguf compare` measured this very file, and how to run it with each tool."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from . import ggml_vq

# how the bundle's C example is compiled inside it (the card shows it; the tests run it)
EXAMPLE_CC = ["cc", "-O2", "example/generate.c", "-Iinclude", "-Llib", "-lllama", "-lggml", "-lggml-base",
              "-Wl,-rpath,$ORIGIN/lib", "-o", "generate"]


def find_results(model: Path, results: Path | None = None) -> dict | None:
    """The compare results holding a row for this file (same path and size): `results`, or any results.json
    under $VQ_GGUF_HOME/compare. Returns the results with only the float reference and this file's rows."""
    from vq_gguf.paths import home
    candidates = [Path(results)] if results else sorted((home() / "compare").glob("**/results.json"))
    model, size = Path(model).resolve(), Path(model).stat().st_size
    for path in candidates:
        try:
            data = json.loads(path.read_text())
            rows = data["files"]
        except (OSError, json.JSONDecodeError, KeyError):
            if results:
                raise ValueError(f"{path} is not a results.json of `vq-gguf compare`") from None
            continue
        mine = [f for f in rows if Path(f["path"]).resolve() == model and f["bits"]["bytes"] == size]
        if mine and mine[0].get("quality"):
            return {**data, "files": [f for f in rows if f["kind"] == "float"] + mine[:1]}
    return None


def render(manifest: dict, results: dict | None, *, bundle: bool) -> str:
    m = manifest["model"]
    meta, bits, file = m["metadata"], m["bits"], m["file"]
    name = meta.get("general.name", file.removesuffix(".gguf"))
    preset, method = meta.get(ggml_vq.PRESET_KEY), meta.get(ggml_vq.METHOD_KEY)
    types = ", ".join(f"{t} {share:.0%}" for t, share in bits["types_block_linears"].items())
    lines = [
        f"# {name}, vector-quantized{f' ({preset})' if preset else ''}",
        "",
        f"`{file}`: {name} ({meta.get('general.architecture', '?')}, {bits['params'] / 1e6:.1f}M parameters, "
        f"context {meta.get('context_length', '?')}) with its block linears vector-quantized by vq-gguf"
        f"{f' (method {method}, preset {preset})' if method else ''}.",
        "",
        f"- Bits per weight, counted from the file with codebooks and side tensors: {bits['bpw_block_linears']:.3f} "
        f"over the block linears ({types}), {bits['bpw_file']:.3f} over the whole file "
        f"({bits['file_bytes'] / 1e6:.1f} MB).",
        f"- VQ format version {meta.get(ggml_vq.FORMAT_KEY, '?')} (the vq-gguf repository's docs/format.md).",
        "",
        "## Quality and speed",
        "",
    ]
    if results:
        from vq_gguf.tools import report
        lines += [report.table(results), "", report.notes(results), "",
                  f"Measured by `{results['command']}` ({results['finished'] or 'unfinished'})."]
    else:
        lines += ["Not measured for this file: `vq-gguf compare` measures perplexity, KL-divergence and speed against "
                  "llama.cpp's own quants; `vq-gguf export` copies its figures here when they are of this file."]
    lines += ["", "## Running it", "",
              "Stock llama.cpp cannot read VQ types: every way below uses the patched llama.cpp that vq-gguf builds "
              "(the vq-gguf repository's README and docs/integrations.md).", "",
              "```bash",
              "# vq-gguf's own chat",
              f"vq-gguf chat {file} --prompt \"What is the capital of France?\"",
              "# llama-server: an OpenAI-compatible API at http://127.0.0.1:8080/v1",
              f"vq-gguf serve {file}",
              "# llama-cpp-python: build the wheel of the patched llama.cpp, pip install it, then",
              "vq-gguf wheel",
              f"python -c 'from llama_cpp import Llama; print(Llama(\"{file}\", flash_attn=True).create_chat_completion("
              "[{\"role\": \"user\", \"content\": \"Hi\"}]))'",
              "```"]
    if bundle:
        lib = manifest["library"]
        lines += ["", "## C API (this folder)", "",
                  f"`lib/` holds the patched shared libraries ({lib['platform']}; {lib['cpu flags']}), `include/` "
                  "`llama.h` and the ggml headers, `example/generate.c` a greedy chat through the C API. "
                  f"Built from llama.cpp {lib['llama.cpp commit'][:10]} with the vq-gguf patch (sha256 "
                  f"{lib['patch sha256'][:16]}..., vq-gguf commit {str(lib['vq-gguf git commit'])[:10]}).", "",
                  "```bash",
                  shlex.join(EXAMPLE_CC),
                  f"./generate {file} \"What is the capital of France?\" 64",
                  "vq-gguf verify .                # every file against manifest.json",
                  "```"]
    return "\n".join(lines) + "\n"
