// Loader driver of the sanitizer build: loads one model file through libllama and decodes a few tokens.
//
//   vq-load <model.gguf> [n_tokens]     (n_tokens: default 3; 0 loads only)
//
// llama.cpp's warnings and errors go to stderr. Exit status: 0 loaded and ran, 2 refused at load, 3 no
// context, 4 decoding failed (enum vq_load_result); a sanitizer report exits with the status that
// ASAN_OPTIONS / UBSAN_OPTIONS give (tests/test_malformed.py sets distinct ones).

#include "vq-load-model.h"

#include "llama.h"

#include <stdio.h>
#include <stdlib.h>

static enum ggml_log_level last_level = GGML_LOG_LEVEL_NONE;

static void log_warnings(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level != GGML_LOG_LEVEL_CONT) {
        last_level = level;
    }
    if (last_level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s <model.gguf> [n_tokens]\n", argv[0]);
        return 64;
    }
    llama_log_set(log_warnings, NULL);
    llama_backend_init();
    const enum vq_load_result res = vq_load_model(argv[1], argc > 2 ? atoi(argv[2]) : 3, true);
    llama_backend_free();
    printf("%s\n", res == VQ_LOAD_OK ? "ok" : res == VQ_LOAD_REFUSED ? "refused" : res == VQ_LOAD_NO_CTX ? "no context" : "decode failed");
    return (int) res;
}
