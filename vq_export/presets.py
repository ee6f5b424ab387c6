"""Presets: what to quantize how, for a whole model. The shipped ones are plain data in presets.toml."""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .config import VQConfig
from .finetune import LR
from .names import LINEAR_KINDS, parse_linear


@dataclass(frozen=True)
class Preset:
    name: str
    method: str                                     # "kmeans" or "vptq"
    config: VQConfig                                # for every block linear ...
    overrides: tuple[tuple[str, VQConfig], ...] = ()  # ... except those a selector picks (first match; see `selects`)
    n_calib: int = 128                              # calibration windows (vptq; docs/results.md "Calibration")
    seq_len: int = 512                              # tokens per window
    n_heldout: int = 4                              # windows kept out of the Hessians, for the error report
    sequential: bool = True                         # Hessians from the quantized earlier blocks
    finetune_steps: int = 0                         # end-to-end KL fine-tuning of codebooks and norms (0: none)
    finetune_lr: float = LR
    share: tuple[str, ...] = ()                     # kinds whose tensors of equal config share one main codebook
    channel_weights: str = "none"                   # "fisher": output channels weighted by the end loss (fisher.py)
    fisher_windows: int = 32                        # calibration windows the channel weights are taken from

    def __post_init__(self):
        if self.method not in ("kmeans", "vptq"):
            raise ValueError(f"preset {self.name}: unknown method {self.method!r} (kmeans, vptq)")
        for key, _ in self.overrides:
            check_selector(key)
        for kind in self.share:
            if kind not in LINEAR_KINDS:
                raise ValueError(f"preset {self.name}: cannot share {kind!r}; the kinds are {', '.join(LINEAR_KINDS)}")

    def config_for(self, name: str, n_blocks: int) -> VQConfig:
        """The config of block linear `name` (blk.N.KIND.weight) in a model of n_blocks blocks."""
        block, kind = parse_linear(name)
        return next((cfg for key, cfg in self.overrides if selects(key, kind, block, n_blocks)), self.config)


def selects(key: str, kind: str, block: int, n_blocks: int) -> bool:
    """Whether selector KIND[@WHERE,...] picks block `block`'s `kind`. WHERE: first, last, a block number
    (negative: from the end) or a depth range A-B%: the blocks whose middle, (block + ½)/n_blocks, lies in
    [A %, B %)."""
    k, _, where = key.partition("@")
    return k == kind and (not where or any(_at(w, block, n_blocks) for w in where.split(",")))


def _at(where: str, block: int, n_blocks: int) -> bool:
    if where == "first":
        return block == 0
    if where == "last":
        return block == n_blocks - 1
    if where.endswith("%"):
        lo, _, hi = where[:-1].partition("-")
        return float(lo) <= 100 * (block + 0.5) / n_blocks < float(hi)
    return block == int(where) % n_blocks


def check_selector(key: str) -> None:
    """Raises ValueError, saying what is accepted, for a selector `selects` cannot read."""
    kind, _, where = key.partition("@")
    if kind not in LINEAR_KINDS:
        raise ValueError(f"selector {key!r}: {kind!r} is not a block linear kind ({', '.join(LINEAR_KINDS)})")
    for w in where.split(",") if where else ():
        try:
            if w.endswith("%"):
                lo, sep, hi = w[:-1].partition("-")
                if not sep or not 0 <= float(lo) < float(hi) <= 100:
                    raise ValueError
            elif w not in ("first", "last"):
                int(w)
        except ValueError:
            raise ValueError(f"selector {key!r}: {w!r} is not first, last, a block number or a depth range "
                             "such as 0-33%") from None


def from_table(name: str, table: dict) -> Preset:
    """A preset from its TOML table (presets.toml's format): overrides' settings are relative to `config`."""
    table = dict(table)
    try:
        config = VQConfig(**table.pop("config"))
        overrides = tuple((key, dataclasses.replace(config, **settings)) for key, settings in table.pop("overrides", ()))
        return Preset(name, config=config, overrides=overrides, share=tuple(table.pop("share", ())), **table)
    except (TypeError, KeyError) as e:
        raise ValueError(f"preset {name}: {e}") from None


def load(path: Path) -> dict[str, Preset]:
    """Every preset of a TOML file, by name."""
    with open(path, "rb") as f:
        return {name: from_table(name, table) for name, table in tomllib.load(f).items()}


PRESETS = load(Path(__file__).with_name("presets.toml"))
