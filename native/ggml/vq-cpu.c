// CPU MUL_MAT for VQ weights: each thread decodes a tile of vector rows with the reference decoder
// into its slice of the work buffer, then takes dot products with every column of src1.
// Threads own disjoint output rows, so no synchronisation is needed.

#include "vq-cpu.h"
#include "ggml-vq.h"
#include "ggml-cpu-impl.h"
#include "vec.h"

#include <string.h>

#define VQ_TILE_ROWS 64 // decoded output rows per tile (rounded to whole vector rows)

static int64_t vq_tile_vrows(int v) {
    return v >= VQ_TILE_ROWS ? 1 : VQ_TILE_ROWS / v;
}

static size_t vq_thread_bytes(int v, int64_t in) {
    return GGML_PAD((size_t) vq_tile_vrows(v) * v * in * sizeof(float), 64);
}

size_t ggml_vq_cpu_work_size(const struct ggml_tensor * node, int n_threads) {
    const struct ggml_tensor * cb = node->src[GGML_VQ_SRC_FIRST + GGML_VQ_CODEBOOK];
    if (node->op != GGML_OP_MUL_MAT || !ggml_is_vq(node->src[0]->type) || !cb) {
        return 0;
    }
    return 64 + (size_t) n_threads * vq_thread_bytes((int) cb->ne[0], node->src[0]->ne[0]);
}

void ggml_compute_forward_mul_mat_vq(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];

    struct ggml_vq_layout L;
    char err[256];
    if (!ggml_vq_layout_init(&L, src0, dst->src + GGML_VQ_SRC_FIRST, err, sizeof(err))) {
        GGML_ABORT("MUL_MAT of VQ weight '%s': %s (VQ weights must be multiplied through llama.cpp's weight matmul hook)", src0->name, err);
    }
    GGML_ASSERT(src1->type == GGML_TYPE_F32 && src1->nb[0] == sizeof(float));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && dst->nb[0] == sizeof(float));
    GGML_ASSERT(src1->ne[0] == L.in && dst->ne[0] == L.out);
    GGML_ASSERT(params->wsize >= ggml_vq_cpu_work_size(dst, params->nth));

    const int     ith   = params->ith;
    const int     nth   = params->nth;
    const int64_t v     = L.v;
    const int64_t P     = L.out / v;
    const int64_t tile  = vq_tile_vrows(L.v);
    const int64_t p0    = P * ith / nth;
    const int64_t p1    = P * (ith + 1) / nth;
    float * w = (float *) ((char *) GGML_PAD((uintptr_t) params->wdata, 64) + (size_t) ith * vq_thread_bytes(L.v, L.in));

    for (int64_t p = p0; p < p1; p += tile) {
        const int64_t np = MIN(tile, p1 - p);
        for (int64_t k = 0; k < np; ++k) {
            ggml_vq_decode_vrow(&L, p + k, w + k * v * L.in);
        }
        for (int64_t i13 = 0; i13 < src1->ne[3]; ++i13) {
            for (int64_t i12 = 0; i12 < src1->ne[2]; ++i12) {
                for (int64_t i11 = 0; i11 < src1->ne[1]; ++i11) {
                    const float * x = (const float *) ((const char *) src1->data + i11 * src1->nb[1] + i12 * src1->nb[2] + i13 * src1->nb[3]);
                    float       * y = (float *)       ((char *)       dst->data  + i11 * dst->nb[1]  + i12 * dst->nb[2]  + i13 * dst->nb[3]) + p * v;
                    for (int64_t r = 0; r < np * v; ++r) {
                        ggml_vec_dot_f32((int) L.in, y + r, 0, w + r * L.in, 0, x, 0, 1);
                    }
                }
            }
        }
    }
}
