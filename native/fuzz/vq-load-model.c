#include "vq-load-model.h"

#include "llama.h"

#include <stdlib.h>

enum vq_load_result vq_load_model(const char * path, int n_tokens, bool check_data) {
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.check_tensors = check_data;
    struct llama_model * model = llama_model_load_from_file(path, mp);
    if (!model) {
        return VQ_LOAD_REFUSED;
    }
    enum vq_load_result res = VQ_LOAD_OK;
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    if (n_tokens > 0 && n_vocab > 0) {
        struct llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 64;
        cp.n_batch = cp.n_ubatch = 64;
        cp.n_threads = cp.n_threads_batch = 1;
        cp.no_perf = true;
        struct llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) {
            res = VQ_LOAD_NO_CTX;
        } else {
            llama_token * tokens = malloc(sizeof(llama_token) * (size_t) n_tokens);
            for (int i = 0; i < n_tokens; ++i) {
                tokens[i] = i % n_vocab;
            }
            if (llama_decode(ctx, llama_batch_get_one(tokens, n_tokens)) != 0) {
                res = VQ_LOAD_NO_RUN;
            }
            free(tokens);
            llama_free(ctx);
        }
    }
    llama_model_free(model);
    return res;
}
