"""The comparison's report, made only from results.json: the Markdown table, the plots, the README section.

Nothing here measures anything, so a report can be redrawn from an old results.json, and no figure in the
README is ever typed by hand.
"""
from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from .environment import describe  # noqa: E402

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
PLOTS = {"quality": "quality.png", "speed": "speed.png"}
COLORS = {"float": "0.35", "llama.cpp": "tab:blue", "vq": "tab:red"}


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _sig(x, digits: int = 4) -> str:
    """A figure with about `digits` significant digits; in exponent form outside 1e-3..1e5 (a ruined model's
    perplexity runs into the millions, the float model's KL-divergence to itself is about 1e-6)."""
    if not _ok(x):
        return "—" if x is None else str(x)
    if x == 0:
        return "0"
    if abs(x) >= 1e5 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{max(0, digits - 1 - math.floor(math.log10(abs(x))))}f}"


def _pm(value, err, digits: int = 4) -> str:
    """value ± err, the error with as many decimals as the value."""
    text = _sig(value, digits)
    if not (_ok(value) and _ok(err)):
        return text
    if "e" in text:
        return f"{text} ± {err:.2e}"
    decimals = len(text.split(".")[1]) if "." in text else 0
    return f"{text} ± {err:.{decimals}f}"


def _speed(s: dict | None) -> str:
    return _pm(s["mean"], s["sd"], 3) if s else "—"


def _shares(types: dict[str, float]) -> str:
    """"q5_0 .74, q6_k .12, ...": each type's share of the parameters, three decimals below 1 %."""
    if len(types) == 1:
        return next(iter(types))
    return ", ".join(f"{t} {share:.{2 if share >= 0.01 else 3}f}".replace(" 0.", " .") for t, share in types.items())


def x_bpw(f: dict) -> float:
    """The bits per weight a file is plotted at: over the quantized tensors (all block linears, or the --only ones)."""
    return f["bits"]["selected_bpw"]


def label(f: dict) -> str:
    """The file's name; in quotes when llama.cpp gave some of the quantized tensors another type than asked."""
    return f'"{f["label"]}"' if f.get("fallback_share") else f["label"]


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: at most as many bits and at most the same error, one of
    them strictly less. Points with a missing or infinite figure take no part."""
    valid = [i for i, (x, y) in enumerate(points) if _ok(x) and _ok(y)]
    front = []
    for i in valid:
        xi, yi = points[i]
        if not any(points[j][0] <= xi and points[j][1] <= yi and points[j] != points[i] for j in valid):
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


# --- Markdown ------------------------------------------------------------------------------------------

def table(results: dict) -> str:
    s = results["settings"]
    sel = "+".join(s["only"]) if s["only"] else None
    bench = f"pp{s['bench_prompt']}", f"tg{s['bench_gen']}"
    head = ["file", f"bpw {sel}" if sel else "bpw block linears"]
    head += ["bpw block linears"] if sel else []
    head += [f"types in {sel} (share of params)" if sel else "types in the block linears (share of params)",
             "file MB", "bpw file", "PPL", "mean KLD", "KLD p99", "same top %", f"{bench[0]} t/s", f"{bench[1]} t/s"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for f in results["files"]:
        b, q, sp = f["bits"], f.get("quality") or {}, f.get("speed") or {}
        cells = [label(f), f"{b['selected_bpw']:.3f}"] + ([f"{b['linear_bpw']:.3f}"] if sel else [])
        cells += [_shares(b["selected_types"]), f"{b['bytes'] / 1e6:.1f}", f"{b['file_bpw']:.3f}",
                  _pm(q.get("ppl"), q.get("ppl_err")), _sig(q.get("kld_mean"), 3), _sig(q.get("kld_p99"), 3),
                  _pm(q.get("same_top"), q.get("same_top_err"), 3), _speed(sp.get("pp")), _speed(sp.get("tg"))]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def notes(results: dict) -> str:
    s, v, m = results["settings"], results["versions"], results["machine"]
    quant = (f"only the tensors named {', '.join(s['only'])} are quantized in every file, every other tensor is "
             f"{s['common_type']}" if s["only"] else f"token embedding and output head {s['common_type']} in every file")
    calib = ", ".join(Path(c).name for c in s["calib"])
    lines = [
        f"Model {results['model']['name']}; {quant}. Bits per weight are counted from each file, codebooks and "
        "other side tensors included; \"types\" are what the file really holds.",
        f"Quality: `llama-perplexity -c {s['ctx']}` on {Path(s['eval']).name}, {results.get('chunks_evaluated') or s['chunks']} chunks, "
        f"the same for every file; KL-divergence and top-token agreement against the {results['model'].get('float_type', 'float').upper()} "
        f"file's logits. llama.cpp files use an importance matrix from `llama-imatrix` on {calib} "
        f"({s['imatrix_chunks']} chunks of {s['ctx']}).",
        f"Speed: `llama-bench -t {s['threads']} -p {s['bench_prompt']} -n {s['bench_gen']} -r {s['bench_reps']}`, "
        "tokens per second, mean ± standard deviation over the repetitions.",
        f"Machine: {describe(m)}; load average at start "
        f"{', '.join(f'{x:.1f}' for x in m['load average at start (1, 5, 15 min)'])}"
        f"{_bench_load(results)}.",
        f"Versions: vq-gguf {v['vq-gguf']} (commit {str(v['vq-gguf git commit'])[:10]}"
        f"{', with uncommitted changes' if v['vq-gguf uncommitted changes'] else ''}), llama.cpp {v['llama.cpp commit'][:10]}.",
    ]
    if any(f.get("fallback_share") for f in results["files"]):
        lines.insert(1, "A name in quotes: llama.cpp's row-length rules made it store some of these tensors in "
                        "another type than the one named (`fallbacks` in results.json); the types column shows what it holds.")
    if s["quantize_args"]:
        lines.insert(1, f"VQ files made with `vq-gguf quantize ... {s['quantize_args']}`.")
    return "\n".join(f"- {line}" for line in lines)


def _bench_load(results: dict) -> str:
    """The machine's load while the speed was measured: other work on a small machine slows llama-bench down."""
    loads = [f["speed"]["load_average"][0] for f in results["files"] if f.get("speed")]
    return f", during the speed runs {min(loads):.1f} to {max(loads):.1f}" if loads else ""


def markdown(results: dict, image_prefix: str = "") -> str:
    """The results section: table, notes, plots, and the command that produced it."""
    parts = [table(results), "", notes(results), ""]
    if results.get("error"):
        parts += [f"**Incomplete**: {results['error'].splitlines()[0]}", ""]
    parts += [f"![{name}]({image_prefix}{file})" for name, file in PLOTS.items()]
    parts += ["", f"Produced by `{results['command']}` ({results['finished'] or 'unfinished'})."]
    return "\n".join(parts) + "\n"


def update_readme(readme: Path, results: dict, report_dir: Path) -> None:
    """Replace the text between the results markers of `readme` with this run's section; the plots are
    copied to docs/results/ beside it so that the README shows them."""
    text = readme.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"{readme} has no {BEGIN} ... {END} markers to put the results between")
    assets = readme.parent / "docs" / "results"
    assets.mkdir(parents=True, exist_ok=True)
    prefix = f"{results['run_name']}-"
    for file in PLOTS.values():
        if (report_dir / file).exists():
            shutil.copyfile(report_dir / file, assets / f"{prefix}{file}")
    section = markdown(results, image_prefix=f"{assets.relative_to(readme.parent).as_posix()}/{prefix}")
    readme.write_text(pattern.sub(lambda _: f"{BEGIN}\n{section}{END}", text, count=1))


# --- plots ---------------------------------------------------------------------------------------------

def _scatter(ax, files: list[dict], value, *, front: bool, log: bool, errors=None) -> None:
    points = [(x_bpw(f), value(f)) for f in files]
    for f, (x, y) in zip(files, points):
        if _ok(x) and _ok(y) and (y > 0 or not log):
            err = errors(f) if errors else None
            ax.errorbar(x, y, yerr=err if _ok(err) else None, fmt="o", color=COLORS[f["kind"]], capsize=3)
            ax.annotate(label(f), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if front:
        idx = [i for i in pareto(points) if not log or points[i][1] > 0]
        if idx:
            ax.step([points[i][0] for i in idx], [points[i][1] for i in idx], where="post", color="k",
                    linestyle="--", linewidth=0.8, label="Pareto front")
            ax.scatter([points[i][0] for i in idx], [points[i][1] for i in idx], s=110, facecolors="none",
                       edgecolors="k", linewidths=0.8)
    if log:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)


def _legend(ax, files: list[dict], front: bool) -> None:
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=COLORS[k], label=k)
               for k in COLORS if any(f["kind"] == k for f in files)]
    if front:
        handles.append(plt.Line2D([], [], color="k", linestyle="--", linewidth=0.8, label="Pareto front"))
    ax.legend(handles=handles, fontsize=8)


def plots(results: dict, folder: Path) -> list[Path]:
    """quality.png (perplexity and mean KL-divergence against bits per weight, Pareto front marked) and
    speed.png (prompt processing and generation speed against bits per weight)."""
    files, s = results["files"], results["settings"]
    xlabel = f"bits per weight over {'+'.join(s['only']) if s['only'] else 'the block linears'}"
    title = f"{results['model']['name']}, {Path(s['eval']).name}"
    out = []

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 5))
    _scatter(a, files, lambda f: (f.get("quality") or {}).get("ppl"), front=True, log=True,
             errors=lambda f: f["quality"]["ppl_err"])
    a.set(xlabel=xlabel, ylabel="perplexity (lower is better)", title=f"Perplexity, {title}")
    _scatter(b, files, lambda f: (f.get("quality") or {}).get("kld_mean"), front=True, log=True)
    b.set(xlabel=xlabel, ylabel="mean KL-divergence to the float model", title="KL-divergence")
    _legend(a, files, True)
    fig.tight_layout()
    fig.savefig(folder / PLOTS["quality"], dpi=120)
    plt.close(fig)
    out.append(folder / PLOTS["quality"])

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, kind in zip(axes, ("pp", "tg")):
        tokens = s["bench_prompt"] if kind == "pp" else s["bench_gen"]
        _scatter(ax, files, lambda f: ((f.get("speed") or {}).get(kind) or {}).get("mean"), front=False, log=False,
                 errors=lambda f: f["speed"][kind]["sd"])
        ax.set(xlabel=xlabel, ylabel="tokens per second (higher is better)",
               title=f"{'Prompt processing' if kind == 'pp' else 'Generation'} {kind}{tokens}, {s['threads']} threads")
        ax.set_ylim(bottom=0)
    _legend(axes[0], files, False)
    fig.tight_layout()
    fig.savefig(folder / PLOTS["speed"], dpi=120)
    plt.close(fig)
    out.append(folder / PLOTS["speed"])
    return out
