#include "llama-vq.h"

#include "llama-impl.h"
#include "llama-model-loader.h"

#include "ggml-backend.h"
#include "gguf.h"

#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

static const std::string VQ_WEIGHT_SUFFIX = ".weight";
static const std::string VQ_SIDE_MARK     = ".vq_";  // every side tensor is <base>.vq_* or vq_shared.<label>.vq_*

static bool starts_with(const std::string & s, const std::string & prefix) {
    return s.compare(0, prefix.size(), prefix) == 0;
}

static bool ends_with(const std::string & s, const std::string & suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// the shared tensor that vq.link.<sname> names (docs/format.md 4.1), or "" without a link
static std::string vq_link(const gguf_context * meta, const std::string & sname, const std::string & suffix) {
    const int64_t kid = gguf_find_key(meta, (GGML_VQ_LINK_PREFIX + sname).c_str());
    if (kid < 0) {
        return "";
    }
    if (gguf_get_kv_type(meta, kid) != GGUF_TYPE_STRING) {
        throw std::runtime_error(format("key '%s%s' is not a string", GGML_VQ_LINK_PREFIX, sname.c_str()));
    }
    const std::string target = gguf_get_val_str(meta, kid);
    if (!starts_with(target, GGML_VQ_SHARED_PREFIX) || !ends_with(target, "." + suffix)) {
        throw std::runtime_error(format("key '%s%s' names '%s', which is not a shared '%s' tensor (%s<label>.%s)",
                GGML_VQ_LINK_PREFIX, sname.c_str(), target.c_str(), suffix.c_str(), GGML_VQ_SHARED_PREFIX, suffix.c_str()));
    }
    return target;
}

void llama_vq_sides::load_rope_order(const llama_model_loader & ml, llama_rope_type arch_rope_type) {
    static const char * key = "vq.rope_neox";
    const int64_t kid = gguf_find_key(ml.metadata, key);
    if (kid < 0) {
        return;
    }
    if (gguf_get_kv_type(ml.metadata, kid) != GGUF_TYPE_BOOL) {
        throw std::runtime_error(format("key '%s' is not a bool", key));
    }
    rope_neox = gguf_get_val_bool(ml.metadata, kid);
    if (rope_neox && arch_rope_type != LLAMA_ROPE_TYPE_NORM) {
        throw std::runtime_error(format("key '%s' is only defined for architectures rotated in adjacent pairs "
                "(rope type %d), not rope type %d", key, LLAMA_ROPE_TYPE_NORM, arch_rope_type));
    }
}

// whether dev runs the MUL_MAT of w with its side tensors attached (a one-token node, no data)
static bool supports_with_sides(ggml_backend_dev_t dev, ggml_tensor * w, const std::array<ggml_tensor *, GGML_VQ_N_SIDES> & s) {
    ggml_init_params params = { 2 * ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * x  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], 1);
    ggml_tensor * op = ggml_vq_attach(ggml_mul_mat(ctx, w, x), s.data());
    const bool ok = ggml_backend_dev_supports_op(dev, op);
    ggml_free(ctx);
    return ok;
}

void llama_vq_sides::load(llama_model_loader & ml) {
    std::unordered_set<std::string> side_names;
    std::unordered_set<std::string> links_used;
    std::unordered_map<std::string, ggml_tensor *> shared;  // a shared side tensor is created once
    for (const auto & [name, tw] : ml.weights_map) {
        if (!ggml_is_vq(tw.tensor->type)) {
            continue;
        }
        if (sides.empty()) {
            const int64_t kid = gguf_find_key(ml.metadata, GGML_VQ_FORMAT_KEY);
            if (kid < 0 || gguf_get_kv_type(ml.metadata, kid) != GGUF_TYPE_UINT32 || gguf_get_val_u32(ml.metadata, kid) < 1 ||
                    gguf_get_val_u32(ml.metadata, kid) > GGML_VQ_FORMAT_VERSION) {
                throw std::runtime_error(format("the file has VQ tensors but no '%s' of 1 to %d: unsupported VQ format version",
                        GGML_VQ_FORMAT_KEY, GGML_VQ_FORMAT_VERSION));
            }
        }

        ggml_tensor  * w    = nullptr;
        ggml_context * wctx = nullptr;
        ggml_backend_buffer_type_t buft = nullptr;
        for (auto & it : ml.ctx_map) {
            if ((w = ggml_get_tensor(it.second.get(), name.c_str()))) {
                wctx = it.second.get();
                buft = it.first.buft;
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
            const std::string suffix = ggml_vq_side_suffix((ggml_vq_side) i);
            const std::string own    = base + "." + suffix;
            const std::string linked = vq_link(ml.metadata, own, suffix);
            if (!linked.empty() && ml.get_tensor_meta(own.c_str())) {
                throw std::runtime_error(format("VQ tensor '%s' has both its own '%s' and a link to '%s'", name.c_str(), own.c_str(), linked.c_str()));
            }
            if (!linked.empty()) {
                links_used.insert(GGML_VQ_LINK_PREFIX + own);
                if (shared.count(linked)) {
                    s[i] = shared[linked];
                    continue;
                }
            }
            const std::string sname = linked.empty() ? own : linked;
            const ggml_tensor * meta = ml.get_tensor_meta(sname.c_str());
            if (!meta) {
                if (!linked.empty()) {
                    throw std::runtime_error(format("VQ tensor '%s' links its %s to '%s', which the file lacks", name.c_str(), suffix.c_str(), linked.c_str()));
                }
                continue;
            }
            s[i] = ggml_dup_tensor(wctx, meta);
            ggml_set_name(s[i], sname.c_str());
            ml.n_created++;
            if (!linked.empty()) {
                shared[linked] = s[i];
            }
        }

        ggml_vq_layout layout;
        char err[256];
        if (!ggml_vq_layout_init(&layout, w, s.data(), err, sizeof(err))) {
            throw std::runtime_error(format("VQ tensor '%s': %s", name.c_str(), err));
        }
        // llama.cpp placed the weight by a MUL_MAT without side tensors; the device must take it with them
        ggml_backend_dev_t dev = buft ? ggml_backend_buft_get_device(buft) : nullptr;
        if (dev && !supports_with_sides(dev, w, s)) {
            throw std::runtime_error(format("VQ tensor '%s' (v = %d%s) cannot be multiplied on %s, where it was placed: "
                    "keep the VQ weights on the CPU (e.g. -ngl 0)", name.c_str(), layout.v,
                    layout.n_tail ? ", with a tail" : "", ggml_backend_dev_name(dev)));
        }
        sides[w] = s;
        for (const ggml_tensor * t : s) {
            if (t) {
                side_names.insert(ggml_get_name(t));
            }
        }
    }
    // a link that no VQ weight used: its weight is not VQ or missing, or the suffix is unknown
    for (int64_t k = 0; k < gguf_get_n_kv(ml.metadata); ++k) {
        const std::string key = gguf_get_key(ml.metadata, k);
        if (starts_with(key, GGML_VQ_LINK_PREFIX) && !links_used.count(key)) {
            throw std::runtime_error(format("key '%s' links a side tensor of no VQ weight", key.c_str()));
        }
    }
    // a side tensor that no VQ weight claimed: a weight that is not VQ, a misspelt or unknown side, an unused shared one
    for (const auto & [name, tw] : ml.weights_map) {
        if (starts_with(name, GGML_VQ_SHARED_PREFIX) && !side_names.count(name)) {
            throw std::runtime_error(format("shared VQ side tensor '%s' is linked by no VQ weight", name.c_str()));
        }
        if (name.find(VQ_SIDE_MARK) != std::string::npos && !side_names.count(name)) {
            throw std::runtime_error(format("tensor '%s' looks like a VQ side tensor, but no VQ weight '%s.weight' with such a side exists",
                    name.c_str(), name.substr(0, name.find(VQ_SIDE_MARK)).c_str()));
        }
    }
    if (!sides.empty()) {
        LLAMA_LOG_INFO("%s: %zu VQ weights, %zu shared side tensors\n", __func__, sides.size(), shared.size());
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
