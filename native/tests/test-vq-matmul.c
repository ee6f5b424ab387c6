// Kernel test and micro-benchmark for the VQ MUL_MAT on the CPU backend.
//
//   test-vq-matmul random [seed] [quick]     random weights in every configuration of the format, every
//                                            token count and odd shape; compares with the reference decoder
//                                            (ggml_vq_dequantize) and a float64 matmul, and checks that 1, 2
//                                            and 3 threads give bitwise equal results
//   test-vq-matmul file <model.gguf> [max_tensors]   the same on the VQ weights of a real file
//   test-vq-matmul one <in> <out> <v> <b1> <b2> <G> <perm> <norm> <rscale> <outliers> <ntok>
//                                            (rscale: 0 none, 1 F32, 2 F16)
//                                            a single random case
//   test-vq-matmul bench <v> <K1> <K2> <in> <out> <ntok> <threads> [n_mats] [reps] [F16 row scales]
//                                            time one MUL_MAT over n_mats weights (more than the caches);
//                                            also prints the weights' bytes over the time (GB/s read)
//   test-vq-matmul bench-type <type> <in> <out> <ntok> <threads> [n_mats] [reps]
//                                            the same for one of ggml's own types (e.g. iq2_xxs, q4_K)
//   test-vq-matmul bandwidth [MiB] [threads] [passes]
//                                            memory read bandwidth: threads summing disjoint slices of a
//                                            buffer far larger than the caches; prints GB/s (best pass)
//   test-vq-matmul decode <in.gguf> <out.gguf>
//                                            the same model with every VQ weight decoded to F16 (side
//                                            tensors dropped): llama-quantize's input for speed comparisons
//   test-vq-matmul residual <in.gguf> <out.gguf> <k_res>
//                                            a file without residual plus a synthetic residual codebook of
//                                            k_res random centroids and random residual codes: the geometry
//                                            and speed of a residual preset, outputs not meaningful
//
// `--backend NAME` first (e.g. `--backend CUDA0`) runs random, one and file on that ggml backend instead of
// the CPU: the same reference comparison, with the tolerance of its F16 path above GGML_VQ_MAX_F32_BATCH
// tokens, and two runs bitwise equal instead of the thread checks.
//
// The instruction set is capped by GGML_VQ_ISA=ref|scalar|avx2|avx512|vbmi (Arm: ref|scalar|neon; read once per process), so
// each fast path is tested by running the program once per value. Prints one line per failure and a
// summary; exit status 1 on any failure.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-vq.h"
#include "gguf.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <pthread.h>

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float rndf(float lo, float hi) {
    return lo + (hi - lo) * (float) ((rnd() >> 11) * (1.0 / 9007199254740992.0));
}
static float rndn(void) { // roughly normal
    return rndf(-1, 1) + rndf(-1, 1) + rndf(-1, 1);
}

static int n_fail = 0, n_cases = 0;

// NULL: the CPU backend through ggml_graph_compute_with_ctx
static ggml_backend_t g_backend = NULL;

// Tolerances relative to sum |w x|: F32 arithmetic, and a backend's F16 path (weights and activations rounded
// to F16, 2^-11 each, products summed in F32: at most ~1e-3) above this many tokens (CUDA: cuBLAS)
#define TOL_F32 2e-5
#define TOL_F16 2e-3
#define GGML_VQ_MAX_F32_BATCH 8

struct cfg {
    int64_t in, out;
    int v, b1, b2, G;
    bool perm, norm;
    int rscale;         // row scale: 0 none, 1 F32, 2 F16
    bool outl;
    int64_t ne1, ne2;   // tokens = ne1 * ne2
};

static void cfg_str(const struct cfg * c, char * s, size_t n) {
    snprintf(s, n, "in=%lld out=%lld v=%d b1=%d b2=%d G=%d perm=%d norm=%d rscale=%d outl=%d tok=%lldx%lld",
             (long long) c->in, (long long) c->out, c->v, c->b1, c->b2, c->G, c->perm, c->norm, c->rscale, c->outl,
             (long long) c->ne1, (long long) c->ne2);
}

struct vq_weight {
    struct ggml_tensor * w;
    struct ggml_tensor * sides[GGML_VQ_N_SIDES];
};

// y = w x on g_backend: the weight, its side tensors and x copied into a buffer of that backend
static void run_matmul_backend(const struct vq_weight * W, const struct ggml_tensor * x, float * out) {
    struct ggml_init_params ip = { ggml_tensor_overhead() * (GGML_VQ_N_SIDES + 4) + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    const struct ggml_tensor * src[GGML_VQ_N_SIDES + 2] = { W->w, x };
    struct ggml_tensor * dev[GGML_VQ_N_SIDES + 2] = { 0 };
    for (int s = 0; s < GGML_VQ_N_SIDES; ++s) {
        src[2 + s] = W->sides[s];
    }
    for (int i = 0; i < GGML_VQ_N_SIDES + 2; ++i) {
        dev[i] = src[i] ? ggml_dup_tensor(ctx, src[i]) : NULL;
    }
    struct ggml_tensor * y = ggml_vq_attach(ggml_mul_mat(ctx, dev[0], dev[1]), dev + 2);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, g_backend);
    for (int i = 0; i < GGML_VQ_N_SIDES + 2; ++i) {
        if (src[i]) {
            ggml_backend_tensor_set(dev[i], src[i]->data, 0, ggml_nbytes(src[i]));
        }
    }
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    if (ggml_backend_graph_compute(g_backend, gf) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "FAIL: %s could not compute the graph\n", ggml_backend_name(g_backend));
        exit(1);
    }
    ggml_backend_tensor_get(y, out, 0, ggml_nbytes(y));
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

// y = w x in a fresh graph with nthreads (or on g_backend); returns y's data copied to out[ntok][out]
static void run_matmul(struct ggml_context * ctx, const struct vq_weight * W, struct ggml_tensor * x, int nthreads, float * out) {
    if (g_backend) {
        run_matmul_backend(W, x, out);
        return;
    }
    struct ggml_tensor * y = ggml_mul_mat(ctx, W->w, x);
    ggml_vq_attach(y, W->sides);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_graph_compute_with_ctx(ctx, gf, nthreads);
    memcpy(out, y->data, ggml_nbytes(y));
}

// compares y (ntok x out) with the reference; returns 0 if all good
static int check(const char * what, const struct vq_weight * W, struct ggml_tensor * x, const float * y) {
    struct ggml_vq_layout L;
    char err[256];
    if (!ggml_vq_layout_init(&L, W->w, W->sides, err, sizeof(err))) {
        printf("FAIL %s: layout: %s\n", what, err);
        return 1;
    }
    const int64_t in = L.in, out = L.out, ntok = x->ne[1] * x->ne[2];
    float * Wd = malloc(sizeof(float) * in * out);
    ggml_vq_dequantize(&L, Wd);
    int bad = 0;
    double worst = 0;
    for (int64_t t = 0; t < ntok && bad < 5; ++t) {
        const float * xr = (const float *) ((const char *) x->data + (t % x->ne[1]) * x->nb[1] + (t / x->ne[1]) * x->nb[2]);
        for (int64_t r = 0; r < out && bad < 5; ++r) {
            double s = 0, mag = 0;
            const float * wr = Wd + r * in;
            for (int64_t c = 0; c < in; ++c) {
                s += (double) wr[c] * xr[c];
                mag += fabs((double) wr[c] * xr[c]);
            }
            if (L.col_norm) { // the kernel may split off the bias term; its own rounding scales with it
                const float u = fabsf(ggml_vq_row_scale(&L, r));
                for (int64_t j = 0; j < in; ++j) {
                    const int64_t c = L.perm ? L.perm[j] : j;
                    mag += fabs((double) L.col_norm[in + j] * xr[c]) * u;
                }
            }
            const double got = y[t * out + r];
            const double e = fabs(got - s);
            const double tol = (g_backend && ntok > GGML_VQ_MAX_F32_BATCH ? TOL_F16 : TOL_F32) * mag + 1e-30;
            if (e / (mag + 1e-30) > worst) {
                worst = e / (mag + 1e-30);
            }
            if (!(e <= tol)) {
                printf("FAIL %s: token %lld row %lld: got %.9g want %.9g (|err| %.3g, scale %.3g)\n",
                       what, (long long) t, (long long) r, got, s, e, mag);
                ++bad;
            }
        }
    }
    free(Wd);
    return bad;
}


// ggml's own F32 MUL_MAT of the decoded weight (ggml_vq_dequantize) with x: at one token the VQ kernel must
// give exactly this (llama.cpp's F32 path at batch 1), so that a VQ file equals its decoded F32 file bitwise
static void f32_matmul(const struct vq_weight * W, struct ggml_tensor * x, int nthreads, float * out) {
    struct ggml_vq_layout L;
    char err[256];
    ggml_vq_layout_init(&L, W->w, W->sides, err, sizeof(err));
    struct ggml_init_params ip = { 16 * 1024 * 1024 + (size_t) L.in * L.out * 4 + (size_t) (L.in + L.out) * ggml_nelements(x) / L.in * 8, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * wf = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, L.in, L.out);
    ggml_vq_dequantize(&L, wf->data);
    struct ggml_tensor * y = ggml_mul_mat(ctx, wf, x);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_graph_compute_with_ctx(ctx, gf, nthreads);
    memcpy(out, y->data, ggml_nbytes(y));
    ggml_free(ctx);
}

static int check_exact(const char * what, const struct vq_weight * W, struct ggml_tensor * x, const float * y) {
    const int64_t n = W->w->ne[1] * x->ne[1] * x->ne[2];
    float * yf = malloc(n * sizeof(float));
    f32_matmul(W, x, 1, yf);
    int bad = 0;
    for (int64_t i = 0; i < n && bad < 3; ++i) {
        if (memcmp(&yf[i], &y[i], sizeof(float)) != 0) {
            printf("FAIL %s: one token: row %lld = %.9g, the F32 matmul of the decoded weight gives %.9g (must be equal)\n",
                   what, (long long) i, y[i], yf[i]);
            ++bad;
        }
    }
    free(yf);
    return bad;
}

static void fill_f16(struct ggml_tensor * t, float scale) {
    ggml_fp16_t * d = t->data;
    for (int64_t i = 0; i < ggml_nelements(t); ++i) {
        d[i] = ggml_fp32_to_fp16(rndn() * scale);
    }
}

static void run_case(const struct cfg * c, int quick) {
    char name[256];
    cfg_str(c, name, sizeof(name));
    const int b = c->b1 + c->b2;
    const int n = b * 4 / c->v;
    const size_t mem = 64 * 1024 * 1024 + (size_t) 4 * c->v * (((size_t) 1 << c->b1) + ((size_t) 1 << c->b2)) * c->G + (size_t) c->in * c->out * 8 + (size_t) c->in * c->ne1 * c->ne2 * 4 * 8 + (size_t) c->out * c->ne1 * c->ne2 * 4 * 8;
    struct ggml_init_params ip = { mem, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct vq_weight W = {0};
    W.w = ggml_new_tensor_2d(ctx, (enum ggml_type) (GGML_VQ_TYPE_BASE + n), c->in, c->out);
    uint8_t * codes = W.w->data;
    for (size_t i = 0; i < ggml_nbytes(W.w); ++i) {
        codes[i] = (uint8_t) rnd();
    }
    W.sides[GGML_VQ_CODEBOOK] = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, c->v, (int64_t) 1 << c->b1, c->G);
    fill_f16(W.sides[GGML_VQ_CODEBOOK], 0.05f);
    if (c->b2) {
        W.sides[GGML_VQ_RES_CODEBOOK] = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, c->v, (int64_t) 1 << c->b2, c->G);
        fill_f16(W.sides[GGML_VQ_RES_CODEBOOK], 0.01f);
    }
    if (c->perm) {
        struct ggml_tensor * t = W.sides[GGML_VQ_PERM] = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, c->in);
        int32_t * p = t->data;
        for (int64_t j = 0; j < c->in; ++j) {
            p[j] = (int32_t) j;
        }
        for (int64_t j = c->in - 1; j > 0; --j) {
            const int64_t k = (int64_t) (rnd() % (uint64_t) (j + 1));
            const int32_t tmp = p[j]; p[j] = p[k]; p[k] = tmp;
        }
    }
    if (c->norm) {
        struct ggml_tensor * t = W.sides[GGML_VQ_COL_NORM] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c->in, 2);
        float * d = t->data;
        for (int64_t j = 0; j < c->in; ++j) {
            d[j] = rndf(0.5f, 1.5f);
            d[c->in + j] = rndn() * 0.002f;
        }
    }
    if (c->rscale) {
        struct ggml_tensor * t = W.sides[GGML_VQ_ROW_SCALE] = ggml_new_tensor_1d(ctx, c->rscale == 2 ? GGML_TYPE_F16 : GGML_TYPE_F32, c->out);
        for (int64_t r = 0; r < c->out; ++r) {
            const float u = rndf(0.8f, 1.2f);
            if (c->rscale == 2) {
                ((ggml_fp16_t *) t->data)[r] = ggml_fp32_to_fp16(u);
            } else {
                ((float *) t->data)[r] = u;
            }
        }
    }
    if (c->outl) {
        const int n_o = 3;
        const int v0 = (c->out % 4 == 0) ? 4 : 1;
        const int k0 = 16;
        struct ggml_tensor * oc = W.sides[GGML_VQ_OUTLIER_COLS] = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_o);
        struct ggml_tensor * oi = W.sides[GGML_VQ_OUTLIER_IDX] = ggml_new_tensor_2d(ctx, GGML_TYPE_I16, c->out / v0, n_o);
        struct ggml_tensor * ob = W.sides[GGML_VQ_OUTLIER_CODEBOOK] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, v0, k0);
        for (int o = 0; o < n_o; ++o) {
            ((int32_t *) oc->data)[o] = (int32_t) ((o * 7919 + 13) % c->in);
        }
        for (int64_t i = 0; i < ggml_nelements(oi); ++i) {
            ((int16_t *) oi->data)[i] = (int16_t) (rnd() % k0);
        }
        fill_f16(ob, 0.05f);
    }
    if (c->out % c->v) {
        W.sides[GGML_VQ_TAIL] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, c->in, c->out % c->v);
        fill_f16(W.sides[GGML_VQ_TAIL], 0.05f);
    }
    struct ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c->in, c->ne1, c->ne2);
    for (int64_t i = 0; i < ggml_nelements(x); ++i) {
        ((float *) x->data)[i] = rndn();
    }

    const int64_t ny = c->out * c->ne1 * c->ne2;
    float * y1 = malloc(ny * sizeof(float));
    float * yk = malloc(ny * sizeof(float));
    run_matmul(ctx, &W, x, 1, y1);
    n_cases++;
    if (check(name, &W, x, y1)) {
        n_fail++;
    }
    if (!g_backend && c->ne1 * c->ne2 == 1 && check_exact(name, &W, x, y1)) {
        n_fail++;
    }
    const int threads[] = { 2, 3 };
    for (int i = 0; i < (quick || g_backend ? 1 : 2); ++i) {
        run_matmul(ctx, &W, x, threads[i], yk);
        if (memcmp(y1, yk, ny * sizeof(float)) != 0) {
            printf("FAIL %s: %s\n", name, g_backend ? "two runs differ" : threads[i] == 2 ? "2 threads differ from 1 thread" : "3 threads differ from 1 thread");
            n_fail++;
        }
    }
    free(y1);
    free(yk);
    ggml_free(ctx);
}

// (v, b1, b2) with (b1 + b2) * 4 / v an integer rate in 2..32 quarter bits
static const int layouts[][3] = {
    {4, 8, 0}, {4, 8, 4}, {4, 8, 8}, {4, 6, 2}, {4, 7, 0}, {4, 4, 4}, {4, 2, 0}, {4, 12, 0}, {4, 16, 0},
    {2, 8, 0}, {2, 3, 1}, {2, 5, 0}, {2, 8, 0},
    {6, 8, 4}, {6, 12, 0}, {6, 6, 0}, {6, 9, 0},
    {8, 8, 8}, {8, 12, 0}, {8, 16, 0}, {8, 8, 0}, {8, 16, 8}, {8, 4, 4},
    {12, 8, 4}, {12, 12, 12}, {12, 9, 0}, {12, 16, 8},
    {16, 8, 0}, {16, 16, 16}, {16, 12, 4},
    {1, 2, 0}, {1, 3, 1}, {3, 6, 0}, {3, 8, 4}, {5, 10, 0}, {7, 7, 0}, {3, 12, 0}, {3, 9, 0},
    // above 4 bits per weight
    {2, 10, 0}, {2, 9, 0}, {2, 8, 4}, {2, 16, 0}, {1, 5, 0}, {1, 7, 1}, {1, 8, 0}, {3, 8, 7}, {4, 12, 9}, {4, 16, 8},
};

static int mode_random(int quick) {
    const int64_t tokens[] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33, 512 };
    const int nlay = (int) (sizeof(layouts) / sizeof(layouts[0]));
    for (int li = 0; li < nlay; ++li) {
        const int v = layouts[li][0], b1 = layouts[li][1], b2 = layouts[li][2];
        if (((b1 + b2) * 4) % v != 0) {
            continue;
        }
        for (int variant = 0; variant < (quick ? 3 : 6); ++variant) {
            struct cfg c = {0};
            c.v = v; c.b1 = b1; c.b2 = b2;
            // shapes: in a multiple of 32; out odd counts of vector rows, and a tail of out % v rows in half the
            // variants without outliers (those need v to divide out)
            const int64_t ins[] = { 96, 160, 576, 224, 1536, 64 };
            c.in  = ins[(li + variant) % 6];
            c.out = v * (int64_t) (1 + (rnd() % (v >= 8 ? 23 : 61)));
            if (v > 1 && variant < 4 && (variant + li) % 2) {
                c.out += 1 + (int64_t) (rnd() % (uint64_t) (v - 1));
            }
            const int Gs[] = { 1, 1, 2, 3, 1, 5 };
            c.G = Gs[variant];
            while (c.in % c.G != 0) {
                c.G--;
            }
            c.perm   = variant == 1 || variant == 4;
            c.norm   = variant == 2 || variant == 4;
            c.rscale = variant == 3 ? 1 + li % 2 : variant == 4 ? 2 : 0;
            c.outl   = variant == 4 || variant == 5;
            if (variant == 3 && li % 4 < 2) {
                c.G = 1; // a row scale alone: the one-token centx path
            }
            if (variant == 0 && (li % 3 == 0)) {
                c.G = (int) (c.in / 32); // a group per 32 columns
            }
            for (int ti = 0; ti < (int) (sizeof(tokens) / sizeof(tokens[0])); ++ti) {
                if (quick && ti % 3 != 0 && tokens[ti] != 1) {
                    continue;
                }
                if (tokens[ti] >= 512 && (c.in * c.out > 200000 || variant > 2)) {
                    continue;
                }
                c.ne1 = tokens[ti];
                c.ne2 = 1;
                if (ti == 5) { // a 3-D activation: 2 x 3 tokens
                    c.ne1 = 3;
                    c.ne2 = 2;
                }
                run_case(&c, quick);
            }
        }
    }
    // a large layer like the default model's ffn_down, many tokens
    struct cfg big = { 1536, 576, 4, 8, 0, 1, false, false, 0, false, 512, 1 };
    run_case(&big, quick);
    big.b2 = 4; big.ne1 = 37;
    run_case(&big, quick);
    printf("%s: %d cases, %d failed\n", quick ? "random (quick)" : "random", n_cases, n_fail);
    return n_fail ? 1 : 0;
}

// the VQ weight named tname in a file's tensors, with its side tensors (<base>.vq_*, or the shared tensor
// that vq.link.<base>.vq_* names); false if not VQ
static bool file_weight(const struct gguf_context * gctx, struct ggml_context * wctx, const char * tname, struct vq_weight * W) {
    memset(W, 0, sizeof(*W));
    W->w = ggml_get_tensor(wctx, tname);
    if (!W->w || !ggml_is_vq(W->w->type)) {
        return false;
    }
    char base[256], sname[320];
    snprintf(base, sizeof(base), "%s", tname);
    char * dot = strstr(base, ".weight");
    if (dot) {
        *dot = 0;
    }
    for (int s = 0; s < GGML_VQ_N_SIDES; ++s) {
        snprintf(sname, sizeof(sname), "%s%s.%s", GGML_VQ_LINK_PREFIX, base, ggml_vq_side_suffix((enum ggml_vq_side) s));
        const int64_t link = gguf_find_key(gctx, sname);
        W->sides[s] = ggml_get_tensor(wctx, link >= 0 ? gguf_get_val_str(gctx, link) : sname + strlen(GGML_VQ_LINK_PREFIX));
    }
    return true;
}

// true if tname is a side tensor (<base>.vq_*)
static bool is_side_tensor(const char * tname) {
    const size_t n = strlen(tname);
    for (int s = 0; s < GGML_VQ_N_SIDES; ++s) {
        const char * suffix = ggml_vq_side_suffix((enum ggml_vq_side) s);
        const size_t k = strlen(suffix);
        if (n > k && tname[n - k - 1] == '.' && strcmp(tname + n - k, suffix) == 0) {
            return true;
        }
    }
    return false;
}

static int mode_file(const char * path, int max_tensors) {
    struct ggml_context * wctx = NULL;
    struct gguf_init_params gp = { false, &wctx };
    struct gguf_context * gctx = gguf_init_from_file(path, gp);
    if (!gctx) {
        printf("FAIL cannot read %s\n", path);
        return 1;
    }
    int done = 0;
    const int64_t n_t = gguf_get_n_tensors(gctx);
    for (int64_t i = 0; i < n_t && done < max_tensors; ++i) {
        const char * tname = gguf_get_tensor_name(gctx, i);
        struct vq_weight W;
        if (!file_weight(gctx, wctx, tname, &W)) {
            continue;
        }
        const struct ggml_tensor * w = W.w;
        // a backend: both sides of its batch threshold and a prompt (CUDA: decode-and-dot, then cuBLAS)
        const int64_t toks_cpu[] = { 1, 3, 8, 9, 64 };
        const int64_t toks_backend[] = { 1, 7, 8, 9, 512 };
        const int64_t * toks = g_backend ? toks_backend : toks_cpu;
        for (int k = 0; k < 5; ++k) {
            const int64_t ntok = toks[k];
            struct ggml_init_params ip = { 32 * 1024 * 1024 + (size_t) (w->ne[0] + w->ne[1]) * ntok * 4 * 4, NULL, false };
            struct ggml_context * ctx = ggml_init(ip);
            struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], ntok);
            for (int64_t e = 0; e < ggml_nelements(x); ++e) {
                ((float *) x->data)[e] = rndn();
            }
            float * y1 = malloc(sizeof(float) * w->ne[1] * ntok);
            float * y2 = malloc(sizeof(float) * w->ne[1] * ntok);
            char what[400];
            snprintf(what, sizeof(what), "%s tokens=%lld", tname, (long long) ntok);
            run_matmul(ctx, &W, x, 1, y1);
            run_matmul(ctx, &W, x, 2, y2);
            n_cases++;
            if (check(what, &W, x, y1)) {
                n_fail++;
            }
            if (!g_backend && ntok == 1 && check_exact(what, &W, x, y1)) {
                n_fail++;
            }
            if (memcmp(y1, y2, sizeof(float) * w->ne[1] * ntok) != 0) {
                printf("FAIL %s: %s\n", what, g_backend ? "two runs differ" : "2 threads differ from 1 thread");
                n_fail++;
            }
            free(y1);
            free(y2);
            ggml_free(ctx);
        }
        done++;
    }
    printf("file %s: %d tensors, %d cases, %d failed\n", path, done, n_cases, n_fail);
    gguf_free(gctx);
    ggml_free(wctx);
    return (n_fail || done == 0) ? 1 : 0;
}

// bits [bit, bit + n) of a little-endian bit stream (n <= 32)
static uint32_t get_bits(const uint8_t * s, uint64_t bit, int n) {
    uint64_t w = 0;
    for (int k = 0; k < (int) (((bit & 7) + n + 7) >> 3); ++k) {
        w |= (uint64_t) s[(bit >> 3) + k] << (8 * k);
    }
    return (uint32_t) ((w >> (bit & 7)) & ((1ull << n) - 1));
}

static void put_bits(uint8_t * s, uint64_t bit, int n, uint32_t value) {
    for (int i = 0; i < n; ++i, ++bit) {
        s[bit >> 3] = (uint8_t) ((s[bit >> 3] & ~(1u << (bit & 7))) | (((value >> i) & 1u) << (bit & 7)));
    }
}

// how `rewrite` turns each VQ weight of a file into new tensors
struct rewrite {
    const char * what;
    bool decoded;                                           // drop the side tensors and the VQ format key, F16 file type
    size_t (*bytes)(const struct vq_weight * W, int arg);   // data bytes of the new tensors
    // adds the new tensors (allocated in ctx), or w as it is, to out; false with a message
    bool (*convert)(const struct ggml_tensor * w, const struct ggml_vq_layout * L, int arg, struct ggml_context * ctx, struct gguf_context * out);
};

// writes src to dst with every VQ weight converted by r, the other tensors and the keys copied
static int rewrite_file(const char * src, const char * dst, const struct rewrite * r, int arg) {
    struct ggml_context * wctx = NULL;
    struct gguf_init_params gp = { false, &wctx };
    struct gguf_context * in = gguf_init_from_file(src, gp);
    if (!in) {
        printf("FAIL cannot read %s\n", src);
        return 1;
    }
    const int64_t n_t = gguf_get_n_tensors(in);
    size_t bytes = 0;
    for (int64_t i = 0; i < n_t; ++i) {
        struct vq_weight W;
        if (file_weight(in, wctx, gguf_get_tensor_name(in, i), &W) && W.sides[GGML_VQ_CODEBOOK]) {
            bytes += r->bytes(&W, arg) + 2 * ggml_tensor_overhead() + 256;
        }
    }
    struct ggml_init_params ip = { bytes + ggml_tensor_overhead(), NULL, false };
    struct ggml_context * nctx = ggml_init(ip);
    struct gguf_context * out = gguf_init_empty();
    gguf_set_kv(out, in);
    if (r->decoded) {
        gguf_remove_key(out, GGML_VQ_FORMAT_KEY);
        for (int64_t k = gguf_get_n_kv(out) - 1; k >= 0; --k) {
            char key[512];
            snprintf(key, sizeof(key), "%s", gguf_get_key(out, k));
            if (strncmp(key, GGML_VQ_LINK_PREFIX, strlen(GGML_VQ_LINK_PREFIX)) == 0) {
                gguf_remove_key(out, key);
            }
        }
        gguf_set_val_u32(out, "general.file_type", 1); // LLAMA_FTYPE_MOSTLY_F16
    }
    int n_vq = 0;
    bool ok = true;
    for (int64_t i = 0; i < n_t && ok; ++i) {
        const char * tname = gguf_get_tensor_name(in, i);
        struct vq_weight W;
        if (!file_weight(in, wctx, tname, &W)) {
            if (!(r->decoded && is_side_tensor(tname))) {
                gguf_add_tensor(out, ggml_get_tensor(wctx, tname));
            }
            continue;
        }
        struct ggml_vq_layout L;
        char err[256];
        ok = ggml_vq_layout_init(&L, W.w, W.sides, err, sizeof(err)) && ggml_vq_check_data(&L, err, sizeof(err));
        if (!ok) {
            printf("FAIL %s: %s\n", tname, err);
        } else {
            ok = r->convert(W.w, &L, arg, nctx, out);
            n_vq++;
        }
    }
    ok = ok && n_vq > 0 && gguf_write_to_file(out, dst, false);
    printf("%s -> %s: %d VQ weights %s%s\n", src, dst, n_vq, r->what, ok ? "" : ": FAIL");
    gguf_free(out);
    gguf_free(in);
    ggml_free(nctx);
    ggml_free(wctx);
    return ok ? 0 : 1;
}

static size_t decoded_bytes(const struct vq_weight * W, int arg) {
    (void) arg;
    return ggml_nelements(W->w) * sizeof(ggml_fp16_t);
}

// the weight decoded by the reference decoder, stored F16
static bool decode_weight(const struct ggml_tensor * w, const struct ggml_vq_layout * L, int arg, struct ggml_context * ctx, struct gguf_context * out) {
    (void) arg;
    const char * name = w->name;
    float * wf = malloc(sizeof(float) * L->in * L->out);
    ggml_vq_dequantize(L, wf);
    struct ggml_tensor * f = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, L->in, L->out);
    ggml_set_name(f, name);
    ggml_fp32_to_fp16_row(wf, f->data, L->in * L->out);
    free(wf);
    gguf_add_tensor(out, f);
    return true;
}

// log2 of k_res if it is a power of two in [2, 65536], else 0
static int residual_bits(int k_res) {
    return k_res >= 2 && k_res <= 65536 && (k_res & (k_res - 1)) == 0 ? __builtin_ctz((unsigned) k_res) : 0;
}

static size_t residual_bytes(const struct vq_weight * W, int k_res) {
    struct ggml_vq_layout L;
    char err[256];
    const int b2 = residual_bits(k_res);
    return ggml_vq_layout_init(&L, W->w, W->sides, err, sizeof(err)) && b2 ?
        ggml_nbytes(W->w) / (L.b1 + L.b2) * (L.b1 + L.b2 + b2) + (size_t) L.v * k_res * L.G * sizeof(ggml_fp16_t) : 0;
}

// the same main codes with random residual codes of log2(k_res) bits appended to each, in the VQ type of the new
// rate, and a residual codebook of small random centroids; a weight that has a residual already, or whose new
// rate would have no VQ type (a preset's wider tensors), is kept as it is
static bool add_residual(const struct ggml_tensor * w0, const struct ggml_vq_layout * L, int k_res, struct ggml_context * ctx, struct gguf_context * out) {
    const char * name = w0->name;
    const int b = L->b1, b2 = residual_bits(k_res), bn = b + b2;
    if (b2 < 1) {
        printf("FAIL k_res %d is not a power of two in [2, 65536]\n", k_res);
        return false;
    }
    if (L->b2 != 0 || (bn * 4) % L->v != 0 || bn * 4 / L->v > GGML_VQ_N_MAX) {
        printf("kept %s as it is: %s\n", name, L->b2 ? "it has a residual codebook" : "no VQ type for the rate with a residual");
        gguf_add_tensor(out, w0);
        return true;
    }
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, (enum ggml_type) (GGML_VQ_TYPE_BASE + bn * 4 / L->v), L->in, L->out);
    ggml_set_name(w, name);
    for (int64_t p = 0; p < L->out / L->v; ++p) {
        const uint8_t * s = L->codes + p * (L->in * b / 8);
        uint8_t * d = (uint8_t *) w->data + p * (L->in * bn / 8);
        for (int64_t j = 0; j < L->in; ++j) {
            put_bits(d, (uint64_t) j * bn, bn, get_bits(s, (uint64_t) j * b, b) | (uint32_t) (rnd() % k_res) << b);
        }
    }
    struct ggml_tensor * rcb = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, L->v, k_res, L->G);
    ggml_format_name(rcb, "%.*s.%s", (int) (strlen(name) - strlen(".weight")), name, ggml_vq_side_suffix(GGML_VQ_RES_CODEBOOK));
    fill_f16(rcb, 0.005f);
    gguf_add_tensor(out, w);
    gguf_add_tensor(out, rcb);
    return true;
}

static const struct rewrite REWRITE_DECODE   = { "decoded to F16", true, decoded_bytes, decode_weight };
static const struct rewrite REWRITE_RESIDUAL = { "with a synthetic residual codebook", false, residual_bytes, add_residual };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Times one MUL_MAT per weight of `gf` (warm-up, then best of reps) and prints the figures bench and bench-type
// share: the weights' bytes (sides included) over the best time is the read rate to compare with `bandwidth`.
static void time_graph(struct ggml_cgraph * gf, const char * what, int64_t in, int64_t out, int64_t ntok, int nth,
                       int nm, int reps, size_t bytes) {
    struct ggml_cplan plan = ggml_graph_plan(gf, nth, NULL);
    uint8_t * work = malloc(plan.work_size + 64);
    plan.work_data = work;
    ggml_graph_compute(gf, &plan); // warm up
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
        const double t0 = now_s();
        ggml_graph_compute(gf, &plan);
        const double t = now_s() - t0;
        best = t < best ? t : best;
    }
    const double weights = (double) nm * in * out;
    printf("bench %s in=%lld out=%lld ntok=%lld threads=%d mats=%d: %.3f ms, %.4f ns/weight/token (x threads: %.4f), %.1f GFLOP/s, %.3f bits/weight read, %.2f GB/s read\n",
           what, (long long) in, (long long) out, (long long) ntok, nth, nm, best * 1e3,
           best * 1e9 / (weights * ntok), best * 1e9 * nth / (weights * ntok), 2 * weights * ntok / best * 1e-9,
           8.0 * bytes / weights, bytes / best * 1e-9);
    free(work);
}

static struct ggml_tensor * bench_input(struct ggml_context * ctx, int64_t in, int64_t ntok) {
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, in, ntok);
    for (int64_t e = 0; e < ggml_nelements(x); ++e) {
        ((float *) x->data)[e] = rndn();
    }
    return x;
}

static int mode_bench(int argc, char ** argv) {
    if (argc < 9) {
        printf("usage: bench v K1 K2 in out ntok threads [n_mats] [reps] [F16 row scales: 0 or 1]\n");
        return 2;
    }
    const int v = atoi(argv[2]);
    const int K1 = atoi(argv[3]), K2 = atoi(argv[4]);
    const int64_t in = atoll(argv[5]), out = atoll(argv[6]), ntok = atoll(argv[7]);
    const int nth = atoi(argv[8]);
    const int nm = argc > 9 ? atoi(argv[9]) : 64;
    const int reps = argc > 10 ? atoi(argv[10]) : 5;
    const int rscale = argc > 11 ? atoi(argv[11]) : 0;
    int b1 = 0, b2 = 0;
    while ((1 << b1) < K1) b1++;
    while (K2 > 1 && (1 << b2) < K2) b2++;
    const int n = (b1 + b2) * 4 / v;
    if (v < 1 || out < v || in % 32 != 0 || (b1 + b2) * 4 % v != 0) {
        printf("FAIL v=%d K1=%d K2=%d does not fit %lld inputs x %lld outputs (v must be at most the outputs and divide "
               "the index bits x 4, the inputs be whole blocks of 32)\n", v, K1, K2, (long long) in, (long long) out);
        return 2;
    }
    const size_t wbytes = (size_t) in * out * n / 32;
    struct ggml_init_params ip = { (size_t) nm * (wbytes + 4096 + (size_t) v * (K1 + K2) * 2 + (size_t) out * 2 + (size_t) (out % v) * in * 2) + 256 * 1024 * 1024 + (size_t) (in + out) * ntok * 4 * 2, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * x = bench_input(ctx, in, ntok);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4096, false);
    size_t bytes = 0;
    for (int m = 0; m < nm; ++m) {
        struct vq_weight W = {0};
        W.w = ggml_new_tensor_2d(ctx, (enum ggml_type) (GGML_VQ_TYPE_BASE + n), in, out);
        for (size_t i = 0; i < ggml_nbytes(W.w); ++i) {
            ((uint8_t *) W.w->data)[i] = (uint8_t) rnd();
        }
        W.sides[GGML_VQ_CODEBOOK] = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, v, K1, 1);
        fill_f16(W.sides[GGML_VQ_CODEBOOK], 0.05f);
        if (K2 > 1) {
            W.sides[GGML_VQ_RES_CODEBOOK] = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, v, K2, 1);
            fill_f16(W.sides[GGML_VQ_RES_CODEBOOK], 0.01f);
        }
        if (rscale) {
            W.sides[GGML_VQ_ROW_SCALE] = ggml_new_tensor_1d(ctx, GGML_TYPE_F16, out);
            fill_f16(W.sides[GGML_VQ_ROW_SCALE], 1.0f);
        }
        if (out % v) {
            W.sides[GGML_VQ_TAIL] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, in, out % v);
            fill_f16(W.sides[GGML_VQ_TAIL], 0.05f);
        }
        for (int k = 0; k < GGML_VQ_N_SIDES; ++k) {
            bytes += W.sides[k] ? ggml_nbytes(W.sides[k]) : 0;
        }
        bytes += ggml_nbytes(W.w);
        struct ggml_tensor * y = ggml_mul_mat(ctx, W.w, x);
        ggml_vq_attach(y, W.sides);
        ggml_build_forward_expand(gf, y);
    }
    const char * isa = getenv("GGML_VQ_ISA");
    char what[128];
    snprintf(what, sizeof what, "isa=%s v=%d K1=%d K2=%d rs=%d", isa ? isa : "best", v, K1, K2, rscale);
    time_graph(gf, what, in, out, ntok, nth, nm, reps, bytes);
    ggml_free(ctx);
    return 0;
}

// The same timing for one of ggml's own types (llama.cpp's quants), so that both are read at the same shapes in
// one run: a few rows quantized from random values (with an importance matrix of ones where the type needs one),
// their bytes repeated over every matrix.
static int mode_bench_type(int argc, char ** argv) {
    if (argc < 7) {
        printf("usage: bench-type TYPE in out ntok threads [n_mats] [reps]   (TYPE: a ggml type name, e.g. iq2_xxs)\n");
        return 2;
    }
    enum ggml_type type = GGML_TYPE_COUNT;
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * name = ggml_type_name((enum ggml_type) t);
        if (name && strcasecmp(name, argv[2]) == 0 && ggml_blck_size((enum ggml_type) t) > 0) {
            type = (enum ggml_type) t;
        }
    }
    const int64_t in = atoll(argv[3]), out = atoll(argv[4]), ntok = atoll(argv[5]);
    const int nth = atoi(argv[6]);
    const int nm = argc > 7 ? atoi(argv[7]) : 64;
    const int reps = argc > 8 ? atoi(argv[8]) : 5;
    if (type == GGML_TYPE_COUNT || type >= GGML_VQ_TYPE_BASE || in % ggml_blck_size(type) != 0) {
        printf("FAIL %s is not one of ggml's types, or rows of %lld are not whole blocks of it\n", argv[2], (long long) in);
        return 2;
    }
    const int64_t rows = 16;
    const size_t row_bytes = ggml_row_size(type, in);
    float * src = malloc(sizeof(float) * in * rows);
    float * ones = malloc(sizeof(float) * in);
    uint8_t * pattern = malloc(row_bytes * rows);
    for (int64_t e = 0; e < in * rows; ++e) {
        src[e] = rndn();
    }
    for (int64_t e = 0; e < in; ++e) {
        ones[e] = 1.0f;
    }
    ggml_quantize_chunk(type, src, pattern, 0, rows, in, ggml_quantize_requires_imatrix(type) ? ones : NULL);
    struct ggml_init_params ip = { (size_t) nm * (row_bytes * out + 4096) + 256 * 1024 * 1024 + (size_t) (in + out) * ntok * 4 * 2, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * x = bench_input(ctx, in, ntok);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4096, false);
    size_t bytes = 0;
    for (int m = 0; m < nm; ++m) {
        struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, in, out);
        for (int64_t r = 0; r < out; ++r) {
            memcpy((uint8_t *) w->data + r * row_bytes, pattern + (r % rows) * row_bytes, row_bytes);
        }
        bytes += ggml_nbytes(w);
        ggml_build_forward_expand(gf, ggml_mul_mat(ctx, w, x));
    }
    char what[64];
    snprintf(what, sizeof what, "type=%s", ggml_type_name(type));
    time_graph(gf, what, in, out, ntok, nth, nm, reps, bytes);
    ggml_free(ctx);
    free(src);
    free(ones);
    free(pattern);
    return 0;
}


typedef long long vq_v8 __attribute__((vector_size(64)));

struct bw_job {
    const vq_v8 * p;
    size_t n;
    long long sum;
};

static void * bw_read(void * arg) {
    struct bw_job * j = arg;
    vq_v8 a = {0}, b = {0}, c = {0}, d = {0};
    for (size_t i = 0; i + 4 <= j->n; i += 4) {
        a += j->p[i]; b += j->p[i + 1]; c += j->p[i + 2]; d += j->p[i + 3];
    }
    a += b + c + d;
    long long s = 0;
    for (int k = 0; k < 8; ++k) {
        s += a[k];
    }
    j->sum = s;
    return NULL;
}

static int mode_bandwidth(int argc, char ** argv) {
    const size_t mib = argc > 2 ? (size_t) atoll(argv[2]) : 1024;
    const int nth = argc > 3 ? atoi(argv[3]) : 2;
    const int passes = argc > 4 ? atoi(argv[4]) : 5;
    const size_t bytes = mib << 20;
    vq_v8 * buf = aligned_alloc(64, bytes);
    if (!buf || nth < 1 || nth > 256) {
        printf("FAIL cannot allocate %zu MiB\n", mib);
        return 1;
    }
    memset(buf, 1, bytes);
    const size_t n = bytes / sizeof(vq_v8);
    double best = 1e30;
    long long total = 0;
    for (int pass = 0; pass < passes; ++pass) {
        pthread_t th[256];
        struct bw_job jobs[256];
        const double t0 = now_s();
        for (int i = 0; i < nth; ++i) {
            jobs[i].p = buf + n * i / nth;
            jobs[i].n = n * (i + 1) / nth - n * i / nth;
            pthread_create(&th[i], NULL, bw_read, &jobs[i]);
        }
        for (int i = 0; i < nth; ++i) {
            pthread_join(th[i], NULL);
            total += jobs[i].sum;
        }
        const double t = now_s() - t0;
        best = t < best ? t : best;
    }
    printf("bandwidth %.2f GB/s (%zu MiB, %d threads, best of %d passes, checksum %lld)\n", bytes / best * 1e-9, mib, nth, passes, total & 0xff);
    free(buf);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc >= 3 && strcmp(argv[1], "--backend") == 0) {
        g_backend = ggml_backend_init_by_name(argv[2], NULL);
        if (!g_backend) {
            printf("FAIL no ggml backend named %s in this build\n", argv[2]);
            return 1;
        }
        argc -= 2;
        argv += 2;
    }
    if (getenv("VQ_TEST_SEED")) {
        rng_state ^= (uint64_t) atoll(getenv("VQ_TEST_SEED")) * 0x9E3779B97F4A7C15ull;
    }
    if (argc >= 2 && strcmp(argv[1], "random") == 0) {
        if (argc >= 3) {
            rng_state ^= (uint64_t) atoll(argv[2]) * 0x9E3779B97F4A7C15ull;
        }
        return mode_random(argc >= 4 && strcmp(argv[3], "quick") == 0);
    }
    if (argc >= 13 && strcmp(argv[1], "one") == 0) { // one case: in out v b1 b2 G perm norm rscale outl ntok
        struct cfg c = { atoll(argv[2]), atoll(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]), atoi(argv[7]),
                         atoi(argv[8]) != 0, atoi(argv[9]) != 0, atoi(argv[10]), atoi(argv[11]) != 0, atoll(argv[12]), 1 };
        run_case(&c, 0);
        printf("one: %d cases, %d failed\n", n_cases, n_fail);
        return n_fail ? 1 : 0;
    }
    if (argc >= 3 && strcmp(argv[1], "file") == 0) {
        return mode_file(argv[2], argc >= 4 ? atoi(argv[3]) : 1000000);
    }
    if (argc >= 2 && strcmp(argv[1], "bandwidth") == 0) {
        return mode_bandwidth(argc, argv);
    }
    if (argc >= 2 && strcmp(argv[1], "bench") == 0) {
        return mode_bench(argc, argv);
    }
    if (argc >= 2 && strcmp(argv[1], "bench-type") == 0) {
        return mode_bench_type(argc, argv);
    }
    if (argc >= 4 && strcmp(argv[1], "decode") == 0) {
        return rewrite_file(argv[2], argv[3], &REWRITE_DECODE, 0);
    }
    if (argc >= 5 && strcmp(argv[1], "residual") == 0) {
        return rewrite_file(argv[2], argv[3], &REWRITE_RESIDUAL, atoi(argv[4]));
    }
    printf("usage: %s [--backend NAME] random [seed] [quick] | one ... | file <gguf> [max] | bench ... | bench-type ... | bandwidth [MiB] [threads] [passes] | decode <in> <out> | residual <in> <out> <k_res>\n", argv[0]);
    return 2;
}
