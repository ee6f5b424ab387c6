// CPU MUL_MAT for VQ weights (docs/format.md; design and measurements in docs/kernels.md).
//
// y[r] = u_r * ( sum_j (C+R)[code(p,j)][e] * xs[j]  +  tb  +  sum_o O(o,r) * x[oc_o] )      r = p*v + e
// with xs[j] = s_j * x[perm j] and tb = sum_j t_j * x[perm j] (the "prepared" activations, made once per call
// and shared by the threads), which equals the definition of format.md §5 up to float rounding.
//
// Paths, chosen per call from the token count, the code layout and the instruction set (never from the
// thread count):
//   2 .. VQ_FUSED_MAX_TOKENS tokens (batched generation), fused decode-and-dot:
//     lut   AVX-512 VBMI, K1 and K2 <= 256. Lane e of a codebook is a table of K fp16 values, split into a
//           low-byte and a high-byte plane held in registers; 64 codes are looked up at once with byte
//           permutes (vpermb / vpermt2b), re-interleaved into fp16, widened to f32 and multiplied with 64
//           consecutive activations. 8-bit codes are read in place, other widths are unpacked per vector
//           row into byte indices first.
//     cent  AVX-512 (v <= 16) or AVX2 (v in {2, 3, 4, 6, 8}), any K: 16/VP (8/VP) vector rows at one input column
//           at a time (VP: v rounded up to a power of two, vq_cent_vp); their centroids, read as fp16
//           straight from the codebook, fill one vector that is widened and multiplied with the broadcast
//           activation.
//   one token (generation), exact: bitwise ggml_vec_dot_f32 on the reference decoder's weights
//     lutx  AVX-512 VBMI, K1 and K2 <= 256: lut's lookups, summed in ggml_vec_dot_f32's order.
//     centx AVX2 and up, no permutation, norm or outliers (row scale allowed), v in {2, 3, 4, 6, 8}: cent's
//           loads from a padded copy of the fp16 codebooks, each of ggml_vec_dot_f32's accumulator lanes
//           run as its own chain.
//     decx  anything else: rows decoded, then ggml_vec_dot_f32.
//   many tokens (prompt processing), gemm: a tile of rows is decoded to f32 into the thread's work buffer,
//           packed as panels of 32 (AVX-512) or 16 (AVX2) rows, and multiplied with the activations, packed
//           once per call in blocks of 12 (6) tokens, by an outer-product register-blocked kernel.
//   scalar: decode a tile of rows (scalar), then ggml_vec_dot_f32 per row and token (any architecture).
//   ref:    the reference decoder ggml_vq_decode_vrow and ggml_vec_dot_f32 (the plain path, for comparison).
// GGML_VQ_ISA=ref|scalar|avx2|avx512|vbmi caps the instruction set used (tests, benchmarks); GGML_VQ_DECX=1
// sends every one-token call that would take centx through decx (comparisons).
//
// No allocation: everything lives in the work buffer that ggml_graph_plan sizes with ggml_vq_cpu_work_size.
// Threads own disjoint, even ranges of vector rows. The only synchronisation is one barrier after the
// shared activations are prepared (gemm path; other paths only with a permutation or column norms). Each
// output element is summed in an order fixed by the path and the shapes, never by the thread split.

#include "vq-cpu.h"
#include "ggml-vq.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "vec.h"

#include <stdatomic.h>
#include <stdlib.h>
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
#if defined(VQ_HAVE_AVX2) && defined(GGML_SIMD) && defined(GGML_F32_STEP) && defined(GGML_F32_EPR) && GGML_F32_STEP % 8 == 0
#define VQ_HAVE_CENTX 1 // ggml_vec_dot_f32's accumulators are whole 8-lane vectors (AVX2: 4 x 8, AVX-512: 4 x 16)
#endif

#if defined(_MSC_VER)
#define VQ_ALWAYS_INLINE __forceinline
#else
#define VQ_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

enum vq_isa { VQ_ISA_REF = 0, VQ_ISA_SCALAR, VQ_ISA_AVX2, VQ_ISA_AVX512, VQ_ISA_VBMI };

static int vq_isa_compiled(void) {
#if defined(VQ_HAVE_VBMI)
    return VQ_ISA_VBMI;
#elif defined(VQ_HAVE_AVX512)
    return VQ_ISA_AVX512;
#elif defined(VQ_HAVE_AVX2)
    return VQ_ISA_AVX2;
#else
    return VQ_ISA_SCALAR;
#endif
}

static atomic_int vq_isa_cached = -1;

void ggml_vq_cpu_set_isa(const char * name) {
    static const char * names[] = { "ref", "scalar", "avx2", "avx512", "vbmi" };
    int isa = vq_isa_compiled();
    for (int i = 0; name && i < 5; ++i) {
        if (strcmp(name, names[i]) == 0) {
            isa = i < isa ? i : isa;
        }
    }
    atomic_store_explicit(&vq_isa_cached, isa, memory_order_relaxed);
}

// the best compiled instruction set, capped by the environment variable GGML_VQ_ISA (read once)
static int vq_isa(void) {
    int isa = atomic_load_explicit(&vq_isa_cached, memory_order_relaxed);
    if (isa < 0) {
        ggml_vq_cpu_set_isa(getenv("GGML_VQ_ISA"));
        isa = atomic_load_explicit(&vq_isa_cached, memory_order_relaxed);
    }
    return isa;
}

// GGML_VQ_DECX=1: one token always through decx (read once; for comparisons, docs/kernels.md)
static bool vq_decx_only(void) {
    static atomic_int cached = -1;
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        const char * e = getenv("GGML_VQ_DECX");
        v = e && strcmp(e, "1") == 0;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v;
}

// ---------------------------------------------------------------------------------------------------------
// geometry of one call: a function of the node and the instruction set only, shared by the plan (work
// size) and the compute

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
    size_t  lut_bytes, idx_bytes, cbuf_bytes, tile_bytes, xinfo_bytes, rs_bytes, thread_bytes; // per thread
    bool    perm, norm, plain; // plain: no permutation, column norm, row scale or outliers
    int64_t n_o;
};

static int vq_log2_i64(int64_t k) {
    int b = 0;
    while (((int64_t) 1 << b) < k) {
        ++b;
    }
    return b;
}

static size_t vq_pad64(size_t n) {
    return (n + 63) & ~(size_t) 63;
}

// bytes of one byte-plane table for a codebook of K entries (at least one 64-byte register)
static int64_t vq_lut_kp(int64_t K) {
    return K < 64 ? 64 : K;
}

// centx: the codebooks, main [G][K1][v] then residual [G][K2][v], then VQ_CX_PAD values
static size_t vq_centx_table_bytes(const struct vq_geom * g) {
    return ((size_t) g->G * (g->K1 + (g->b2 ? g->K2 : 0)) * g->v + VQ_CX_PAD) * sizeof(ggml_fp16_t);
}

static void vq_geom_init(struct vq_geom * g, const struct ggml_tensor * node, int isa) {
    const struct ggml_tensor * w    = node->src[0];
    const struct ggml_tensor * x    = node->src[1];
    const struct ggml_tensor * cb   = node->src[GGML_VQ_SRC_FIRST + GGML_VQ_CODEBOOK];
    const struct ggml_tensor * rcb  = node->src[GGML_VQ_SRC_FIRST + GGML_VQ_RES_CODEBOOK];
    const struct ggml_tensor * perm = node->src[GGML_VQ_SRC_FIRST + GGML_VQ_PERM];
    const struct ggml_tensor * norm = node->src[GGML_VQ_SRC_FIRST + GGML_VQ_COL_NORM];
    memset(g, 0, sizeof(*g));
    g->in    = w->ne[0];
    g->out   = w->ne[1];
    g->v     = (int) cb->ne[0];
    g->K1    = cb->ne[1];
    g->K2    = rcb ? rcb->ne[1] : 1;
    g->G     = cb->ne[2];
    g->b1    = vq_log2_i64(g->K1);
    g->b2    = rcb ? vq_log2_i64(g->K2) : 0;
    g->b     = g->b1 + g->b2;
    g->P     = g->v > 0 ? g->out / g->v : 0;
    g->gcols = g->G > 0 ? g->in / g->G : g->in;
    g->ntok  = x->ne[1] * x->ne[2] * x->ne[3];
    const bool has_prep = perm != NULL || norm != NULL;
    const struct ggml_tensor * ocols = node->src[GGML_VQ_SRC_FIRST + GGML_VQ_OUTLIER_COLS];
    const struct ggml_tensor * rs    = node->src[GGML_VQ_SRC_FIRST + GGML_VQ_ROW_SCALE];
    g->perm  = perm != NULL;
    g->norm  = norm != NULL;
    g->n_o   = ocols ? ocols->ne[0] : 0;
    g->plain = !perm && !norm && !rs && !ocols;

    const bool   few       = g->ntok <= VQ_FUSED_MAX_TOKENS;
    const size_t lut_bytes = (size_t) g->G * g->v * 2 * (vq_lut_kp(g->K1) + (g->b2 ? vq_lut_kp(g->K2) : 0));
    // lut costs the same per weight whatever v, cent costs per code: lut for short vectors (measured, docs/kernels.md)
    const bool   lut  = isa >= VQ_ISA_VBMI && g->b1 <= 8 && g->b2 <= 8 && g->v < 8 && lut_bytes <= VQ_LUT_MAX_BYTES;
    const bool   cent = (isa >= VQ_ISA_AVX512 && g->v >= 2 && g->v <= 16) ||
                        (isa >= VQ_ISA_AVX2 && g->v >= 2 && g->v <= 8 && g->v != 5 && g->v != 7);
    // One token (generation): exact, i.e. bitwise the F32 matmul of the decoded weight (ggml_vec_dot_f32 on
    // the reference decoder's values), so that a VQ file gives exactly the logits of its decoded F32 file;
    // rounding differences would otherwise be amplified by the Q8 activations of other layers.
    const bool lutx = isa >= VQ_ISA_VBMI && g->b1 <= 8 && g->b2 <= 8 && lut_bytes <= VQ_LUT_MAX_BYTES && (!g->perm || g->G <= 16);
#if defined(VQ_HAVE_CENTX)
    const bool centx = !vq_decx_only() && isa >= VQ_ISA_AVX2 && !perm && !norm && !ocols &&
                       (g->v == 2 || g->v == 3 || g->v == 4 || g->v == 6 || g->v == 8) &&
                       (g->G == 1 || g->gcols % 8 == 0) && vq_centx_table_bytes(g) <= VQ_LUT_MAX_BYTES;
#else
    const bool centx = false;
#endif
    if (isa == VQ_ISA_REF) {
        g->path = VQ_PATH_REF;
    } else if (g->ntok == 1) {
        g->path = lutx ? VQ_PATH_LUTX : centx ? VQ_PATH_CENTX : VQ_PATH_DECX;
    } else if (isa == VQ_ISA_SCALAR) {
        g->path = VQ_PATH_SCALAR;
    } else if (!few) {
        g->path = VQ_PATH_GEMM;
    } else if (lut) {
        g->path = VQ_PATH_LUT;
    } else if (cent) {
        g->path = VQ_PATH_CENT;
    } else {
        g->path = VQ_PATH_SCALAR;
    }

    switch (g->path) {
        case VQ_PATH_REF:
            g->tile_vrows = g->v >= 64 ? 1 : 64 / g->v;
            g->tile_bytes = vq_pad64((size_t) g->tile_vrows * g->v * g->in * sizeof(float));
            break;
        case VQ_PATH_SCALAR: {
            const int64_t rows = VQ_TILE_BYTES / (g->in * (int64_t) sizeof(float));
            g->tile_vrows = rows / g->v > 0 ? rows / g->v : 1;
            g->tile_bytes = vq_pad64((size_t) g->tile_vrows * g->v * g->in * sizeof(float));
            g->prep       = has_prep;
            break;
        }
        case VQ_PATH_LUTX: {
            g->lut_bytes   = vq_pad64(lut_bytes);
            g->idx_bytes   = (g->perm ? 4 : 2) * vq_pad64((size_t) g->in + 64);
            g->xinfo_bytes = (g->perm && g->norm ? 2 * vq_pad64((size_t) g->in * sizeof(float)) : 0) +
                             (g->perm && g->G > 1 ? vq_pad64((size_t) g->in * sizeof(uint16_t)) : 0) +
                             (g->n_o ? 2 * vq_pad64((size_t) g->n_o * sizeof(int32_t)) + vq_pad64((size_t) (g->in / 64 + 2) * sizeof(int32_t)) : 0) +
                             vq_pad64((size_t) g->in * sizeof(float)); // permuted activations (last)
            break;
        }
        case VQ_PATH_CENTX: // + decx's buffers for the last vector rows, when fewer than 8 / v are left
            g->lut_bytes = vq_pad64(vq_centx_table_bytes(g));
            // fall through
        case VQ_PATH_DECX:
            g->tile_bytes = (g->plain ? 1 : 2) * vq_pad64((size_t) (g->v > 8 ? g->v : 8) * g->in * sizeof(float));
            g->cbuf_bytes = 8 * VQ_CHUNK * sizeof(uint32_t); // codes of up to 8 vector rows
            break;
        case VQ_PATH_LUT:
            g->lut_bytes = vq_pad64(lut_bytes);
            g->idx_bytes = 2 * vq_pad64((size_t) g->in + 64);
            g->prep      = has_prep;
            break;
        case VQ_PATH_CENT:
            g->cbuf_bytes = 16 * VQ_CHUNK * sizeof(uint32_t);
            g->prep       = has_prep;
            break;
        case VQ_PATH_GEMM: {
            g->mr = isa >= VQ_ISA_AVX512 ? 32 : 16;
            g->nr = isa >= VQ_ISA_AVX512 ? 12 : 6;
            // whole panels of rows, at least one vector row
            int64_t panels = VQ_TILE_BYTES / (g->in * g->mr * (int64_t) sizeof(float));
            panels = panels < 1 ? 1 : panels;
            g->tile_vrows = panels * g->mr / g->v > 0 ? panels * g->mr / g->v : 1;
            const int64_t tile_panels = (g->tile_vrows * g->v + g->mr - 1) / g->mr;
            g->tile_bytes = vq_pad64((size_t) tile_panels * g->mr * g->in * sizeof(float));
            g->cbuf_bytes = VQ_CHUNK * sizeof(uint32_t);
            break;
        }
    }
    if (g->path == VQ_PATH_GEMM) {
        const int64_t nblk = (g->ntok + g->nr - 1) / g->nr;
        g->xs_bytes = vq_pad64((size_t) nblk * g->nr * g->in * sizeof(float));
    } else if (g->prep) {
        g->xs_bytes = vq_pad64((size_t) g->ntok * g->in * sizeof(float));
    }
    g->shared_bytes = g->xs_bytes ? g->xs_bytes + vq_pad64((size_t) g->ntok * sizeof(float)) : 0;
    // an F16 row scale is widened to F32 once per call, each thread its own rows (at their index in `out`)
    g->rs_bytes     = rs && rs->type == GGML_TYPE_F16 ? vq_pad64((size_t) g->out * sizeof(float)) : 0;
    g->thread_bytes = g->lut_bytes + g->idx_bytes + g->cbuf_bytes + g->tile_bytes + g->xinfo_bytes + g->rs_bytes;
}

size_t ggml_vq_cpu_work_size(const struct ggml_tensor * node, int n_threads) {
    const struct ggml_tensor * cb = node->src[GGML_VQ_SRC_FIRST + GGML_VQ_CODEBOOK];
    if (node->op != GGML_OP_MUL_MAT || !ggml_is_vq(node->src[0]->type) || !cb) {
        return 0;
    }
    struct vq_geom g;
    vq_geom_init(&g, node, vq_isa());
    return 64 + g.shared_bytes + (size_t) n_threads * g.thread_bytes;
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

// y = (y + tb + outliers) * u for output rows [r0, r1) of token t
static void vq_epilogue(const struct vq_call * c, int64_t r0, int64_t r1, int64_t t) {
    const struct ggml_vq_layout * L = &c->L;
    if (!c->tb && !L->n_o && !L->row_scale) {
        return;
    }
    float * y = vq_y_row(c, t);
    const float tb = c->tb ? c->tb[t] : 0.0f;
    const float * x = L->n_o ? vq_src_row(c, t) : NULL;
    const int64_t Q0 = L->v0 ? L->out / L->v0 : 0;
    const uint32_t omask = L->v0 ? (1u << L->b0) - 1 : 0;
    for (int64_t r = r0; r < r1; ++r) {
        float s = y[r] + tb;
        for (int64_t o = 0; o < L->n_o; ++o) {
            const uint32_t id = (uint16_t) L->outlier_idx[o * Q0 + r / L->v0] & omask;
            s += GGML_CPU_FP16_TO_FP32(L->outlier_codebook[(int64_t) id * L->v0 + r % L->v0]) * x[L->outlier_cols[o]];
        }
        y[r] = L->row_scale ? s * L->row_scale[r] : s;
    }
}

// prepared activations of token t into d[j * stride]: s_j * x[perm j]; returns tb = sum_j t_j * x[perm j]
static float vq_prepare_token(const struct vq_call * c, int64_t t, float * d, int64_t stride) {
    const struct ggml_vq_layout * L = &c->L;
    const int64_t in = L->in;
    const float * x = vq_src_row(c, t);
    const float * s  = L->col_norm;
    const float * tt = L->col_norm ? L->col_norm + in : NULL;
    float acc = 0.0f;
    for (int64_t j = 0; j < in; ++j) {
        const float xv = L->perm ? x[L->perm[j]] : x[j];
        if (tt) {
            acc += tt[j] * xv;
            d[j * stride] = s[j] * xv;
        } else {
            d[j * stride] = xv;
        }
    }
    return acc;
}

// fused paths: xs[t][j], tokens split over the threads
static void vq_prepare_rows(const struct vq_call * c, float * xs, float * tb, int ith, int nth) {
    for (int64_t t = ith; t < c->g.ntok; t += nth) {
        tb[t] = vq_prepare_token(c, t, xs + t * c->g.in, 1);
    }
}

// gemm path: blocks of nr tokens packed as [in][nr] (missing tokens zero), blocks split over the threads
static void vq_prepare_packed(const struct vq_call * c, float * xs, float * tb, int ith, int nth) {
    const int nr = c->g.nr;
    const int64_t in = c->g.in, ntok = c->g.ntok;
    const bool plain = !c->L.perm && !c->L.col_norm;
    for (int64_t blk = ith; blk * nr < ntok; blk += nth) {
        float * d = xs + blk * nr * in;
        const int64_t nt = MIN(nr, ntok - blk * nr);
        if (plain) {
            // transpose in tiles that stay in L1
            const float * x[16];
            for (int64_t i = 0; i < nt; ++i) {
                x[i] = vq_src_row(c, blk * nr + i);
            }
            for (int64_t j0 = 0; j0 < in; j0 += 64) {
                const int64_t j1 = MIN(in, j0 + 64);
                for (int64_t i = 0; i < nt; ++i) {
                    for (int64_t j = j0; j < j1; ++j) {
                        d[j * nr + i] = x[i][j];
                    }
                }
            }
        } else {
            for (int64_t i = 0; i < nt; ++i) {
                tb[blk * nr + i] = vq_prepare_token(c, blk * nr + i, d + i, nr);
            }
        }
        for (int64_t i = nt; i < nr; ++i) {
            for (int64_t j = 0; j < in; ++j) {
                d[j * nr + i] = 0.0f;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// codes

static void vq_unpack_init(struct vq_call * c) {
    const int b = c->g.b;
    for (int k = 0; k < 16; ++k) {
        const int bit = k * b;
        for (int m = 0; m < 4; ++m) {
            const int byte = bit / 8 + m;
            c->up_perm[4 * k + m] = (uint8_t) (byte < 64 ? byte : 63);
        }
        c->up_shift[k] = (uint32_t) (bit & 7);
    }
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

// codes of stored columns [j0, j0 + n) of vector row p into dst; j0 and n multiples of 16
static void vq_unpack(const struct vq_call * c, int64_t p, int64_t j0, int64_t n, uint32_t * dst) {
    const int b = c->g.b;
    const uint8_t * stream = c->L.codes + p * c->row_bytes;
#if defined(VQ_HAVE_AVX512)
    if (c->isa >= VQ_ISA_AVX512 && b <= 25) {
        // 16 codes (2b bytes) at a time: dword k = the 4 bytes that hold code k, shifted into place
        const __m512i perm = _mm512_loadu_si512((const void *) c->up_perm);
        const __m512i sh   = _mm512_loadu_si512((const void *) c->up_shift);
        const __m512i mk   = _mm512_set1_epi32((int) ((1u << b) - 1));
        const __mmask64 lm = (__mmask64) ((((uint64_t) 1) << (2 * b)) - 1);
        const uint8_t * end = c->L.codes + c->code_bytes;
        for (int64_t j = 0; j < n; j += 16) {
            const uint8_t * src = stream + (j0 + j) / 16 * 2 * b;
            // a plain load where the 64 bytes stay inside the tensor (bytes past the 2b of the codes only
            // reach bits above each code); masked loads are much slower on some cores
            const __m512i raw = src + 64 <= end ? _mm512_loadu_si512((const void *) src) : _mm512_maskz_loadu_epi8(lm, src);
#if defined(VQ_HAVE_VBMI)
            const __m512i d = _mm512_permutexvar_epi8(perm, raw);
#else
            uint8_t tmp[64], out[64];
            _mm512_storeu_si512((void *) tmp, raw);
            for (int k = 0; k < 64; ++k) {
                out[k] = tmp[c->up_perm[k]];
            }
            const __m512i d = _mm512_loadu_si512((const void *) out);
            (void) perm;
#endif
            _mm512_storeu_si512((void *) (dst + j), _mm512_and_si512(_mm512_srlv_epi32(d, sh), mk));
        }
        return;
    }
#endif
#if defined(VQ_HAVE_AVX2)
    if (c->isa >= VQ_ISA_AVX2 && b <= 14 && b != 8) {
        // 8 codes (b bytes) at a time, the same dwords as above from 16 bytes broadcast to both lanes
        // (byte (7b)/8 + 3 < 16 for b <= 14)
        const __m256i perm = _mm256_loadu_si256((const __m256i *) c->up_perm);
        const __m256i sh   = _mm256_loadu_si256((const __m256i *) c->up_shift);
        const __m256i mk   = _mm256_set1_epi32((int) ((1u << b) - 1));
        const uint8_t * end = c->L.codes + c->code_bytes;
        for (int64_t j = 0; j < n; j += 8) {
            const uint8_t * src = stream + (j0 + j) / 8 * b;
            __m128i raw;
            if (src + 16 <= end) {
                raw = _mm_loadu_si128((const __m128i *) src);
            } else {
                uint8_t tmp[16] = { 0 };
                memcpy(tmp, src, (size_t) (end - src < 16 ? end - src : 16));
                raw = _mm_loadu_si128((const __m128i *) tmp);
            }
            const __m256i d = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(raw), perm);
            _mm256_storeu_si256((__m256i *) (dst + j), _mm256_and_si256(_mm256_srlv_epi32(d, sh), mk));
        }
        return;
    }
#endif
    if (b == 8) {
        for (int64_t j = 0; j < n; ++j) {
            dst[j] = stream[j0 + j];
        }
        return;
    }
    if (b == 16) {
        for (int64_t j = 0; j < n; ++j) {
            dst[j] = (uint32_t) stream[2 * (j0 + j)] | ((uint32_t) stream[2 * (j0 + j) + 1] << 8);
        }
        return;
    }
    const uint64_t mask = (((uint64_t) 1) << b) - 1;
    const uint8_t * end = c->L.codes + c->code_bytes;
    if (stream + (((j0 + n) * b) >> 3) + 8 <= end) {
        for (int64_t j = 0; j < n; ++j) {
            const uint64_t bit = (uint64_t) (j0 + j) * (uint64_t) b;
            uint64_t word;
            memcpy(&word, stream + (bit >> 3), 8);
            dst[j] = (uint32_t) ((word >> (bit & 7)) & mask);
        }
    } else {
        for (int64_t j = 0; j < n; ++j) {
            dst[j] = vq_code_at(c, stream, j0 + j);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// scalar decoder: vector row p, codebook values only (no norm, outliers, row scale), stored column order,
// into dst[e * ld + j]

static void vq_decode_vrow_plain(const struct vq_call * c, int64_t p, float * dst, int64_t ld, uint32_t * codes) {
    const struct ggml_vq_layout * L = &c->L;
    const int v = L->v;
    const uint32_t m1 = (uint32_t) (c->g.K1 - 1);
    for (int64_t j0 = 0; j0 < c->g.in; j0 += VQ_CHUNK) {
        const int64_t n = MIN(VQ_CHUNK, c->g.in - j0);
        vq_unpack(c, p, j0, n, codes);
        int64_t g = j0 / c->g.gcols, gend = (g + 1) * c->g.gcols;
        for (int64_t j = j0; j < j0 + n; ++j) {
            if (j >= gend) {
                g++;
                gend += c->g.gcols;
            }
            const uint32_t code = codes[j - j0];
            const ggml_fp16_t * cm = L->codebook + (g * c->g.K1 + (code & m1)) * v;
            if (L->res_codebook) {
                const ggml_fp16_t * cr = L->res_codebook + (g * c->g.K2 + (code >> L->b1)) * v;
                for (int e = 0; e < v; ++e) {
                    dst[e * ld + j] = GGML_CPU_FP16_TO_FP32(cm[e]) + GGML_CPU_FP16_TO_FP32(cr[e]);
                }
            } else {
                for (int e = 0; e < v; ++e) {
                    dst[e * ld + j] = GGML_CPU_FP16_TO_FP32(cm[e]);
                }
            }
        }
    }
}
// ---------------------------------------------------------------------------------------------------------
// lut path (AVX-512 VBMI)

#if defined(VQ_HAVE_VBMI)

// byte planes of the codebooks for this thread: for group g, lane e: lo[Kp] then hi[Kp]
static void vq_lut_build(const struct vq_call * c, uint8_t * tab1, uint8_t * tab2) {
    const struct ggml_vq_layout * L = &c->L;
    const int v = L->v;
    for (int pass = 0; pass < (L->res_codebook ? 2 : 1); ++pass) {
        const int64_t K  = pass ? c->g.K2 : c->g.K1;
        const int64_t Kp = vq_lut_kp(K);
        const ggml_fp16_t * cb = pass ? L->res_codebook : L->codebook;
        uint8_t * tab = pass ? tab2 : tab1;
        for (int64_t g = 0; g < c->g.G; ++g) {
            for (int e = 0; e < v; ++e) {
                uint8_t * lo = tab + (g * v + e) * 2 * Kp;
                uint8_t * hi = lo + Kp;
                const ggml_fp16_t * src = cb + g * K * v + e;
                int64_t k = 0;
                if (v == 4) {
                    // 16 centroids (64 fp16, two registers) per step: the low and high bytes of lane e's words
                    // (byte permutes into registers, then plain stores: narrowing stores are slow on some cores)
                    uint8_t sl[64], sh[64];
                    for (int i = 0; i < 64; ++i) {
                        sl[i] = (uint8_t) (i < 16 ? 8 * i + 2 * e : 0);
                        sh[i] = (uint8_t) (i < 16 ? 8 * i + 2 * e + 1 : 0);
                    }
                    const __m512i il = _mm512_loadu_si512((const void *) sl);
                    const __m512i ih = _mm512_loadu_si512((const void *) sh);
                    for (; k + 16 <= K; k += 16) {
                        const ggml_fp16_t * s0 = cb + (g * K + k) * v;
                        const __m512i w0 = _mm512_loadu_si512((const void *) s0);
                        const __m512i w1 = _mm512_loadu_si512((const void *) (s0 + 32));
                        _mm_storeu_si128((__m128i *) (lo + k), _mm512_castsi512_si128(_mm512_permutex2var_epi8(w0, il, w1)));
                        _mm_storeu_si128((__m128i *) (hi + k), _mm512_castsi512_si128(_mm512_permutex2var_epi8(w0, ih, w1)));
                    }
                }
                for (; k < K; ++k) {
                    const ggml_fp16_t h = src[k * v];
                    lo[k] = (uint8_t) (h & 0xff);
                    hi[k] = (uint8_t) (h >> 8);
                }
                for (; k < Kp; ++k) {
                    lo[k] = hi[k] = 0;
                }
            }
        }
    }
}

struct vq_lut {
    __m512i lo[4], hi[4];
};

static VQ_ALWAYS_INLINE void vq_lut_load(struct vq_lut * T, const uint8_t * planes, int64_t Kp, int nreg) {
    for (int i = 0; i < nreg; ++i) {
        T->lo[i] = _mm512_loadu_si512((const void *) (planes + 64 * i));
        T->hi[i] = _mm512_loadu_si512((const void *) (planes + Kp + 64 * i));
    }
}

// nreg = 1: K <= 64 (vpermb), 2: K = 128 (vpermt2b), 4: K = 256 (two vpermt2b and a blend on bit 7)
static VQ_ALWAYS_INLINE __m512i vq_lut_plane(const __m512i * T, __m512i idx, __mmask64 m7, int nreg) {
    if (nreg == 1) {
        return _mm512_permutexvar_epi8(idx, T[0]);
    }
    if (nreg == 2) {
        return _mm512_permutex2var_epi8(T[0], idx, T[1]);
    }
    return _mm512_mask_blend_epi8(m7, _mm512_permutex2var_epi8(T[0], idx, T[1]), _mm512_permutex2var_epi8(T[2], idx, T[3]));
}

// 64 codebook values (one lane) for 64 byte indices, as four vectors of 16 floats in column order
static VQ_ALWAYS_INLINE void vq_lut_lookup(const struct vq_lut * T, int nreg, __m512i idx, __m512 w[4]) {
    const __m512i il0 = _mm512_set_epi8(
        95,31,94,30,93,29,92,28,91,27,90,26,89,25,88,24,87,23,86,22,85,21,84,20,83,19,82,18,81,17,80,16,
        79,15,78,14,77,13,76,12,75,11,74,10,73, 9,72, 8,71, 7,70, 6,69, 5,68, 4,67, 3,66, 2,65, 1,64, 0);
    const __m512i il1 = _mm512_set_epi8(
        127,63,126,62,125,61,124,60,123,59,122,58,121,57,120,56,119,55,118,54,117,53,116,52,115,51,114,50,113,49,112,48,
        111,47,110,46,109,45,108,44,107,43,106,42,105,41,104,40,103,39,102,38,101,37,100,36,99,35,98,34,97,33,96,32);
    const __mmask64 m7 = nreg == 4 ? _mm512_movepi8_mask(idx) : 0;
    const __m512i lo = vq_lut_plane(T->lo, idx, m7, nreg);
    const __m512i hi = vq_lut_plane(T->hi, idx, m7, nreg);
    const __m512i h0 = _mm512_permutex2var_epi8(lo, il0, hi);
    const __m512i h1 = _mm512_permutex2var_epi8(lo, il1, hi);
    w[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h0));
    w[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h0, 1));
    w[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(h1));
    w[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h1, 1));
}

// Byte indices of vector row p: main indices into i1, residual into i2 (when b2 > 0). Returns the main
// index pointer (the stream itself for plain 8-bit codes).
static const uint8_t * vq_lut_indices(const struct vq_call * c, int64_t p, uint8_t * i1, uint8_t * i2) {
    const int b = c->g.b, b1 = c->g.b1;
    const uint8_t * stream = c->L.codes + p * c->row_bytes;
    const int64_t in = c->g.in;
    if (b == 8 && c->g.b2 == 0) {
        return stream;
    }
    if (b <= 25) {
        // 16 codes per load: dword k = the 4 bytes holding code k, shifted into place; 64 codes are then
        // compacted to bytes with byte permutes (narrowing stores are slow on some cores)
        const __m512i perm = _mm512_loadu_si512((const void *) c->up_perm);
        const __m512i sh   = _mm512_loadu_si512((const void *) c->up_shift);
        const __mmask64 lm = (__mmask64) ((((uint64_t) 1) << (2 * b)) - 1); // 2b bytes (b <= 25: < 64 bits)
        const uint8_t * end = c->L.codes + c->code_bytes;
        uint8_t cp[64];
        for (int i = 0; i < 64; ++i) {
            cp[i] = (uint8_t) (4 * (i % 32) + (i >= 32 ? 0 : 0)); // low byte of dword i % 32 of the pair
        }
        const __m512i pk  = _mm512_loadu_si512((const void *) cp);
        const __m512i mk1 = _mm512_set1_epi8((char) ((1 << b1) - 1));
        const __m512i mk2 = _mm512_set1_epi8((char) ((1 << c->g.b2) - 1));
        int64_t j = 0;
        for (; j + 64 <= in; j += 64) {
            __m512i d[4];
            for (int q = 0; q < 4; ++q) {
                const uint8_t * src = stream + (j / 16 + q) * 2 * b;
                const __m512i raw = src + 64 <= end ? _mm512_loadu_si512((const void *) src) : _mm512_maskz_loadu_epi8(lm, src);
                d[q] = _mm512_srlv_epi32(_mm512_permutexvar_epi8(perm, raw), sh);
            }
            // bytes 0..31 from d0|d1, 32..63 from d2|d3
            const __m512i a1 = _mm512_permutex2var_epi8(d[0], pk, d[1]);
            const __m512i b1v = _mm512_permutex2var_epi8(d[2], pk, d[3]);
            _mm512_storeu_si512((void *) (i1 + j), _mm512_and_si512(_mm512_shuffle_i64x2(a1, b1v, 0x44), mk1));
            if (c->g.b2) {
                for (int q = 0; q < 4; ++q) {
                    d[q] = _mm512_srli_epi32(d[q], b1);
                }
                const __m512i a2 = _mm512_permutex2var_epi8(d[0], pk, d[1]);
                const __m512i b2v = _mm512_permutex2var_epi8(d[2], pk, d[3]);
                _mm512_storeu_si512((void *) (i2 + j), _mm512_and_si512(_mm512_shuffle_i64x2(a2, b2v, 0x44), mk2));
            }
        }
        for (; j < in; ++j) {
            const uint32_t code = vq_code_at(c, stream, j);
            i1[j] = (uint8_t) (code & ((1u << b1) - 1));
            if (c->g.b2) {
                i2[j] = (uint8_t) (code >> b1);
            }
        }
        return i1;
    }
    for (int64_t j = 0; j < in; ++j) {
        const uint32_t code = vq_code_at(c, stream, j);
        i1[j] = (uint8_t) (code & ((1u << b1) - 1));
        if (c->g.b2) {
            i2[j] = (uint8_t) (code >> b1);
        }
    }
    return i1;
}

static VQ_ALWAYS_INLINE __mmask64 vq_mask64(int64_t n) {
    return n >= 64 ? ~(__mmask64) 0 : ((((__mmask64) 1) << n) - 1);
}

// the 64 (or n < 64) decoded values of lane e at stored columns j0.., main + residual
static VQ_ALWAYS_INLINE void vq_lut_block(const struct vq_lut * T1, int n1, const struct vq_lut * T2, int n2,
                                          const uint8_t * i1, const uint8_t * i2, int64_t j0, int64_t n, __m512 w[4]) {
    const __mmask64 m = vq_mask64(n);
    const __m512i idx1 = n >= 64 ? _mm512_loadu_si512((const void *) (i1 + j0)) : _mm512_maskz_loadu_epi8(m, i1 + j0);
    vq_lut_lookup(T1, n1, idx1, w);
    if (n2) {
        const __m512i idx2 = n >= 64 ? _mm512_loadu_si512((const void *) (i2 + j0)) : _mm512_maskz_loadu_epi8(m, i2 + j0);
        __m512 r[4];
        vq_lut_lookup(T2, n2, idx2, r);
        for (int k = 0; k < 4; ++k) {
            w[k] = _mm512_add_ps(w[k], r[k]);
        }
    }
    if (n < 64) {
        for (int k = 0; k < 4; ++k) {
            w[k] = _mm512_maskz_mov_ps((__mmask16) (m >> (16 * k)), w[k]);
        }
    }
}

static int vq_lut_nreg(int64_t K) {
    return K <= 64 ? 1 : K <= 128 ? 2 : 4;
}

// fused lookup and dot product for vector rows [p0, p1), tokens [t0, t0 + NT)
static VQ_ALWAYS_INLINE void vq_lut_rows_impl(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0,
                                              const int NT, const int n1, const int n2,
                                              const uint8_t * tab1, const uint8_t * tab2, uint8_t * ib1, uint8_t * ib2) {
    const int v = c->g.v;
    const int64_t Kp1 = vq_lut_kp(c->g.K1), Kp2 = vq_lut_kp(c->g.K2);
    const int64_t gcols = c->g.gcols;
    const float * x[4];
    float * y[4];
    for (int t = 0; t < NT; ++t) {
        x[t] = vq_x_row(c, t0 + t);
        y[t] = vq_y_row(c, t0 + t);
    }
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t * i1 = vq_lut_indices(c, p, ib1, ib2);
        for (int e = 0; e < v; ++e) {
            __m512 acc[4][4];
            for (int t = 0; t < NT; ++t) {
                for (int a = 0; a < 4; ++a) {
                    acc[t][a] = _mm512_setzero_ps();
                }
            }
            for (int64_t g = 0; g < c->g.G; ++g) {
                struct vq_lut T1, T2;
                vq_lut_load(&T1, tab1 + (g * v + e) * 2 * Kp1, Kp1, n1);
                if (n2) {
                    vq_lut_load(&T2, tab2 + (g * v + e) * 2 * Kp2, Kp2, n2);
                }
                const int64_t jend = (g + 1) * gcols;
                for (int64_t j0 = g * gcols; j0 < jend; j0 += 64) {
                    const int64_t n = jend - j0;
                    __m512 w[4];
                    vq_lut_block(&T1, n1, &T2, n2, i1, ib2, j0, n, w);
                    if (n >= 64) {
                        for (int t = 0; t < NT; ++t) {
                            const float * xx = x[t] + j0;
                            if (NT == 1) {
                                for (int k = 0; k < 4; ++k) {
                                    acc[t][k] = _mm512_fmadd_ps(w[k], _mm512_loadu_ps(xx + 16 * k), acc[t][k]);
                                }
                            } else {
                                acc[t][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xx +  0), acc[t][0]);
                                acc[t][1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xx + 16), acc[t][1]);
                                acc[t][0] = _mm512_fmadd_ps(w[2], _mm512_loadu_ps(xx + 32), acc[t][0]);
                                acc[t][1] = _mm512_fmadd_ps(w[3], _mm512_loadu_ps(xx + 48), acc[t][1]);
                            }
                        }
                    } else {
                        const __mmask64 m = vq_mask64(n);
                        for (int t = 0; t < NT; ++t) {
                            const float * xx = x[t] + j0;
                            for (int k = 0; k < 4; ++k) {
                                const __m512 xv = _mm512_maskz_loadu_ps((__mmask16) (m >> (16 * k)), xx + 16 * k);
                                const int a = NT == 1 ? k : (k & 1);
                                acc[t][a] = _mm512_fmadd_ps(w[k], xv, acc[t][a]);
                            }
                        }
                    }
                }
            }
            for (int t = 0; t < NT; ++t) {
                __m512 s = NT == 1 ? _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][2]), _mm512_add_ps(acc[t][1], acc[t][3]))
                                   : _mm512_add_ps(acc[t][0], acc[t][1]);
                y[t][p * v + e] = _mm512_reduce_add_ps(s);
            }
        }
    }
}

#define VQ_LUT_CASE(NT, N1, N2) \
    if (nt == NT && n1 == N1 && n2 == N2) { vq_lut_rows_impl(c, p0, p1, t0, NT, N1, N2, tab1, tab2, ib1, ib2); return; }
#define VQ_LUT_CASES_N2(NT, N1) VQ_LUT_CASE(NT, N1, 0) VQ_LUT_CASE(NT, N1, 1) VQ_LUT_CASE(NT, N1, 2) VQ_LUT_CASE(NT, N1, 4)
#define VQ_LUT_CASES(NT) VQ_LUT_CASES_N2(NT, 1) VQ_LUT_CASES_N2(NT, 2) VQ_LUT_CASES_N2(NT, 4)

static void vq_lut_rows(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0, int nt,
                        const uint8_t * tab1, const uint8_t * tab2, uint8_t * ib1, uint8_t * ib2) {
    const int n1 = vq_lut_nreg(c->g.K1);
    const int n2 = c->g.b2 ? vq_lut_nreg(c->g.K2) : 0;
    VQ_LUT_CASES(1) VQ_LUT_CASES(2) VQ_LUT_CASES(3) VQ_LUT_CASES(4)
    GGML_ABORT("vq lut: no kernel for %d tokens, %d/%d table registers", nt, n1, n2);
}


// ---------------------------------------------------------------------------------------------------------
// lutx: one token, exact. The weights are formed as the reference decoder forms them (codebook values, then
// x * s + t, then outliers added, then the row scale, each rounded like the reference: no fused multiply-add)
// in the original column order, and summed as ggml_vec_dot_f32 sums: four 16-lane accumulators over blocks
// of 64 columns, the same reduction, then the leftover columns one by one.

struct vq_xinfo {
    uint8_t        * perm_i1, * perm_i2; // original-order index buffers (with a permutation)
    const float    * s, * t;             // column norm in original column order (NULL: none)
    const uint16_t * gid;                // group of each original column (permutation and G > 1)
    const int32_t  * ocol, * onum;       // outliers by 64-column block: column, outlier number
    const int32_t  * oblk;               // [in / 64 + 2] first entry of each block
};

static void vq_xinfo_build(const struct vq_call * c, char * mem, uint8_t * ib_orig, struct vq_xinfo * X) {
    const struct ggml_vq_layout * L = &c->L;
    const int64_t in = c->g.in;
    memset(X, 0, sizeof(*X));
    if (L->perm) {
        X->perm_i1 = ib_orig;
        X->perm_i2 = ib_orig + vq_pad64((size_t) in + 64);
    }
    if (L->col_norm) {
        if (L->perm) {
            float * s = (float *) mem;
            float * t = (float *) (mem + vq_pad64((size_t) in * sizeof(float)));
            mem += 2 * vq_pad64((size_t) in * sizeof(float));
            for (int64_t j = 0; j < in; ++j) {
                s[L->perm[j]] = L->col_norm[j];
                t[L->perm[j]] = L->col_norm[in + j];
            }
            X->s = s;
            X->t = t;
        } else {
            X->s = L->col_norm;
            X->t = L->col_norm + in;
        }
    }
    if (L->perm && c->g.G > 1) {
        uint16_t * gid = (uint16_t *) mem;
        mem += vq_pad64((size_t) in * sizeof(uint16_t));
        for (int64_t j = 0, g = 0, gend = c->g.gcols; j < in; ++j) {
            if (j >= gend) {
                g++;
                gend += c->g.gcols;
            }
            gid[L->perm[j]] = (uint16_t) g;
        }
        X->gid = gid;
    }
    if (L->n_o) {
        int32_t * ocol = (int32_t *) mem;
        int32_t * onum = (int32_t *) (mem + vq_pad64((size_t) L->n_o * sizeof(int32_t)));
        int32_t * oblk = (int32_t *) (mem + 2 * vq_pad64((size_t) L->n_o * sizeof(int32_t)));
        const int64_t nblk = in / 64 + 1;
        for (int64_t b = 0; b <= nblk; ++b) {
            oblk[b] = 0;
        }
        for (int64_t o = 0; o < L->n_o; ++o) {
            oblk[L->outlier_cols[o] / 64 + 1]++;
        }
        for (int64_t b = 0; b < nblk; ++b) {
            oblk[b + 1] += oblk[b];
        }
        // placed in outlier order within each block (stable: repeated columns add in the reference's order)
        for (int64_t b = 0; b < nblk; ++b) {
            for (int32_t q = oblk[b]; q < oblk[b + 1]; ++q) {
                ocol[q] = -1;
            }
        }
        for (int64_t o = 0; o < L->n_o; ++o) {
            const int64_t b = L->outlier_cols[o] / 64;
            int32_t q = oblk[b];
            while (ocol[q] != -1) {
                ++q;
            }
            ocol[q] = L->outlier_cols[o];
            onum[q] = (int32_t) o;
        }
        X->ocol = ocol;
        X->onum = onum;
        X->oblk = oblk;
    }
}

// the 64 (n <= 64) weights of lane e (row r) at original columns j0.. (lanes past n: finite, unused)
static VQ_ALWAYS_INLINE void vq_lutx_weights(const struct vq_call * c, const struct vq_xinfo * X, int e, int64_t r,
                                             const uint8_t * i1, const uint8_t * i2, int64_t j0, int64_t n,
                                             const uint8_t * tab1, const uint8_t * tab2, const struct vq_lut * T1c,
                                             const struct vq_lut * T2c, const int n1, const int n2, __m512 w[4]) {
    const int v = c->g.v;
    const int64_t G = c->g.G, gcols = c->g.gcols;
    const int64_t Kp1 = vq_lut_kp(c->g.K1), Kp2 = vq_lut_kp(c->g.K2);
    if (G == 1) {
        vq_lut_block(T1c, n1, T2c, n2, i1, i2, j0, n, w);
    } else {
        // the groups present in the block, each with its own tables, blended by column
        int64_t ga, gb;
        if (X->gid) {
            ga = 0;
            gb = G - 1;
        } else {
            ga = j0 / gcols;
            gb = MIN(G - 1, (j0 + n - 1) / gcols);
        }
        __m512i gv0 = _mm512_setzero_si512(), gv1 = _mm512_setzero_si512();
        if (X->gid) {
            const __mmask64 m = vq_mask64(n);
            if (n >= 64) {
                gv0 = _mm512_loadu_si512((const void *) (X->gid + j0));
                gv1 = _mm512_loadu_si512((const void *) (X->gid + j0 + 32));
            } else {
                gv0 = _mm512_maskz_loadu_epi16((__mmask32) m, X->gid + j0);
                gv1 = _mm512_maskz_loadu_epi16((__mmask32) (m >> 32), X->gid + j0 + 32);
            }
        }
        for (int k = 0; k < 4; ++k) {
            w[k] = _mm512_setzero_ps();
        }
        for (int64_t g = ga; g <= gb; ++g) {
            uint64_t gm;
            if (X->gid) {
                const __m512i gg = _mm512_set1_epi16((short) g);
                gm = (uint64_t) _mm512_cmpeq_epi16_mask(gv0, gg) | ((uint64_t) _mm512_cmpeq_epi16_mask(gv1, gg) << 32);
                if (!gm) {
                    continue;
                }
            } else {
                const int64_t lo = MAX(g * gcols, j0) - j0, hi = MIN((g + 1) * gcols, j0 + 64) - j0;
                gm = (hi >= 64 ? ~(uint64_t) 0 : (((uint64_t) 1 << hi) - 1)) & ~((((uint64_t) 1) << lo) - 1);
            }
            struct vq_lut T1, T2;
            vq_lut_load(&T1, tab1 + (g * v + e) * 2 * Kp1, Kp1, n1);
            if (n2) {
                vq_lut_load(&T2, tab2 + (g * v + e) * 2 * Kp2, Kp2, n2);
            }
            __m512 wg[4];
            vq_lut_block(&T1, n1, &T2, n2, i1, i2, j0, n, wg);
            for (int k = 0; k < 4; ++k) {
                w[k] = _mm512_mask_mov_ps(w[k], (__mmask16) (gm >> (16 * k)), wg[k]);
            }
        }
    }
    const __mmask64 m = vq_mask64(n);
    if (X->s) {
        for (int k = 0; k < 4; ++k) {
            const __mmask16 mk = (__mmask16) (m >> (16 * k));
            const __m512 s = n >= 64 ? _mm512_loadu_ps(X->s + j0 + 16 * k) : _mm512_maskz_loadu_ps(mk, X->s + j0 + 16 * k);
            const __m512 t = n >= 64 ? _mm512_loadu_ps(X->t + j0 + 16 * k) : _mm512_maskz_loadu_ps(mk, X->t + j0 + 16 * k);
            w[k] = _mm512_add_round_ps(_mm512_mul_round_ps(w[k], s, _MM_FROUND_CUR_DIRECTION), t, _MM_FROUND_CUR_DIRECTION);
        }
    }
    if (X->oblk) {
        const int64_t b = j0 / 64;
        if (X->oblk[b] < X->oblk[b + 1]) {
            const struct ggml_vq_layout * L = &c->L;
            const int64_t Q0 = L->out / L->v0;
            const uint32_t omask = (1u << L->b0) - 1;
            float tmp[64];
            for (int k = 0; k < 4; ++k) {
                _mm512_storeu_ps(tmp + 16 * k, w[k]);
            }
            for (int32_t q = X->oblk[b]; q < X->oblk[b + 1]; ++q) {
                const int64_t o = X->onum[q];
                const uint32_t id = (uint16_t) L->outlier_idx[o * Q0 + r / L->v0] & omask;
                tmp[X->ocol[q] - j0] += GGML_CPU_FP16_TO_FP32(L->outlier_codebook[(int64_t) id * L->v0 + r % L->v0]);
            }
            for (int k = 0; k < 4; ++k) {
                w[k] = _mm512_loadu_ps(tmp + 16 * k);
            }
        }
    }
    if (c->L.row_scale) {
        const __m512 u = _mm512_set1_ps(c->L.row_scale[r]);
        for (int k = 0; k < 4; ++k) {
            w[k] = _mm512_mul_round_ps(w[k], u, _MM_FROUND_CUR_DIRECTION);
        }
    }
}

static VQ_ALWAYS_INLINE void vq_lutx_rows_impl(const struct vq_call * c, const struct vq_xinfo * X, int64_t p0, int64_t p1,
                                               const int n1, const int n2, const uint8_t * tab1, const uint8_t * tab2,
                                               uint8_t * ib1, uint8_t * ib2) {
    const int v = c->g.v;
    const int64_t in = c->g.in;
    const int64_t Kp1 = vq_lut_kp(c->g.K1), Kp2 = vq_lut_kp(c->g.K2);
    const float * x = vq_src_row(c, 0);
    float * y = vq_y_row(c, 0);
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t * i1 = vq_lut_indices(c, p, ib1, ib2);
        const uint8_t * i2 = ib2;
        if (X->perm_i1) {
            uint8_t * o1 = X->perm_i1;
            uint8_t * o2 = X->perm_i2;
            const int32_t * perm = c->L.perm;
            for (int64_t j = 0; j < in; ++j) {
                o1[perm[j]] = i1[j];
            }
            if (n2) {
                for (int64_t j = 0; j < in; ++j) {
                    o2[perm[j]] = i2[j];
                }
            }
            i1 = o1;
            i2 = o2;
        }
        for (int e = 0; e < v; ++e) {
            const int64_t r = p * v + e;
            struct vq_lut T1c, T2c;
            if (c->g.G == 1) {
                vq_lut_load(&T1c, tab1 + e * 2 * Kp1, Kp1, n1);
                if (n2) {
                    vq_lut_load(&T2c, tab2 + e * 2 * Kp2, Kp2, n2);
                }
            }
            __m512 acc[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
            int64_t j0 = 0;
            for (; j0 + 64 <= in; j0 += 64) {
                __m512 w[4];
                vq_lutx_weights(c, X, e, r, i1, i2, j0, 64, tab1, tab2, &T1c, &T2c, n1, n2, w);
                for (int k = 0; k < 4; ++k) {
                    acc[k] = _mm512_fmadd_ps(w[k], _mm512_loadu_ps(x + j0 + 16 * k), acc[k]);
                }
            }
            float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])));
            if (j0 < in) {
                // leftover columns as ggml_vec_dot_f32 takes them: rounded products added one by one
                const int64_t n = in - j0;
                __m512 w[4];
                vq_lutx_weights(c, X, e, r, i1, i2, j0, n, tab1, tab2, &T1c, &T2c, n1, n2, w);
                float prod[64];
                const __mmask64 m = vq_mask64(n);
                for (int k = 0; k < 4; ++k) {
                    const __mmask16 mk = (__mmask16) (m >> (16 * k));
                    _mm512_storeu_ps(prod + 16 * k, _mm512_mul_ps(w[k], _mm512_maskz_loadu_ps(mk, x + j0 + 16 * k)));
                }
                for (int64_t i = 0; i < n; ++i) {
                    sum += prod[i];
                }
            }
            y[r] = sum;
        }
    }
}

// the common case without any extra (one codebook group, no norm, permutation, outliers or row scale, whole
// blocks of 64 columns): the same sums, with nothing else in the loop
// The low and high bytes are re-interleaved in-lane (vpunpcklbw/vpunpckhbw, cheaper than a two-source permute),
// so the four vectors of a block hold the columns {0-7,16-23}, {32-39,48-55}, {8-15,24-31}, {40-47,56-63}; the
// activations are permuted alike once per call (xp), and the accumulators are put back in ggml_vec_dot_f32's
// order before its reduction: every column still meets the same accumulator lane in the same order.
static VQ_ALWAYS_INLINE void vq_lutx_plain_impl(const struct vq_call * c, int64_t p0, int64_t p1, const int n1, const int n2,
                                                const uint8_t * tab1, const uint8_t * tab2, uint8_t * ib1, uint8_t * ib2,
                                                float * xp) {
    const int v = c->g.v;
    const int64_t in = c->g.in;
    const int64_t Kp1 = vq_lut_kp(c->g.K1), Kp2 = vq_lut_kp(c->g.K2);
    const float * x = vq_src_row(c, 0);
    float * y = vq_y_row(c, 0);
    for (int64_t j0 = 0; j0 < in; j0 += 64) {
        static const int8_t src[4] = { 0, 32, 8, 40 }; // first column of each 8 + 8 pair of vector k
        for (int k = 0; k < 4; ++k) {
            memcpy(xp + j0 + 16 * k,     x + j0 + src[k],      8 * sizeof(float));
            memcpy(xp + j0 + 16 * k + 8, x + j0 + src[k] + 16, 8 * sizeof(float));
        }
    }
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t * i1 = vq_lut_indices(c, p, ib1, ib2);
        const uint8_t * i2 = ib2;
        for (int e = 0; e < v; ++e) {
            struct vq_lut T1, T2;
            vq_lut_load(&T1, tab1 + e * 2 * Kp1, Kp1, n1);
            if (n2) {
                vq_lut_load(&T2, tab2 + e * 2 * Kp2, Kp2, n2);
            }
            __m512 acc[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
            for (int64_t j0 = 0; j0 < in; j0 += 64) {
                const __m512i idx1 = _mm512_loadu_si512((const void *) (i1 + j0));
                const __mmask64 m7 = n1 == 4 ? _mm512_movepi8_mask(idx1) : 0;
                const __m512i lo = vq_lut_plane(T1.lo, idx1, m7, n1);
                const __m512i hi = vq_lut_plane(T1.hi, idx1, m7, n1);
                const __m512i h0 = _mm512_unpacklo_epi8(lo, hi), h1 = _mm512_unpackhi_epi8(lo, hi);
                __m512 w[4] = { _mm512_cvtph_ps(_mm512_castsi512_si256(h0)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h0, 1)),
                                _mm512_cvtph_ps(_mm512_castsi512_si256(h1)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h1, 1)) };
                if (n2) {
                    const __m512i idx2 = _mm512_loadu_si512((const void *) (i2 + j0));
                    const __mmask64 r7 = n2 == 4 ? _mm512_movepi8_mask(idx2) : 0;
                    const __m512i rlo = vq_lut_plane(T2.lo, idx2, r7, n2);
                    const __m512i rhi = vq_lut_plane(T2.hi, idx2, r7, n2);
                    const __m512i r0 = _mm512_unpacklo_epi8(rlo, rhi), r1 = _mm512_unpackhi_epi8(rlo, rhi);
                    w[0] = _mm512_add_ps(w[0], _mm512_cvtph_ps(_mm512_castsi512_si256(r0)));
                    w[1] = _mm512_add_ps(w[1], _mm512_cvtph_ps(_mm512_extracti64x4_epi64(r0, 1)));
                    w[2] = _mm512_add_ps(w[2], _mm512_cvtph_ps(_mm512_castsi512_si256(r1)));
                    w[3] = _mm512_add_ps(w[3], _mm512_cvtph_ps(_mm512_extracti64x4_epi64(r1, 1)));
                }
                for (int k = 0; k < 4; ++k) {
                    acc[k] = _mm512_fmadd_ps(w[k], _mm512_loadu_ps(xp + j0 + 16 * k), acc[k]);
                }
            }
            // back to ggml_vec_dot_f32's accumulators: columns 0-15, 16-31, 32-47, 48-63 of each block
            const __m512 a0 = _mm512_shuffle_f32x4(acc[0], acc[2], 0x44), a1 = _mm512_shuffle_f32x4(acc[0], acc[2], 0xEE);
            const __m512 a2 = _mm512_shuffle_f32x4(acc[1], acc[3], 0x44), a3 = _mm512_shuffle_f32x4(acc[1], acc[3], 0xEE);
            y[p * v + e] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a2), _mm512_add_ps(a1, a3)));
        }
    }
}

static void vq_lutx_rows(const struct vq_call * c, const struct vq_xinfo * X, int64_t p0, int64_t p1,
                         const uint8_t * tab1, const uint8_t * tab2, uint8_t * ib1, uint8_t * ib2, float * xp) {
    const int n1 = vq_lut_nreg(c->g.K1);
    const int n2 = c->g.b2 ? vq_lut_nreg(c->g.K2) : 0;
    if (c->g.plain && c->g.G == 1 && c->g.in % 64 == 0) {
#define VQ_LUTXP_CASE(N1, N2) if (n1 == N1 && n2 == N2) { vq_lutx_plain_impl(c, p0, p1, N1, N2, tab1, tab2, ib1, ib2, xp); return; }
        VQ_LUTXP_CASE(1, 0) VQ_LUTXP_CASE(1, 1) VQ_LUTXP_CASE(1, 2) VQ_LUTXP_CASE(1, 4)
        VQ_LUTXP_CASE(2, 0) VQ_LUTXP_CASE(2, 1) VQ_LUTXP_CASE(2, 2) VQ_LUTXP_CASE(2, 4)
        VQ_LUTXP_CASE(4, 0) VQ_LUTXP_CASE(4, 1) VQ_LUTXP_CASE(4, 2) VQ_LUTXP_CASE(4, 4)
#undef VQ_LUTXP_CASE
    }
#define VQ_LUTX_CASE(N1, N2) if (n1 == N1 && n2 == N2) { vq_lutx_rows_impl(c, X, p0, p1, N1, N2, tab1, tab2, ib1, ib2); return; }
    VQ_LUTX_CASE(1, 0) VQ_LUTX_CASE(1, 1) VQ_LUTX_CASE(1, 2) VQ_LUTX_CASE(1, 4)
    VQ_LUTX_CASE(2, 0) VQ_LUTX_CASE(2, 1) VQ_LUTX_CASE(2, 2) VQ_LUTX_CASE(2, 4)
    VQ_LUTX_CASE(4, 0) VQ_LUTX_CASE(4, 1) VQ_LUTX_CASE(4, 2) VQ_LUTX_CASE(4, 4)
#undef VQ_LUTX_CASE
    GGML_ABORT("vq lutx: %d/%d table registers", n1, n2);
}

#endif // VQ_HAVE_VBMI

// ---------------------------------------------------------------------------------------------------------
// cent path: R vector rows at one column, centroids read from the f16 codebook

#if defined(VQ_HAVE_AVX512)

// VP fp16 values from p: a plain load inside the codebook (lanes past v hold the next centroid's values and
// are never stored), a masked one at its end (masked loads are slow on some cores)
static VQ_ALWAYS_INLINE __m128i vq_load8h(const ggml_fp16_t * p, int v, const ggml_fp16_t * end) {
    return p + 8 <= end ? _mm_loadu_si128((const __m128i *) p) : _mm_maskz_loadu_epi16((__mmask8) ((1u << v) - 1), p);
}

// 16 fp16 -> f32: R = 16 / VP centroids of v <= VP values each (lanes past v: unused)
static VQ_ALWAYS_INLINE __m512 vq_cent_gather512(const ggml_fp16_t * const * ptr, const int VP, const int v, const ggml_fp16_t * end) {
    __m256i h;
    if (VP == 16) {
        h = v == 16 || ptr[0] + 16 <= end ? _mm256_loadu_si256((const __m256i *) ptr[0]) : _mm256_maskz_loadu_epi16((__mmask16) ((1u << v) - 1), ptr[0]);
    } else if (VP == 8) {
        if (v == 8) {
            h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) ptr[0])), _mm_loadu_si128((const __m128i *) ptr[1]), 1);
        } else {
            h = _mm256_inserti128_si256(_mm256_castsi128_si256(vq_load8h(ptr[0], v, end)), vq_load8h(ptr[1], v, end), 1);
        }
    } else if (VP == 4) {
        __m128i a, b;
        if (v == 4) {
            a = _mm_loadl_epi64((const __m128i *) ptr[0]);
            a = _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(a), (const double *) ptr[1]));
            b = _mm_loadl_epi64((const __m128i *) ptr[2]);
            b = _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(b), (const double *) ptr[3]));
        } else {
            a = _mm_unpacklo_epi64(vq_load8h(ptr[0], v, end), vq_load8h(ptr[1], v, end));
            b = _mm_unpacklo_epi64(vq_load8h(ptr[2], v, end), vq_load8h(ptr[3], v, end));
        }
        h = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    } else { // VP == 2, v == 2 (built in registers: a store then a wide load would stall forwarding)
        int32_t w[8];
        for (int i = 0; i < 8; ++i) {
            memcpy(&w[i], ptr[i], 4);
        }
        h = _mm256_set_epi32(w[7], w[6], w[5], w[4], w[3], w[2], w[1], w[0]);
    }
    return _mm512_cvtph_ps(h);
}

#define VQ_CENT_NAME vq_cent512_rows_impl
#define VQ_CENT_LANES 16
#define VQ_CENT_VEC __m512
#define VQ_CENT_ZERO() _mm512_setzero_ps()
#define VQ_CENT_ADD(a, b) _mm512_add_ps(a, b)
#define VQ_CENT_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VQ_CENT_SET1(s) _mm512_set1_ps(s)
#define VQ_CENT_STORE(p, a) _mm512_storeu_ps(p, a)
#define VQ_CENT_GATHER(ptr, VP, v, end) vq_cent_gather512(ptr, VP, v, end)
#include "vq-cpu-cent.inc"

static void vq_cent512_rows(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0, int nt, uint32_t * cbuf) {
    const int v = c->g.v;
    const int VP = vq_cent_vp(v);
    const bool res = c->L.res_codebook != NULL;
#define VQ_C5_CASE(NT, VPc, RES) if (nt == NT && VP == VPc && res == RES) { vq_cent512_rows_impl(c, p0, p1, t0, NT, VPc, true, RES, cbuf); return; }
#define VQ_C5_CASES(NT) VQ_C5_CASE(NT, 2, false) VQ_C5_CASE(NT, 4, false) VQ_C5_CASE(NT, 8, false) VQ_C5_CASE(NT, 16, false) \
                        VQ_C5_CASE(NT, 2, true)  VQ_C5_CASE(NT, 4, true)  VQ_C5_CASE(NT, 8, true)  VQ_C5_CASE(NT, 16, true)
    VQ_C5_CASES(1) VQ_C5_CASES(2) VQ_C5_CASES(3) VQ_C5_CASES(4)
#undef VQ_C5_CASES
#undef VQ_C5_CASE
    GGML_ABORT("vq cent512: no kernel for v=%d, %d tokens", v, nt);
}

#endif // VQ_HAVE_AVX512

#if defined(VQ_HAVE_AVX2)

// 8 fp16 values side by side, not yet widened: R = 8 / V centroids of V in {2, 4, 8} values, or their first V
// values (cent and centx)
static VQ_ALWAYS_INLINE __m128i vq_cent_load128(const ggml_fp16_t * const * ptr, const int V) {
    if (V == 8) {
        return _mm_loadu_si128((const __m128i *) ptr[0]);
    }
    if (V == 4) {
        return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *) ptr[0]), _mm_loadl_epi64((const __m128i *) ptr[1]));
    }
    int32_t w[4];
    for (int i = 0; i < 4; ++i) {
        memcpy(&w[i], ptr[i], 4);
    }
    return _mm_setr_epi32(w[0], w[1], w[2], w[3]);
}

// the same for centroids of v < VP values (v = 3, 6) padded to VP lanes: loads of VP values, except where one
// would pass the end of the codebook (its last centroids), whose values are copied instead; lanes past v are
// computed but never stored
static VQ_ALWAYS_INLINE __m256 vq_cent_gather256(const ggml_fp16_t * const * ptr, const int VP, const int v, const ggml_fp16_t * end) {
    if (v == VP) {
        return _mm256_cvtph_ps(vq_cent_load128(ptr, VP));
    }
    ggml_fp16_t tail[4][8];
    const ggml_fp16_t * q[4];
    for (int i = 0; i < 8 / VP; ++i) {
        q[i] = ptr[i];
        if (ptr[i] + VP > end) {
            memset(tail[i], 0, sizeof(tail[i]));
            memcpy(tail[i], ptr[i], v * sizeof(ggml_fp16_t));
            q[i] = tail[i];
        }
    }
    return _mm256_cvtph_ps(vq_cent_load128(q, VP));
}

#define VQ_CENT_NAME vq_cent256_rows_impl
#define VQ_CENT_LANES 8
#define VQ_CENT_VEC __m256
#define VQ_CENT_ZERO() _mm256_setzero_ps()
#define VQ_CENT_ADD(a, b) _mm256_add_ps(a, b)
#define VQ_CENT_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VQ_CENT_SET1(s) _mm256_set1_ps(s)
#define VQ_CENT_STORE(p, a) _mm256_storeu_ps(p, a)
#define VQ_CENT_GATHER(ptr, VP, v, end) vq_cent_gather256(ptr, VP, v, end)
#include "vq-cpu-cent.inc"

static void vq_cent256_rows(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0, int nt, uint32_t * cbuf) {
    const int v = c->g.v;
    const int VP = vq_cent_vp(v);
    const bool res = c->L.res_codebook != NULL;
#define VQ_C2_CASE(NT, V, PAD, RES) if (nt == NT && VP == V && (v != VP) == PAD && res == RES) { vq_cent256_rows_impl(c, p0, p1, t0, NT, V, PAD, RES, cbuf); return; }
#define VQ_C2_CASES(NT, RES) VQ_C2_CASE(NT, 2, false, RES) VQ_C2_CASE(NT, 4, false, RES) VQ_C2_CASE(NT, 8, false, RES) \
                             VQ_C2_CASE(NT, 4, true, RES)  VQ_C2_CASE(NT, 8, true, RES)
    VQ_C2_CASES(1, false) VQ_C2_CASES(2, false) VQ_C2_CASES(3, false) VQ_C2_CASES(4, false)
    VQ_C2_CASES(1, true)  VQ_C2_CASES(2, true)  VQ_C2_CASES(3, true)  VQ_C2_CASES(4, true)
#undef VQ_C2_CASES
#undef VQ_C2_CASE
    GGML_ABORT("vq cent256: no kernel for v=%d, %d tokens", v, nt);
}

#endif // VQ_HAVE_AVX2

// ---------------------------------------------------------------------------------------------------------
// decx: one token, exact, any layout: rows decoded to the reference decoder's values, then ggml_vec_dot_f32.
// Plain weights with v in {1, 2, 4, 8, 16} (AVX2): 8 output rows at a time, each column's centroids
// widened into one vector of 8 rows, 8 columns transposed into 8 row pieces.

#if defined(VQ_HAVE_AVX2)

static VQ_ALWAYS_INLINE __m128i vq_load8h_avx2(const ggml_fp16_t * p, const ggml_fp16_t * end) {
    if (p + 8 <= end) {
        return _mm_loadu_si128((const __m128i *) p);
    }
    ggml_fp16_t h[8] = { 0 };
    memcpy(h, p, (size_t) (end - p) * sizeof(ggml_fp16_t));
    return _mm_loadu_si128((const __m128i *) h);
}

static VQ_ALWAYS_INLINE void vq_transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// 8 output rows: vector rows p .. p + 8/V - 1 (V in {1, 2, 4, 8}) or half `half` of vector row p (V = 16);
// dst[k * in + j], codebook values only (plain weights)
static VQ_ALWAYS_INLINE void vq_decx8_impl(const struct vq_call * c, int64_t p, int half, float * dst, uint32_t * cbuf,
                                           const int V, const bool RES) {
    const int64_t in = c->g.in, gcols = c->g.gcols;
    const uint32_t m1 = (uint32_t) (c->g.K1 - 1);
    const int b1 = c->g.b1;
    // R vector rows per 8 lanes; vv: fp16 values taken from each centroid (8: the next 8 of a longer one,
    // lanes past the vector's end unused); off: the half of a vector longer than 8
    const int R = (V == 1 || V == 2 || V == 4) ? 8 / V : 1;
    const int vv = (V == 1 || V == 2 || V == 4) ? V : 8;
    const int off = V > 8 ? 8 * half : 0;
    const ggml_fp16_t * Cend = c->L.codebook + c->g.G * c->g.K1 * V;
    const ggml_fp16_t * Rend = RES ? c->L.res_codebook + c->g.G * c->g.K2 * V : NULL;
    for (int64_t j0 = 0; j0 < in; j0 += VQ_CHUNK) {
        const int64_t n = MIN(VQ_CHUNK, in - j0);
        for (int i = 0; i < R; ++i) {
            vq_unpack(c, p + i, j0, n, cbuf + i * VQ_CHUNK);
        }
        int64_t g = j0 / gcols, gend = (g + 1) * gcols; // the group of the column and where it ends
        const ggml_fp16_t * C  = c->L.codebook + g * c->g.K1 * V + off;
        const ggml_fp16_t * Rc = RES ? c->L.res_codebook + g * c->g.K2 * V + off : NULL;
        for (int64_t jb = j0; jb < j0 + n; jb += 8) {
            __m256 r[8];
            for (int k = 0; k < 8; ++k) {
                const int64_t j = jb + k;
                if (j >= gend) {
                    g++;
                    gend += gcols;
                    C = c->L.codebook + g * c->g.K1 * V + off;
                    Rc = RES ? c->L.res_codebook + g * c->g.K2 * V + off : NULL;
                }
                const ggml_fp16_t * pm[8], * pr[8];
                for (int i = 0; i < R; ++i) {
                    const uint32_t code = cbuf[i * VQ_CHUNK + (j - j0)];
                    pm[i] = C + (code & m1) * V;
                    pr[i] = RES ? Rc + (code >> b1) * V : pm[i];
                }
                if (vv == 1) {
                    uint16_t h[8];
                    for (int i = 0; i < 8; ++i) {
                        h[i] = pm[i][0];
                    }
                    r[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) h));
                    if (RES) {
                        for (int i = 0; i < 8; ++i) {
                            h[i] = pr[i][0];
                        }
                        r[k] = _mm256_add_ps(r[k], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) h)));
                    }
                } else if (vv == 8 && V != 8 && V != 16) {
                    // 8 values from a centroid of another length: a plain load inside the codebook, a copy at its end
                    r[k] = _mm256_cvtph_ps(vq_load8h_avx2(pm[0], Cend));
                    if (RES) {
                        r[k] = _mm256_add_ps(r[k], _mm256_cvtph_ps(vq_load8h_avx2(pr[0], Rend)));
                    }
                } else {
                    r[k] = _mm256_cvtph_ps(vq_cent_load128(pm, vv));
                    if (RES) {
                        r[k] = _mm256_add_ps(r[k], _mm256_cvtph_ps(vq_cent_load128(pr, vv)));
                    }
                }
            }
            vq_transpose8(r);
            const int rows = (V == 1 || V == 2 || V == 4 || V == 8) ? 8 : V < 8 ? V : (half ? V - 8 : 8);
            for (int k = 0; k < rows; ++k) {
                _mm256_storeu_ps(dst + k * in + jb, r[k]);
            }
        }
    }
}

static void vq_decx8(const struct vq_call * c, int64_t p, int half, float * dst, uint32_t * cbuf) {
    const int v = c->g.v;
    const bool res = c->L.res_codebook != NULL;
#define VQ_DX_CASE(V, RES) if (v == V && res == RES) { vq_decx8_impl(c, p, half, dst, cbuf, V, RES); return; }
#define VQ_DX_CASES(RES) VQ_DX_CASE(1, RES) VQ_DX_CASE(2, RES) VQ_DX_CASE(4, RES) VQ_DX_CASE(5, RES) VQ_DX_CASE(6, RES) \
    VQ_DX_CASE(7, RES) VQ_DX_CASE(8, RES) VQ_DX_CASE(9, RES) VQ_DX_CASE(10, RES) VQ_DX_CASE(11, RES) VQ_DX_CASE(12, RES) \
    VQ_DX_CASE(13, RES) VQ_DX_CASE(14, RES) VQ_DX_CASE(15, RES) VQ_DX_CASE(16, RES)
    VQ_DX_CASES(false) VQ_DX_CASES(true)
#undef VQ_DX_CASES
#undef VQ_DX_CASE
    GGML_ABORT("vq decx8: v=%d", v);
}

#endif // VQ_HAVE_AVX2

#if defined(VQ_HAVE_AVX2)
// the rest of the reference decoder on rows decoded to codebook values in stored column order (src): the
// column norm (x * s + t, rounded twice like the reference: no fused multiply-add), the permutation, the
// outliers, the row scale; row k of src is output row r0 + k; the result in original order in dst
static void vq_decx_extras(const struct vq_call * c, int64_t r0, int nrows, float * src, float * dst) {
    const struct ggml_vq_layout * L = &c->L;
    const int64_t in = c->g.in;
    for (int k = 0; k < nrows; ++k) {
        float * row = src + k * in;
        float * out = dst + k * in;
        const int64_t r = r0 + k;
        if (L->col_norm) {
            for (int64_t j = 0; j < in; j += 8) {
                __m256 m = _mm256_mul_ps(_mm256_loadu_ps(row + j), _mm256_loadu_ps(L->col_norm + j));
#if defined(__GNUC__)
                __asm__("" : "+x"(m)); // keeps the compiler from fusing the multiply and the add
#endif
                _mm256_storeu_ps(row + j, _mm256_add_ps(m, _mm256_loadu_ps(L->col_norm + in + j)));
            }
        }
        if (L->perm) {
            for (int64_t j = 0; j < in; ++j) {
                out[L->perm[j]] = row[j];
            }
        } else if (out != row) {
            memcpy(out, row, in * sizeof(float));
        }
        if (L->n_o) {
            const int64_t Q0 = L->out / L->v0;
            const uint32_t omask = (1u << L->b0) - 1;
            for (int64_t o = 0; o < L->n_o; ++o) {
                const uint32_t id = (uint16_t) L->outlier_idx[o * Q0 + r / L->v0] & omask;
                out[L->outlier_cols[o]] += GGML_CPU_FP16_TO_FP32(L->outlier_codebook[(int64_t) id * L->v0 + r % L->v0]);
            }
        }
        if (L->row_scale) {
            const __m256 u = _mm256_set1_ps(L->row_scale[r]);
            for (int64_t j = 0; j < in; j += 8) {
                _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), u));
            }
        }
    }
}
#endif

// rows [p0, p1) of one token, exact
static void vq_decx_rows(const struct vq_call * c, int64_t p0, int64_t p1, float * tile, uint32_t * cbuf) {
    const int64_t v = c->g.v, in = c->g.in;
    const float * x = vq_src_row(c, 0);
    float * y = vq_y_row(c, 0);
    int64_t p = p0;
#if defined(VQ_HAVE_AVX2)
    if (c->isa >= VQ_ISA_AVX2 && v != 3 && v <= 16) {
        const int64_t R = (v == 1 || v == 2 || v == 4) ? 8 / v : 1;
        float * rows = c->g.plain ? tile : tile + (v > 8 ? v : 8) * in; // stored order, before the extras
        for (; p + R <= p1; p += R) {
            vq_decx8(c, p, 0, rows, cbuf);
            if (v > 8) {
                vq_decx8(c, p, 1, rows + 8 * in, cbuf);
            }
            if (!c->g.plain) {
                vq_decx_extras(c, p * v, (int) (R * v), rows, tile);
            }
            for (int64_t e = 0; e < R * v; ++e) {
                ggml_vec_dot_f32((int) in, y + p * v + e, 0, tile + e * in, 0, x, 0, 1);
            }
        }
    }
#endif
    for (; p < p1; ++p) {
        if (c->g.plain) {
            vq_decode_vrow_plain(c, p, tile, in, cbuf); // the reference's values: codebook sums only
        } else {
            ggml_vq_decode_vrow(&c->L, p, tile);
        }
        for (int64_t e = 0; e < v; ++e) {
            ggml_vec_dot_f32((int) in, y + p * v + e, 0, tile + e * in, 0, x, 0, 1);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// centx: one token, exact, weights without permutation, column norm or outliers (a row scale is allowed),
// v in {2, 3, 4, 6, 8}: cent's loads summed as ggml_vec_dot_f32 sums. A group of R vector rows at one column
// fills NB vectors of 8 lanes (v = 2, 4, 8: R = 8 / v, NB = 1, no transposes; v = 6: R = 4, NB = 3:
// four centroid loads, each vector two of them shifted and blended; v = 3: R = 8, NB = 4, two centroids of
// 4 values per vector, every fourth lane unused), read from a copy of the fp16 codebooks (padded at the end:
// a v = 6 load reads 8 values, a v = 3 load 4; half the cache footprint of f32 tables), widened, multiplied by the
// rows' scales as the reference decoder multiplies them (after the codebook sum, rounded) and then with the
// broadcast activation. ggml_vec_dot_f32 gives column j of a row to accumulator lane j mod GGML_F32_STEP,
// one fused multiply-add per block of GGML_F32_STEP columns in turn, then reduces the lanes
// (GGML_F32_VEC_REDUCE) and adds the products of the leftover columns one by one. Each lane is its own
// chain, so the chains can be run a few at a time (8 accumulators, each one chain of 8 rows; v = 3, 6: 2 chains
// of 3 vectors) over every block of a chunk of codes; the chains wait in memory between chunks, are
// transposed to rows at the end and reduced with ggml's own macro. Every product meets its chain in the same
// order as in ggml_vec_dot_f32.

#if defined(VQ_HAVE_CENTX)

// vector rows per group: the fewest whose v * R output rows are whole vectors of 8
static VQ_ALWAYS_INLINE int vq_centx_group(int v) {
    return v == 6 ? 4 : v == 3 ? 8 : 8 / v;
}

// vectors of 8 lanes per group: VP lanes per centroid (v = 3: 4, the last one unused), except v = 6, whose
// centroids are packed into 3 vectors
static VQ_ALWAYS_INLINE int vq_centx_nvec(int v) {
    return v == 6 ? 3 : vq_centx_group(v) * vq_cent_vp(v) / 8;
}

// the output row (within the group) of lane l of vector b, -1 for an unused lane
static VQ_ALWAYS_INLINE int vq_centx_row(int v, int b, int l) {
    return v != 3 ? 8 * b + l : l % 4 == 3 ? -1 : 6 * b + 3 * (l / 4) + l % 4;
}

// v = 6, vector b: rows 8b .. 8b + 7 of the group are elements 2b .. 5 of centroid b, then the first of b + 1
static VQ_ALWAYS_INLINE __m128i vq_centx6_vec(__m128i cb, __m128i cb1, const int b) {
    return b == 0 ? _mm_blend_epi16(cb, _mm_slli_si128(cb1, 12), 0xC0)
         : b == 1 ? _mm_blend_epi16(_mm_srli_si128(cb, 4), _mm_slli_si128(cb1, 8), 0xF0)
                  : _mm_blend_epi16(_mm_srli_si128(cb, 8), _mm_slli_si128(cb1, 4), 0xFC);
}

// the group's weights at one column as NB vectors of 8 rows (w): codes cb[k * VQ_CHUNK] of vector rows k < R,
// centroids from the fp16 tables T1 (main) and T2 (residual) of the column's group, times the rows' scales u
static VQ_ALWAYS_INLINE void vq_centx_w(const uint32_t * cb, const ggml_fp16_t * T1, const ggml_fp16_t * T2, uint32_t m1,
                                        int b1, const __m256 * u, __m256 * w, const int V, const bool RES, const bool RS) {
    uint32_t q[8], r[8];
    for (int k = 0; k < vq_centx_group(V); ++k) {
        const uint32_t code = cb[k * VQ_CHUNK];
        q[k] = RES ? code & m1 : code; // without a residual a code is b1 bits
        r[k] = RES ? code >> b1 : 0;
    }
    __m128i h1[4], h2[4];
    if (V == 6) {
        __m128i c1[4], c2[4];
        for (int k = 0; k < 4; ++k) {
            c1[k] = _mm_loadu_si128((const __m128i *) (T1 + 6 * (size_t) q[k]));
            c2[k] = RES ? _mm_loadu_si128((const __m128i *) (T2 + 6 * (size_t) r[k])) : c1[k];
        }
        for (int b = 0; b < 3; ++b) {
            h1[b] = vq_centx6_vec(c1[b], c1[b + 1], b);
            h2[b] = vq_centx6_vec(c2[b], c2[b + 1], b);
        }
    } else { // 8 / VP centroids per vector, read as VP values (the table's padding covers the last)
        const int VP = vq_cent_vp(V);
        const ggml_fp16_t * p1[8], * p2[8];
        for (int k = 0; k < vq_centx_group(V); ++k) {
            p1[k] = T1 + V * (size_t) q[k];
            p2[k] = T2 + V * (size_t) r[k];
        }
        for (int b = 0; b < vq_centx_nvec(V); ++b) {
            h1[b] = vq_cent_load128(p1 + b * (8 / VP), VP);
            h2[b] = RES ? vq_cent_load128(p2 + b * (8 / VP), VP) : h1[b];
        }
    }
    for (int b = 0; b < vq_centx_nvec(V); ++b) {
        w[b] = _mm256_cvtph_ps(h1[b]);
        w[b] = RES ? _mm256_add_ps(w[b], _mm256_cvtph_ps(h2[b])) : w[b];
        w[b] = RS ? _mm256_mul_ps(w[b], u[b]) : w[b];
    }
}

static VQ_ALWAYS_INLINE void vq_centx_impl(const struct vq_call * c, int64_t p, const ggml_fp16_t * T, uint32_t * cbuf,
                                           const int V, const bool RES, const bool G1, const bool RS) {
    enum { STEP = GGML_F32_STEP, NBMAX = 4 };
    const int NB = vq_centx_nvec(V), R = vq_centx_group(V);
    const int NC = NB == 1 ? 8 : 2;     // chains at a time: NB * NC accumulators
    const int64_t in = c->g.in, gcols = c->g.gcols, np = in & ~(int64_t) (STEP - 1);
    const uint32_t m1 = (uint32_t) (c->g.K1 - 1);
    const int b1 = c->g.b1;
    const float * x = vq_src_row(c, 0);
    __m256 chain[NBMAX][STEP];          // chain[b][q]: lane q of ggml_vec_dot_f32's accumulators, for vector b's 8 rows
    float  left[NBMAX][(STEP - 1) * 8]; // products of the leftover columns [np, in), 8 rows each
    __m256 u[NBMAX];
    for (int b = 0; b < NB; ++b) {
        float ub[8] = {0};
        for (int l = 0; l < 8 && RS; ++l) {
            const int row = vq_centx_row(V, b, l);
            ub[l] = row < 0 ? 0.0f : c->L.row_scale[p * V + row];
        }
        u[b] = _mm256_loadu_ps(ub);
        for (int q = 0; q < STEP; ++q) {
            chain[b][q] = _mm256_setzero_ps();
        }
    }
    for (int64_t j0 = 0; j0 < in; j0 += VQ_CHUNK) {
        const int64_t n = MIN(VQ_CHUNK, in - j0), je = MIN(j0 + n, np);
        for (int k = 0; k < R; ++k) {
            vq_unpack(c, p + k, j0, n, cbuf + k * VQ_CHUNK);
        }
        for (int q0 = 0; q0 < STEP; q0 += NC) {
            __m256 acc[NBMAX][8];
            for (int b = 0; b < NB; ++b) {
                for (int i = 0; i < NC; ++i) {
                    acc[b][i] = chain[b][q0 + i];
                }
            }
            for (int64_t js = j0 + q0; js < je; js += STEP) {
                const int64_t g = G1 ? 0 : js / gcols; // 8 columns never straddle groups (gcols % 8 == 0)
                const ggml_fp16_t * T1 = T + g * c->g.K1 * V;
                const ggml_fp16_t * T2 = T + (c->g.G * c->g.K1 + g * c->g.K2) * V;
                for (int i = 0; i < NC; ++i) {
                    __m256 w[NBMAX];
                    vq_centx_w(cbuf + (js - j0) + i, T1, T2, m1, b1, u, w, V, RES, RS);
                    const __m256 xb = _mm256_broadcast_ss(x + js + i);
                    for (int b = 0; b < NB; ++b) {
                        acc[b][i] = _mm256_fmadd_ps(w[b], xb, acc[b][i]);
                    }
                }
            }
            for (int b = 0; b < NB; ++b) {
                for (int i = 0; i < NC; ++i) {
                    chain[b][q0 + i] = acc[b][i];
                }
            }
        }
        for (int64_t j = MAX(j0, np); j < j0 + n; ++j) {
            const int64_t g = j / gcols;
            __m256 w[NBMAX];
            vq_centx_w(cbuf + (j - j0), T + g * c->g.K1 * V, T + (c->g.G * c->g.K1 + g * c->g.K2) * V, m1, b1, u, w, V, RES, RS);
            for (int b = 0; b < NB; ++b) {
                _mm256_storeu_ps(left[b] + (j - np) * 8, _mm256_mul_ps(w[b], _mm256_set1_ps(x[j])));
            }
        }
    }
    float * y = vq_y_row(c, 0) + p * V;
    for (int b = 0; b < NB; ++b) {
        float rows[8][STEP];
        for (int q0 = 0; q0 < STEP; q0 += 8) {
            vq_transpose8(chain[b] + q0);
            for (int k = 0; k < 8; ++k) {
                _mm256_storeu_ps(rows[k] + q0, chain[b][q0 + k]);
            }
        }
        for (int k = 0; k < 8; ++k) {
            GGML_F32_VEC sum[GGML_F32_ARR];
            for (int a = 0; a < GGML_F32_ARR; ++a) {
                sum[a] = GGML_F32_VEC_LOAD(rows[k] + a * GGML_F32_EPR);
            }
            float sumf = 0.0f;
            GGML_F32_VEC_REDUCE(sumf, sum);
            for (int64_t j = np; j < in; ++j) {
                sumf += left[b][(j - np) * 8 + k];
            }
            const int row = vq_centx_row(V, b, k);
            if (row >= 0) {
                y[row] = sumf;
            }
        }
    }
}

static void vq_centx_group_rows(const struct vq_call * c, int64_t p, const ggml_fp16_t * T, uint32_t * cbuf) {
    const int v = c->g.v;
    const bool res = c->L.res_codebook != NULL;
    const bool g1 = c->g.G == 1;
    const bool rs = c->L.row_scale != NULL; // F16 row scales are widened to f32 once per call
#define VQ_CX_CASE(V, RES, G1, RS) if (v == V && res == RES && g1 == G1 && rs == RS) { vq_centx_impl(c, p, T, cbuf, V, RES, G1, RS); return; }
#define VQ_CX_CASES(G1, RS) VQ_CX_CASE(2, false, G1, RS) VQ_CX_CASE(3, false, G1, RS) VQ_CX_CASE(4, false, G1, RS) VQ_CX_CASE(6, false, G1, RS) \
                            VQ_CX_CASE(8, false, G1, RS) VQ_CX_CASE(2, true, G1, RS)  VQ_CX_CASE(3, true, G1, RS)  VQ_CX_CASE(4, true, G1, RS)  \
                            VQ_CX_CASE(6, true, G1, RS)  VQ_CX_CASE(8, true, G1, RS)
    VQ_CX_CASES(true, false) VQ_CX_CASES(false, false) VQ_CX_CASES(true, true) VQ_CX_CASES(false, true)
#undef VQ_CX_CASES
#undef VQ_CX_CASE
    GGML_ABORT("vq centx: v=%d", v);
}

// rows [p0, p1) of one token: R vector rows at a time, decx for the last few
static void vq_centx_rows(const struct vq_call * c, int64_t p0, int64_t p1, ggml_fp16_t * T, float * tile, uint32_t * cbuf) {
    const int64_t R = vq_centx_group(c->g.v);
    const int64_t n1 = c->g.G * c->g.K1 * c->g.v, n2 = c->g.b2 ? c->g.G * c->g.K2 * c->g.v : 0;
    memcpy(T, c->L.codebook, n1 * sizeof(ggml_fp16_t));
    if (n2) {
        memcpy(T + n1, c->L.res_codebook, n2 * sizeof(ggml_fp16_t));
    }
    memset(T + n1 + n2, 0, VQ_CX_PAD * sizeof(ggml_fp16_t));
    int64_t p = p0;
    for (; p + R <= p1; p += R) {
        vq_centx_group_rows(c, p, T, cbuf);
    }
    if (p < p1) {
        vq_decx_rows(c, p, p1, tile, cbuf);
    }
}

#endif // VQ_HAVE_CENTX

// ---------------------------------------------------------------------------------------------------------
// gemm path: decoded panels of mr rows ([in][mr], row-contiguous per column) times packed activations
// ([in][nr] per block of nr tokens), outer-product form: each output is one f32 accumulator summed over the
// columns in order, the same whatever the panel, block or thread it falls in

#if defined(VQ_HAVE_AVX2)

// 4 fp16 values from p, zeros past the codebook's end
static VQ_ALWAYS_INLINE __m128i vq_load4h_avx2(const ggml_fp16_t * p, const ggml_fp16_t * end) {
    if (p + 4 <= end) {
        return _mm_loadl_epi64((const __m128i *) p);
    }
    ggml_fp16_t h[4] = { 0 };
    memcpy(h, p, (size_t) (end - p) * sizeof(ggml_fp16_t));
    return _mm_loadl_epi64((const __m128i *) h);
}

// gemm's decode of columns js..je of the vector row at tile row r0 for v <= 8 other than 4 and 8 (v = 2, 3, 6:
// a vector row's lanes sit at different places of each 16- or 32-row panel): each centroid widened as 4 or 8
// values and stored whole where those lanes stay in the panel (lanes past v are the next vector row's, written
// after it, or padding), lane by lane where they cross its edge
static VQ_ALWAYS_INLINE void vq_decode_lanes(const uint32_t * cd, int64_t js, int64_t je, const ggml_fp16_t * C,
                                             const ggml_fp16_t * Cend, const ggml_fp16_t * Rc, const ggml_fp16_t * Rend,
                                             uint32_t m1, int b1, int v, float * tile, int64_t in, int mr, int64_t r0) {
    const int     w  = v <= 4 ? 4 : 8;
    const int64_t l0 = r0 % mr;
    float * lane[8];
    for (int e = 0; e < v; ++e) {
        lane[e] = tile + ((r0 + e) / mr) * in * mr + (r0 + e) % mr;
    }
    float * base = tile + (r0 / mr) * in * mr + l0;
    if (w == 4) {
        for (int64_t j = js; j < je; ++j) {
            __m128 f = _mm_cvtph_ps(vq_load4h_avx2(C + (cd[j] & m1) * v, Cend));
            if (Rc) {
                f = _mm_add_ps(f, _mm_cvtph_ps(vq_load4h_avx2(Rc + (cd[j] >> b1) * v, Rend)));
            }
            if (l0 + 4 <= mr) {
                _mm_storeu_ps(base + j * mr, f);
            } else {
                float t[4];
                _mm_storeu_ps(t, f);
                for (int e = 0; e < v; ++e) {
                    lane[e][j * mr] = t[e];
                }
            }
        }
    } else {
        for (int64_t j = js; j < je; ++j) {
            __m256 f = _mm256_cvtph_ps(vq_load8h_avx2(C + (cd[j] & m1) * v, Cend));
            if (Rc) {
                f = _mm256_add_ps(f, _mm256_cvtph_ps(vq_load8h_avx2(Rc + (cd[j] >> b1) * v, Rend)));
            }
            if (l0 + 8 <= mr) {
                _mm256_storeu_ps(base + j * mr, f);
            } else {
                float t[8];
                _mm256_storeu_ps(t, f);
                for (int e = 0; e < v; ++e) {
                    lane[e][j * mr] = t[e];
                }
            }
        }
    }
}

// decodes vector rows [pa, pb) into panels: row r = (p - pa) * v + e at tile[(r / mr) * in * mr + j * mr + r % mr]
static void vq_decode_panels(const struct vq_call * c, int64_t pa, int64_t pb, float * tile, uint32_t * codes) {
    const int v = c->g.v, mr = c->g.mr, b1 = c->g.b1;
    const int64_t in = c->g.in, gcols = c->g.gcols;
    const int64_t nrows = (pb - pa) * v;
    const int64_t npan = (nrows + mr - 1) / mr;
    const uint32_t m1 = (uint32_t) (c->g.K1 - 1);
    const bool res = c->L.res_codebook != NULL;
    if (nrows % mr) { // lanes past the last row are computed but never stored: keep them finite
        float * last = tile + (npan - 1) * in * mr;
        for (int64_t j = 0; j < in; ++j) {
            memset(last + j * mr + nrows % mr, 0, (mr - nrows % mr) * sizeof(float));
        }
    }
    for (int64_t p = pa; p < pb; ++p) {
        const int64_t r0 = (p - pa) * v;
        const bool whole = mr % v == 0; // the vector row's lanes are contiguous in one panel
        float * base = tile + (r0 / mr) * in * mr + r0 % mr;
        for (int64_t j0 = 0; j0 < in; j0 += VQ_CHUNK) {
            const int64_t n = MIN(VQ_CHUNK, in - j0);
            vq_unpack(c, p, j0, n, codes);
            for (int64_t js = j0; js < j0 + n; ) {
                const int64_t g  = js / gcols;
                const int64_t je = MIN(j0 + n, (g + 1) * gcols);
                const ggml_fp16_t * C  = c->L.codebook + g * c->g.K1 * v;
                const ggml_fp16_t * Rc = res ? c->L.res_codebook + g * c->g.K2 * v : NULL;
                const uint32_t * cd = codes - j0;
                if (whole && v == 4) {
                    for (int64_t j = js; j < je; ++j) {
                        __m128 f = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *) (C + (cd[j] & m1) * 4)));
                        if (res) {
                            f = _mm_add_ps(f, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *) (Rc + (cd[j] >> b1) * 4))));
                        }
                        _mm_storeu_ps(base + j * mr, f);
                    }
                } else if (whole && v == 8) {
                    for (int64_t j = js; j < je; ++j) {
                        __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (C + (cd[j] & m1) * 8)));
                        if (res) {
                            f = _mm256_add_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (Rc + (cd[j] >> b1) * 8))));
                        }
                        _mm256_storeu_ps(base + j * mr, f);
                    }
                } else if (whole && v == 16) {
                    for (int64_t j = js; j < je; ++j) {
                        const ggml_fp16_t * cm = C + (cd[j] & m1) * 16;
                        __m256 f0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) cm));
                        __m256 f1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (cm + 8)));
                        if (res) {
                            const ggml_fp16_t * cr = Rc + (cd[j] >> b1) * 16;
                            f0 = _mm256_add_ps(f0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) cr)));
                            f1 = _mm256_add_ps(f1, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (cr + 8))));
                        }
                        _mm256_storeu_ps(base + j * mr, f0);
                        _mm256_storeu_ps(base + j * mr + 8, f1);
                    }
                } else if (v <= 8) {
                    vq_decode_lanes(cd, js, je, C, C + c->g.K1 * v, Rc, res ? Rc + c->g.K2 * v : NULL, m1, b1, v,
                                    tile, in, mr, r0);
                } else {
                    for (int64_t j = js; j < je; ++j) {
                        const ggml_fp16_t * cm = C + (cd[j] & m1) * v;
                        const ggml_fp16_t * cr = res ? Rc + (cd[j] >> b1) * v : NULL;
                        for (int e = 0; e < v; ++e) {
                            const int64_t r = r0 + e;
                            const float f = GGML_CPU_FP16_TO_FP32(cm[e]) + (res ? GGML_CPU_FP16_TO_FP32(cr[e]) : 0.0f);
                            tile[(r / mr) * in * mr + j * mr + r % mr] = f;
                        }
                    }
                }
                js = je;
            }
        }
    }
}

#endif // VQ_HAVE_AVX2

#if defined(VQ_HAVE_AVX512)

// 32 rows x NR tokens; A = [k][32], B = [k][12]; rows masked by m0 (0..15) and m1 (16..31)
static VQ_ALWAYS_INLINE void vq_mk512(int64_t k, const float * A, const float * B, float * const * C, int64_t r0,
                                      __mmask16 m0, __mmask16 m1, const int NR) {
    __m512 acc[12][2];
    for (int t = 0; t < NR; ++t) {
        acc[t][0] = _mm512_setzero_ps();
        acc[t][1] = _mm512_setzero_ps();
    }
    for (int64_t l = 0; l < k; ++l) {
        const __m512 a0 = _mm512_loadu_ps(A + l * 32);
        const __m512 a1 = _mm512_loadu_ps(A + l * 32 + 16);
        for (int t = 0; t < NR; ++t) {
            const __m512 b = _mm512_set1_ps(B[l * 12 + t]);
            acc[t][0] = _mm512_fmadd_ps(a0, b, acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(a1, b, acc[t][1]);
        }
    }
    for (int t = 0; t < NR; ++t) {
        _mm512_mask_storeu_ps(C[t] + r0, m0, acc[t][0]);
        _mm512_mask_storeu_ps(C[t] + r0 + 16, m1, acc[t][1]);
    }
}

static void vq_mk512_n(int64_t k, const float * A, const float * B, float * const * C, int64_t r0, int64_t nrows, int nt) {
    const uint32_t m = nrows >= 32 ? 0xffffffffu : (uint32_t) ((1ull << nrows) - 1);
    const __mmask16 m0 = (__mmask16) (m & 0xffff), m1 = (__mmask16) (m >> 16);
    switch (nt) {
        case 12: vq_mk512(k, A, B, C, r0, m0, m1, 12); break;
        case 11: vq_mk512(k, A, B, C, r0, m0, m1, 11); break;
        case 10: vq_mk512(k, A, B, C, r0, m0, m1, 10); break;
        case 9:  vq_mk512(k, A, B, C, r0, m0, m1, 9);  break;
        case 8:  vq_mk512(k, A, B, C, r0, m0, m1, 8);  break;
        case 7:  vq_mk512(k, A, B, C, r0, m0, m1, 7);  break;
        case 6:  vq_mk512(k, A, B, C, r0, m0, m1, 6);  break;
        case 5:  vq_mk512(k, A, B, C, r0, m0, m1, 5);  break;
        case 4:  vq_mk512(k, A, B, C, r0, m0, m1, 4);  break;
        case 3:  vq_mk512(k, A, B, C, r0, m0, m1, 3);  break;
        case 2:  vq_mk512(k, A, B, C, r0, m0, m1, 2);  break;
        default: vq_mk512(k, A, B, C, r0, m0, m1, 1);  break;
    }
}

#endif // VQ_HAVE_AVX512

#if defined(VQ_HAVE_AVX2)

// 16 rows x NR tokens; A = [k][16], B = [k][6]; nrows < 16: partial store
static VQ_ALWAYS_INLINE void vq_mk256(int64_t k, const float * A, const float * B, float * const * C, int64_t r0,
                                      int64_t nrows, const int NR) {
    __m256 acc[6][2];
    for (int t = 0; t < NR; ++t) {
        acc[t][0] = _mm256_setzero_ps();
        acc[t][1] = _mm256_setzero_ps();
    }
    for (int64_t l = 0; l < k; ++l) {
        const __m256 a0 = _mm256_loadu_ps(A + l * 16);
        const __m256 a1 = _mm256_loadu_ps(A + l * 16 + 8);
        for (int t = 0; t < NR; ++t) {
            const __m256 b = _mm256_broadcast_ss(B + l * 6 + t);
            acc[t][0] = _mm256_fmadd_ps(a0, b, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(a1, b, acc[t][1]);
        }
    }
    for (int t = 0; t < NR; ++t) {
        if (nrows >= 16) {
            _mm256_storeu_ps(C[t] + r0, acc[t][0]);
            _mm256_storeu_ps(C[t] + r0 + 8, acc[t][1]);
        } else {
            float tmp[16];
            _mm256_storeu_ps(tmp, acc[t][0]);
            _mm256_storeu_ps(tmp + 8, acc[t][1]);
            memcpy(C[t] + r0, tmp, nrows * sizeof(float));
        }
    }
}

static void vq_mk256_n(int64_t k, const float * A, const float * B, float * const * C, int64_t r0, int64_t nrows, int nt) {
    switch (nt) {
        case 6:  vq_mk256(k, A, B, C, r0, nrows, 6); break;
        case 5:  vq_mk256(k, A, B, C, r0, nrows, 5); break;
        case 4:  vq_mk256(k, A, B, C, r0, nrows, 4); break;
        case 3:  vq_mk256(k, A, B, C, r0, nrows, 3); break;
        case 2:  vq_mk256(k, A, B, C, r0, nrows, 2); break;
        default: vq_mk256(k, A, B, C, r0, nrows, 1); break;
    }
}

static void vq_gemm_rows(const struct vq_call * c, int64_t p0, int64_t p1, float * tile, uint32_t * codes) {
    const int v = c->g.v, mr = c->g.mr, nr = c->g.nr;
    const int64_t in = c->g.in, ntok = c->g.ntok;
    for (int64_t pa = p0; pa < p1; pa += c->g.tile_vrows) {
        const int64_t pb = MIN(p1, pa + c->g.tile_vrows);
        vq_decode_panels(c, pa, pb, tile, codes);
        const int64_t nrows = (pb - pa) * v;
        const int64_t npan = (nrows + mr - 1) / mr;
        for (int64_t blk = 0; blk * nr < ntok; ++blk) {
            const int nt = (int) MIN(nr, ntok - blk * nr);
            float * C[12];
            for (int t = 0; t < nt; ++t) {
                C[t] = vq_y_row(c, blk * nr + t);
            }
            const float * B = c->bpack + blk * nr * in;
            for (int64_t q = 0; q < npan; ++q) {
                const int64_t rr = q * mr;
                const int64_t nv = MIN(mr, nrows - rr);
#if defined(VQ_HAVE_AVX512)
                if (mr == 32) {
                    vq_mk512_n(in, tile + q * in * mr, B, C, pa * v + rr, nv, nt);
                    continue;
                }
#endif
                vq_mk256_n(in, tile + q * in * mr, B, C, pa * v + rr, nv, nt);
            }
        }
    }
}

#endif // VQ_HAVE_AVX2

// ---------------------------------------------------------------------------------------------------------
// the op

void ggml_compute_forward_mul_mat_vq(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];

    struct vq_call c;
    char err[256];
    if (!ggml_vq_layout_init(&c.L, src0, dst->src + GGML_VQ_SRC_FIRST, err, sizeof(err))) {
        GGML_ABORT("MUL_MAT of VQ weight '%s': %s (VQ weights must be multiplied through llama.cpp's weight matmul hook)", src0->name, err);
    }
    GGML_ASSERT(src1->type == GGML_TYPE_F32 && src1->nb[0] == sizeof(float));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && dst->nb[0] == sizeof(float));
    GGML_ASSERT(src1->ne[0] == c.L.in && dst->ne[0] == c.L.out);
    GGML_ASSERT(dst->ne[1] == src1->ne[1] && dst->ne[2] == src1->ne[2] && dst->ne[3] == src1->ne[3]);
    GGML_ASSERT(params->wsize >= ggml_vq_cpu_work_size(dst, params->nth));

    c.isa = vq_isa();
    vq_geom_init(&c.g, dst, c.isa);
    c.src1       = src1;
    c.dst        = dst;
    c.row_bytes  = c.L.in * c.g.b / 8;
    c.code_bytes = c.g.P * c.row_bytes;
    c.xprep      = NULL;
    c.bpack      = NULL;
    c.tb         = NULL;
    vq_unpack_init(&c);

    const int ith = params->ith;
    const int nth = params->nth;
    const struct vq_geom * g = &c.g;
    char * wbase = (char *) GGML_PAD((uintptr_t) params->wdata, 64);
    char * wthr  = wbase + g->shared_bytes + (size_t) ith * g->thread_bytes;

    if (g->xs_bytes) {
        float * xs = (float *) wbase;
        float * tb = (float *) (wbase + g->xs_bytes);
        if (g->path == VQ_PATH_GEMM) {
            vq_prepare_packed(&c, xs, tb, ith, nth);
            c.bpack = xs;
        } else {
            vq_prepare_rows(&c, xs, tb, ith, nth);
            c.xprep = xs;
        }
        if (nth > 1) {
            ggml_barrier(params->threadpool);
        }
        c.tb = c.L.col_norm ? tb : NULL;
    }

    const int64_t v  = g->v;
    const int64_t p0 = g->P * ith / nth;
    const int64_t p1 = g->P * (ith + 1) / nth;
    if (p0 >= p1) {
        return;
    }
    const int64_t in = g->in;

    uint8_t  * tab1 = (uint8_t *) wthr;
    uint8_t  * tab2 = tab1 + (size_t) g->G * v * 2 * vq_lut_kp(g->K1);
    uint8_t  * ib1  = (uint8_t *) wthr + g->lut_bytes;
    uint8_t  * ib2  = ib1 + vq_pad64((size_t) in + 64);
    uint8_t  * ibo  = ib1 + 2 * vq_pad64((size_t) in + 64); // original order (lutx with a permutation)
    uint32_t * cbuf = (uint32_t *) (wthr + g->lut_bytes + g->idx_bytes);
    float    * tile = (float *) (wthr + g->lut_bytes + g->idx_bytes + g->cbuf_bytes);
    char     * xmem = wthr + g->lut_bytes + g->idx_bytes + g->cbuf_bytes + g->tile_bytes;
    (void) tab2; (void) ib1; (void) ib2; (void) ibo; (void) cbuf; (void) xmem;
    if (c.L.row_scale_f16) {
        float * u = (float *) (xmem + g->xinfo_bytes);
        for (int64_t r = p0 * v; r < p1 * v; ++r) {
            u[r] = GGML_CPU_FP16_TO_FP32(c.L.row_scale_f16[r]);
        }
        c.L.row_scale     = u;
        c.L.row_scale_f16 = NULL;
    }

    switch (g->path) {
        case VQ_PATH_REF: {
            for (int64_t p = p0; p < p1; p += g->tile_vrows) {
                const int64_t np = MIN(g->tile_vrows, p1 - p);
                for (int64_t k = 0; k < np; ++k) {
                    ggml_vq_decode_vrow(&c.L, p + k, tile + k * v * in);
                }
                for (int64_t t = 0; t < g->ntok; ++t) {
                    const float * x = vq_src_row(&c, t);
                    float * y = vq_y_row(&c, t) + p * v;
                    for (int64_t r = 0; r < np * v; ++r) {
                        ggml_vec_dot_f32((int) in, y + r, 0, tile + r * in, 0, x, 0, 1);
                    }
                }
            }
            return; // the reference decoder applied everything
        }
#if defined(VQ_HAVE_VBMI)
        case VQ_PATH_LUTX: {
            struct vq_xinfo X;
            vq_lut_build(&c, tab1, tab2);
            vq_xinfo_build(&c, xmem, ibo, &X);
            vq_lutx_rows(&c, &X, p0, p1, tab1, tab2, ib1, ib2, (float *) (xmem + g->xinfo_bytes - vq_pad64((size_t) in * sizeof(float))));
            return; // exact: the weights already hold the norm, outliers and row scale
        }
#endif
        case VQ_PATH_DECX: {
            vq_decx_rows(&c, p0, p1, tile, cbuf);
            return; // exact: the weights already hold the norm, outliers and row scale
        }
#if defined(VQ_HAVE_CENTX)
        case VQ_PATH_CENTX: {
            vq_centx_rows(&c, p0, p1, (ggml_fp16_t *) tab1, tile, cbuf);
            return; // exact: the weights already hold the row scale
        }
#endif
        case VQ_PATH_SCALAR: {
            uint32_t codes[VQ_CHUNK];
            for (int64_t p = p0; p < p1; p += g->tile_vrows) {
                const int64_t np = MIN(g->tile_vrows, p1 - p);
                for (int64_t k = 0; k < np; ++k) {
                    vq_decode_vrow_plain(&c, p + k, tile + k * v * in, in, codes);
                }
                for (int64_t t = 0; t < g->ntok; ++t) {
                    const float * x = vq_x_row(&c, t);
                    float * y = vq_y_row(&c, t) + p * v;
                    for (int64_t r = 0; r < np * v; ++r) {
                        ggml_vec_dot_f32((int) in, y + r, 0, tile + r * in, 0, x, 0, 1);
                    }
                }
            }
            break;
        }
#if defined(VQ_HAVE_VBMI)
        case VQ_PATH_LUT: {
            vq_lut_build(&c, tab1, tab2);
            for (int64_t t = 0; t < g->ntok; t += 4) {
                vq_lut_rows(&c, p0, p1, t, (int) MIN(4, g->ntok - t), tab1, tab2, ib1, ib2);
            }
            break;
        }
#endif
#if defined(VQ_HAVE_AVX2)
        case VQ_PATH_CENT: {
            for (int64_t t = 0; t < g->ntok; t += 4) {
                const int nt = (int) MIN(4, g->ntok - t);
#if defined(VQ_HAVE_AVX512)
                // the 256-bit kernel is as fast or faster for the vector lengths it has (measured)
                if (c.isa >= VQ_ISA_AVX512 && v != 2 && v != 4 && v != 8) {
                    vq_cent512_rows(&c, p0, p1, t, nt, cbuf);
                    continue;
                }
#endif
                vq_cent256_rows(&c, p0, p1, t, nt, cbuf);
            }
            break;
        }
        case VQ_PATH_GEMM: {
            vq_gemm_rows(&c, p0, p1, tile, cbuf);
            break;
        }
#endif
        default:
            GGML_ABORT("vq: path %d not compiled", g->path);
    }

    for (int64_t t = 0; t < g->ntok; ++t) {
        vq_epilogue(&c, p0 * v, p1 * v, t);
    }
}
