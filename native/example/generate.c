// Chat one prompt with a GGUF (VQ or stock types) through llama.cpp's C API, greedily.
//
// The prompt, with an optional system message, is rendered by the model's own chat template, then tokens are
// decoded one at a time until end of generation or N_TOKENS. The answer goes to stdout, errors to stderr.
//
//   cc -O2 generate.c -Iinclude -Llib -lllama -lggml -lggml-base -Wl,-rpath,'$ORIGIN/lib' -o generate
//   ./generate MODEL.gguf "What is the capital of France?" [N_TOKENS] [SYSTEM]
#define _GNU_SOURCE // dladdr
#include "llama.h"

#include <dlfcn.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void log_errors_only(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

// the chat template applied to the messages, with the assistant's turn opened; NULL on failure
static char * render_prompt(const struct llama_model * model, const llama_chat_message * msgs, size_t n_msgs) {
    const char * tmpl = llama_model_chat_template(model, NULL);
    if (tmpl == NULL) {
        fprintf(stderr, "the model has no chat template (tokenizer.chat_template)\n");
        return NULL;
    }
    int32_t len = llama_chat_apply_template(tmpl, msgs, n_msgs, true, NULL, 0);
    if (len < 0) {
        fprintf(stderr, "llama.cpp does not recognise this model's chat template\n");
        return NULL;
    }
    char * text = malloc((size_t) len + 1);
    llama_chat_apply_template(tmpl, msgs, n_msgs, true, text, len + 1);
    text[len] = 0;
    return text;
}

// A portable build keeps ggml's CPU backend in loadable libraries beside libllama, one per instruction-set
// level (libggml-cpu-haswell.so, ...): load the best one this CPU runs from libllama's folder. ggml alone would
// look only beside the executable and in the current folder. A build for one CPU has its backend linked in.
static void load_backends(void) {
    Dl_info info;
    if (ggml_backend_reg_count() > 0 || !dladdr((void *) llama_backend_init, &info) || info.dli_fname == NULL) {
        return;
    }
    char * path = strdup(info.dli_fname);
    ggml_backend_load_all_from_path(dirname(path));
    free(path);
}

static llama_token * tokenize(const struct llama_vocab * vocab, const char * text, int32_t * n_tokens) {
    int32_t n = -llama_tokenize(vocab, text, (int32_t) strlen(text), NULL, 0, false, true);
    llama_token * tokens = malloc(sizeof(llama_token) * (size_t) (n > 0 ? n : 1));
    *n_tokens = llama_tokenize(vocab, text, (int32_t) strlen(text), tokens, n, false, true);
    return tokens;
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPT [N_TOKENS=64] [SYSTEM]\n", argv[0]);
        return 2;
    }
    const char * path     = argv[1];
    const char * prompt   = argv[2];
    const int    n_gen    = argc > 3 ? atoi(argv[3]) : 64;
    const char * system   = argc > 4 ? argv[4] : NULL;
    const int    n_ctx    = 2048;
    const long   n_cpu    = sysconf(_SC_NPROCESSORS_ONLN);

    llama_log_set(log_errors_only, NULL);
    load_backends();
    llama_backend_init();
    if (ggml_backend_dev_count() == 0) {
        fprintf(stderr, "no ggml backend could be loaded (a portable build keeps them in lib/libggml-cpu-*.so)\n");
        return 1;
    }

    struct llama_model * model = llama_model_load_from_file(path, llama_model_default_params());
    if (model == NULL) {
        fprintf(stderr, "could not load %s\n", path);
        return 1;
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);

    llama_chat_message msgs[2];
    size_t n_msgs = 0;
    if (system != NULL) {
        msgs[n_msgs++] = (llama_chat_message) { "system", system };
    }
    msgs[n_msgs++] = (llama_chat_message) { "user", prompt };
    char * text = render_prompt(model, msgs, n_msgs);
    if (text == NULL) {
        llama_model_free(model);
        return 1;
    }
    int32_t n_prompt = 0;
    llama_token * tokens = tokenize(vocab, text, &n_prompt);
    free(text);
    if (n_prompt <= 0 || n_prompt + n_gen > n_ctx) {
        fprintf(stderr, "the prompt (%d tokens) and %d new tokens do not fit a context of %d\n", n_prompt, n_gen, n_ctx);
        free(tokens);
        llama_model_free(model);
        return 1;
    }

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_ctx;  // the whole prompt in one llama_decode
    cp.n_threads = cp.n_threads_batch = n_cpu > 0 ? (int32_t) n_cpu : 1;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == NULL) {
        fprintf(stderr, "could not create a context\n");
        free(tokens);
        llama_model_free(model);
        return 1;
    }
    struct llama_sampler * greedy = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(greedy, llama_sampler_init_greedy());

    int rc = 0;
    struct llama_batch batch = llama_batch_get_one(tokens, n_prompt);
    llama_token next = 0;
    for (int i = 0; i < n_gen; i++) {
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed\n");
            rc = 1;
            break;
        }
        next = llama_sampler_sample(greedy, ctx, -1);
        if (llama_vocab_is_eog(vocab, next)) {
            break;
        }
        char piece[256];
        int32_t n = llama_token_to_piece(vocab, next, piece, sizeof(piece), 0, false);
        if (n > 0) {
            fwrite(piece, 1, (size_t) n, stdout);
            fflush(stdout);
        }
        batch = llama_batch_get_one(&next, 1);
    }
    printf("\n");

    llama_sampler_free(greedy);
    llama_free(ctx);
    free(tokens);
    llama_model_free(model);
    return rc;
}
