// CUDA kernels of the VQ MUL_MAT (layout: docs/format.md; design and tests: docs/cuda.md).
//
// Up to GGML_CUDA_VQ_MAX_BATCH tokens: a few warps per vector row (v output channels) decode its code stream,
// lanes striding over the stored columns, with the codebooks in shared memory when they fit (global memory,
// through L1/L2, otherwise); a permutation or column norm is folded into the activations first (k_vq_prep).
// More tokens: the weight is decoded to F16 (k_vq_dequant_f16) and multiplied by cuBLAS with F32 accumulation.
// Outliers and the row scale are applied as the C reference decoder (ggml_vq_decode_vrow) defines them.

#include "vq-cuda.cuh"
#include "convert.cuh"
#include "ggml-vq.h"

static constexpr int VQ_WARPS      = 8;        // warps per block of the decode-and-dot kernel
static constexpr int VQ_MAX_ACC    = 64;       // accumulators per lane (tokens x vector length) before tokens are split
static constexpr int VQ_BLOCK_SIZE = 256;      // threads per block of the element-wise kernels

// a VQ weight as the kernels read it (device pointers, from ggml_vq_layout)
struct vq_weight_dev {
    const uint32_t * codes;       // vector row p's code stream: words [p*words, (p+1)*words)
    const half     * cb;          // [G][K1][v]
    const half     * rcb;         // [G][K2][v] or nullptr
    const int32_t  * perm;        // [in] or nullptr
    const float    * col_norm;    // [2][in] or nullptr
    const float    * row_scale;   // [out] F32, or nullptr
    const half     * row_scale_h; // [out] F16, or nullptr (at most one of the two)
    const int32_t  * ocols;       // [n_o]
    const int16_t  * oidx;        // [n_o][out/v0]
    const half     * ocb;         // [K0][v0]
    int     in, out, v, b1, b2, gcols, n_o, v0;
    int64_t words;                // 32-bit words per vector row: in*(b1+b2)/32
};

// u_r: the row scale of output channel r, 1 without one
static __device__ __forceinline__ float vq_row_scale(const vq_weight_dev & W, int r) {
    return W.row_scale ? W.row_scale[r] : W.row_scale_h ? __half2float(W.row_scale_h[r]) : 1.0f;
}

// F32 activations: token t lives at x + (t%ne1)*s1 + (t/ne1%ne2)*s2 + (t/(ne1*ne2))*s3 (in floats)
struct vq_act {
    const float * x;
    int64_t s1, s2, s3;
    int64_t ne1, ne2;
};

static __device__ __forceinline__ const float * vq_token(const vq_act & a, int64_t t) {
    return a.x + (t % a.ne1) * a.s1 + (t / a.ne1 % a.ne2) * a.s2 + t / (a.ne1 * a.ne2) * a.s3;
}

// the b-bit code of stored column j in a little-endian bit stream of 32-bit words (format §3)
static __device__ __forceinline__ uint32_t vq_code(const uint32_t * __restrict__ stream, int j, int b) {
    const uint32_t bit = (uint32_t) j * (uint32_t) b;
    const uint32_t w   = bit >> 5;
    const uint32_t sh  = bit & 31;
    const uint32_t lo  = __ldg(stream + w);
    const uint32_t hi  = sh + b > 32 ? __ldg(stream + w + 1) : 0u;
    const uint32_t c   = __funnelshift_r(lo, hi, sh);
    return b == 32 ? c : c & ((1u << b) - 1u);
}

// w[e] += c[e] for e < v. EXACT (v == VT, a power of two): an entry is VT halves at a multiple of its size,
// so it loads in 4-, 8- or 16-byte words
template <int VT, bool EXACT>
static __device__ __forceinline__ void vq_add_centroid(const half * __restrict__ c, const int v, float * w) {
    if constexpr (EXACT && VT >= 8) {
#pragma unroll
        for (int i = 0; i < VT / 8; ++i) {
            const int4 q = ((const int4 *) c)[i];
            const half2 * h = (const half2 *) &q;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 f = __half22float2(h[k]);
                w[8 * i + 2 * k]     += f.x;
                w[8 * i + 2 * k + 1] += f.y;
            }
        }
    } else if constexpr (EXACT && VT == 4) {
        const uint2 q = *(const uint2 *) c;
        const float2 f0 = __half22float2(*(const half2 *) &q.x);
        const float2 f1 = __half22float2(*(const half2 *) &q.y);
        w[0] += f0.x; w[1] += f0.y; w[2] += f1.x; w[3] += f1.y;
    } else if constexpr (EXACT && VT == 2) {
        const float2 f = __half22float2(*(const half2 *) c);
        w[0] += f.x; w[1] += f.y;
    } else {
#pragma unroll
        for (int e = 0; e < VT; ++e) {
            if (EXACT || e < v) {
                w[e] += __half2float(c[e]);
            }
        }
    }
}

// outlier correction of output channel r in outlier column o (before the row scale)
static __device__ __forceinline__ float vq_outlier(const vq_weight_dev & W, int o, int r) {
    const int     q0 = W.out / W.v0;
    const int32_t id = (uint16_t) W.oidx[(int64_t) o * q0 + r / W.v0];
    return __half2float(W.ocb[(int64_t) id * W.v0 + r % W.v0]);
}

// xs[t][j] = s_j * x_t[perm j] for token t = blockIdx.x, and bias[t] = sum_j t_j * x_t[perm j]
static __global__ void k_vq_prep(const vq_weight_dev W, const vq_act a, float * __restrict__ xs, float * __restrict__ bias) {
    const float * xt = vq_token(a, blockIdx.x);
    float * xst = xs + (int64_t) blockIdx.x * W.in;
    float b = 0.0f;
    for (int j = threadIdx.x; j < W.in; j += blockDim.x) {
        const float x = xt[W.perm ? W.perm[j] : j];
        xst[j] = W.col_norm ? x * W.col_norm[j] : x;
        if (W.col_norm) {
            b += x * W.col_norm[W.in + j];
        }
    }
    __shared__ float part[VQ_BLOCK_SIZE / WARP_SIZE];
    b = warp_reduce_sum(b);
    if (threadIdx.x % WARP_SIZE == 0) {
        part[threadIdx.x / WARP_SIZE] = b;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int i = 0; i < VQ_BLOCK_SIZE / WARP_SIZE; ++i) {
            s += part[i];
        }
        bias[blockIdx.x] = s;
    }
}

// Decode-and-dot for up to NT tokens [t0, t0 + nt): a vector row p is split over S warps of a block (S divides
// VQ_WARPS, so a block takes VQ_WARPS / S rows a pass); warp s of a row takes the stored columns s*32 + lane,
// + 32*S, ... of each column group, and the S partial sums meet in shared memory in a fixed order (no atomics:
// runs are bitwise equal). VT >= v accumulators per token (EXACT: v == VT, no guards). xs holds the activations
// in stored column order (s_j folded in when there is a column norm); raw is src1 (outliers). Shared memory:
// the partial sums [VQ_WARPS][NT*VT], then the codebooks when cb_in_smem.
template <int VT, bool EXACT, int NT>
__launch_bounds__(VQ_WARPS * WARP_SIZE)
static __global__ void k_vq_mmv(const vq_weight_dev W, const vq_act xs, const vq_act raw, const float * __restrict__ bias,
                                const int64_t t0, const int nt, const int S, const bool cb_in_smem, float * __restrict__ dst) {
    constexpr int NACC   = NT * VT;
    constexpr int UNROLL = NACC <= 16 ? 4 : 1;   // independent code loads in flight; more accumulators would spill
    extern __shared__ __align__(16) uint32_t vq_smem[];
    float * part = (float *) vq_smem;
    const int v  = EXACT ? VT : W.v;
    const int b  = W.b1 + W.b2;
    const uint32_t m1 = (1u << W.b1) - 1u;

    const half * cb  = W.cb;
    const half * rcb = W.rcb;
    if (cb_in_smem) {
        // K1, K2 >= 2: both codebooks hold an even number of halves, so they copy as 32-bit words
        uint32_t * cbs = vq_smem + VQ_WARPS * NACC;
        const int n1 = (W.in / W.gcols) * (v << W.b1) / 2;
        const int n2 = W.rcb ? (W.in / W.gcols) * (v << W.b2) / 2 : 0;
        for (int i = threadIdx.x; i < n1 + n2; i += blockDim.x) {
            cbs[i] = i < n1 ? ((const uint32_t *) W.cb)[i] : ((const uint32_t *) W.rcb)[i - n1];
        }
        __syncthreads();
        cb  = (const half *) cbs;
        rcb = W.rcb ? (const half *) (cbs + n1) : nullptr;
    }

    const float * x[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        x[t] = vq_token(xs, t0 + (t < nt ? t : 0));
    }

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int s    = warp % S;
    const int R    = VQ_WARPS / S;
    const int P    = W.out / v;
    for (int p0 = blockIdx.x * R; p0 < P; p0 += gridDim.x * R) {   // the same passes for every warp of the block
        const int p = p0 + warp / S;
        float acc[NT][VT] = {};
        if (p < P) {
            const uint32_t * stream = W.codes + (int64_t) p * W.words;
            for (int g = 0, g0 = 0; g0 < W.in; ++g, g0 += W.gcols) {
                const half * cbg  = cb + ((int64_t) g << W.b1) * v;
                const half * rcbg = rcb ? rcb + ((int64_t) g << W.b2) * v : nullptr;
#pragma unroll UNROLL
                for (int j = g0 + s * WARP_SIZE + lane; j < g0 + W.gcols; j += S * WARP_SIZE) {
                    const uint32_t code = vq_code(stream, j, b);
                    float w[VT] = {};
                    vq_add_centroid<VT, EXACT>(cbg + (int64_t) (code & m1) * v, v, w);
                    if (rcbg) {
                        vq_add_centroid<VT, EXACT>(rcbg + (int64_t) (code >> W.b1) * v, v, w);
                    }
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        const float xv = t < nt ? x[t][j] : 0.0f;
#pragma unroll
                        for (int e = 0; e < VT; ++e) {
                            acc[t][e] += w[e] * xv;
                        }
                    }
                }
            }

            for (int o = s * WARP_SIZE + lane; o < W.n_o; o += S * WARP_SIZE) {
                const int c = W.ocols[o];
#pragma unroll
                for (int e = 0; e < VT; ++e) {
                    if (EXACT || e < v) {
                        const float w = vq_outlier(W, o, p * v + e);
#pragma unroll
                        for (int t = 0; t < NT; ++t) {
                            if (t < nt) {
                                acc[t][e] += w * vq_token(raw, t0 + t)[c];
                            }
                        }
                    }
                }
            }
        }

#pragma unroll
        for (int t = 0; t < NT; ++t) {
#pragma unroll
            for (int e = 0; e < VT; ++e) {
                acc[t][e] = warp_reduce_sum(acc[t][e]);
                if (S > 1 && s > 0 && lane == (t * VT + e) % WARP_SIZE) {
                    part[warp * NACC + t * VT + e] = acc[t][e];
                }
            }
        }
        if (S > 1) {
            __syncthreads();
        }
        if (s == 0 && p < P) {
#pragma unroll
            for (int t = 0; t < NT; ++t) {
#pragma unroll
                for (int e = 0; e < VT; ++e) {
                    if (lane == (t * VT + e) % WARP_SIZE && t < nt && (EXACT || e < v)) {
                        const int r = p * v + e;
                        float y = acc[t][e];
                        for (int q = 1; q < S; ++q) {
                            y += part[(warp + q) * NACC + t * VT + e];
                        }
                        y += bias ? bias[t0 + t] : 0.0f;
                        y *= vq_row_scale(W, r);
                        dst[(t0 + t) * W.out + r] = y;
                    }
                }
            }
        }
        if (S > 1) {
            __syncthreads();   // the partial sums are read before the next pass writes them
        }
    }
}

// W16[r][perm j] = ((C + R) * s_j + t_j) * u_r for every vector row p and stored column j (outliers excluded)
static __global__ void k_vq_dequant_f16(const vq_weight_dev W, half * __restrict__ w16) {
    const int     b     = W.b1 + W.b2;
    const int64_t total = (int64_t) (W.out / W.v) * W.in;
    for (int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t) gridDim.x * blockDim.x) {
        const int64_t p = i / W.in;
        const int     j = (int) (i % W.in);
        const int     g = j / W.gcols;
        const uint32_t code = vq_code(W.codes + p * W.words, j, b);
        const half * c1 = W.cb + ((int64_t) (g << W.b1) + (code & ((1u << W.b1) - 1u))) * W.v;
        const half * c2 = W.rcb ? W.rcb + ((int64_t) (g << W.b2) + (code >> W.b1)) * W.v : nullptr;
        const float  s  = W.col_norm ? W.col_norm[j] : 1.0f;
        const float  t  = W.col_norm ? W.col_norm[W.in + j] : 0.0f;
        const int    c  = W.perm ? W.perm[j] : j;
        for (int e = 0; e < W.v; ++e) {
            const int64_t r = p * W.v + e;
            float w = (__half2float(c1[e]) + (c2 ? __half2float(c2[e]) : 0.0f)) * s + t;
            w *= vq_row_scale(W, r);
            w16[r * W.in + c] = __float2half(w);
        }
    }
}

// dst[t][r] += u_r * sum_o O[oidx[o][r/v0]][r%v0] * x_t[ocols[o]]: the outliers of the cuBLAS path, in F32
static __global__ void k_vq_outliers(const vq_weight_dev W, const vq_act raw, const int64_t ntok, float * __restrict__ dst) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= W.out) {
        return;
    }
    for (int64_t t = blockIdx.y; t < ntok; t += gridDim.y) {
        const float * xt = vq_token(raw, t);
        float s = 0.0f;
        for (int o = 0; o < W.n_o; ++o) {
            s += vq_outlier(W, o, r) * xt[W.ocols[o]];
        }
        dst[t * W.out + r] += vq_row_scale(W, r) * s;
    }
}

static vq_weight_dev vq_weight_of(const ggml_tensor * dst) {
    ggml_vq_layout L;
    char err[256];
    if (!ggml_vq_layout_init(&L, dst->src[0], dst->src + GGML_VQ_SRC_FIRST, err, sizeof(err))) {
        GGML_ABORT("VQ weight '%s': %s", dst->src[0]->name, err);
    }
    vq_weight_dev W;
    W.codes       = (const uint32_t *) L.codes;
    W.cb          = (const half *) L.codebook;
    W.rcb         = (const half *) L.res_codebook;
    W.perm        = L.perm;
    W.col_norm    = L.col_norm;
    W.row_scale   = L.row_scale;
    W.row_scale_h = (const half *) L.row_scale_f16;
    W.ocols       = L.outlier_cols;
    W.oidx        = L.outlier_idx;
    W.ocb         = (const half *) L.outlier_codebook;
    W.in          = (int) L.in;
    W.out         = (int) L.out;
    W.v           = L.v;
    W.b1          = L.b1;
    W.b2          = L.b2;
    W.gcols       = (int) (L.in / L.G);
    W.n_o         = (int) L.n_o;
    W.v0          = L.v0;
    W.words       = L.in * (L.b1 + L.b2) / 32;
    GGML_ASSERT(W.v <= 16 && "the CUDA kernels take vector lengths up to 16");
    GGML_ASSERT(L.n_tail == 0 && "the CUDA kernels take no tail (vq_tail): supports_op sends such weights to the CPU");
    return W;
}

static vq_act vq_act_of(const ggml_tensor * src1) {
    const size_t ts = sizeof(float);
    return { (const float *) src1->data, (int64_t) (src1->nb[1] / ts), (int64_t) (src1->nb[2] / ts),
             (int64_t) (src1->nb[3] / ts), src1->ne[1], src1->ne[2] };
}

// how the decode-and-dot kernel runs over one weight
struct vq_mmv_shape {
    int    nblocks;
    int    split;      // warps per vector row, a divisor of VQ_WARPS
    size_t cb_bytes;   // codebooks copied into shared memory (0: read from global memory, through L1)
};

// Warps per vector row: all of the block's while each lane still takes at least two columns. The environment
// variable GGML_VQ_CUDA_SPLIT=1|2|4|8 fixes it (read once; for tuning, docs/cuda.md).
static int vq_mmv_split(int in) {
    static const int forced = [] {
        const char * e = getenv("GGML_VQ_CUDA_SPLIT");
        const int s = e ? atoi(e) : 0;
        return s > 0 && s <= VQ_WARPS && VQ_WARPS % s == 0 ? s : 0;
    }();
    if (forced) {
        return forced;
    }
    int S = VQ_WARPS;
    while (S > 1 && in < 2 * WARP_SIZE * S) {
        S /= 2;
    }
    return S;
}

template <int VT, bool EXACT, int NT>
static void vq_mmv_launch(const vq_weight_dev & W, const vq_act & xs, const vq_act & raw, const float * bias, int64_t t0,
                          int nt, const vq_mmv_shape & sh, float * dst, cudaStream_t stream) {
    const size_t smem = VQ_WARPS * NT * VT * sizeof(float) + sh.cb_bytes;
    k_vq_mmv<VT, EXACT, NT><<<sh.nblocks, VQ_WARPS * WARP_SIZE, smem, stream>>>(W, xs, raw, bias, t0, nt, sh.split,
                                                                               sh.cb_bytes > 0, dst);
}

template <int VT, bool EXACT>
static void vq_mmv_tokens(const vq_weight_dev & W, const vq_act & xs, const vq_act & raw, const float * bias, int64_t t0,
                          int nt, const vq_mmv_shape & sh, float * dst, cudaStream_t stream) {
    if (nt == 1) {
        vq_mmv_launch<VT, EXACT, 1>(W, xs, raw, bias, t0, nt, sh, dst, stream);
    } else if (nt == 2) {
        vq_mmv_launch<VT, EXACT, 2>(W, xs, raw, bias, t0, nt, sh, dst, stream);
    } else if (nt <= 4) {
        vq_mmv_launch<VT, EXACT, 4>(W, xs, raw, bias, t0, nt, sh, dst, stream);
    } else if constexpr (VT * 8 <= VQ_MAX_ACC) {
        vq_mmv_launch<VT, EXACT, 8>(W, xs, raw, bias, t0, nt, sh, dst, stream);
    } else {
        GGML_ABORT("%d tokens exceed the accumulators of the v=%d kernel", nt, VT);
    }
}

static void vq_mmv_dispatch(const vq_weight_dev & W, const vq_act & xs, const vq_act & raw, const float * bias, int64_t t0,
                            int nt, const vq_mmv_shape & sh, float * dst, cudaStream_t stream) {
    switch (W.v) {
        case 1:  vq_mmv_tokens< 1, true >(W, xs, raw, bias, t0, nt, sh, dst, stream); break;
        case 2:  vq_mmv_tokens< 2, true >(W, xs, raw, bias, t0, nt, sh, dst, stream); break;
        case 3:  vq_mmv_tokens< 4, false>(W, xs, raw, bias, t0, nt, sh, dst, stream); break;
        case 4:  vq_mmv_tokens< 4, true >(W, xs, raw, bias, t0, nt, sh, dst, stream); break;
        case 8:  vq_mmv_tokens< 8, true >(W, xs, raw, bias, t0, nt, sh, dst, stream); break;
        case 16: vq_mmv_tokens<16, true >(W, xs, raw, bias, t0, nt, sh, dst, stream); break;
        default:
            if (W.v < 8) {
                vq_mmv_tokens< 8, false>(W, xs, raw, bias, t0, nt, sh, dst, stream);
            } else {
                vq_mmv_tokens<16, false>(W, xs, raw, bias, t0, nt, sh, dst, stream);
            }
    }
}

static void ggml_cuda_mul_mat_vq_vec(ggml_backend_cuda_context & ctx, const vq_weight_dev & W, const ggml_tensor * src1,
                                     int64_t ntok, float * dst) {
    cudaStream_t stream = ctx.stream();
    const auto & info = ggml_cuda_info().devices[ctx.device];

    const vq_act raw = vq_act_of(src1);
    vq_act xs = raw;
    ggml_cuda_pool_alloc<float> xs_buf(ctx.pool());
    ggml_cuda_pool_alloc<float> bias_buf(ctx.pool());
    const bool prep = W.perm || W.col_norm;
    if (prep) {
        xs_buf.alloc(ntok * W.in);
        bias_buf.alloc(ntok);
        k_vq_prep<<<ntok, VQ_BLOCK_SIZE, 0, stream>>>(W, raw, xs_buf.get(), bias_buf.get());
        xs = { xs_buf.get(), W.in, 0, 0, ntok, 1 };
    }

    const int    G        = W.in / W.gcols;
    const size_t cb_bytes = (size_t) G * W.v * (((size_t) 1 << W.b1) + (W.rcb ? (size_t) 1 << W.b2 : 0)) * sizeof(half);
    const size_t part_max = VQ_WARPS * VQ_MAX_ACC * sizeof(float);   // the partial sums, at most
    vq_mmv_shape sh;
    sh.split    = vq_mmv_split(W.in);
    sh.cb_bytes = cb_bytes + part_max <= info.smpb ? cb_bytes : 0;
    const int rows = VQ_WARPS / sh.split;   // vector rows per block and pass
    sh.nblocks = (W.out / W.v + rows - 1) / rows;
    if (sh.cb_bytes > 4096) {
        // each block fills its shared memory once: with large codebooks fewer blocks, more rows per warp
        sh.nblocks = std::min(sh.nblocks, 2 * info.nsm);
    }

    const int vt    = W.v <= 1 ? 1 : W.v <= 2 ? 2 : W.v <= 4 ? 4 : W.v <= 8 ? 8 : 16;
    const int chunk = std::min(GGML_CUDA_VQ_MAX_BATCH, VQ_MAX_ACC / vt);
    for (int64_t t0 = 0; t0 < ntok; t0 += chunk) {
        const int nt = (int) std::min<int64_t>(chunk, ntok - t0);
        vq_mmv_dispatch(W, xs, raw, prep ? bias_buf.get() : nullptr, t0, nt, sh, dst, stream);
    }
    CUDA_CHECK(cudaGetLastError());
}

static void ggml_cuda_mul_mat_vq_cublas(ggml_backend_cuda_context & ctx, const vq_weight_dev & W, const ggml_tensor * src1,
                                        int64_t ntok, float * dst) {
    cudaStream_t stream = ctx.stream();

    ggml_cuda_pool_alloc<half> w16(ctx.pool(), (size_t) W.out * W.in);
    const int64_t total   = (int64_t) (W.out / W.v) * W.in;
    const int64_t nblocks = std::min<int64_t>((total + VQ_BLOCK_SIZE - 1) / VQ_BLOCK_SIZE, 65535);
    k_vq_dequant_f16<<<nblocks, VQ_BLOCK_SIZE, 0, stream>>>(W, w16.get());
    CUDA_CHECK(cudaGetLastError());

    const size_t ts = sizeof(float);
    ggml_cuda_pool_alloc<half> x16(ctx.pool(), (size_t) ntok * W.in);
    const to_fp16_nc_cuda_t to_fp16 = ggml_get_to_fp16_nc_cuda(GGML_TYPE_F32);
    GGML_ASSERT(to_fp16 != nullptr);
    to_fp16(src1->data, x16.get(), src1->ne[0], src1->ne[1], src1->ne[2], src1->ne[3],
            src1->nb[1] / ts, src1->nb[2] / ts, src1->nb[3] / ts, stream);

    const float alpha = 1.0f;
    const float beta  = 0.0f;
    CUBLAS_CHECK(cublasGemmEx(ctx.cublas_handle(), CUBLAS_OP_T, CUBLAS_OP_N,
                              W.out, (int) ntok, W.in,
                              &alpha, w16.get(), CUDA_R_16F, W.in,
                                      x16.get(), CUDA_R_16F, W.in,
                              &beta,  dst,       CUDA_R_32F, W.out,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP));

    if (W.n_o > 0) {
        const dim3 grid((W.out + VQ_BLOCK_SIZE - 1) / VQ_BLOCK_SIZE, (unsigned) std::min<int64_t>(ntok, 65535));
        k_vq_outliers<<<grid, VQ_BLOCK_SIZE, 0, stream>>>(W, vq_act_of(src1), ntok, dst);
        CUDA_CHECK(cudaGetLastError());
    }
}

void ggml_cuda_mul_mat_vq(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src1 = dst->src[1];
    GGML_ASSERT(src1->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32);
    GGML_ASSERT(src1->nb[0] == sizeof(float) && ggml_is_contiguous(dst));

    const vq_weight_dev W    = vq_weight_of(dst);
    const int64_t       ntok = src1->ne[1] * src1->ne[2] * src1->ne[3];
    GGML_ASSERT(src1->ne[0] == W.in && dst->ne[0] == W.out);

    if (ntok <= GGML_CUDA_VQ_MAX_BATCH) {
        ggml_cuda_mul_mat_vq_vec(ctx, W, src1, ntok, (float *) dst->data);
    } else {
        ggml_cuda_mul_mat_vq_cublas(ctx, W, src1, ntok, (float *) dst->data);
    }
}
