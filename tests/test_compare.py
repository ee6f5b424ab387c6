"""`vq-gguf compare` end to end on a small slice: two far-apart llama.cpp types and one VQ preset on ffn_down,
two evaluation chunks; then the same folder rerun, interrupted, resumed, and broken on purpose.

The comparison runs once for the module (a few minutes on two cores); the tests read its folder in order,
the last ones rerun it.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from tests.conftest import DATA, EVAL_TEXT
from vq_gguf import bundle, cli
from vq_gguf.tools import compare, llamacpp, report

CALIB = DATA / "calib" / "austen-prideprejudice.txt"
FAST_PRESET = "kmeans-2bit"  # plain k-means, no calibration pass: seconds per tensor with the flags below
# ARGS use one thread: llama.cpp's threads spin at every barrier, which collapses when other work holds the cores
ARGS = ["--calib", str(CALIB), "--eval", str(EVAL_TEXT), "--llama-types", "Q4_K_M", "IQ1_M",
        "--presets", FAST_PRESET, "--quantize-args", "--v 2 --k 16", "--only", "ffn_down",
        "--chunks", "2", "--imatrix-chunks", "2", "--threads", "1",
        "--bench-prompt", "32", "--bench-gen", "8", "--bench-reps", "2"]

# bits per weight of each type from its block: bytes per block * 8 / weights per block (ggml-common.h)
TYPE_BPW = {"f16": 16, "q8_0": 34 * 8 / 32, "q4_k": 144 * 8 / 256, "q6_k": 210 * 8 / 256, "q2_k": 84 * 8 / 256,
            "iq1_m": 56 * 8 / 256}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    cli.main(["compare", "--out", str(out), *ARGS])
    return out


@pytest.fixture(scope="module")
def results(folder) -> dict:
    return json.loads((folder / "only-ffn_down" / "results.json").read_text())


def by_label(results: dict) -> dict[str, dict]:
    return {f["label"]: f for f in results["files"]}


def test_results_have_every_field(results):
    assert results["error"] is None and results["finished"]
    assert {"vq-gguf", "vq-gguf git commit", "llama.cpp commit", "python", "torch", "gguf"} <= set(results["versions"])
    assert {"cpu", "logical cores", "os"} <= set(results["machine"])
    assert results["command"].startswith("vq-gguf compare ") and "--only ffn_down" in results["command"]
    assert results["chunks_evaluated"] == 2 and results["imatrix"]["chunks"] == 2
    assert [f["kind"] for f in results["files"]] == ["float", "llama.cpp", "llama.cpp", "vq"]
    assert list(by_label(results))[:3] == ["F16", "Q4_K_M", "IQ1_M"]
    for f in results["files"]:
        assert {"bytes", "file_bpw", "linear_bpw", "selected_bpw", "selected_types", "tensor_types"} <= set(f["bits"])
        q, sp = f["quality"], f["speed"]
        for key in ("ppl", "ppl_err", "kld_mean", "kld_p99", "same_top"):
            assert math.isfinite(q[key]), (f["label"], key)
        assert q["ppl"] > 1 and q["chunks"] == 2  # a plain k-means file may well be in the millions
        for kind, tokens in (("pp", 32), ("tg", 8)):
            assert sp[kind]["tokens"] == tokens and sp[kind]["mean"] > 0 and len(sp[kind]["samples"]) == 2
        assert "llama-perplexity" in q["command"] and "llama-bench" in sp["command"]
        if f["kind"] != "float":
            assert "quantize" in f["made"]["command"]


def test_far_apart_types_are_ordered(results):
    files = by_label(results)
    f16, q4, iq1 = files["F16"]["quality"], files["Q4_K_M"]["quality"], files["IQ1_M"]["quality"]
    assert q4["ppl"] < iq1["ppl"] and q4["kld_mean"] < iq1["kld_mean"] and q4["same_top"] > iq1["same_top"]
    assert abs(f16["kld_mean"]) < 1e-3 and f16["same_top"] > 99  # the reference scored against itself
    assert files["Q4_K_M"]["bits"]["selected_bpw"] > files["IQ1_M"]["bits"]["selected_bpw"]


def test_types_and_bits_per_weight_match_a_hand_count(results):
    """Every tensor outside ffn_down holds the common type; the bits per weight over ffn_down follow from the
    types the file holds and their block sizes."""
    n = 576 * 1536  # one ffn_down
    for f in results["files"][1:]:
        types = f["bits"]["tensor_types"]
        down = [t for name, t in types.items() if ".ffn_down." in name]
        assert len(down) == 30
        others = {t for name, t in types.items() if name.startswith("blk.") and ".ffn_down." not in name and "norm" not in name}
        assert others == {"q8_0"}, f["label"]
        if f["kind"] == "llama.cpp":
            assert f["bits"]["selected_bpw"] == pytest.approx(sum(TYPE_BPW[t] for t in down) / len(down))
        else:  # 2 index bits per weight + 16 centroids of 2 F16 values per tensor
            assert set(down) == {"vq2_00"}
            assert f["bits"]["selected_bpw"] == pytest.approx((n * 2 + 16 * 2 * 16) / n)
        shares = {t: down.count(t) / len(down) for t in set(down)}
        assert f["bits"]["selected_types"] == pytest.approx(shares)
        assert f["fallback_share"] == 0 and f["made"].get("fallbacks", {}) == {}  # 1536 columns fit every block


def test_fallbacks_are_reported_and_the_name_quoted(folder, results, tmp_path):
    """attn_k has 576 columns: llama.cpp's Q2_K cannot take it and silently stores another type."""
    s = {**results["settings"], "only": ["attn_k"]}
    out = tmp_path / "q2k-attn_k.gguf"
    made = compare.make_llama(s, Path(results["files"][0]["path"]), folder / "imatrix.gguf", "Q2_K", out,
                              tmp_path / "quantize.log")
    row = compare.entry(s, "Q2_K", "llama.cpp", out, made)
    attn_k = {n: t for n, t in row["bits"]["tensor_types"].items() if ".attn_k." in n}
    assert len(attn_k) == 30 and set(made["fallbacks"]) == set(attn_k)
    assert all(attn_k[n] == f["got"].lower() and f["wanted"].lower() == "q2_k" for n, f in made["fallbacks"].items())
    assert row["fallback_share"] == 1 and report.label(row) == '"Q2_K"'
    assert row["bits"]["selected_bpw"] > 4  # what "2-bit" Q2_K really costs on these tensors


def test_bits_of_a_file_with_known_tensors(tmp_path):
    path = tmp_path / "known.gguf"
    w = GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.normal(size=(64, 32)).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.normal(size=(32, 32)).astype(np.float16))
    w.add_tensor("blk.0.ffn_down.weight", quantize(rng.normal(size=(32, 64)).astype(np.float32), GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    s = {"only": ["ffn_down"]}
    row = compare.entry(s, "known", "llama.cpp", path, {})["bits"]
    q_bits, down_bits = 32 * 32 * 16, 32 * 64 * (2 + 32) * 8 / 32      # F16; Q8_0: 2-byte scale + 32 bytes per 32
    assert row["linear_bpw"] == pytest.approx((q_bits + down_bits) / (32 * 32 + 32 * 64))
    assert row["selected_bpw"] == pytest.approx(8.5) and row["selected_types"] == {"q8_0": 1.0}
    assert row["linear_types"] == pytest.approx({"q8_0": 2 / 3, "f16": 1 / 3})
    assert row["params"] == 64 * 32 + 32 + 32 * 32 + 32 * 64
    assert row["file_bpw"] == pytest.approx(8 * path.stat().st_size / row["params"])
    assert row["tensor_types"]["token_embd.weight"] == "f32"


def test_the_same_evaluation_twice_gives_the_same_figures(folder, results):
    vq = results["files"][-1]
    again = compare.evaluate(results["settings"], Path(vq["path"]), folder / "float-logits.kld",
                             folder / "logs" / "again.log")
    for key in ("ppl", "ppl_err", "kld_mean", "kld_p99", "same_top"):
        assert again[key] == vq["quality"][key], key


def test_table_and_plots(folder, results):
    md = (folder / "only-ffn_down" / "results.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 4 and set(rows[1].replace(" ", "")) <= {"|", "-"}
    assert len({row.count("|") for row in rows}) == 1
    for f, row in zip(results["files"], rows[2:]):
        assert row.startswith(f"| {f['label']} | {f['bits']['selected_bpw']:.3f} |")
    assert "PPL" in rows[0] and "tg8 t/s" in rows[0] and results["command"] in md
    for name in report.PLOTS.values():
        data = (folder / "only-ffn_down" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", data[16:24])
        assert width > 600 and height > 300


def test_readme_section_is_replaced(tmp_path, folder, results):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.BEGIN}\nold\n{report.END}\n\nafter\n")
    report.update_readme(readme, results, folder / "only-ffn_down")
    text = readme.read_text()
    assert "\nold\n" not in text and text.endswith("\n\nafter\n") and text.count(report.BEGIN) == 1
    assert report.table(results) in text and results["command"] in text
    for name in report.PLOTS.values():
        assert f"docs/results/{results['run_name']}-{name}" in text
        assert (tmp_path / "docs" / "results" / f"{results['run_name']}-{name}").exists()
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        report.update_readme(readme, results, folder / "only-ffn_down")


def test_export_model_card_carries_the_measured_figures(tmp_path, folder, results):
    md = (folder / "only-ffn_down" / "results.md").read_text()
    vq = results["files"][-1]
    vq_row = next(line for line in md.splitlines() if line.startswith(f"| {report.label(vq)} |"))
    out = bundle.export(Path(vq["path"]), tmp_path / "out", results=folder / "only-ffn_down" / "results.json")
    card = (out / "README.md").read_text()
    assert vq_row in card and results["command"] in card
    others = [report.label(f) for f in results["files"] if f["kind"] == "llama.cpp"]
    assert not any(line.startswith(f"| {label} |") for label in others for line in card.splitlines())


def test_pareto_front():
    points = [(2, 50.0), (4, 20.0), (3, 60.0), (16, 19.0), (5, 20.0), (1, math.nan)]
    assert report.pareto(points) == [0, 1, 3]


def test_an_interrupted_rerun_resumes_and_reuses_every_finished_step(folder, results, monkeypatch, capsys):
    steps = json.loads((folder / "steps.json").read_text())
    for name in [n for n in steps if n.startswith("bench")][1:]:
        del steps[name]                                 # as if the run had stopped after the first bench
    (folder / "steps.json").write_text(json.dumps(steps))
    calls = []
    real = llamacpp.run_bench

    def interrupted_after_one(cmd, log):
        if calls:
            raise KeyboardInterrupt
        calls.append(cmd)
        return real(cmd, log)

    monkeypatch.setattr(llamacpp, "run_bench", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["compare", "--out", str(folder), *ARGS])
    partial = json.loads((folder / "only-ffn_down" / "results.json").read_text())
    assert partial["error"].startswith("KeyboardInterrupt") and partial["finished"] is None
    assert [f["speed"] is not None for f in partial["files"]] == [True, True, False, False]
    assert [f["quality"] for f in partial["files"]] == [f["quality"] for f in results["files"]]  # kept

    capsys.readouterr()
    monkeypatch.setattr(llamacpp, "run_bench", lambda cmd, log: (calls.append(cmd), real(cmd, log))[1])
    cli.main(["compare", "--out", str(folder), *ARGS])
    assert len(calls) == 3  # the two benches left, after the one done before the interruption
    # every step reused but vq-gguf quantize (which decides by itself) and the two benches left
    assert capsys.readouterr().out.count("done before, reused") == 14 - 3
    done = json.loads((folder / "only-ffn_down" / "results.json").read_text())
    assert done["error"] is None and all(f["speed"] for f in done["files"])
    assert [f["quality"] for f in done["files"]] == [f["quality"] for f in results["files"]]


def test_files_made_elsewhere_are_measured_beside_the_others(folder, results, tmp_path, capsys):
    made = next(f for f in results["files"] if f["kind"] == "vq")
    copy = tmp_path / "tuned.gguf"
    shutil.copy(made["path"], copy)
    cli.main(["compare", "--out", str(folder), *ARGS, "--files", f"tuned={copy}"])
    done = json.loads((folder / "only-ffn_down" / "results.json").read_text())
    tuned = by_label(done)["tuned"]
    assert tuned["kind"] == "vq" and tuned["made"]["given"] == str(copy) and f"--files tuned={compare._shown(copy)}" in done["command"]
    assert tuned["bits"] == made["bits"] | {"tensor_types": tuned["bits"]["tensor_types"]}
    assert {k: tuned["quality"][k] for k in ("ppl", "kld_mean", "same_top")} == \
           {k: made["quality"][k] for k in ("ppl", "kld_mean", "same_top")}   # the same weights, the same figures

    other = tmp_path / "other.gguf"
    w = GGUFWriter(str(other), "llama")
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(SystemExit, match="not a file of this model"):
        cli.main(["compare", "--out", str(folder), *ARGS, "--files", f"other={other}"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["compare", "--out", str(folder), *ARGS, "--files", str(copy)])
    assert "expected LABEL=PATH" in capsys.readouterr().err


def test_a_failing_tool_stops_with_its_own_error(tmp_path, folder):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Too short to evaluate.\n")
    argv = ["compare", "--out", str(folder), "--eval", str(tiny), "--llama-types", "--presets", "--chunks", "2"]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    message = str(e.value)
    # llama-perplexity exits with status 0 here: its own error line must still reach the user
    assert "llama-perplexity gave no figures" in message and "you need at least" in message
    kept = json.loads((folder / "results.json").read_text())
    assert kept["error"] and [f["label"] for f in kept["files"]] == ["F16"]


def test_bad_inputs_are_refused_before_any_long_step(tmp_path):
    with pytest.raises(SystemExit, match="also a calibration text"):
        cli.main(["compare", "--out", str(tmp_path), "--calib", str(CALIB), "--eval", str(CALIB)])
    with pytest.raises(SystemExit, match="does not know Q9_X"):
        cli.main(["compare", "--out", str(tmp_path), "--llama-types", "Q9_X"])
    with pytest.raises(SystemExit, match="does not exist"):
        cli.main(["compare", "--out", str(tmp_path), "--eval", str(tmp_path / "missing.txt")])
    assert not list(tmp_path.iterdir())
