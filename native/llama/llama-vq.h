// VQ weights in libllama: load each VQ weight's side tensors next to it, and attach them to the
// MUL_MAT nodes that llama.cpp builds for its weights (docs/format.md). Copied into src/ by the build.
#pragma once

#include "ggml-vq.h"
#include "llama.h"

#include <array>
#include <unordered_map>

struct llama_model_loader;

struct llama_vq_sides {
    // key: the VQ weight tensor of the model; value: its side tensors, NULL where absent
    std::unordered_map<const ggml_tensor *, std::array<ggml_tensor *, GGML_VQ_N_SIDES>> sides;

    // q and k weights kept in Hugging Face's row order (key vq.rope_neox, docs/format.md §1): llama.cpp
    // rotates them NEOX-style (halves together) instead of in adjacent pairs; llama_model_rope_type says so
    bool rope_neox = false;

    // read vq.rope_neox, given the rope type the architecture has; throws for a bad key or an architecture
    // that is not rotated in adjacent pairs
    void load_rope_order(const llama_model_loader & ml, llama_rope_type arch_rope_type);

    // after the architecture created its tensors: create the side tensors of every VQ weight in the
    // weight's own context (so they share its buffer and device) and check their shapes; throws on error
    void load(llama_model_loader & ml);

    // after the tensor data is loaded: check the side data (finite values, permutation, outliers); throws on error
    void check_data() const;

    // attach the side tensors if res is a MUL_MAT of a VQ weight; returns res
    ggml_tensor * apply(ggml_tensor * res) const;
};
