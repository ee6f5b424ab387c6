"""The texts the defaults use ship with the package (a user's clone has nothing beside it), unchanged, and a
missing text stops a command at once with a message that says how to supply one."""
import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vq_gguf
from vq_gguf import calib

PACKAGE_DATA = Path(vq_gguf.__file__).parent / "data"


def test_defaults_point_into_the_package():
    if os.environ.get("VQ_GGUF_DATA"):
        pytest.fail("VQ_GGUF_DATA is set: the suite must run on the texts the package ships")
    assert calib.DATA_DIR == PACKAGE_DATA
    assert calib.DEFAULT_CALIB.is_dir() and calib.EVAL_TEXT.is_file()
    assert calib.EVAL_TEXT.parent.parent == calib.DEFAULT_CALIB.parent


def test_shipped_texts_match_their_checksums():
    """data/README.md lists a sha256 for every file; the files are exactly those, each under 2 MB."""
    listed = dict((name, digest) for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$",
                                                               (PACKAGE_DATA / "README.md").read_text(), re.M))
    shipped = sorted(p.relative_to(PACKAGE_DATA).as_posix() for p in PACKAGE_DATA.glob("*/*.txt"))
    assert shipped == sorted(listed)
    for name in shipped:
        data = (PACKAGE_DATA / name).read_bytes()
        assert len(data) < 2 * 2**20
        assert hashlib.sha256(data).hexdigest() == listed[name], name


def test_calibration_and_evaluation_never_overlap():
    evaluation = set(calib.EVAL_TEXT.read_text().splitlines()) - {""}
    for f in calib.DEFAULT_CALIB.glob("*.txt"):
        shared = [line for line in set(f.read_text().splitlines()) & evaluation if len(line) > 80]
        assert not shared, f"{f.name} shares {len(shared)} long lines with the evaluation text"


def test_missing_text_is_named_with_the_way_out(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"calibration text .*nowhere\.txt does not exist: .*VQ_GGUF_DATA"):
        calib.read_texts([tmp_path / "nowhere.txt"])
    with pytest.raises(FileNotFoundError, match=r"has no \.txt files"):
        calib.check_sources([tmp_path])
    calib.check_sources([calib.DEFAULT_CALIB, calib.EVAL_TEXT, "hf:wikitext"])   # hf: is checked when read


def test_demo_stops_before_any_work_without_data(tmp_path):
    """With the data pointed at an empty folder, the demo exits at once with the message, before the build."""
    env = {**os.environ, "VQ_GGUF_DATA": str(tmp_path), "VQ_GGUF_HOME": str(tmp_path / "home")}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "vq_gguf.cli", "demo"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"calibration text {tmp_path / 'calib'} does not exist" in proc.stderr and "VQ_GGUF_DATA" in proc.stderr
    assert not (tmp_path / "home").exists(), "the demo started work before checking its data"
    assert time.time() - start < 60
