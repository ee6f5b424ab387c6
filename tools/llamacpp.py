"""llama.cpp's own tools, as the comparison runs them, and the figures read back from their output.

Every tool writes its whole output (stdout and stderr) to a log file. A tool that exits non-zero raises
`ToolError` carrying the command and the end of the tool's own output, so the user sees llama.cpp's error,
not ours. Long tools (imatrix, perplexity) report their progress chunk by chunk, read from their output.
"""
from __future__ import annotations

import codecs
import json
import math
import re
import shlex
import subprocess
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from vq_gguf.runtime.llama import lib_dir

TAIL_LINES = 40
NUM = r"([-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|-?inf))"  # %lf prints nan / inf for a ruined model


class ToolError(RuntimeError):
    """A llama.cpp tool failed; the message carries its command and the end of its own output."""


def tool(name: str) -> Path:
    path = lib_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: build the patched llama.cpp first (vq-gguf build)")
    return path


class ChunkProgress:
    """A progress bar fed with a tool's output: the highest chunk number that `pattern` finds so far."""

    def __init__(self, pattern: str, total: int, desc: str):
        self.pattern = re.compile(pattern, re.MULTILINE)
        self.bar = tqdm(total=total, desc=desc, unit="chunk", dynamic_ncols=True, leave=False)
        self.pending = ""

    def feed(self, text: str) -> None:
        self.pending += text
        lines = self.pending.split("\n")
        self.pending = lines.pop()  # a line still being written can hold half a number
        for line in lines:
            for m in self.pattern.finditer(line):
                self.bar.update(max(0, min(int(m.group(1)), self.bar.total) - self.bar.n))

    def close(self) -> None:
        self.bar.close()


def _fail(cmd: list[str], what: str, output: str, log: Path, name: str | None = None) -> ToolError:
    tail = "\n".join("    " + line for line in output.rstrip().splitlines()[-TAIL_LINES:])
    return ToolError(f"{name or Path(cmd[0]).name} {what}\n  command: {shlex.join(cmd)}\n"
                     f"  its last output:\n{tail}\n  full log: {log}")


def figures(parse: Callable[[str], dict], cmd: list[str], output: str, log: Path) -> dict:
    """parse(output), or a ToolError showing the tool's own output: some tools report an error (a text too
    short for the context, say) and still exit with status 0."""
    try:
        return parse(output)
    except ValueError as e:
        raise _fail(cmd, f"gave no figures: {e}", output, log) from None


def run(cmd: list[str], log: Path, *, watch: Callable[[str], None] | None = None, name: str | None = None) -> str:
    """Run a tool (called `name` in an error, default its file name), its stdout and stderr together into
    `log` (and `watch`, as they come); return the output."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = []
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a read can end inside a "±"
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            while chunk := proc.stdout.read1(1 << 16):
                text = decoder.decode(chunk)
                out.append(text)
                f.write(text)
                if watch:
                    watch(text)
        except BaseException:  # interrupted: do not leave the tool running
            proc.kill()
            raise
        finally:
            rc = proc.wait()
    output = "".join(out)
    if rc != 0:
        raise _fail(cmd, f"exited with status {rc}", output, log, name)
    return output


def run_with_progress(cmd: list[str], log: Path, pattern: str, chunks: int, desc: str) -> str:
    bar = ChunkProgress(pattern, chunks, desc)
    try:
        return run(cmd, log, watch=bar.feed)
    finally:
        bar.close()


# --- llama-quantize ------------------------------------------------------------------------------------

def quant_types() -> list[str]:
    """The file types this build's llama-quantize accepts (from its help), to refuse a typo before any long step."""
    help_text = subprocess.run([str(tool("llama-quantize")), "--help"], capture_output=True, text=True).stdout
    return re.findall(r"^\s*\d+\s+or\s+(\S+)\s*:", help_text, re.MULTILINE)


def quantize_cmd(src: Path, out: Path, ftype: str, *, imatrix: Path, common_type: str, threads: int,
                 type_file: Path | None) -> list[str]:
    """llama-quantize with the importance matrix, the common type on token embedding and output head, and
    (in --only mode) a file that pins every tensor outside the selection to the common type."""
    cmd = [str(tool("llama-quantize")), "--imatrix", str(imatrix),
           "--token-embedding-type", common_type, "--output-tensor-type", common_type]
    if type_file:
        cmd += ["--tensor-type-file", str(type_file)]
    return cmd + [str(src), str(out), ftype, str(threads)]


def pin_types(names: list[str], ggml_type: str) -> str:
    """--tensor-type-file text: each named tensor (an anchored regex: llama.cpp searches, not matches) to one type."""
    return "".join(f"^{re.escape(n)}$={ggml_type}\n" for n in names)


def quantize_fallbacks(output: str) -> dict[str, dict[str, str]]:
    """Tensors whose row length did not fit the wanted type, as llama-quantize reports them: {name: {wanted, got}}."""
    pat = re.compile(r"warning: (\S+)\s+- ncols\s+\d+ not divisible by\s+\d+ \(required for type\s+(\S+)\)"
                     r" -> falling back to\s+(\S+)")
    return {m.group(1): {"wanted": m.group(2), "got": m.group(3)} for m in pat.finditer(output)}


# --- llama-imatrix -------------------------------------------------------------------------------------

def parse_imatrix(output: str) -> dict[str, int]:
    return {"chunks": chunks_used(output)}


def imatrix_cmd(model: Path, text: Path, out: Path, *, ctx: int, chunks: int, threads: int) -> list[str]:
    return [str(tool("llama-imatrix")), "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
            "-t", str(threads), "-o", str(out)]


# --- llama-perplexity ----------------------------------------------------------------------------------

PPL_PROGRESS = r"\[(\d+)\]"                      # [1]12.8463,[2]21.6836, (plain perplexity, imatrix)
KLD_PROGRESS = r"^\s*(\d+)\s+\S+\s+±"            # one table row per chunk with --kl-divergence


def perplexity_cmd(model: Path, text: Path, *, ctx: int, chunks: int, threads: int, base: Path,
                   kld: bool) -> list[str]:
    """Without `kld`: save the logits of `model` (the float reference) to `base`; with it: score `model`
    against them (perplexity, KL-divergence, top-token agreement on the same chunks)."""
    cmd = [str(tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
           "-t", str(threads), "--kl-divergence-base", str(base)]
    return cmd + ["--kl-divergence"] if kld else cmd


def _find(pattern: str, text: str, what: str) -> re.Match:
    m = re.search(pattern, text, re.MULTILINE)
    if m is None:
        raise ValueError(f"its output has no {what}")
    return m


def chunks_used(output: str) -> int:
    """How many chunks the tool really evaluated (fewer than asked when the text is short)."""
    return int(_find(r"(?:calculating perplexity|computing) over (\d+) chunks", output, "chunk count").group(1))


def parse_kld(output: str) -> dict[str, float]:
    """The figures of a --kl-divergence run; `same_top` is in percent."""
    fig = {}
    m = _find(rf"^Mean PPL\(Q\)\s*:\s*{NUM}\s*±\s*{NUM}", output, "Mean PPL(Q)")
    fig["ppl"], fig["ppl_err"] = float(m.group(1)), float(m.group(2))
    fig["ppl_base"] = float(_find(rf"^Mean PPL\(base\)\s*:\s*{NUM}", output, "Mean PPL(base)").group(1))
    m = _find(rf"^Mean\s+KLD:\s*{NUM}\s*±\s*{NUM}", output, "Mean KLD")
    fig["kld_mean"], fig["kld_mean_err"] = float(m.group(1)), float(m.group(2))
    fig["kld_p99"] = float(_find(rf"^99\.0%\s+KLD:\s*{NUM}", output, "99.0% KLD").group(1))
    fig["kld_median"] = float(_find(rf"^Median\s+KLD:\s*{NUM}", output, "Median KLD").group(1))
    fig["kld_max"] = float(_find(rf"^Maximum KLD:\s*{NUM}", output, "Maximum KLD").group(1))
    m = _find(rf"^Same top p:\s*{NUM}\s*±\s*{NUM}\s*%", output, "Same top p")
    fig["same_top"], fig["same_top_err"] = float(m.group(1)), float(m.group(2))
    fig["chunks"] = chunks_used(output)
    return fig


def parse_ppl(output: str) -> dict[str, float]:
    m = _find(rf"Final estimate: PPL = {NUM} \+/- {NUM}", output, "final perplexity estimate")
    return {"ppl": float(m.group(1)), "ppl_err": float(m.group(2)), "chunks": chunks_used(output)}


# --- llama-bench ---------------------------------------------------------------------------------------

def bench_cmd(model: Path, *, threads: int, prompt: int, gen: int, reps: int) -> list[str]:
    return [str(tool("llama-bench")), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
            "-r", str(reps), "-o", "json"]


def run_bench(cmd: list[str], log: Path) -> dict:
    """llama-bench prints its JSON on stdout and its log on stderr: keep them apart, the log into `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
    if proc.returncode != 0:
        raise _fail(cmd, f"exited with status {proc.returncode}", log.read_text(errors="replace"), log)
    return figures(parse_bench, cmd, proc.stdout, log)


def parse_bench(stdout: str) -> dict:
    """{"pp": {...}, "tg": {...}}: tokens per second, mean and standard deviation over the repetitions."""
    result = {}
    for test in json.loads(stdout):
        kind, tokens = ("pp", test["n_prompt"]) if test["n_prompt"] else ("tg", test["n_gen"])
        sd = test["stddev_ts"] if len(test["samples_ts"]) > 1 else math.nan  # one sample has no spread
        result[kind] = {"tokens": tokens, "mean": test["avg_ts"], "sd": sd, "samples": test["samples_ts"]}
        result["build_commit"], result["cpu_info"] = test["build_commit"], test["cpu_info"]
    return result
