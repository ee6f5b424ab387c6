"""`vq-gguf compare`: VQ presets against llama.cpp's k-quants and i-quants on one model (issue 3).

Placeholder: implemented by the comparison harness work; the CLI wiring is in vq_export/cli.py.
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> None:
    raise NotImplementedError("vq-gguf compare is not implemented yet")
