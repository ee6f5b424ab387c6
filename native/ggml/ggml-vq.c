// VQ weights: validation and the plain C reference decoder (docs/format.md).
// Copied into ggml/src/ by the build; part of ggml-base.

#include "ggml-vq.h"
#include "ggml-impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool ggml_is_vq(enum ggml_type type) {
    return (int) type >= GGML_VQ_TYPE_BASE + GGML_VQ_N_MIN && (int) type <= GGML_VQ_TYPE_BASE + GGML_VQ_N_MAX;
}

int ggml_vq_rate_quarters(enum ggml_type type) {
    return ggml_is_vq(type) ? (int) type - GGML_VQ_TYPE_BASE : 0;
}

const char * ggml_vq_side_suffix(enum ggml_vq_side side) {
    static const char * names[GGML_VQ_N_SIDES] = {
        "vq_codebook", "vq_res_codebook", "vq_perm", "vq_col_norm", "vq_row_scale",
        "vq_outlier_cols", "vq_outlier_idx", "vq_outlier_codebook", "vq_tail",
    };
    return (int) side >= 0 && side < GGML_VQ_N_SIDES ? names[side] : NULL;
}

static bool vq_fail(char * err, size_t err_size, const char * fmt, ...) {
    if (err && err_size) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(err, err_size, fmt, args);
        va_end(args);
    }
    return false;
}

// log2 of a power of two in [2, 65536], or -1
static int vq_log2(int64_t k) {
    for (int b = 1; b <= 16; ++b) {
        if (k == ((int64_t) 1 << b)) {
            return b;
        }
    }
    return -1;
}

static bool vq_shape_is(const struct ggml_tensor * t, enum ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2) {
    return t->type == type && t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == ne2 && t->ne[3] == 1 && ggml_is_contiguous(t);
}

bool ggml_vq_layout_init(struct ggml_vq_layout * L, const struct ggml_tensor * w,
                         struct ggml_tensor * const * sides, char * err, size_t err_size) {
    memset(L, 0, sizeof(*L));
    if (!ggml_is_vq(w->type)) {
        return vq_fail(err, err_size, "type %d is not a VQ type", (int) w->type);
    }
    if (w->ne[2] != 1 || w->ne[3] != 1 || !ggml_is_contiguous(w)) {
        return vq_fail(err, err_size, "a VQ weight must be a contiguous 2-D tensor");
    }
    const int n = ggml_vq_rate_quarters(w->type);
    L->in  = w->ne[0];
    L->out = w->ne[1];
    if (L->in % GGML_VQ_BLCK_SIZE != 0) {
        return vq_fail(err, err_size, "row length %lld is not a multiple of %d", (long long) L->in, GGML_VQ_BLCK_SIZE);
    }

    const struct ggml_tensor * cb = sides[GGML_VQ_CODEBOOK];
    if (!cb) {
        return vq_fail(err, err_size, "missing codebook tensor (%s)", ggml_vq_side_suffix(GGML_VQ_CODEBOOK));
    }
    if (cb->type != GGML_TYPE_F16 || cb->ne[3] != 1 || !ggml_is_contiguous(cb)) {
        return vq_fail(err, err_size, "codebook must be a contiguous F16 tensor [v, K, G]");
    }
    L->v  = (int32_t) cb->ne[0];
    L->b1 = vq_log2(cb->ne[1]);
    L->G  = cb->ne[2];
    if (cb->ne[0] < 1 || cb->ne[0] > 64 || cb->ne[0] > L->out) {
        return vq_fail(err, err_size, "codebook vector length %lld is outside [1, min(64, %lld output channels)]", (long long) cb->ne[0], (long long) L->out);
    }
    L->P      = L->out / L->v;
    L->n_tail = L->out % L->v;
    const struct ggml_tensor * tail = sides[GGML_VQ_TAIL];
    if (L->n_tail && !tail) {
        return vq_fail(err, err_size, "vector length %d does not divide the %lld output channels, and the last %lld have no %s",
                       L->v, (long long) L->out, (long long) L->n_tail, ggml_vq_side_suffix(GGML_VQ_TAIL));
    }
    if (tail && !vq_shape_is(tail, GGML_TYPE_F16, L->in, L->n_tail, 1)) {
        return vq_fail(err, err_size, "%s must be F16 [%lld, out %% v = %lld]%s", ggml_vq_side_suffix(GGML_VQ_TAIL), (long long) L->in,
                       (long long) L->n_tail, L->n_tail ? "" : " (none: the vector length divides the output channels)");
    }
    if (L->b1 < 0) {
        return vq_fail(err, err_size, "codebook size %lld is not a power of two in [2, 65536]", (long long) cb->ne[1]);
    }
    if (L->G < 1 || L->in % L->G != 0) {
        return vq_fail(err, err_size, "%lld codebook groups do not divide the %lld input columns", (long long) L->G, (long long) L->in);
    }

    const struct ggml_tensor * rcb = sides[GGML_VQ_RES_CODEBOOK];
    if (rcb) {
        if (rcb->type != GGML_TYPE_F16 || rcb->ne[0] != L->v || rcb->ne[2] != L->G || rcb->ne[3] != 1 || !ggml_is_contiguous(rcb)) {
            return vq_fail(err, err_size, "residual codebook must be F16 [v=%d, K2, G=%lld]", L->v, (long long) L->G);
        }
        L->b2 = vq_log2(rcb->ne[1]);
        if (L->b2 < 0) {
            return vq_fail(err, err_size, "residual codebook size %lld is not a power of two in [2, 65536]", (long long) rcb->ne[1]);
        }
    }
    if ((L->b1 + L->b2) * 4 != n * L->v) {
        return vq_fail(err, err_size, "codebooks give %d index bits per vector of %d, but type %s stores %.2f bits per weight",
                       L->b1 + L->b2, L->v, ggml_type_name(w->type), n / 4.0);
    }

    const struct ggml_tensor * perm = sides[GGML_VQ_PERM];
    if (perm && !vq_shape_is(perm, GGML_TYPE_I32, L->in, 1, 1)) {
        return vq_fail(err, err_size, "permutation must be I32 [%lld]", (long long) L->in);
    }
    const struct ggml_tensor * norm = sides[GGML_VQ_COL_NORM];
    if (norm && !vq_shape_is(norm, GGML_TYPE_F32, L->in, 2, 1)) {
        return vq_fail(err, err_size, "column norm must be F32 [%lld, 2]", (long long) L->in);
    }
    const struct ggml_tensor * rs = sides[GGML_VQ_ROW_SCALE];
    if (rs && !vq_shape_is(rs, GGML_TYPE_F16, L->out, 1, 1) && !vq_shape_is(rs, GGML_TYPE_F32, L->out, 1, 1)) {
        return vq_fail(err, err_size, "row scale must be F16 or F32 [%lld]", (long long) L->out);
    }

    const struct ggml_tensor * ocols = sides[GGML_VQ_OUTLIER_COLS];
    const struct ggml_tensor * oidx  = sides[GGML_VQ_OUTLIER_IDX];
    const struct ggml_tensor * ocb   = sides[GGML_VQ_OUTLIER_CODEBOOK];
    if (ocols || oidx || ocb) {
        if (L->n_tail) {
            return vq_fail(err, err_size, "outliers need a vector length that divides the output channels (no %s)", ggml_vq_side_suffix(GGML_VQ_TAIL));
        }
        if (!ocols || !oidx || !ocb) {
            return vq_fail(err, err_size, "outliers need all of %s, %s and %s", ggml_vq_side_suffix(GGML_VQ_OUTLIER_COLS),
                           ggml_vq_side_suffix(GGML_VQ_OUTLIER_IDX), ggml_vq_side_suffix(GGML_VQ_OUTLIER_CODEBOOK));
        }
        if (ocb->type != GGML_TYPE_F16 || ocb->ne[2] != 1 || ocb->ne[3] != 1 || !ggml_is_contiguous(ocb)) {
            return vq_fail(err, err_size, "outlier codebook must be F16 [v0, K0]");
        }
        L->v0 = (int32_t) ocb->ne[0];
        L->b0 = vq_log2(ocb->ne[1]);
        L->n_o = ocols->ne[0];
        if (ocb->ne[0] < 1 || ocb->ne[0] > L->out || L->out % ocb->ne[0] != 0 || L->b0 < 0) {
            return vq_fail(err, err_size, "outlier codebook [%lld, %lld] needs v0 dividing %lld and a power-of-two size",
                           (long long) ocb->ne[0], (long long) ocb->ne[1], (long long) L->out);
        }
        if (!vq_shape_is(ocols, GGML_TYPE_I32, L->n_o, 1, 1) || L->n_o > L->in) {
            return vq_fail(err, err_size, "outlier columns must be I32 [n_o <= %lld]", (long long) L->in);
        }
        if (!vq_shape_is(oidx, GGML_TYPE_I16, L->out / L->v0, L->n_o, 1)) {
            return vq_fail(err, err_size, "outlier indices must be I16 [%lld, %lld]", (long long) (L->out / L->v0), (long long) L->n_o);
        }
    }

    L->codes            = (const uint8_t *) w->data;
    L->codebook         = (const ggml_fp16_t *) cb->data;
    L->res_codebook     = rcb   ? (const ggml_fp16_t *) rcb->data   : NULL;
    L->perm             = perm  ? (const int32_t *)     perm->data  : NULL;
    L->col_norm         = norm  ? (const float *)       norm->data  : NULL;
    L->row_scale        = rs && rs->type == GGML_TYPE_F32 ? (const float *)       rs->data : NULL;
    L->row_scale_f16    = rs && rs->type == GGML_TYPE_F16 ? (const ggml_fp16_t *) rs->data : NULL;
    L->outlier_cols     = ocols ? (const int32_t *)     ocols->data : NULL;
    L->outlier_idx      = oidx  ? (const int16_t *)     oidx->data  : NULL;
    L->outlier_codebook = ocb   ? (const ggml_fp16_t *) ocb->data   : NULL;
    L->tail             = tail  ? (const ggml_fp16_t *) tail->data  : NULL;
    return true;
}

// index of the first NaN or infinite value, or -1
static int64_t vq_first_nonfinite_f16(const ggml_fp16_t * x, int64_t n) {
    for (int64_t i = 0; x && i < n; ++i) {
        if ((x[i] & 0x7c00) == 0x7c00) {
            return i;
        }
    }
    return -1;
}

static int64_t vq_first_nonfinite_f32(const float * x, int64_t n) {
    for (int64_t i = 0; x && i < n; ++i) {
        if (!isfinite(x[i])) {
            return i;
        }
    }
    return -1;
}

bool ggml_vq_check_data(const struct ggml_vq_layout * L, char * err, size_t err_size) {
    const struct { const char * what; int64_t at; } finite[] = {
        { ggml_vq_side_suffix(GGML_VQ_CODEBOOK),         vq_first_nonfinite_f16(L->codebook, ((int64_t) L->v << L->b1) * L->G) },
        { ggml_vq_side_suffix(GGML_VQ_RES_CODEBOOK),     vq_first_nonfinite_f16(L->res_codebook, ((int64_t) L->v << L->b2) * L->G) },
        { ggml_vq_side_suffix(GGML_VQ_COL_NORM),         vq_first_nonfinite_f32(L->col_norm, 2 * L->in) },
        { ggml_vq_side_suffix(GGML_VQ_ROW_SCALE),        vq_first_nonfinite_f32(L->row_scale, L->out) },
        { ggml_vq_side_suffix(GGML_VQ_ROW_SCALE),        vq_first_nonfinite_f16(L->row_scale_f16, L->out) },
        { ggml_vq_side_suffix(GGML_VQ_OUTLIER_CODEBOOK), vq_first_nonfinite_f16(L->outlier_codebook, (int64_t) L->v0 << L->b0) },
        { ggml_vq_side_suffix(GGML_VQ_TAIL),             vq_first_nonfinite_f16(L->tail, L->n_tail * L->in) },
    };
    for (size_t i = 0; i < sizeof(finite) / sizeof(finite[0]); ++i) {
        if (finite[i].at >= 0) {
            return vq_fail(err, err_size, "%s: value %lld is NaN or infinite", finite[i].what, (long long) finite[i].at);
        }
    }
    if (L->perm) {
        uint8_t * seen = calloc((size_t) L->in, 1);
        if (!seen) {
            return vq_fail(err, err_size, "out of memory");
        }
        for (int64_t j = 0; j < L->in; ++j) {
            const int32_t c = L->perm[j];
            if (c < 0 || c >= L->in || seen[c]) {
                free(seen);
                return vq_fail(err, err_size, "permutation entry %lld = %d is out of range or repeated", (long long) j, c);
            }
            seen[c] = 1;
        }
        free(seen);
    }
    for (int64_t o = 0; o < L->n_o; ++o) {
        if (L->outlier_cols[o] < 0 || L->outlier_cols[o] >= L->in) {
            return vq_fail(err, err_size, "outlier column %d is outside [0, %lld)", L->outlier_cols[o], (long long) L->in);
        }
    }
    const int64_t n_oidx = L->n_o * (L->v0 ? L->out / L->v0 : 0);
    for (int64_t i = 0; i < n_oidx; ++i) {
        if ((uint16_t) L->outlier_idx[i] >= (1u << L->b0)) {
            return vq_fail(err, err_size, "outlier index %u is outside a codebook of %u entries", (uint16_t) L->outlier_idx[i], 1u << L->b0);
        }
    }
    return true;
}

// the code of stored column j in a vector row's bit stream; reads only the bytes that hold it
static inline uint32_t vq_code(const uint8_t * stream, int64_t j, int b) {
    const uint64_t bit   = (uint64_t) j * (uint64_t) b;
    const uint8_t * src  = stream + (bit >> 3);
    const int shift      = (int) (bit & 7);
    const int nbytes     = (shift + b + 7) >> 3;
    uint64_t word = 0;
    for (int k = 0; k < nbytes; ++k) {
        word |= (uint64_t) src[k] << (8 * k);
    }
    return (uint32_t) ((word >> shift) & (((uint64_t) 1 << b) - 1));
}

// the tail's rows (output channels P*v ..) into dst[n_tail][in]: their values, times the row scale
static void vq_decode_tail(const struct ggml_vq_layout * L, float * dst) {
    for (int64_t e = 0; e < L->n_tail; ++e) {
        const float u = ggml_vq_row_scale(L, L->P * L->v + e);
        for (int64_t c = 0; c < L->in; ++c) {
            dst[e * L->in + c] = GGML_FP16_TO_FP32(L->tail[e * L->in + c]) * u;
        }
    }
}

void ggml_vq_decode_vrow(const struct ggml_vq_layout * L, int64_t p, float * dst) {
    if (p == L->P) {
        vq_decode_tail(L, dst);
        return;
    }
    const int     v       = L->v;
    const int     b       = L->b1 + L->b2;
    const int64_t in      = L->in;
    const int64_t K1      = (int64_t) 1 << L->b1;
    const int64_t K2      = (int64_t) 1 << L->b2;
    const int64_t gcols   = in / L->G;
    const uint8_t * stream = L->codes + p * (in * b / 8);

    for (int64_t j = 0; j < in; ++j) {
        const uint32_t code = vq_code(stream, j, b);
        const int64_t  g    = j / gcols;
        const int64_t  c    = L->perm ? L->perm[j] : j;
        const float    s    = L->col_norm ? L->col_norm[j]      : 1.0f;
        const float    t    = L->col_norm ? L->col_norm[in + j] : 0.0f;
        const ggml_fp16_t * cm = L->codebook + (g * K1 + (code & (K1 - 1))) * v;
        const ggml_fp16_t * cr = L->res_codebook ? L->res_codebook + (g * K2 + (code >> L->b1)) * v : NULL;
        for (int e = 0; e < v; ++e) {
            const float x = GGML_FP16_TO_FP32(cm[e]) + (cr ? GGML_FP16_TO_FP32(cr[e]) : 0.0f);
            dst[e * in + c] = x * s + t;
        }
    }

    const int64_t Q0 = L->v0 ? L->out / L->v0 : 0;
    for (int64_t o = 0; o < L->n_o; ++o) {
        const int64_t c = L->outlier_cols[o];
        for (int e = 0; e < v; ++e) {
            const int64_t r   = p * v + e;
            const uint32_t id = (uint16_t) L->outlier_idx[o * Q0 + r / L->v0] & ((1u << L->b0) - 1);
            dst[e * in + c] += GGML_FP16_TO_FP32(L->outlier_codebook[(int64_t) id * L->v0 + r % L->v0]);
        }
    }

    if (L->row_scale || L->row_scale_f16) {
        for (int e = 0; e < v; ++e) {
            const float u = ggml_vq_row_scale(L, p * v + e);
            for (int64_t c = 0; c < in; ++c) {
                dst[e * in + c] *= u;
            }
        }
    }
}

void ggml_vq_dequantize(const struct ggml_vq_layout * L, float * dst) {
    for (int64_t p = 0; p < L->P + (L->n_tail > 0); ++p) {
        ggml_vq_decode_vrow(L, p, dst + p * L->v * L->in);
    }
}

struct ggml_tensor * ggml_vq_attach(struct ggml_tensor * mul_mat, struct ggml_tensor * const * sides) {
    GGML_ASSERT(mul_mat->op == GGML_OP_MUL_MAT && ggml_is_vq(mul_mat->src[0]->type));
    for (int i = 0; i < GGML_VQ_N_SIDES; ++i) {
        mul_mat->src[GGML_VQ_SRC_FIRST + i] = sides[i];
    }
    return mul_mat;
}
