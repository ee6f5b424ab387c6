"""The malformed-file corpus (tests/malformed.py) against the runtime and against the sanitizer build: each
file is refused with a message naming the tensor and the problem, or (valid but odd) loads and runs; the
loader driver built with AddressSanitizer and UndefinedBehaviorSanitizer (`python -m vq_gguf.native.build --sanitize`)
must agree and report nothing."""
import os
import subprocess

import numpy as np
import pytest

from tests import malformed
from vq_gguf import cli
from vq_gguf.native.build import sanitize_bin_dir
from vq_gguf.runtime.llama import LlamaError, Model

CASES = malformed.corpus()
# distinct exit statuses for sanitizer reports; leaks are reports too
SAN_ENV = {**os.environ, "ASAN_OPTIONS": "exitcode=86:detect_leaks=1:abort_on_error=0",
           "UBSAN_OPTIONS": "exitcode=87:print_stacktrace=1:halt_on_error=1"}


@pytest.fixture(scope="session")
def vq_load():
    exe = sanitize_bin_dir() / "vq-load"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: run `python -m vq_gguf.native.build --sanitize` (needs clang-14 and libclang-rt-14-dev)")
    return exe


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_file(case, tmp_path, vq_load, capsys):
    path = tmp_path / "case.gguf"
    case.make(path)

    r = subprocess.run([str(vq_load), str(path), "3"], capture_output=True, text=True, env=SAN_ENV, timeout=300)
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-4000:]
    assert r.returncode == (0 if case.expect is None else 2), f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    for word in case.expect or ():
        assert word in r.stderr, r.stderr

    if case.expect is None:
        with Model(path, n_ctx=64) as m:
            assert m.logits([1, 2, 3]).shape == (3, m.n_vocab)
    else:
        with pytest.raises(LlamaError) as e:
            Model(path, n_ctx=64)
        for word in case.expect:
            assert word in str(e.value)

    # `vq-gguf inspect` runs the loader's checks: the same verdict and words, never a traceback
    if case.expect is None:
        cli.main(["inspect", str(path)])
        assert "bits per weight" in capsys.readouterr().out
    else:
        with pytest.raises(SystemExit) as e:
            cli.main(["inspect", str(path)])
        message = str(e.value.code)
        assert message.startswith("vq-gguf inspect: ") and all(word in message for word in case.expect), message


@pytest.mark.parametrize("field,dtype", [("codebook", None), ("res_codebook", None), ("col_norm", None),
                                         ("row_scale", np.float16), ("row_scale", np.float32), ("outlier_codebook", None)])
def test_vq_check_data_refuses_non_finite_values(field, dtype):
    """Tools that load without llama.cpp's data check (llama-cli, llama-perplexity) rely on ggml_vq_check_data."""
    from tests.native import c_check_data
    from tests import tiny_model
    t = tiny_model.vq_tensors()[malformed.Q]
    arr = getattr(t, field).astype(dtype or getattr(t, field).dtype)
    setattr(t, field, arr)
    assert c_check_data(t) is None
    arr = arr.copy()
    arr.flat[3] = np.inf
    setattr(t, field, arr)
    assert f"vq_{field}: value" in c_check_data(t) and "NaN or infinite" in c_check_data(t)
