"""Typed constants of the VQ-GGUF format (docs/format.md), in one place.

The PyPI `gguf` package knows nothing of our private ggml type ids, so importing this module registers
them with it: block and type sizes in `GGML_QUANT_SIZES` (used by the writer to turn byte shapes into
logical shapes) and enum members of `GGMLQuantizationType` (used by the reader to parse tensor infos).
"""
from __future__ import annotations

import enum

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

FORMAT_KEY = "vq.format_version"
FORMAT_VERSION = 4       # the newest version this package writes (format_version says which a file gets)
LINK_PREFIX = "vq.link."  # vq.link.<side tensor name> = "vq_shared.<label>.<suffix>" (format.md 4.1)
SHARED_PREFIX = "vq_shared."
METHOD_KEY = "vq.method"
PRESET_KEY = "vq.preset"
INPUTS_KEY = "vq.inputs"  # hash of what the file was made from, to reuse it when nothing changed
FINETUNE_KEY = "vq.finetune"  # how the codebooks and norms were fine-tuned end to end, if they were
ROPE_NEOX_KEY = "vq.rope_neox"  # q and k rows in Hugging Face's order: llama.cpp rotates them NEOX-style (format.md §1)
FTYPE_MOSTLY_VQ = 200  # llama_ftype LLAMA_FTYPE_MOSTLY_VQ

TYPE_BASE = 200
BLOCK_SIZE = 32
N_MIN, N_MAX = 2, 32  # type 200 + n stores n/4 index bits per weight

# side tensors, in the order they are attached to the MUL_MAT node (src[2 + i])
SIDES = (
    "vq_codebook",
    "vq_res_codebook",
    "vq_perm",
    "vq_col_norm",
    "vq_row_scale",
    "vq_outlier_cols",
    "vq_outlier_idx",
    "vq_outlier_codebook",
    "vq_tail",
)
WEIGHT_SUFFIX = ".weight"


def format_version(shares: bool, rope_neox: bool = False, tails: bool = False) -> int:
    """The version a file declares: 4 when a weight has a tail (vq_tail: its vector length does not divide its
    outputs), else 3 with q and k in Hugging Face's row order (ROPE_NEOX_KEY: a reader that ignored the key would
    rotate the wrong rows), else 2 when it shares side tensors (format.md 4.1), else 1, so that older readers keep
    reading every file they can describe and refuse the others."""
    return 4 if tails else 3 if rope_neox else 2 if shares else 1


def code_bits(k: int) -> int:
    """Bits of a code into a codebook of k entries: k must be a power of two in [2, 65536] (format.md §4)."""
    b = int(k).bit_length() - 1
    if k < 2 or (1 << b) != k or b > 16:
        raise ValueError(f"codebook size {k} is not a power of two in [2, 65536]")
    return b


def type_name(n: int) -> str:
    """ggml's name of the type with n/4 index bits per weight: vq2_00 for n = 8."""
    return f"vq{n // 4}_{25 * (n % 4):02d}"


def type_id(n: int) -> int:
    if not N_MIN <= n <= N_MAX:
        raise ValueError(f"index rate {n}/4 bits per weight is outside the VQ types ({N_MIN}/4 .. {N_MAX}/4)")
    return TYPE_BASE + n


def is_vq(ggml_type: int) -> bool:
    return TYPE_BASE + N_MIN <= int(ggml_type) <= TYPE_BASE + N_MAX


def rate_quarters(ggml_type: int) -> int:
    """n such that the type stores n/4 index bits per weight."""
    if not is_vq(ggml_type):
        raise ValueError(f"ggml type {int(ggml_type)} is not a VQ type")
    return int(ggml_type) - TYPE_BASE


def side_name(weight_name: str, side: str) -> str:
    """Name of a side tensor: blk.0.ffn_down.weight -> blk.0.ffn_down.vq_codebook."""
    if not weight_name.endswith(WEIGHT_SUFFIX):
        raise ValueError(f"{weight_name!r} is not a weight name (it must end in {WEIGHT_SUFFIX!r})")
    return weight_name[: -len(WEIGHT_SUFFIX)] + "." + side


def shared_name(label: str, side: str) -> str:
    """Name of a side tensor several weights link: ("ffn_down", "vq_codebook") -> vq_shared.ffn_down.vq_codebook."""
    if side not in SIDES:
        raise ValueError(f"{side!r} is not a VQ side tensor")
    return f"{SHARED_PREFIX}{label}.{side}"


def links(fields) -> dict[str, str]:
    """The links of a GGUFReader's fields: side tensor name -> the shared tensor that stands for it."""
    return {k[len(LINK_PREFIX):]: f.contents() for k, f in fields.items() if k.startswith(LINK_PREFIX)}


def _register_with_gguf() -> None:
    for n in range(N_MIN, N_MAX + 1):
        value = TYPE_BASE + n
        member = GGMLQuantizationType._value2member_map_.get(value)
        if member is None:
            member = int.__new__(GGMLQuantizationType, value)
            member._name_ = type_name(n).upper()
            member._value_ = value
            GGMLQuantizationType._value2member_map_[value] = member
        GGML_QUANT_SIZES[member] = (BLOCK_SIZE, n)


def gguf_type(n: int) -> enum.IntEnum:
    """The gguf package's enum member for the VQ type with n/4 index bits per weight."""
    return GGMLQuantizationType(type_id(n))


_register_with_gguf()
