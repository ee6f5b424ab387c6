"""Compile the runtime's cffi module `_vq_llama` against the patched tree's llama.h and ggml-vq.h.

API mode: the C compiler sees the real headers, and every struct below declares only the fields the
runtime touches followed by `...;`, so cffi takes offsets and sizes from the compiler. A field that is
renamed or retyped upstream fails this build instead of corrupting memory at run time.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import cffi

MODULE = "_vq_llama"

CDEF = """
typedef int32_t llama_token;
typedef int32_t llama_pos;
typedef int32_t llama_seq_id;
typedef uint16_t ggml_fp16_t;
typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;
struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_sampler;
typedef struct llama_memory_i * llama_memory_t;
enum llama_vocab_type { LLAMA_VOCAB_TYPE_NONE, ... };

struct llama_model_params {
    ggml_backend_dev_t * devices;
    int32_t n_gpu_layers;
    bool vocab_only;
    bool check_tensors;
    bool use_extra_bufts;
    ...;
};
struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    bool embeddings;
    bool no_perf;
    ...;
};
typedef struct llama_sampler_chain_params { bool no_perf; ...; } llama_sampler_chain_params;
typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

void llama_backend_init(void);
struct llama_model_params   llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);
struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
uint64_t llama_model_size(const struct llama_model * model);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);
uint32_t llama_n_ctx(const struct llama_context * ctx);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
enum llama_vocab_type llama_vocab_type(const struct llama_vocab * vocab);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_eos(const struct llama_vocab * vocab);
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t length,
                             int32_t lstrip, bool special);
struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
llama_memory_t llama_get_memory(const struct llama_context * ctx);
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
void llama_sampler_free(struct llama_sampler * smpl);
const char * llama_print_system_info(void);

struct ggml_vq_layout {
    int64_t in, out;
    int32_t v, b1, b2;
    int64_t P, n_tail;
    int64_t G;
    int64_t n_o;
    int32_t v0, b0;
    const uint8_t     * codes;
    const ggml_fp16_t * codebook;
    const ggml_fp16_t * res_codebook;
    const int32_t     * perm;
    const float       * col_norm;
    const float       * row_scale;
    const ggml_fp16_t * row_scale_f16;
    const int32_t     * outlier_cols;
    const int16_t     * outlier_idx;
    const ggml_fp16_t * outlier_codebook;
    const ggml_fp16_t * tail;
};
void ggml_vq_dequantize(const struct ggml_vq_layout * layout, float * dst);
bool ggml_vq_check_data(const struct ggml_vq_layout * layout, char * err, size_t err_size);

void vq_log_setup(int verbose);
const char * vq_log_text(void);
enum ggml_backend_dev_type { GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU, ... };
ggml_backend_reg_t vq_add_rpc_server(const char * endpoint);
ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
void vq_log_clear(void);
"""

# llama.cpp's log goes through this: errors and warnings are kept for the Python exceptions, and
# everything is echoed to stderr in verbose mode
SOURCE = r"""
#include "llama.h"
#include "ggml-vq.h"
#include <stdio.h>
#include <string.h>

#define VQ_LOG_CAP 8192
static char vq_log_buf[VQ_LOG_CAP];
static size_t vq_log_len;
static int vq_log_verbose;
static enum ggml_log_level vq_log_last = GGML_LOG_LEVEL_NONE;

static void vq_log_cb(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level != GGML_LOG_LEVEL_CONT) {
        vq_log_last = level;
    }
    if (vq_log_verbose) {
        fputs(text, stderr);
    }
    if (vq_log_last < GGML_LOG_LEVEL_WARN) {
        return;
    }
    size_t n = strlen(text);
    if (n >= VQ_LOG_CAP) {
        text += n - (VQ_LOG_CAP - 1);
        n = VQ_LOG_CAP - 1;
    }
    if (vq_log_len + n >= VQ_LOG_CAP) {  /* keep the newest text */
        size_t drop = vq_log_len + n - (VQ_LOG_CAP - 1);
        memmove(vq_log_buf, vq_log_buf + drop, vq_log_len - drop);
        vq_log_len -= drop;
    }
    memcpy(vq_log_buf + vq_log_len, text, n);
    vq_log_len += n;
    vq_log_buf[vq_log_len] = 0;
}

void vq_log_setup(int verbose) { vq_log_verbose = verbose; llama_log_set(vq_log_cb, NULL); }

/* the registry entry of an RPC server's devices, registered as llama.cpp's --rpc registers them
   (common/arg.cpp); NULL when the build has no RPC backend (`vq-gguf build --rpc`) or the server offers none */
ggml_backend_reg_t vq_add_rpc_server(const char * endpoint) {
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (!rpc) {
        return NULL;
    }
    typedef ggml_backend_reg_t (*add_server_t)(const char * endpoint);
    add_server_t add = (add_server_t) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server");
    ggml_backend_reg_t reg = add ? add(endpoint) : NULL;
    if (reg) {
        ggml_backend_register(reg);
    }
    return reg;
}
const char * vq_log_text(void) { return vq_log_buf; }
void vq_log_clear(void) { vq_log_len = 0; vq_log_buf[0] = 0; }
"""


def build(tree: Path, lib_dir: Path) -> Path:
    """Compile the module into lib_dir/python (next to the shared libraries it links with, via rpath)."""
    out_dir = lib_dir / "python"
    stamp = out_dir / f"{MODULE}.stamp"
    key = CDEF + SOURCE + str(tree)
    if stamp.exists() and stamp.read_text() == key and any(out_dir.glob(f"{MODULE}*.so")):
        return out_dir
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        MODULE, SOURCE,
        include_dirs=[str(tree / "include"), str(tree / "ggml" / "include")],
        library_dirs=[str(lib_dir)],
        libraries=["llama", "ggml-base", "ggml"],
        extra_link_args=[f"-Wl,-rpath,{lib_dir}"],
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        so = Path(ffi.compile(tmpdir=tmp))
        staged = out_dir / f".{so.name}.tmp"
        shutil.copy2(so, staged)
        os.replace(staged, out_dir / so.name)  # a new file: processes that loaded the old one keep it intact
    stamp.write_text(key)
    return out_dir
