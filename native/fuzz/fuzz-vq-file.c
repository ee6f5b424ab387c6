// libFuzzer harness, structure-aware: edits to a real-size VQ GGUF, loaded through libllama.
//
// The small-file harness (fuzz-vq-load.c) mutates whole files of a few KB; the default model's VQ file is
// ~100 MB and its interesting bytes are few: the header's counts, the keys' values, each tensor's type, dims and
// offset, and the side tensors (codebooks, norms, permutations, outliers). So this harness reads the real file
// once into a memfd, and an input is a short list of edits, each aimed at one field by a region map that
// tests/fuzz.py writes with gguf-py (VQ_FUZZ_FILE=<file>, map at <file>.regions: one region per line,
// "offset length width": width 4 or 8 for an integer field, 4 or 2 for float or half data, 0 for bytes).
// Each edit is written into the memfd, the file is loaded (the loader's checks, the VQ side tensors and their
// data checks; no decode: a 135M-parameter forward pass under ASan takes seconds), and the original bytes are
// written back: no copy of the file per input.
//
// An input: up to MAX_EDITS records of 8 bytes, [region u16][op u8][arg u8][offset u32], little-endian:
//   op 0: write `arg % 16 + 1` bytes taken from the record after it (or zeros) at offset % length
//   op 1: set an integer field to INTS[arg % N_INTS]       op 2: set a float or half to a special value
//   op 3: xor the byte at offset % length with arg | 1
// docs/hardening.md.

#define _GNU_SOURCE
#include "vq-load-model.h"

#include "llama.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_EDITS 8
#define MAX_WRITE 16

struct region { uint64_t offset, length; int width; };

static int              g_fd = -1;
static char             g_path[64];
static uint8_t *        g_file;      // the original bytes
static size_t           g_size;
static struct region *  g_regions;
static size_t           g_n_regions;

static const int64_t INTS[] = {0, 1, -1, 2, 3, 255, 256, 65535, 65536, INT32_MAX, (int64_t) INT32_MAX + 1,
                               UINT32_MAX, (int64_t) 1 << 40, (int64_t) 1 << 62, INT64_MAX, INT64_MIN, 199, 32};
static const float   FLOATS[] = {0.0f, -0.0f, 1.0f, -1.0f, 1e30f, -1e30f, 1e-40f, NAN, INFINITY, -INFINITY, 65504.0f};
// the same in IEEE half precision (the codebooks' type): 0, -0, 1, -1, max, -max, a subnormal, NaN, Inf, -Inf
static const uint16_t HALFS[] = {0x0000, 0x8000, 0x3c00, 0xbc00, 0x7bff, 0xfbff, 0x0001, 0x7e00, 0x7c00, 0xfc00};
#define N_INTS   (sizeof(INTS) / sizeof(INTS[0]))
#define N_FLOATS (sizeof(FLOATS) / sizeof(FLOATS[0]))
#define N_HALFS  (sizeof(HALFS) / sizeof(HALFS[0]))

static void log_nothing(enum ggml_log_level level, const char * text, void * user_data) {
    (void) level; (void) text; (void) user_data;
}

static void fail(const char * what, const char * path) {
    fprintf(stderr, "fuzz-vq-file: %s: %s\n", what, path ? path : "(unset)");
    exit(1);
}

static void pwrite_all(const void * buf, size_t n, uint64_t offset) {
    if (pwrite(g_fd, buf, n, (off_t) offset) != (ssize_t) n) {
        perror("fuzz-vq-file: pwrite");
        abort();
    }
}

int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void) argc; (void) argv;
    const char * path = getenv("VQ_FUZZ_FILE");
    FILE * f = path ? fopen(path, "rb") : NULL;
    if (!f) {
        fail("VQ_FUZZ_FILE names no readable file", path);
    }
    fseek(f, 0, SEEK_END);
    g_size = (size_t) ftell(f);
    fseek(f, 0, SEEK_SET);
    g_file = malloc(g_size);
    if (!g_file || fread(g_file, 1, g_size, f) != g_size) {
        fail("cannot read", path);
    }
    fclose(f);

    char map_path[4096];
    snprintf(map_path, sizeof(map_path), "%s.regions", path);
    FILE * m = fopen(map_path, "r");
    if (!m) {
        fail("no region map (tests/fuzz.py writes it)", map_path);
    }
    size_t cap = 1024;
    g_regions = malloc(cap * sizeof(*g_regions));
    unsigned long long off, len;
    int width;
    while (fscanf(m, "%llu %llu %d", &off, &len, &width) == 3) {
        if (len == 0 || off + len > g_size) {
            fail("a region outside the file in", map_path);
        }
        if (g_n_regions == cap) {
            cap *= 2;
            g_regions = realloc(g_regions, cap * sizeof(*g_regions));
        }
        g_regions[g_n_regions++] = (struct region) {off, len, width};
    }
    fclose(m);
    if (g_n_regions == 0) {
        fail("empty region map", map_path);
    }

    g_fd = memfd_create("fuzz-vq-file", 0);
    if (g_fd < 0) {
        perror("memfd_create");
        exit(1);
    }
    pwrite_all(g_file, g_size, 0);
    snprintf(g_path, sizeof(g_path), "/proc/self/fd/%d", g_fd);

    llama_log_set(log_nothing, NULL);
    llama_backend_init();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    struct { uint64_t offset; size_t n; } touched[MAX_EDITS];
    int n_touched = 0;
    for (size_t pos = 0; pos + 8 <= size && n_touched < MAX_EDITS; pos += 8) {
        const uint8_t * rec = data + pos;
        const struct region * r = &g_regions[(rec[0] | rec[1] << 8) % g_n_regions];
        const uint8_t op = rec[2] % 4, arg = rec[3];
        const uint32_t at = (uint32_t) rec[4] | (uint32_t) rec[5] << 8 | (uint32_t) rec[6] << 16 | (uint32_t) rec[7] << 24;
        uint8_t buf[MAX_WRITE] = {0};
        size_t n = 0;
        uint64_t where = r->offset + at % r->length;
        if (op == 0) {
            n = (size_t) arg % MAX_WRITE + 1;
            const size_t have = size - pos - 8;
            memcpy(buf, rec + 8, n < have ? n : have);
        } else if (op == 1 && r->width) {
            const int64_t v = INTS[arg % N_INTS];
            n = (size_t) r->width;
            memcpy(buf, &v, n);  // little-endian: the low bytes for a 4-byte field
            where = r->offset;
        } else if (op == 2 && (r->width == 4 || r->width == 2)) {
            n = (size_t) r->width;
            memcpy(buf, n == 4 ? (const void *) &FLOATS[arg % N_FLOATS] : (const void *) &HALFS[arg % N_HALFS], n);
            where = r->offset + (at % r->length) / n * n;
        } else {
            buf[0] = g_file[where] ^ (arg | 1);
            n = 1;
        }
        if (where + n > g_size) {
            n = (size_t) (g_size - where);
        }
        pwrite_all(buf, n, where);
        touched[n_touched].offset = where;
        touched[n_touched].n = n;
        n_touched++;
    }

    vq_load_model(g_path, 0, false);

    for (int i = 0; i < n_touched; ++i) {  // back to the original bytes for the next input
        pwrite_all(g_file + touched[i].offset, touched[i].n, touched[i].offset);
    }
    return 0;
}
