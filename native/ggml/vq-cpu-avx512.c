// AVX-512 kernels of the VQ MUL_MAT (vq-cpu.c chooses the path; docs/kernels.md): code unpacking, lut and
// lutx (VBMI), cent with 16 lanes, the gemm micro-kernel of 32 rows.

#include "vq-cpu-impl.h"

#if defined(VQ_HAVE_AVX512)

// vq_unpack for b <= 25 bits: 16 codes (2b bytes) at a time: dword k = the 4 bytes that hold code k, shifted
// into place
void vq_unpack_avx512(const struct vq_call * c, const uint8_t * stream, int64_t j0, int64_t n, uint32_t * dst) {
    const int b = c->g.b;
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

void vq_lut(const struct vq_call * c, int64_t p0, int64_t p1, uint8_t * tab1, uint8_t * tab2, uint8_t * ib1, uint8_t * ib2) {
    vq_lut_build(c, tab1, tab2);
    for (int64_t t = 0; t < c->g.ntok; t += 4) {
        vq_lut_rows(c, p0, p1, t, (int) MIN(4, c->g.ntok - t), tab1, tab2, ib1, ib2);
    }
}

void vq_lutx(const struct vq_call * c, int64_t p0, int64_t p1, uint8_t * tab1, uint8_t * tab2, uint8_t * ib1, uint8_t * ib2,
             uint8_t * ibo, char * xmem) {
    struct vq_xinfo X;
    vq_lut_build(c, tab1, tab2);
    vq_xinfo_build(c, xmem, ibo, &X);
    vq_lutx_rows(c, &X, p0, p1, tab1, tab2, ib1, ib2, (float *) (xmem + c->g.xinfo_bytes - vq_pad64((size_t) c->g.in * sizeof(float))));
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

void vq_cent512_rows(const struct vq_call * c, int64_t p0, int64_t p1, int64_t t0, int nt, uint32_t * cbuf) {
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

#if defined(VQ_HAVE_AVX512)

// 32 rows x NR tokens; A = [k][32], B = [k][12]; rows masked by m0 (0..15) and m1 (16..31)
static VQ_ALWAYS_INLINE void vq_mk512(int64_t k, const float * A, const float * B, float * const * C, int64_t r0,
                                      __mmask16 m0, __mmask16 m1, const int NR) {
    __m512 acc[12][2];
    VQ_UNROLL
    for (int t = 0; t < NR; ++t) {
        acc[t][0] = _mm512_setzero_ps();
        acc[t][1] = _mm512_setzero_ps();
    }
    for (int64_t l = 0; l < k; ++l) {
        const __m512 a0 = _mm512_loadu_ps(A + l * 32);
        const __m512 a1 = _mm512_loadu_ps(A + l * 32 + 16);
        VQ_UNROLL
        for (int t = 0; t < NR; ++t) {
            const __m512 b = _mm512_set1_ps(B[l * 12 + t]);
            acc[t][0] = _mm512_fmadd_ps(a0, b, acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(a1, b, acc[t][1]);
        }
    }
    VQ_UNROLL
    for (int t = 0; t < NR; ++t) {
        _mm512_mask_storeu_ps(C[t] + r0, m0, acc[t][0]);
        _mm512_mask_storeu_ps(C[t] + r0 + 16, m1, acc[t][1]);
    }
}

void vq_mk512_n(int64_t k, const float * A, const float * B, float * const * C, int64_t r0, int64_t nrows, int nt) {
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

#endif // VQ_HAVE_AVX512
