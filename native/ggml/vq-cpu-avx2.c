// AVX2 kernels of the VQ MUL_MAT (vq-cpu.c chooses the path; docs/kernels.md): code unpacking, cent with 8
// lanes, decx's 8-row decoder, centx, the gemm panels and micro-kernel of 16 rows (32-row AVX-512 kernel from
// vq-cpu-avx512.c where compiled).

#include "vq-cpu-impl.h"

#if defined(VQ_HAVE_AVX2)

// vq_unpack for b <= 14 bits, b != 8: 8 codes (b bytes) at a time, the same dwords as vq_unpack_avx512 from
// 16 bytes broadcast to both lanes (byte (7b)/8 + 3 < 16 for b <= 14)
void vq_unpack_avx2(const struct vq_call * c, const uint8_t * stream, int64_t j0, int64_t n, uint32_t * dst) {
    const int b = c->g.b;
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
}

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

// the same for centroids of v <= VP values (vq_cent_padded)
static VQ_ALWAYS_INLINE __m256 vq_cent_gather256(const ggml_fp16_t * const * ptr, const int VP, const int v, const ggml_fp16_t * end) {
    if (v == VP) {
        return _mm256_cvtph_ps(vq_cent_load128(ptr, VP));
    }
    ggml_fp16_t tail[4][8];
    const ggml_fp16_t * q[4];
    vq_cent_padded(ptr, VP, v, end, tail, q);
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

void vq_cent256_rows(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0, int nt, uint32_t * cbuf) {
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

void vq_decx8(const struct vq_call * c, int64_t p, int half, float * dst, uint32_t * cbuf) {
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
void vq_decx_extras(const struct vq_call * c, int64_t r0, int nrows, float * src, float * dst) {
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
void vq_centx_rows(const struct vq_call * c, int64_t p0, int64_t p1, ggml_fp16_t * T, float * tile, uint32_t * cbuf) {
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

#if defined(VQ_HAVE_AVX2)

// 16 rows x NR tokens; A = [k][16], B = [k][6]; nrows < 16: partial store
static VQ_ALWAYS_INLINE void vq_mk256(int64_t k, const float * A, const float * B, float * const * C, int64_t r0,
                                      int64_t nrows, const int NR) {
    __m256 acc[6][2];
    VQ_UNROLL
    for (int t = 0; t < NR; ++t) {
        acc[t][0] = _mm256_setzero_ps();
        acc[t][1] = _mm256_setzero_ps();
    }
    for (int64_t l = 0; l < k; ++l) {
        const __m256 a0 = _mm256_loadu_ps(A + l * 16);
        const __m256 a1 = _mm256_loadu_ps(A + l * 16 + 8);
        VQ_UNROLL
        for (int t = 0; t < NR; ++t) {
            const __m256 b = _mm256_broadcast_ss(B + l * 6 + t);
            acc[t][0] = _mm256_fmadd_ps(a0, b, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(a1, b, acc[t][1]);
        }
    }
    VQ_UNROLL
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

void vq_gemm_rows(const struct vq_call * c, int64_t p0, int64_t p1, float * tile, uint32_t * codes) {
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

#endif // VQ_HAVE_AVX2
