// The VQ MUL_MAT on the CUDA backend (docs/cuda.md). Copied into ggml/src/ggml-cuda/ by the build.
#pragma once

#include "common.cuh"

// token counts up to this go through the decode-and-dot kernel; above it the weight is decoded to F16 for cuBLAS
#define GGML_CUDA_VQ_MAX_BATCH 8

// dst = src[0] · src[1] for a VQ weight src[0] (side tensors in src[2..], ggml-vq.h) and F32 activations src[1]
void ggml_cuda_mul_mat_vq(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
