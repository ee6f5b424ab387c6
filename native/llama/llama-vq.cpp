#include "llama-vq.h"

#include "llama-impl.h"
#include "llama-model-loader.h"

#include "ggml-backend.h"
#include "gguf.h"

#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

static const std::string VQ_WEIGHT_SUFFIX = ".weight";
static const std::string VQ_SIDE_MARK     = ".vq_";  // every side tensor is <base>.vq_*

void llama_vq_sides::load(llama_model_loader & ml) {
    std::unordered_set<std::string> side_names;
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
        for (const ggml_tensor * t : s) {
            if (t) {
                side_names.insert(ggml_get_name(t));
            }
        }
    }
    // a side tensor that no VQ weight claimed: a weight that is not VQ, a misspelt or unknown side
    for (const auto & [name, tw] : ml.weights_map) {
        if (name.find(VQ_SIDE_MARK) != std::string::npos && !side_names.count(name)) {
            throw std::runtime_error(format("tensor '%s' looks like a VQ side tensor, but no VQ weight '%s.weight' with such a side exists",
                    name.c_str(), name.substr(0, name.find(VQ_SIDE_MARK)).c_str()));
        }
    }
    if (!sides.empty()) {
        LLAMA_LOG_INFO("%s: %zu VQ weights (format %d)\n", __func__, sides.size(), GGML_VQ_FORMAT_VERSION);
    }
}

void llama_vq_sides::check_data() const {
    for (const auto & [w, s] : sides) {
        // the side tensors with their data copied to the host (they may live on any backend)
        std::array<std::vector<uint8_t>, GGML_VQ_N_SIDES> data;
        std::array<ggml_tensor, GGML_VQ_N_SIDES> host;
        std::array<ggml_tensor *, GGML_VQ_N_SIDES> hs{};
        for (int i = 0; i < GGML_VQ_N_SIDES; ++i) {
            if (s[i]) {
                data[i].resize(ggml_nbytes(s[i]));
                ggml_backend_tensor_get(s[i], data[i].data(), 0, data[i].size());
                host[i] = *s[i];
                host[i].data = data[i].data();
                hs[i] = &host[i];
            }
        }
        ggml_vq_layout layout;
        char err[256];
        GGML_ASSERT(ggml_vq_layout_init(&layout, w, hs.data(), err, sizeof(err)));
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
