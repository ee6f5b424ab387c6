"""Whether two GGUF files hold the same model: every key and every tensor (name, type, bytes), in any order.

For refactors that must not change what the quantizer writes: quantize with the code before and after, then
    python -m vq_gguf.tools.gguf_diff before.gguf after.gguf
Keys that name the run rather than the model (`vq.inputs` hashes the package's code; more with --ignore) are
left out. Exit status 0 when they are the same, 1 when not (the differences are listed).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from gguf import GGUFReader

from vq_gguf import ggml_vq  # noqa: F401  (registers the VQ types with the gguf package, to read their tensors)

RUN_KEYS = (ggml_vq.INPUTS_KEY,)


def differences(a: GGUFReader, b: GGUFReader, ignore: tuple[str, ...] = RUN_KEYS) -> list[str]:
    def keys(r: GGUFReader) -> dict:
        return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in ignore}
    ka, kb = keys(a), keys(b)
    out = [f"key {k}: {ka.get(k)!r} / {kb.get(k)!r}" for k in sorted(set(ka) | set(kb)) if ka.get(k) != kb.get(k)]
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    for name in sorted(set(ta) | set(tb)):
        if name not in ta or name not in tb:
            out.append(f"tensor {name}: only in {'the second' if name in tb else 'the first'}")
        elif ta[name].tensor_type != tb[name].tensor_type:
            out.append(f"tensor {name}: type {ta[name].tensor_type.name} / {tb[name].tensor_type.name}")
        elif not np.array_equal(np.asarray(ta[name].data), np.asarray(tb[name].data)):
            out.append(f"tensor {name}: other values")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--ignore", nargs="*", default=[], metavar="KEY", help="more keys to leave out (e.g. vq.preset)")
    args = ap.parse_args(argv)
    diff = differences(GGUFReader(args.first), GGUFReader(args.second), RUN_KEYS + tuple(args.ignore))
    print("\n".join(diff) if diff else "same keys and tensors")
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
