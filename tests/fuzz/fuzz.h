/* What the fuzz targets share (tests/fuzz/README in docs/testing.md, "Fuzzing").
 *
 * A target is one C file defining LLVMFuzzerTestOneInput, libFuzzer's entry
 * point: it feeds the bytes to one parser and returns 0. It never judges an
 * error status (refusing bad input is the parser's job); it aborts only where
 * a property that must hold for every input is broken, so that a crash, an
 * out-of-bounds access, undefined behaviour, a leak, a hang or a failed
 * property are the findings. The same file links either with libFuzzer
 * (clang -fsanitize=fuzzer) or with tests/fuzz/driver.c, our own mutation
 * driver for gcc builds. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Write data[0..size) to the file `name` in this process's scratch directory
 * (made on first use, removed at exit) and return its path. Parsers that
 * take a path (safetensors, GGUF, the line index, tokenizer.json) read it
 * from there. The path is valid until the next call. */
const char *fuzz_file(const char *name, const uint8_t *data, size_t size);

/* The scratch directory itself. */
const char *fuzz_dir(void);

/* A property every input must keep is broken: say which, then abort (the
 * driver or libFuzzer saves the input). */
#define FUZZ_ASSERT(cond)                                                                  \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: fuzz property broken: %s\n", __FILE__, __LINE__, #cond); \
            abort();                                                                       \
        }                                                                                  \
    } while (0)
