#include "llama-vq.h"

#include "llama-impl.h"
#include "llama-model-loader.h"

#include "ggml-backend.h"
#include "gguf.h"

#include <stdexcept>
#include <string>
#include <vector>

static const std::string VQ_WEIGHT_SUFFIX = ".weight";

void llama_vq_sides::load(llama_model_loader & ml) {
    for (const auto & [name, tw] : ml.weights_map) {
        if (!ggml_is_vq(tw.tensor->type)) {
            continue;
        }
        if (sides.empty()) {
            const int64_t kid = gguf_find_key(ml.metadata, GGML_VQ_FORMAT_KEY);
            if (kid < 0 || gguf_get_kv_type(ml.metadata, kid) != GGUF_TYPE_UINT32 || gguf_get_val_u32(ml.metadata, kid) != GGML_VQ_FORMAT_VERSION) {
                throw std::runtime_error(format("the file has VQ tensors but no '%s' = %d: unsupported VQ format version",
                        GGML_VQ_FORMAT_KEY, GGML_VQ_FORMAT_VERSION));
            }
        }

        ggml_tensor  * w    = nullptr;
        ggml_context * wctx = nullptr;
        for (auto & it : ml.ctx_map) {
            if ((w = ggml_get_tensor(it.second.get(), name.c_str()))) {
                wctx = it.second.get();
                break;
            }
        }
        const bool is_weight = name.size() > VQ_WEIGHT_SUFFIX.size() &&
                name.compare(name.size() - VQ_WEIGHT_SUFFIX.size(), VQ_WEIGHT_SUFFIX.size(), VQ_WEIGHT_SUFFIX) == 0;
        if (!w || !is_weight || name.rfind("token_embd", 0) == 0 || ggml_n_dims(w) != 2) {
            throw std::runtime_error(format("tensor '%s' has VQ type %s, which this build supports only for the 2-D weights of block linears",
                    name.c_str(), ggml_type_name(tw.tensor->type)));
        }

        const std::string base = name.substr(0, name.size() - VQ_WEIGHT_SUFFIX.size());
        std::array<ggml_tensor *, GGML_VQ_N_SIDES> s{};
        for (int i = 0; i < GGML_VQ_N_SIDES; ++i) {
            const std::string sname = base + "." + ggml_vq_side_suffix((ggml_vq_side) i);
            const ggml_tensor * meta = ml.get_tensor_meta(sname.c_str());
            if (!meta) {
                continue;
            }
            s[i] = ggml_dup_tensor(wctx, meta);
            ggml_set_name(s[i], sname.c_str());
            ml.n_created++;
        }

        ggml_vq_layout layout;
        char err[256];
        if (!ggml_vq_layout_init(&layout, w, s.data(), err, sizeof(err))) {
            throw std::runtime_error(format("VQ tensor '%s': %s", name.c_str(), err));
        }
        sides[w] = s;
    }
    if (!sides.empty()) {
        LLAMA_LOG_INFO("%s: %zu VQ weights (format %d)\n", __func__, sides.size(), GGML_VQ_FORMAT_VERSION);
    }
}

// copy of a tensor's data on the host (the tensor may live on any backend)
static std::vector<uint8_t> host_copy(const ggml_tensor * t) {
    std::vector<uint8_t> data;
    if (t) {
        data.resize(ggml_nbytes(t));
        ggml_backend_tensor_get(t, data.data(), 0, data.size());
    }
    return data;
}

void llama_vq_sides::check_data() const {
    for (const auto & [w, s] : sides) {
        ggml_vq_layout layout;
        char err[256];
        GGML_ASSERT(ggml_vq_layout_init(&layout, w, s.data(), err, sizeof(err)));
        const auto perm = host_copy(s[GGML_VQ_PERM]);
        const auto cols = host_copy(s[GGML_VQ_OUTLIER_COLS]);
        const auto oidx = host_copy(s[GGML_VQ_OUTLIER_IDX]);
        layout.perm         = perm.empty() ? nullptr : (const int32_t *) perm.data();
        layout.outlier_cols = cols.empty() ? nullptr : (const int32_t *) cols.data();
        layout.outlier_idx  = oidx.empty() ? nullptr : (const int16_t *) oidx.data();
        if (!ggml_vq_check_data(&layout, err, sizeof(err))) {
            throw std::runtime_error(format("VQ tensor '%s': %s", ggml_get_name(w), err));
        }
    }
}

ggml_tensor * llama_vq_sides::apply(ggml_tensor * res) const {
    if (res->op != GGML_OP_MUL_MAT || !ggml_is_vq(res->src[0]->type)) {
        return res;
    }
    const auto it = sides.find(res->src[0]);
    if (it == sides.end()) {
        GGML_ABORT("VQ weight '%s' has no side tensors registered", ggml_get_name(res->src[0]));
    }
    return ggml_vq_attach(res, it->second.data());
}
