// CPU MUL_MAT for VQ weights (docs/format.md). Copied into ggml/src/ggml-cpu/ by the build.
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

// bytes of work buffer the VQ MUL_MAT node needs with n_threads threads (0 if it is not a VQ MUL_MAT)
size_t ggml_vq_cpu_work_size(const struct ggml_tensor * node, int n_threads);

// caps the instruction set like GGML_VQ_ISA=ref|scalar|avx2|avx512|vbmi (NULL: the best compiled); for the
// fuzz harness, which checks every path in one process
void ggml_vq_cpu_set_isa(const char * name);

void ggml_compute_forward_mul_mat_vq(const struct ggml_compute_params * params, struct ggml_tensor * dst);

#ifdef __cplusplus
}
#endif
