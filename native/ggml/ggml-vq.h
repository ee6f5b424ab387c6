// Vector-quantized (VQ) weights in ggml: types, side tensors, reference decoder.
// The bit layout is defined in docs/format.md; this header follows it.
#pragma once

#include "ggml.h"

#include <assert.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GGML_VQ_FORMAT_VERSION 4                   // reads 1-3 too: 2 adds shared side tensors, 3 vq.rope_neox, 4 vq_tail
#define GGML_VQ_FORMAT_KEY     "vq.format_version"
#define GGML_VQ_LINK_PREFIX    "vq.link."           // vq.link.<side tensor name> = "vq_shared.<label>.<suffix>"
#define GGML_VQ_SHARED_PREFIX  "vq_shared."
#define GGML_VQ_BLCK_SIZE      32

// type id = GGML_VQ_TYPE_BASE + n, with n/4 index bits per weight, n in [GGML_VQ_N_MIN, GGML_VQ_N_MAX]
#define GGML_VQ_TYPE_BASE 200
#define GGML_VQ_N_MIN     2
#define GGML_VQ_N_MAX     32

// side tensors of a VQ weight, in the order they sit in the MUL_MAT node: src[GGML_VQ_SRC_FIRST + side]
enum ggml_vq_side {
    GGML_VQ_CODEBOOK = 0,       // F16 [v, K1, G]
    GGML_VQ_RES_CODEBOOK,       // F16 [v, K2, G]   optional
    GGML_VQ_PERM,               // I32 [in]         optional
    GGML_VQ_COL_NORM,           // F32 [in, 2]      optional
    GGML_VQ_ROW_SCALE,          // F16 or F32 [out] optional
    GGML_VQ_OUTLIER_COLS,       // I32 [n_o]        optional, with the next two
    GGML_VQ_OUTLIER_IDX,        // I16 [out/v0, n_o]
    GGML_VQ_OUTLIER_CODEBOOK,   // F16 [v0, K0]
    GGML_VQ_TAIL,               // F16 [in, out % v] with out % v > 0: the last output channels, plain values
    GGML_VQ_N_SIDES,
};
#define GGML_VQ_SRC_FIRST 2
static_assert(GGML_VQ_SRC_FIRST + GGML_VQ_N_SIDES <= GGML_MAX_SRC, "a VQ MUL_MAT node holds the weight, the activations and every side tensor");

// a VQ weight resolved to host pointers: what every decoder reads
struct ggml_vq_layout {
    int64_t in, out;      // logical shape: ne = [in, out]
    int32_t v, b1, b2;    // vector length, main and residual index bits (b2 = 0: no residual)
    int64_t P, n_tail;    // vector rows (out / v) and the tail's output channels (out % v)
    int64_t G;            // column groups (codebooks)
    int64_t n_o;          // outlier columns (0: none)
    int32_t v0, b0;       // outlier vector length and index bits
    const uint8_t     * codes;
    const ggml_fp16_t * codebook;
    const ggml_fp16_t * res_codebook;
    const int32_t     * perm;
    const float       * col_norm;
    const float       * row_scale;      // an F32 row scale, or NULL
    const ggml_fp16_t * row_scale_f16;  // an F16 row scale, or NULL (at most one of the two is set)
    const int32_t     * outlier_cols;
    const int16_t     * outlier_idx;
    const ggml_fp16_t * outlier_codebook;
    const ggml_fp16_t * tail;           // [n_tail][in], or NULL
};

GGML_API bool         ggml_is_vq(enum ggml_type type);
GGML_API int          ggml_vq_rate_quarters(enum ggml_type type);  // n: index bits per weight times 4
GGML_API const char * ggml_vq_side_suffix(enum ggml_vq_side side); // "vq_codebook", ...

// Checks the shapes and types of a weight and its side tensors (sides[GGML_VQ_N_SIDES], NULL where absent)
// against docs/format.md and fills the geometry of `layout` (pointers from tensor->data, which may be
// device memory). Returns false with a message in err.
GGML_API bool ggml_vq_layout_init(struct ggml_vq_layout * layout, const struct ggml_tensor * w,
                                  struct ggml_tensor * const * sides, char * err, size_t err_size);

// Checks the side tensors' data (host pointers in layout): perm is a permutation, outliers in range.
GGML_API bool ggml_vq_check_data(const struct ggml_vq_layout * layout, char * err, size_t err_size);

// u_r: the row scale of output channel r, 1 without one
static inline float ggml_vq_row_scale(const struct ggml_vq_layout * layout, int64_t r) {
    return layout->row_scale ? layout->row_scale[r] : layout->row_scale_f16 ? ggml_fp16_to_fp32(layout->row_scale_f16[r]) : 1.0f;
}

// Reference decoder. Decodes vector row p (output channels p*v .. p*v+v-1) into dst[v][in], in the
// original column order, outliers and row scale included; p = P decodes the tail (n_tail rows).
GGML_API void ggml_vq_decode_vrow(const struct ggml_vq_layout * layout, int64_t p, float * dst);

// Reference decoder for the whole weight into dst[out][in].
GGML_API void ggml_vq_dequantize(const struct ggml_vq_layout * layout, float * dst);

// Attaches the side tensors to a MUL_MAT node whose src[0] is a VQ weight; returns the node.
GGML_API struct ggml_tensor * ggml_vq_attach(struct ggml_tensor * mul_mat, struct ggml_tensor * const * sides);

// type traits for ggml.c's table: one entry per VQ type
#define GGML_VQ_TYPE_TRAIT(n, name) \
    [GGML_VQ_TYPE_BASE + (n)] = { .type_name = name, .blck_size = GGML_VQ_BLCK_SIZE, .type_size = (n), .is_quantized = true },
#define GGML_VQ_TYPE_TRAITS \
    GGML_VQ_TYPE_TRAIT( 2, "vq0_50") GGML_VQ_TYPE_TRAIT( 3, "vq0_75") GGML_VQ_TYPE_TRAIT( 4, "vq1_00") \
    GGML_VQ_TYPE_TRAIT( 5, "vq1_25") GGML_VQ_TYPE_TRAIT( 6, "vq1_50") GGML_VQ_TYPE_TRAIT( 7, "vq1_75") \
    GGML_VQ_TYPE_TRAIT( 8, "vq2_00") GGML_VQ_TYPE_TRAIT( 9, "vq2_25") GGML_VQ_TYPE_TRAIT(10, "vq2_50") \
    GGML_VQ_TYPE_TRAIT(11, "vq2_75") GGML_VQ_TYPE_TRAIT(12, "vq3_00") GGML_VQ_TYPE_TRAIT(13, "vq3_25") \
    GGML_VQ_TYPE_TRAIT(14, "vq3_50") GGML_VQ_TYPE_TRAIT(15, "vq3_75") GGML_VQ_TYPE_TRAIT(16, "vq4_00") \
    GGML_VQ_TYPE_TRAIT(17, "vq4_25") GGML_VQ_TYPE_TRAIT(18, "vq4_50") GGML_VQ_TYPE_TRAIT(19, "vq4_75") \
    GGML_VQ_TYPE_TRAIT(20, "vq5_00") GGML_VQ_TYPE_TRAIT(21, "vq5_25") GGML_VQ_TYPE_TRAIT(22, "vq5_50") \
    GGML_VQ_TYPE_TRAIT(23, "vq5_75") GGML_VQ_TYPE_TRAIT(24, "vq6_00") GGML_VQ_TYPE_TRAIT(25, "vq6_25") \
    GGML_VQ_TYPE_TRAIT(26, "vq6_50") GGML_VQ_TYPE_TRAIT(27, "vq6_75") GGML_VQ_TYPE_TRAIT(28, "vq7_00") \
    GGML_VQ_TYPE_TRAIT(29, "vq7_25") GGML_VQ_TYPE_TRAIT(30, "vq7_50") GGML_VQ_TYPE_TRAIT(31, "vq7_75") \
    GGML_VQ_TYPE_TRAIT(32, "vq8_00")

#ifdef __cplusplus
}
#endif
