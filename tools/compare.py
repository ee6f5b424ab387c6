"""`vq-gguf compare`: VQ presets against llama.cpp's k-quants and i-quants on one model, one table, two plots.

    vq-gguf compare                                     # the default model, every default type and preset
    vq-gguf compare --chunks 8 --llama-types Q4_K_M IQ2_XXS --presets 2bit --only ffn_down

Steps, each saved as soon as it is done (steps.json; a rerun after an interruption resumes):
1. the float reference GGUF (F16, or F32 where a weight overflows F16) with the metadata the VQ files get;
   every quantized file, ours included, starts from it;
2. our VQ files, one per preset, by `vq-gguf quantize` (which reuses a file whose inputs have not changed),
   and the files given by --files (fine-tuned ones, say), checked to hold the float reference's tensors;
3. an importance matrix by `llama-imatrix` on the calibration text, then llama.cpp's files by `llama-quantize`,
   all with the same common type on token embedding and output head (with --only: on every other tensor);
4. the float model's logits on the evaluation text, then for every file `llama-perplexity --kl-divergence`
   (perplexity, KL-divergence, top-token agreement, on the same chunks) and `llama-bench`;
5. results.json, results.md (table) and quality.png / speed.png, and on request the README's results section.

llama.cpp falls back to other types where a row length does not fit a type's block (its 2-bit types need
multiples of 256): every file's figures are counted from the file itself, and its types are what it holds.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from pathlib import Path

from gguf import GGUFReader

from vq_gguf import bpw, ggml_vq, gguf_writer, source
from vq_gguf.atomic import replacing, sha256
from vq_gguf.calib import DEFAULT_CALIB, EVAL_TEXT, check_sources
from vq_gguf.names import is_linear, is_side
from vq_gguf.native.build import bin_dir, tree_dir
from vq_gguf.paths import checkout, home
from vq_gguf.runtime.llama import thread_count

from . import environment, llamacpp, report
from .steps import Steps, digest, identity, write_json

DEFAULT_LLAMA_TYPES = ["Q2_K", "Q3_K_S", "Q4_K_M", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"]
DEFAULT_PRESETS = ["2bit", "3bit", "4bit"]
COMMON_TYPES = ("q8_0", "f16", "f32")  # types both llama-quantize and vq-gguf quantize can give the other tensors
F16_MAX = 65504.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--calib", nargs="+", type=Path, default=[DEFAULT_CALIB / "austen-prideprejudice.txt"],
                   help="calibration text file(s) for the importance matrix (default: Pride and Prejudice)")
    p.add_argument("--eval", dest="eval_text", type=Path, default=EVAL_TEXT,
                   help="evaluation text (default: WikiText-2 test); never one of the calibration texts")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: $VQ_GGUF_HOME/compare/<model>); an --only run reports in a subfolder of it")
    p.add_argument("--llama-types", nargs="*", default=DEFAULT_LLAMA_TYPES, metavar="TYPE",
                   help=f"llama-quantize file types (default: {' '.join(DEFAULT_LLAMA_TYPES)})")
    p.add_argument("--presets", "--preset", nargs="*", default=DEFAULT_PRESETS, metavar="PRESET",
                   help=f"vq-gguf quantize presets, any name it accepts (default: {' '.join(DEFAULT_PRESETS)})")
    p.add_argument("--files", nargs="+", default=[], metavar="LABEL=PATH", type=_labelled,
                   help="files made elsewhere (fine-tuned, other settings) measured beside the others; they must "
                        "hold the same tensors as the float reference")
    p.add_argument("--only", nargs="+", default=None, metavar="TENSOR",
                   help="quantize only the block linears whose name contains one of these (e.g. ffn_down) in every "
                        "file; the rest stays in --common-type")
    p.add_argument("--common-type", choices=COMMON_TYPES, default="q8_0",
                   help="token embedding and output head of every file (and the unselected tensors with --only)")
    p.add_argument("--quantize-args", default="", metavar="ARGS",
                   help='extra flags for every `vq-gguf quantize`, one string (e.g. "--k-res 16")')
    p.add_argument("--ctx", type=int, default=512, help="context of perplexity and importance matrix (default 512)")
    p.add_argument("--chunks", type=int, default=150, help="evaluation chunks, the same for every file (default 150)")
    p.add_argument("--imatrix-chunks", type=int, default=100, help="calibration chunks for llama-imatrix (default 100)")
    p.add_argument("--threads", type=thread_count, default=os.cpu_count(), help="threads of every llama.cpp tool")
    p.add_argument("--bench-prompt", type=int, default=512, help="llama-bench prompt tokens (pp, default 512)")
    p.add_argument("--bench-gen", type=int, default=128, help="llama-bench generated tokens (tg, default 128)")
    p.add_argument("--bench-reps", type=int, default=3, help="llama-bench repetitions (default 3)")
    p.add_argument("--readme", type=Path, default=None,
                   help="also put the table and plots between the results markers of this README")


# --- settings ------------------------------------------------------------------------------------------

def _labelled(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=PATH")
    return label, path


def model_name(model: str) -> str:
    if model == "default":
        from vq_gguf.default_model import NAME
        return NAME
    path = Path(model)
    return path.name if path.is_dir() else path.name.removesuffix(".gguf")


def _slug(words: list[str]) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(words))


def _shown(path: Path) -> str:
    """A path as the reproduction command shows it: relative to the checkout when it is beside it."""
    path = Path(path).resolve()
    root = checkout()
    return os.path.relpath(path, root) if root and path.is_relative_to(root.parent) else str(path)


def settings(args: argparse.Namespace) -> dict:
    """Every option, resolved; what results.json records and every step is keyed by."""
    out = Path(args.out or home() / "compare" / model_name(args.model)).resolve()
    suffix = f".only-{_slug(args.only)}" if args.only else ""
    return {
        "model": args.model, "calib": [str(Path(c).resolve()) for c in args.calib],
        "eval": str(Path(args.eval_text).resolve()), "out": str(out), "out_given": args.out is not None,
        "report_dir": str(out / suffix[1:] if suffix else out), "suffix": suffix, "llama_types": list(args.llama_types), "presets": list(args.presets), "only": args.only,
        "files": [[label, str(Path(path).resolve())] for label, path in args.files],
        "common_type": args.common_type, "quantize_args": args.quantize_args, "ctx": args.ctx, "chunks": args.chunks,
        "imatrix_chunks": args.imatrix_chunks, "threads": args.threads, "bench_prompt": args.bench_prompt,
        "bench_gen": args.bench_gen, "bench_reps": args.bench_reps,
    }


def command_line(s: dict) -> str:
    """The command that reproduces this run, every option explicit (except an output folder left at default)."""
    parts = ["vq-gguf", "compare", "--model", s["model"] if s["model"] == "default" else _shown(s["model"]),
             "--calib", *map(_shown, s["calib"]), "--eval", _shown(s["eval"])]
    parts += ["--out", _shown(s["out"])] if s["out_given"] else []
    parts += ["--llama-types", *s["llama_types"], "--presets", *s["presets"]]
    parts += ["--files", *(f"{label}={_shown(path)}" for label, path in s["files"])] if s["files"] else []
    parts += ["--only", *s["only"]] if s["only"] else []
    parts += ["--common-type", s["common_type"], "--ctx", str(s["ctx"]), "--chunks", str(s["chunks"]),
              "--imatrix-chunks", str(s["imatrix_chunks"]), "--threads", str(s["threads"]),
              "--bench-prompt", str(s["bench_prompt"]), "--bench-gen", str(s["bench_gen"]),
              "--bench-reps", str(s["bench_reps"])]
    parts += ["--quantize-args", s["quantize_args"]] if s["quantize_args"] else []
    return shlex.join(parts)


def check_inputs(s: dict, model_path: Path) -> None:
    """Refuse what would fail late: missing files, unknown llama.cpp types, evaluation text among the calibration."""
    labels = [label for label, _ in s["files"]]
    if len(set(labels)) < len(labels):
        raise ValueError(f"--files: labels must differ, got {' '.join(labels)}")
    check_sources(s["calib"])
    check_sources([s["eval"]], "evaluation text")
    for path in [model_path, *(Path(p) for _, p in s["files"])]:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
    eval_hash = sha256(Path(s["eval"]))
    if any(sha256(Path(c)) == eval_hash for c in s["calib"]):
        raise ValueError(f"the evaluation text {s['eval']} is also a calibration text: the figures would not be honest")
    known = {t.upper() for t in llamacpp.quant_types()}
    unknown = [t for t in s["llama_types"] if t.upper() not in known]
    if unknown:
        raise ValueError(f"llama-quantize does not know {', '.join(unknown)}; it accepts {', '.join(sorted(known))}")
    for name in ("llama-imatrix", "llama-perplexity", "llama-bench"):
        llamacpp.tool(name)


def plan(s: dict) -> list[tuple[str, str]]:
    """(step name, kind) of every step, in order: for the step count and the ETA."""
    files = (["float reference"] + [llama_file(s, t).name for t in s["llama_types"]] + [vq_file(s, p).name for p in s["presets"]]
             + [Path(p).name for _, p in s["files"]])
    return ([("float reference", "float")] + [(f"quantize {vq_file(s, p).name}", "vq") for p in s["presets"]]
            + [("imatrix", "imatrix")] * bool(s["llama_types"])
            + [(f"quantize {llama_file(s, t).name}", "llama-quantize") for t in s["llama_types"]]
            + [("float logits", "logits")] + [(f"evaluate {f}", "evaluate") for f in files]
            + [(f"bench {f}", "bench") for f in files])


def llama_file(s: dict, ftype: str) -> Path:
    return Path(s["out"]) / f"llama-{ftype.upper()}{s['suffix']}.gguf"


def vq_file(s: dict, preset: str) -> Path:
    return Path(s["out"]) / f"vq-{_slug([preset])}{s['suffix']}.gguf"


def log_file(s: dict, step: str) -> Path:
    return Path(s["out"]) / "logs" / f"{re.sub(r'[^A-Za-z0-9_.+-]+', '_', step)}.log"


def is_selected(s: dict, name: str) -> bool:
    """A block linear that every file quantizes: all of them, or those --only names (as vq-gguf quantize reads it)."""
    return is_linear(name) and (not s["only"] or any(o in name for o in s["only"]))


# --- making the files ----------------------------------------------------------------------------------

def make_float(s: dict, model_path: Path, out: Path) -> dict:
    """The float reference: F16 keeps the weights of a float16/bfloat16/quantized model, F32 only when a
    weight would overflow F16."""
    model = source.load(model_path, llama_tree=tree_dir(), cache_dir=home() / "hf-gguf")
    overflow = any(float(abs(v).max()) > F16_MAX for v in model.tensors.values() if v.ndim >= 2)
    float_type = "f32" if overflow else "f16"
    gguf_writer.write(out, model, other_type=float_type)
    return {"float_type": float_type, "arch": model.arch}


def make_vq(s: dict, float_path: Path, preset: str, out: Path, log: Path) -> dict:
    """`vq-gguf quantize`, as a user runs it, with its own progress shown; it reuses an up-to-date file."""
    cmd = [sys.executable, "-m", "vq_gguf.cli", "quantize", "--model", str(float_path), "--preset", preset,
           "--out", str(out), "--other-type", s["common_type"]]
    cmd += ["--only", *s["only"]] if s["only"] else []
    cmd += shlex.split(s["quantize_args"])
    llamacpp.run(cmd, log, watch=sys.stderr.write, name="vq-gguf quantize")
    field = GGUFReader(out).get_field(ggml_vq.PRESET_KEY)
    return {"command": shlex.join(cmd), "preset_in_file": field.contents() if field else preset}


def given_file(float_path: Path, label: str, path: Path) -> tuple[str, dict]:
    """A file made elsewhere, checked to be a quantization of the same float reference (same tensors, same
    shapes): its kind ("vq" if it holds VQ tensors) and what results.json says of its making."""
    def shapes(reader: GGUFReader) -> dict[str, tuple]:
        return {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors
                if not is_side(t.name)}
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"--files {label}={path}: not a readable GGUF file ({e})") from e
    given, want = shapes(reader), shapes(GGUFReader(float_path))
    differ = sorted(set(given) ^ set(want)) or sorted(n for n, sh in want.items() if given[n] != sh)
    if differ:
        raise ValueError(f"--files {label}={path}: not a file of this model ({len(differ)} tensors differ, e.g. {differ[0]})")
    kind = "vq" if any(ggml_vq.is_vq(t.tensor_type) for t in reader.tensors) else "llama.cpp"
    field = reader.get_field(ggml_vq.FINETUNE_KEY)
    return kind, {"given": str(path), **({"finetune": field.contents()} if field else {})}


def calibration_text(s: dict) -> Path:
    """llama-imatrix reads one file: several calibration texts are joined into one in the output folder."""
    if len(s["calib"]) == 1:
        return Path(s["calib"][0])
    joined = "\n\n".join(Path(c).read_text() for c in s["calib"])
    path = Path(s["out"]) / "calib.txt"
    if not path.exists() or path.read_text() != joined:
        path.write_text(joined)
    return path


def make_imatrix(s: dict, float_path: Path, out: Path, log: Path) -> dict:
    with replacing(out, ".gguf") as tmp:
        cmd = llamacpp.imatrix_cmd(float_path, calibration_text(s), tmp, ctx=s["ctx"], chunks=s["imatrix_chunks"],
                                   threads=s["threads"])
        output = llamacpp.run_with_progress(cmd, log, llamacpp.PPL_PROGRESS, s["imatrix_chunks"], "imatrix")
    return {"command": shlex.join(cmd), **llamacpp.figures(llamacpp.parse_imatrix, cmd, output, log)}


def make_llama(s: dict, float_path: Path, imatrix: Path, ftype: str, out: Path, log: Path) -> dict:
    type_file = None
    if s["only"]:
        names = [t.name for t in GGUFReader(float_path).tensors if is_linear(t.name) and not is_selected(s, t.name)]
        type_file = out.with_name(out.stem + ".types.txt")
        type_file.write_text(llamacpp.pin_types(names, s["common_type"]))
    with replacing(out, ".gguf") as tmp:
        cmd = llamacpp.quantize_cmd(float_path, tmp, ftype.upper(), imatrix=imatrix, common_type=s["common_type"],
                                    threads=s["threads"], type_file=type_file)
        output = llamacpp.run(cmd, log)
    return {"command": shlex.join(cmd), "fallbacks": llamacpp.quantize_fallbacks(output)}


def entry(s: dict, label: str, kind: str, path: Path, made: dict) -> dict:
    """A file's row of results.json, its size figures counted from the file: over the whole file, the block
    linears, and the quantized ones (all block linears, or the --only ones)."""
    counted = bpw.count(path)
    chosen = [t for t in counted.linears() if is_selected(s, t.name)]
    n = sum(t.elements for t in chosen)
    types: dict[str, int] = {}
    for t in chosen:
        types[t.type] = types.get(t.type, 0) + t.elements
    fell = made.get("fallbacks", {})
    return {
        "label": label, "kind": kind, "path": str(path), "made": made,
        "bits": {"bytes": counted.file_bytes, "params": counted.params, "file_bpw": counted.file_bpw,
                 "linear_bpw": counted.linear_bpw, "linear_types": counted.linear_types(),
                 "selected_params": n, "selected_bpw": 8 * sum(t.bytes for t in chosen) / n,
                 "selected_types": {k: v / n for k, v in sorted(types.items(), key=lambda kv: -kv[1])},
                 "tensor_types": {t.name: t.type for t in counted.tensors}},
        "fallback_share": sum(t.elements for t in chosen if t.name in fell) / n,
        "quality": None, "speed": None,
    }


# --- measuring -----------------------------------------------------------------------------------------

def evaluate(s: dict, path: Path, base: Path, log: Path) -> dict:
    cmd = llamacpp.perplexity_cmd(path, Path(s["eval"]), ctx=s["ctx"], chunks=s["chunks"], threads=s["threads"],
                                  base=base, kld=True)
    output = llamacpp.run_with_progress(cmd, log, llamacpp.KLD_PROGRESS, s["chunks"], f"evaluate {path.name}")
    return {**llamacpp.figures(llamacpp.parse_kld, cmd, output, log), "command": shlex.join(cmd)}


def reference_logits(s: dict, float_path: Path, out: Path, log: Path) -> dict:
    with replacing(out) as tmp:
        cmd = llamacpp.perplexity_cmd(float_path, Path(s["eval"]), ctx=s["ctx"], chunks=s["chunks"], threads=s["threads"],
                                      base=tmp, kld=False)
        output = llamacpp.run_with_progress(cmd, log, llamacpp.PPL_PROGRESS, s["chunks"], "float logits")
    return {**llamacpp.figures(llamacpp.parse_ppl, cmd, output, log), "command": shlex.join(cmd)}


def bench(s: dict, path: Path, log: Path) -> dict:
    cmd = llamacpp.bench_cmd(path, threads=s["threads"], prompt=s["bench_prompt"], gen=s["bench_gen"],
                             reps=s["bench_reps"])
    return {**llamacpp.run_bench(cmd, log), "command": shlex.join(cmd),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


# --- the run -------------------------------------------------------------------------------------------

KIND_ORDER = {"float": 0, "llama.cpp": 1, "vq": 2}  # the table's order: reference, llama.cpp's, ours


def float_file(s: dict, model_path: Path) -> Path:
    """The float reference, named after its source's identity, so that a reference made from another source
    never stands under the name of this one (the files made from it are keyed by its contents)."""
    return Path(s["out"]) / f"float-{digest(identity(model_path))[:12]}.gguf"


def check_selection(s: dict, float_path: Path) -> None:
    if not any(is_selected(s, t.name) for t in GGUFReader(float_path).tensors):
        raise ValueError(f"--only {' '.join(s['only'])} matches no block linear of the model")


def add_file(results: dict, row: dict) -> None:
    results["files"].append(row)
    results["files"].sort(key=lambda f: KIND_ORDER[f["kind"]])


def make_files(s: dict, model_path: Path, steps: Steps, results: dict) -> Path:
    """Steps 1-3: the float reference, our VQ files, the importance matrix and llama.cpp's files."""
    out = Path(s["out"])
    float_path = float_file(s, model_path)
    made = steps.run("float reference", "float", {"source": identity(model_path)},
                     lambda: make_float(s, model_path, float_path), output=float_path)
    for stale in out.glob("float-*.gguf"):
        if stale != float_path:
            stale.unlink()
    results["model"].update(made)
    check_selection(s, float_path)
    add_file(results, entry(s, made["float_type"].upper(), "float", float_path, made))

    for preset in s["presets"]:
        path, name = vq_file(s, preset), f"quantize {vq_file(s, preset).name}"
        made = steps.run(name, "vq", None, lambda: make_vq(s, float_path, preset, path, log_file(s, name)), output=path)
        add_file(results, entry(s, f"VQ {made['preset_in_file']}", "vq", path, made))
    for label, path in s["files"]:
        kind, made = given_file(float_path, label, Path(path))
        add_file(results, entry(s, label, kind, Path(path), made))

    if not s["llama_types"]:
        return float_path
    imatrix = out / "imatrix.gguf"
    key = {"float": identity(float_path), "calib": [sha256(Path(c)) for c in s["calib"]], "ctx": s["ctx"],
           "chunks": s["imatrix_chunks"]}
    results["imatrix"] = steps.run("imatrix", "imatrix", key,
                                   lambda: make_imatrix(s, float_path, imatrix, log_file(s, "imatrix")), output=imatrix)

    for ftype in s["llama_types"]:
        path, name = llama_file(s, ftype), f"quantize {llama_file(s, ftype).name}"
        key = {"float": identity(float_path), "imatrix": identity(imatrix), "type": ftype.upper(),
               "common_type": s["common_type"], "only": s["only"]}
        made = steps.run(name, "llama-quantize", key,
                         lambda: make_llama(s, float_path, imatrix, ftype, path, log_file(s, name)), output=path)
        add_file(results, entry(s, ftype.upper(), "llama.cpp", path, made))
    return float_path


def measure(s: dict, float_path: Path, steps: Steps, results: dict) -> None:
    """Step 4: quality of every file against the float logits, then speed (all speed runs close together,
    so that they share the machine's conditions)."""
    base = Path(s["out"]) / "float-logits.kld"
    build = identity(bin_dir())   # a rebuilt llama.cpp (new kernels) measures every file again
    key = {"float": identity(float_path), "eval": sha256(Path(s["eval"])), "ctx": s["ctx"], "chunks": s["chunks"]}
    results["reference_logits"] = steps.run("float logits", "logits", key,
                                            lambda: reference_logits(s, float_path, base, log_file(s, "float logits")),
                                            output=base)
    names = {f["path"]: ("float reference" if f["kind"] == "float" else Path(f["path"]).name) for f in results["files"]}
    for f in results["files"]:
        path, name = Path(f["path"]), f"evaluate {names[f['path']]}"
        f["quality"] = steps.run(name, "evaluate", {"file": identity(path), "base": identity(base), "build": build},
                                 lambda: evaluate(s, path, base, log_file(s, name)))
    results["chunks_evaluated"] = results["files"][0]["quality"]["chunks"]
    for f in results["files"]:
        path, name = Path(f["path"]), f"bench {names[f['path']]}"
        key = {"file": identity(path), "build": build, **{k: s[k] for k in ("threads", "bench_prompt", "bench_gen", "bench_reps")}}
        f["speed"] = steps.run(name, "bench", key, lambda: bench(s, path, log_file(s, name)))


def write_reports(results: dict, folder: Path) -> None:
    write_json(folder / "results.json", results)
    report.plots(results, folder)
    (folder / "results.md").write_text(report.markdown(results))


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z")


def run(args: argparse.Namespace) -> None:
    from vq_gguf.default_model import resolve

    s = settings(args)
    model_path = resolve(args.model)
    check_inputs(s, model_path)
    report_dir = Path(s["report_dir"])
    report_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "schema": 1, "command": command_line(s), "started": _now(), "finished": None, "error": None,
        "run_name": model_name(args.model) + s["suffix"], "settings": s,
        "model": {"name": model_name(args.model), "source": str(model_path)},
        "versions": environment.versions(), "machine": environment.machine(), "files": [],
    }
    steps = Steps(Path(s["out"]) / "steps.json", plan(s))
    print(f"[compare] {len(steps.plan)} steps, output in {s['out']}", flush=True)
    try:
        float_path = make_files(s, model_path, steps, results)
        measure(s, float_path, steps, results)
    except BaseException as e:
        results["error"] = f"{type(e).__name__}: {e}"
        write_reports(results, report_dir)
        print(f"[compare] stopped; what was measured is in {report_dir}/results.json, a rerun resumes", file=sys.stderr)
        raise
    results["finished"] = _now()
    write_reports(results, report_dir)
    if args.readme:
        report.update_readme(args.readme, results, report_dir)
    print(f"\n{report.table(results)}\n\n{report_dir}: results.json, results.md, "
          f"{', '.join(report.PLOTS.values())}", flush=True)
