"""Short libFuzzer runs in CI (tests/fuzz.py; the long runs and their findings are in docs/hardening.md): each
harness fuzzes for 25 s from its seeds with a fixed seed: `matmul`; `load` from the tiny model and the whole
malformed-file corpus, through libllama in one ASan/UBSan process; `file` with edits to a real-size VQ file (the
default model with every ffn_down on 2 bits)."""
import pytest

from tests import fuzz

RUNS = {"matmul": dict(seconds=25), "load": dict(seconds=25), "file": dict(seconds=25)}


@pytest.mark.parametrize("harness", sorted(fuzz.HARNESSES))
def test_short_fuzz_run(harness, tmp_path, request):
    model = request.getfixturevalue("ffn_down_file") if harness == "file" else None
    r = fuzz.run(harness, workdir=tmp_path, log=tmp_path / "log.txt", seed=1, model=model, **RUNS[harness])
    print(f"{harness}: {r.execs} executions in {r.seconds:.0f} s, coverage {r.cov}, corpus {r.corpus}")
    assert not r.crashes, (tmp_path / "log.txt").read_text()[-6000:]
    assert r.exit_status == 0 and r.execs > 0 and r.cov > 0
