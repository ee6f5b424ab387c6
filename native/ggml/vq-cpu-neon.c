// Arm NEON kernels of the VQ MUL_MAT (vq-cpu.c chooses the path; docs/kernels.md): cent for 2..8 tokens and
// an 8-row decoder for decx (one token, exact) and the scalar path's tiles (prompts). Both read centroids as
// fp16 straight from the codebook and widen them with vcvt; 8 f32 lanes are kept as two 128-bit registers, so
// that one column's R = 8 / VP centroids (VP: v rounded up to a power of two) fill one 8-lane vector, as in
// the AVX2 kernels. Tested against the reference decoder under qemu-user (tests/test_kernels.py), where the
// speed of this file cannot be measured.

#include "vq-cpu-impl.h"

#if defined(VQ_HAVE_NEON)

typedef struct { float32x4_t lo, hi; } vq_f32x8;

static VQ_ALWAYS_INLINE vq_f32x8 vq8_zero(void) {
    return (vq_f32x8) { vdupq_n_f32(0.0f), vdupq_n_f32(0.0f) };
}
static VQ_ALWAYS_INLINE vq_f32x8 vq8_add(vq_f32x8 a, vq_f32x8 b) {
    return (vq_f32x8) { vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi) };
}
static VQ_ALWAYS_INLINE vq_f32x8 vq8_fma(vq_f32x8 a, vq_f32x8 b, vq_f32x8 acc) { // acc + a * b
    return (vq_f32x8) { vfmaq_f32(acc.lo, a.lo, b.lo), vfmaq_f32(acc.hi, a.hi, b.hi) };
}
static VQ_ALWAYS_INLINE vq_f32x8 vq8_set1(float s) {
    return (vq_f32x8) { vdupq_n_f32(s), vdupq_n_f32(s) };
}
static VQ_ALWAYS_INLINE void vq8_store(float * p, vq_f32x8 a) {
    vst1q_f32(p, a.lo);
    vst1q_f32(p + 4, a.hi);
}

// 8 fp16 values side by side: R = 8 / V centroids of V in {2, 4, 8} values
static VQ_ALWAYS_INLINE uint16x8_t vq_cent_load8h(const ggml_fp16_t * const * ptr, const int V) {
    if (V == 8) {
        return vld1q_u16((const uint16_t *) ptr[0]);
    }
    if (V == 4) {
        return vcombine_u16(vld1_u16((const uint16_t *) ptr[0]), vld1_u16((const uint16_t *) ptr[1]));
    }
    uint32_t w[4];
    for (int i = 0; i < 4; ++i) {
        memcpy(&w[i], ptr[i], 4);
    }
    return vreinterpretq_u16_u32(vld1q_u32(w));
}

static VQ_ALWAYS_INLINE vq_f32x8 vq_widen8h(uint16x8_t h) {
    const float16x8_t f = vreinterpretq_f16_u16(h);
    return (vq_f32x8) { vcvt_f32_f16(vget_low_f16(f)), vcvt_f32_f16(vget_high_f16(f)) };
}

// the same for centroids of v <= VP values (vq_cent_padded)
static VQ_ALWAYS_INLINE vq_f32x8 vq_cent_gather_neon(const ggml_fp16_t * const * ptr, const int VP, const int v, const ggml_fp16_t * end) {
    if (v == VP) {
        return vq_widen8h(vq_cent_load8h(ptr, VP));
    }
    ggml_fp16_t tail[4][8];
    const ggml_fp16_t * q[4];
    vq_cent_padded(ptr, VP, v, end, tail, q);
    return vq_widen8h(vq_cent_load8h(q, VP));
}

#define VQ_CENT_NAME vq_cent_neon_rows_impl
#define VQ_CENT_LANES 8
#define VQ_CENT_VEC vq_f32x8
#define VQ_CENT_ZERO() vq8_zero()
#define VQ_CENT_ADD(a, b) vq8_add(a, b)
#define VQ_CENT_FMA(a, b, c) vq8_fma(a, b, c)
#define VQ_CENT_SET1(s) vq8_set1(s)
#define VQ_CENT_STORE(p, a) vq8_store(p, a)
#define VQ_CENT_GATHER(ptr, VP, v, end) vq_cent_gather_neon(ptr, VP, v, end)
#include "vq-cpu-cent.inc"

void vq_cent_neon_rows(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0, int nt, uint32_t * cbuf) {
    const int v = c->g.v;
    const int VP = vq_cent_vp(v);
    const bool res = c->L.res_codebook != NULL;
#define VQ_CN_CASE(NT, V, PAD, RES) if (nt == NT && VP == V && (v != VP) == PAD && res == RES) { vq_cent_neon_rows_impl(c, p0, p1, t0, NT, V, PAD, RES, cbuf); return; }
#define VQ_CN_CASES(NT, RES) VQ_CN_CASE(NT, 2, false, RES) VQ_CN_CASE(NT, 4, false, RES) VQ_CN_CASE(NT, 8, false, RES) \
                             VQ_CN_CASE(NT, 4, true, RES)  VQ_CN_CASE(NT, 8, true, RES)
    VQ_CN_CASES(1, false) VQ_CN_CASES(2, false) VQ_CN_CASES(3, false) VQ_CN_CASES(4, false)
    VQ_CN_CASES(1, true)  VQ_CN_CASES(2, true)  VQ_CN_CASES(3, true)  VQ_CN_CASES(4, true)
#undef VQ_CN_CASES
#undef VQ_CN_CASE
    GGML_ABORT("vq cent neon: no kernel for v=%d, %d tokens", v, nt);
}

// ---------------------------------------------------------------------------------------------------------
// 8 output rows decoded to the reference decoder's values (codebook sums in f32, plain weights): vector rows
// p .. p + 8/V - 1, V in {2, 4, 8}, into dst[k * in + j]. Four columns at a time are widened into four 8-lane
// vectors and transposed into 8 row pieces of 4.

static VQ_ALWAYS_INLINE void vq_transpose4(float32x4_t * a, float32x4_t * b, float32x4_t * c, float32x4_t * d) {
    const float32x4x2_t ab = vtrnq_f32(*a, *b), cd = vtrnq_f32(*c, *d);
    *a = vcombine_f32(vget_low_f32(ab.val[0]), vget_low_f32(cd.val[0]));
    *b = vcombine_f32(vget_low_f32(ab.val[1]), vget_low_f32(cd.val[1]));
    *c = vcombine_f32(vget_high_f32(ab.val[0]), vget_high_f32(cd.val[0]));
    *d = vcombine_f32(vget_high_f32(ab.val[1]), vget_high_f32(cd.val[1]));
}

static VQ_ALWAYS_INLINE void vq_decx8_neon_impl(const struct vq_call * c, int64_t p, float * dst, uint32_t * cbuf,
                                                const int V, const bool RES) {
    const int64_t in = c->g.in, gcols = c->g.gcols;
    const uint32_t m1 = (uint32_t) (c->g.K1 - 1);
    const int b1 = c->g.b1;
    const int R = 8 / V;
    for (int64_t j0 = 0; j0 < in; j0 += VQ_CHUNK) {
        const int64_t n = MIN(VQ_CHUNK, in - j0);
        for (int i = 0; i < R; ++i) {
            vq_unpack(c, p + i, j0, n, cbuf + i * VQ_CHUNK);
        }
        for (int64_t js = j0; js < j0 + n; ) {
            const int64_t g  = js / gcols;
            const int64_t je = MIN(j0 + n, (g + 1) * gcols);
            const ggml_fp16_t * C  = c->L.codebook + g * c->g.K1 * V;
            const ggml_fp16_t * Rc = RES ? c->L.res_codebook + g * c->g.K2 * V : NULL;
#define VQ_DX_COL(J, W) do { \
                const ggml_fp16_t * pm[4], * pr[4]; \
                for (int i = 0; i < R; ++i) { \
                    const uint32_t code = cbuf[i * VQ_CHUNK + (J) - j0]; \
                    pm[i] = C + (code & m1) * V; \
                    pr[i] = RES ? Rc + (code >> b1) * V : pm[i]; \
                } \
                W = vq_widen8h(vq_cent_load8h(pm, V)); \
                if (RES) { \
                    W = vq8_add(W, vq_widen8h(vq_cent_load8h(pr, V))); \
                } \
            } while (0)
            int64_t j = js;
            for (; j + 4 <= je; j += 4) {
                vq_f32x8 w0, w1, w2, w3;
                VQ_DX_COL(j, w0); VQ_DX_COL(j + 1, w1); VQ_DX_COL(j + 2, w2); VQ_DX_COL(j + 3, w3);
                vq_transpose4(&w0.lo, &w1.lo, &w2.lo, &w3.lo);
                vq_transpose4(&w0.hi, &w1.hi, &w2.hi, &w3.hi);
                vst1q_f32(dst + 0 * in + j, w0.lo); vst1q_f32(dst + 1 * in + j, w1.lo);
                vst1q_f32(dst + 2 * in + j, w2.lo); vst1q_f32(dst + 3 * in + j, w3.lo);
                vst1q_f32(dst + 4 * in + j, w0.hi); vst1q_f32(dst + 5 * in + j, w1.hi);
                vst1q_f32(dst + 6 * in + j, w2.hi); vst1q_f32(dst + 7 * in + j, w3.hi);
            }
            for (; j < je; ++j) {
                vq_f32x8 w;
                float col[8];
                VQ_DX_COL(j, w);
                vq8_store(col, w);
                for (int k = 0; k < 8; ++k) {
                    dst[k * in + j] = col[k];
                }
            }
#undef VQ_DX_COL
            js = je;
        }
    }
}

void vq_decx8_neon(const struct vq_call * c, int64_t p, float * dst, uint32_t * cbuf) {
    const bool res = c->L.res_codebook != NULL;
    switch (c->g.v * 2 + res) {
        case 4:  vq_decx8_neon_impl(c, p, dst, cbuf, 2, false); return;
        case 5:  vq_decx8_neon_impl(c, p, dst, cbuf, 2, true);  return;
        case 8:  vq_decx8_neon_impl(c, p, dst, cbuf, 4, false); return;
        case 9:  vq_decx8_neon_impl(c, p, dst, cbuf, 4, true);  return;
        case 16: vq_decx8_neon_impl(c, p, dst, cbuf, 8, false); return;
        case 17: vq_decx8_neon_impl(c, p, dst, cbuf, 8, true);  return;
    }
    GGML_ABORT("vq decx8 neon: v=%d", c->g.v);
}

#endif // VQ_HAVE_NEON
