"""The settings of one weight's quantization: one class for both methods (quantize.py's plain k-means reads
v, k, k_res, kmeans_iters and seed; VPTQ reads them all)."""
from __future__ import annotations

from dataclasses import dataclass

from . import ggml_vq


@dataclass(frozen=True)
class VQConfig:
    v: int                       # vector length (output channels per vector)
    k: int                       # main codebook size
    k_res: int = 0               # residual codebook size (0: none)
    outlier_frac: float = 0.0    # share of input columns (largest Hessian diagonal) with an outlier codebook
    v0: int = 4                  # outlier vector length
    k0: int = 256                # outlier codebook size
    act_order: bool = True       # columns in descending diag(H) order
    damp: float = 0.01           # added to diag(H), relative to its mean
    block: int = 128             # columns per lazy-update block
    kmeans_iters: int = 12       # Lloyd passes over ≤ 2¹⁶ vectors (docs/results.md "The k-means sample")
    refit_rounds: int = 2        # codebook refit + re-assignment rounds (0: the paper's fixed k-means codebook)
    groups: int = 1              # column groups, each with its own codebooks (stored columns j·G/in)
    col_norm: bool = False       # per-column scale and bias: codebooks see (w − t_j)/s_j (the paper's normalization)
    row_scale: bool = False      # per-output-channel scale: codebooks see rows of equal RMS
    seed: int = 0

    @property
    def index_bits(self) -> int:
        return ggml_vq.code_bits(self.k) + (ggml_vq.code_bits(self.k_res) if self.k_res else 0)

    def fits(self, out_features: int, in_features: int) -> bool:
        """A weight of this shape can take these settings: its input columns are whole blocks, it has at least one
        vector row, and v (and v0) divide its output channels where there are outlier codebooks (format.md; the
        out % v channels past the last vector row are the weight's tail otherwise)."""
        return (in_features % ggml_vq.BLOCK_SIZE == 0 and out_features >= self.v and
                (not self.outlier_frac or (out_features % self.v == 0 and out_features % self.v0 == 0)))

    def calibrated(self) -> list[str]:
        """The settings that need calibration Hessians (the plain k-means method refuses them)."""
        plain = VQConfig(self.v, self.k, self.k_res)
        return [f for f in ("outlier_frac", "groups", "col_norm", "row_scale") if getattr(self, f) != getattr(plain, f)]
