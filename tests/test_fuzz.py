"""A short libFuzzer run of each harness of the sanitizer build (tools/fuzz.py; the long runs are in
docs/hardening.md): no crash, no sanitizer report, no disagreement between a kernel and the reference."""
import pytest

from tools import fuzz

SECONDS = 25


@pytest.mark.parametrize("harness", sorted(fuzz.HARNESSES))
def test_short_fuzz_run(harness, tmp_path):
    r = fuzz.run(harness, SECONDS, workdir=tmp_path, log=tmp_path / "log.txt", seed=1)  # reproducible
    print(f"{harness}: {r.execs} executions in {r.seconds:.0f} s, coverage {r.cov}, corpus {r.corpus}")
    assert not r.crashes, (tmp_path / "log.txt").read_text()[-6000:]
    assert r.exit_status == 0 and r.execs > 0 and r.cov > 0
