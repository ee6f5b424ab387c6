// CPU MUL_MAT for VQ weights (docs/format.md). Copied into ggml/src/ggml-cpu/ by the build.
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

// bytes of work buffer the VQ MUL_MAT node needs with n_threads threads (0 if it is not a VQ MUL_MAT)
size_t ggml_vq_cpu_work_size(const struct ggml_tensor * node, int n_threads);

void ggml_compute_forward_mul_mat_vq(const struct ggml_compute_params * params, struct ggml_tensor * dst);

#ifdef __cplusplus
}
#endif
