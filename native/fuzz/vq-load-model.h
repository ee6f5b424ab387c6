// Load a model file through libllama and run it on a few tokens: what the loader driver (vq-load) and
// the load fuzzer (fuzz-vq-load) do with each file. See docs/hardening.md.
#pragma once

#include <stdbool.h>
#include <stddef.h>

enum vq_load_result {
    VQ_LOAD_OK      = 0,  // loaded, and a few tokens decoded
    VQ_LOAD_REFUSED = 2,  // the loader refused the file (its message went to the log)
    VQ_LOAD_NO_CTX  = 3,  // loaded, but no context could be created
    VQ_LOAD_NO_RUN  = 4,  // loaded, but decoding failed
};

// n_tokens token ids 0, 1, ... (modulo the vocabulary) are decoded in one batch; 0: load only.
// check_data: llama.cpp's check of every tensor's data (NaN/Inf, invalid quant blocks), as the runtime loads;
// the VQ side tensors' data checks run either way.
enum vq_load_result vq_load_model(const char * path, int n_tokens, bool check_data);
