"""Short libFuzzer runs in CI (tools/fuzz.py; the long runs and their findings are in docs/hardening.md): each
harness fuzzes for 25 s from its seeds (for `load`: the tiny model and the whole malformed-file corpus, through
libllama in one ASan/UBSan process) with a fixed seed."""
import pytest

from tools import fuzz

RUNS = {"matmul": dict(seconds=25), "load": dict(seconds=25)}


@pytest.mark.parametrize("harness", sorted(fuzz.HARNESSES))
def test_short_fuzz_run(harness, tmp_path):
    r = fuzz.run(harness, workdir=tmp_path, log=tmp_path / "log.txt", seed=1, **RUNS[harness])
    print(f"{harness}: {r.execs} executions in {r.seconds:.0f} s, coverage {r.cov}, corpus {r.corpus}")
    assert not r.crashes, (tmp_path / "log.txt").read_text()[-6000:]
    assert r.exit_status == 0 and r.execs > 0 and r.cov > 0
