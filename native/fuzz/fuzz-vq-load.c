// libFuzzer harness: a VQ GGUF file from bytes, loaded through libllama (the GGUF parser, the model loader,
// the VQ side tensors and their checks) and, when it loads, run on a few tokens through the VQ kernels.
// Seeds: tests/fuzz.py writes a tiny valid VQ model (tests/tiny_model.py). docs/hardening.md.

#define _GNU_SOURCE
#include "vq-load-model.h"

#include "llama.h"

#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

static void log_nothing(enum ggml_log_level level, const char * text, void * user_data) {
    (void) level; (void) text; (void) user_data;
}

int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void) argc; (void) argv;
    llama_log_set(log_nothing, NULL);
    llama_backend_init();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const int fd = memfd_create("fuzz-vq-load", 0);
    if (fd < 0) {
        perror("memfd_create");
        return 0;
    }
    size_t done = 0;
    while (done < size) {
        const ssize_t n = write(fd, data + done, size - done);
        if (n <= 0) {
            perror("write");
            close(fd);
            return 0;
        }
        done += (size_t) n;
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    vq_load_model(path, 2, true);
    close(fd);
    return 0;
}
