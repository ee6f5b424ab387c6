// Internal to the CPU MUL_MAT of VQ weights: what vq-cpu.c (instruction-set choice, geometry, the portable
// paths, the op) and the per-instruction-set kernel files (vq-cpu-avx2.c, vq-cpu-avx512.c, vq-cpu-neon.c) share. Each kernel
// file compiles to nothing where its instruction set is not enabled; vq-cpu.c calls a kernel only when the
// same VQ_HAVE_* macro is defined, and only when the call's instruction set (vq_isa, capped by GGML_VQ_ISA)
// allows it. Copied into ggml/src/ggml-cpu/ by the build.
#pragma once

#include "vq-cpu.h"
#include "ggml-vq.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "vec.h"

#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__F16C__) && defined(__FMA__)
#define VQ_HAVE_AVX512 1
#if defined(__AVX512VBMI__)
#define VQ_HAVE_VBMI 1
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VQ_HAVE_AVX2 1
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define VQ_HAVE_NEON 1
#endif
#if defined(VQ_HAVE_AVX2) && defined(GGML_SIMD) && defined(GGML_F32_STEP) && defined(GGML_F32_EPR) && GGML_F32_STEP % 8 == 0
#define VQ_HAVE_CENTX 1 // ggml_vec_dot_f32's accumulators are whole 8-lane vectors (AVX2: 4 x 8, AVX-512: 4 x 16)
#endif

#if defined(_MSC_VER)
#define VQ_ALWAYS_INLINE __forceinline
#else
#define VQ_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

// a loop over a micro-kernel's accumulators, fully unrolled: without it GCC keeps the accumulator array in
// memory too and stores every accumulator at every step (12 stores per 12 FMAs), half the kernel's speed
#if defined(__clang__)
#define VQ_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define VQ_UNROLL _Pragma("GCC unroll 16")
#else
#define VQ_UNROLL
#endif

// ordered within a family (x86: avx2 < avx512 < vbmi); NEON is Arm's only level, below the x86 ones so that no
// x86 path's `isa >= VQ_ISA_AVX2` admits it
enum vq_isa { VQ_ISA_REF = 0, VQ_ISA_SCALAR, VQ_ISA_NEON, VQ_ISA_AVX2, VQ_ISA_AVX512, VQ_ISA_VBMI, VQ_ISA_COUNT };

// ---------------------------------------------------------------------------------------------------------
// geometry of one call: a function of the node and the instruction set only (vq_geom_init), shared by the
// plan (work size) and the compute

#define VQ_FUSED_MAX_TOKENS 8           // up to this many tokens: fused decode-and-dot; more: gemm
#define VQ_TILE_BYTES       (256*1024)  // decoded f32 rows per thread (gemm, scalar)
#define VQ_LUT_MAX_BYTES    (256*1024)  // byte-plane tables per thread (lut)
#define VQ_CHUNK            256         // columns of codes unpacked at a time (a multiple of 16)
#define VQ_CX_PAD           8           // values after centx's tables (a v = 6 load reads 8, a v = 3 load 4)

// cent's lanes per centroid: v rounded up to a power of two (lanes past v are computed, never stored)
static inline int vq_cent_vp(int v) {
    return v <= 2 ? 2 : v <= 4 ? 4 : v <= 8 ? 8 : 16;
}

enum vq_path {
    VQ_PATH_REF, VQ_PATH_SCALAR, VQ_PATH_CENT, VQ_PATH_LUT, VQ_PATH_GEMM,
    VQ_PATH_LUTX,   // one token, exact: lut lookups in ggml_vec_dot_f32's order on the reference weights
    VQ_PATH_DECX,   // one token, exact: decode rows (reference values), then ggml_vec_dot_f32
    VQ_PATH_CENTX,  // one token, exact: cent loads summed in ggml_vec_dot_f32's order (plain, v in {2, 4, 8})
};

struct vq_geom {
    int64_t in, out, P, G, gcols, K1, K2, ntok;
    int     v, b, b1, b2;
    int     path;
    bool    prep;        // fused paths: prepared activations in the shared buffer
    int     mr, nr;      // gemm: rows per panel, tokens per block
    int64_t tile_vrows;  // gemm, scalar, ref: vector rows decoded at a time
    size_t  shared_bytes, xs_bytes;                 // shared: activations (xs or packed), then tb[ntok]
    size_t  lut_bytes, idx_bytes, cbuf_bytes, tile_bytes, xinfo_bytes, rs_bytes, tail_bytes, thread_bytes; // per thread
    bool    perm, norm, plain; // plain: no permutation, column norm, row scale or outliers
    int64_t n_o;
};

static inline size_t vq_pad64(size_t n) {
    return (n + 63) & ~(size_t) 63;
}

// bytes of one byte-plane table for a codebook of K entries (at least one 64-byte register)
static inline int64_t vq_lut_kp(int64_t K) {
    return K < 64 ? 64 : K;
}
// cent's gathers of 8 fp16 lanes, for centroids of v < VP values (v = 3, 6) padded to VP lanes: where a load of VP
// values from ptr[i] would pass the end of the codebook (its last centroids), q[i] points to a zero-padded copy in
// tail[i] instead; otherwise to ptr[i]. Lanes past v are computed but never stored.
static VQ_ALWAYS_INLINE void vq_cent_padded(const ggml_fp16_t * const * ptr, const int VP, const int v, const ggml_fp16_t * end,
                                            ggml_fp16_t tail[4][8], const ggml_fp16_t ** q) {
    for (int i = 0; i < 8 / VP; ++i) {
        q[i] = ptr[i];
        if (ptr[i] + VP > end) {
            memset(tail[i], 0, 8 * sizeof(ggml_fp16_t));
            memcpy(tail[i], ptr[i], v * sizeof(ggml_fp16_t));
            q[i] = tail[i];
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// per call context

struct vq_call {
    struct ggml_vq_layout L;
    struct vq_geom        g;
    int isa;
    const struct ggml_tensor * src1;
    struct ggml_tensor       * dst;
    const float * xprep;      // fused paths: [ntok][in] prepared activations, or NULL: src1's rows
    const float * bpack;      // gemm: [ntok / nr][in][nr] prepared activations
    const float * tb;         // [ntok] bias term of the column norm, or NULL
    int64_t code_bytes;       // bytes of the whole code tensor
    int64_t row_bytes;        // bytes of one vector row's stream
    uint8_t  up_perm[64];     // code unpacking, 16 codes at a time (b <= 25)
    uint32_t up_shift[16];
};

static VQ_ALWAYS_INLINE const float * vq_src_row(const struct vq_call * c, int64_t t) {
    const struct ggml_tensor * s = c->src1;
    const int64_t i11 = t % s->ne[1];
    const int64_t i12 = (t / s->ne[1]) % s->ne[2];
    const int64_t i13 = t / (s->ne[1] * s->ne[2]);
    return (const float *) ((const char *) s->data + i11 * s->nb[1] + i12 * s->nb[2] + i13 * s->nb[3]);
}

// the activations the weight's stored columns multiply (fused paths)
static VQ_ALWAYS_INLINE const float * vq_x_row(const struct vq_call * c, int64_t t) {
    return c->xprep ? c->xprep + t * c->g.in : vq_src_row(c, t);
}

static VQ_ALWAYS_INLINE float * vq_y_row(const struct vq_call * c, int64_t t) {
    const struct ggml_tensor * d = c->dst;
    const int64_t i1 = t % d->ne[1];
    const int64_t i2 = (t / d->ne[1]) % d->ne[2];
    const int64_t i3 = t / (d->ne[1] * d->ne[2]);
    return (float *) ((char *) d->data + i1 * d->nb[1] + i2 * d->nb[2] + i3 * d->nb[3]);
}

// the code of stored column j (b <= 32 bits) of a stream; reads 8 bytes unless that would leave the tensor
static VQ_ALWAYS_INLINE uint32_t vq_code_at(const struct vq_call * c, const uint8_t * stream, int64_t j) {
    const int b = c->g.b;
    const uint64_t bit = (uint64_t) j * (uint64_t) b;
    const uint8_t * src = stream + (bit >> 3);
    const int shift = (int) (bit & 7);
    uint64_t word = 0;
    if (src + 8 <= c->L.codes + c->code_bytes) {
        memcpy(&word, src, 8);
    } else {
        const int nbytes = (shift + b + 7) >> 3;
        for (int k = 0; k < nbytes; ++k) {
            word |= (uint64_t) src[k] << (8 * k);
        }
    }
    return (uint32_t) ((word >> shift) & (((uint64_t) 1 << b) - 1));
}

// --- vq-cpu.c: portable parts the kernels share

// codes of stored columns [j0, j0 + n) of vector row p into dst; j0 and n multiples of 16
void vq_unpack(const struct vq_call * c, int64_t p, int64_t j0, int64_t n, uint32_t * dst);
// vector row p's codebook values (no norm, outliers, row scale), stored column order, into dst[e * ld + j]
void vq_decode_vrow_plain(const struct vq_call * c, int64_t p, float * dst, int64_t ld, uint32_t * codes);
// one token, exact: rows [p0, p1) decoded to the reference decoder's values, then ggml_vec_dot_f32
void vq_decx_rows(const struct vq_call * c, int64_t p0, int64_t p1, float * tile, uint32_t * cbuf);

#if defined(VQ_HAVE_AVX2) // --- vq-cpu-avx2.c
void vq_unpack_avx2(const struct vq_call * c, const uint8_t * stream, int64_t j0, int64_t n, uint32_t * dst);
void vq_cent256_rows(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0, int nt, uint32_t * cbuf);
void vq_decx8(const struct vq_call * c, int64_t p, int half, float * dst, uint32_t * cbuf);
void vq_decx_extras(const struct vq_call * c, int64_t r0, int nrows, float * src, float * dst);
void vq_gemm_rows(const struct vq_call * c, int64_t p0, int64_t p1, float * tile, uint32_t * codes);
#endif
#if defined(VQ_HAVE_CENTX)
void vq_centx_rows(const struct vq_call * c, int64_t p0, int64_t p1, ggml_fp16_t * T, float * tile, uint32_t * cbuf);
#endif
#if defined(VQ_HAVE_AVX512) // --- vq-cpu-avx512.c
void vq_unpack_avx512(const struct vq_call * c, const uint8_t * stream, int64_t j0, int64_t n, uint32_t * dst);
void vq_cent512_rows(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0, int nt, uint32_t * cbuf);
void vq_mk512_n(int64_t k, const float * A, const float * B, float * const * C, int64_t r0, int64_t nrows, int nt);
#endif
#if defined(VQ_HAVE_NEON) // --- vq-cpu-neon.c
void vq_cent_neon_rows(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0, int nt, uint32_t * cbuf);
// 8 output rows (vector rows p .. p + 8/v - 1, v in {2, 4, 8}, plain weights) into dst[k * in + j]; cbuf: 4 chunks
void vq_decx8_neon(const struct vq_call * c, int64_t p, float * dst, uint32_t * cbuf);
#endif
#if defined(VQ_HAVE_VBMI)
// lut: tokens [0, ntok) of rows [p0, p1); lutx: one token, exact (the thread's buffers as the op lays them out)
void vq_lut(const struct vq_call * c, int64_t p0, int64_t p1, uint8_t * tab1, uint8_t * tab2, uint8_t * ib1, uint8_t * ib2);
void vq_lutx(const struct vq_call * c, int64_t p0, int64_t p1, uint8_t * tab1, uint8_t * tab2, uint8_t * ib1, uint8_t * ib2,
             uint8_t * ibo, char * xmem);
#endif
