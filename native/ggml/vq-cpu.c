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
//     cent  AVX-512 (v <= 16), AVX2 or NEON (v in {2, 3, 4, 6, 8}), any K: 16/VP (8/VP) vector rows at one input column
//           at a time (VP: v rounded up to a power of two, vq_cent_vp); their centroids, read as fp16
//           straight from the codebook, fill one vector that is widened and multiplied with the broadcast
//           activation.
//   one token (generation), exact: bitwise ggml_vec_dot_f32 on the reference decoder's weights
//     lutx  AVX-512 VBMI, K1 and K2 <= 256: lut's lookups, summed in ggml_vec_dot_f32's order.
//     centx AVX2 and up, no permutation, norm or outliers (row scale allowed), v in {2, 3, 4, 6, 8}: cent's
//           loads from a padded copy of the fp16 codebooks, each of ggml_vec_dot_f32's accumulator lanes
//           run as its own chain.
//     decx  anything else: rows decoded (8 at a time by AVX2 or NEON where the layout allows), then ggml_vec_dot_f32.
//   many tokens (prompt processing), gemm: a tile of rows is decoded to f32 into the thread's work buffer,
//           packed as panels of 32 (AVX-512) or 16 (AVX2) rows, and multiplied with the activations, packed
//           once per call in blocks of 12 (6) tokens, by an outer-product register-blocked kernel.
//   scalar: decode a tile of rows (scalar, or NEON for v in {2, 4, 8}), then ggml_vec_dot_f32 per row and token
//           (any architecture; on Arm also the prompt path).
//   ref:    the reference decoder ggml_vq_decode_vrow and ggml_vec_dot_f32 (the plain path, for comparison).
// GGML_VQ_ISA=ref|scalar|avx2|avx512|vbmi (Arm: ref|scalar|neon) caps the instruction set used (tests,
// benchmarks); GGML_VQ_DECX=1
// sends every one-token call that would take centx through decx (comparisons).
//
// Files: this one holds the instruction-set choice, the geometry, the activations' preparation, the code
// unpacking, the portable paths (ref, scalar, decx) and the op; vq-cpu-avx2.c, vq-cpu-avx512.c and
// vq-cpu-neon.c the kernels of their instruction sets (vq-cpu-impl.h: what they share).
//
// No allocation: everything lives in the work buffer that ggml_graph_plan sizes with ggml_vq_cpu_work_size.
// Threads own disjoint, even ranges of vector rows. The only synchronisation is one barrier after the
// shared activations are prepared (gemm path; other paths only with a permutation or column norms). Each
// output element is summed in an order fixed by the path and the shapes, never by the thread split.

#include "vq-cpu-impl.h"

#include <stdatomic.h>
#include <stdlib.h>

static int vq_isa_compiled(void) {
#if defined(VQ_HAVE_VBMI)
    return VQ_ISA_VBMI;
#elif defined(VQ_HAVE_AVX512)
    return VQ_ISA_AVX512;
#elif defined(VQ_HAVE_AVX2)
    return VQ_ISA_AVX2;
#elif defined(VQ_HAVE_NEON)
    return VQ_ISA_NEON;
#else
    return VQ_ISA_SCALAR;
#endif
}

static atomic_int vq_isa_cached = -1;

void ggml_vq_cpu_set_isa(const char * name) {
    static const char * names[VQ_ISA_COUNT] = { "ref", "scalar", "neon", "avx2", "avx512", "vbmi" };
    const int compiled = vq_isa_compiled();
    int isa = compiled;
    for (int i = 0; name && i < VQ_ISA_COUNT; ++i) {
        // a cap of the other family (avx2 on Arm, neon on x86) is no cap
        const bool family = i <= VQ_ISA_SCALAR || (i == VQ_ISA_NEON) == (compiled == VQ_ISA_NEON);
        if (strcmp(name, names[i]) == 0 && family) {
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
static int vq_log2_i64(int64_t k) {
    int b = 0;
    while (((int64_t) 1 << b) < k) {
        ++b;
    }
    return b;
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
                        ((isa >= VQ_ISA_AVX2 || isa == VQ_ISA_NEON) && g->v >= 2 && g->v <= 8 && g->v != 5 && g->v != 7);
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
        g->path = isa == VQ_ISA_NEON ? VQ_PATH_SCALAR : VQ_PATH_GEMM; // NEON: tiles decoded by vq_decx8_neon
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
    // the last thread's tail rows, one at a time (vq_tail_rows)
    g->tail_bytes   = g->out % g->v ? vq_pad64((size_t) g->in * sizeof(float)) : 0;
    g->thread_bytes = g->lut_bytes + g->idx_bytes + g->cbuf_bytes + g->tile_bytes + g->xinfo_bytes + g->rs_bytes + g->tail_bytes;
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

// the tail's output channels (P*v ..), exact: the reference decoder's values, then ggml_vec_dot_f32 with every token
static void vq_tail_rows(const struct vq_call * c, float * row) {
    const struct ggml_vq_layout * L = &c->L;
    for (int64_t e = 0; e < L->n_tail; ++e) {
        const int64_t r = L->P * L->v + e;
        const float   u = ggml_vq_row_scale(L, r);
        for (int64_t j = 0; j < L->in; ++j) {
            row[j] = GGML_CPU_FP16_TO_FP32(L->tail[e * L->in + j]) * u;
        }
        for (int64_t t = 0; t < c->g.ntok; ++t) {
            ggml_vec_dot_f32((int) L->in, vq_y_row(c, t) + r, 0, row, 0, vq_src_row(c, t), 0, 1);
        }
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

// codes of stored columns [j0, j0 + n) of vector row p into dst; j0 and n multiples of 16
void vq_unpack(const struct vq_call * c, int64_t p, int64_t j0, int64_t n, uint32_t * dst) {
    const int b = c->g.b;
    const uint8_t * stream = c->L.codes + p * c->row_bytes;
#if defined(VQ_HAVE_AVX512)
    if (c->isa >= VQ_ISA_AVX512 && b <= 25) {
        vq_unpack_avx512(c, stream, j0, n, dst);
        return;
    }
#endif
#if defined(VQ_HAVE_AVX2)
    if (c->isa >= VQ_ISA_AVX2 && b <= 14 && b != 8) {
        vq_unpack_avx2(c, stream, j0, n, dst);
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

void vq_decode_vrow_plain(const struct vq_call * c, int64_t p, float * dst, int64_t ld, uint32_t * codes) {
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
// rows [p0, p1) of one token, exact
void vq_decx_rows(const struct vq_call * c, int64_t p0, int64_t p1, float * tile, uint32_t * cbuf) {
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
#if defined(VQ_HAVE_NEON)
    if (c->isa == VQ_ISA_NEON && c->g.plain && (v == 2 || v == 4 || v == 8)) {
        for (; p + 8 / v <= p1; p += 8 / v) {
            vq_decx8_neon(c, p, tile, cbuf);
            for (int64_t e = 0; e < 8; ++e) {
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
    const bool tail = p1 == g->P && c.L.n_tail; // the last thread also computes the tail
    if (c.L.row_scale_f16) {
        float * u = (float *) (xmem + g->xinfo_bytes);
        for (int64_t r = p0 * v; r < (tail ? g->out : p1 * v); ++r) {
            u[r] = GGML_CPU_FP16_TO_FP32(c.L.row_scale_f16[r]);
        }
        c.L.row_scale     = u;
        c.L.row_scale_f16 = NULL;
    }

    bool exact = true; // the path's weights already hold the norm, outliers and row scale: no epilogue
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
            break; // the reference decoder applied everything
        }
#if defined(VQ_HAVE_VBMI)
        case VQ_PATH_LUTX: {
            vq_lutx(&c, p0, p1, tab1, tab2, ib1, ib2, ibo, xmem);
            break;
        }
#endif
        case VQ_PATH_DECX: {
            vq_decx_rows(&c, p0, p1, tile, cbuf);
            break;
        }
#if defined(VQ_HAVE_CENTX)
        case VQ_PATH_CENTX: {
            vq_centx_rows(&c, p0, p1, (ggml_fp16_t *) tab1, tile, cbuf);
            break; // the weights already hold the row scale (centx takes no norm or outliers)
        }
#endif
        case VQ_PATH_SCALAR: {
            exact = false;
            uint32_t codes[4 * VQ_CHUNK];
            for (int64_t p = p0; p < p1; p += g->tile_vrows) {
                const int64_t np = MIN(g->tile_vrows, p1 - p);
                int64_t k = 0;
#if defined(VQ_HAVE_NEON)
                // 8 rows (8 / v vector rows) at a time where NEON decodes the layout
                if (c.isa == VQ_ISA_NEON && (v == 2 || v == 4 || v == 8)) {
                    for (; k + 8 / v <= np; k += 8 / v) {
                        vq_decx8_neon(&c, p + k, tile + k * v * in, codes);
                    }
                }
#endif
                for (; k < np; ++k) {
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
            exact = false;
            vq_lut(&c, p0, p1, tab1, tab2, ib1, ib2);
            break;
        }
#endif
#if defined(VQ_HAVE_NEON)
        case VQ_PATH_CENT: {
            exact = false;
            for (int64_t t = 0; t < g->ntok; t += 4) {
                vq_cent_neon_rows(&c, p0, p1, t, (int) MIN(4, g->ntok - t), cbuf);
            }
            break;
        }
#endif
#if defined(VQ_HAVE_AVX2)
        case VQ_PATH_CENT: {
            exact = false;
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
            exact = false;
            vq_gemm_rows(&c, p0, p1, tile, cbuf);
            break;
        }
#endif
        default:
            GGML_ABORT("vq: path %d not compiled", g->path);
    }

    for (int64_t t = 0; !exact && t < g->ntok; ++t) {
        vq_epilogue(&c, p0 * v, p1 * v, t);
    }
    if (tail) {
        vq_tail_rows(&c, (float *) (xmem + g->xinfo_bytes + g->rs_bytes));
    }
}
