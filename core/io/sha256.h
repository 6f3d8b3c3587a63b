/* SHA-256 in pieces (internal; moonrl/fs.h has the whole-buffer and whole-file forms). */
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef struct mrl_sha256_ctx {
    uint32_t h[8];
    uint64_t bytes;    /* fed so far */
    uint8_t block[64]; /* the partial block (bytes % 64 of it) */
} mrl_sha256_ctx;

void mrl_sha256_init(mrl_sha256_ctx *s);
void mrl_sha256_update(mrl_sha256_ctx *s, const void *data, size_t n);
void mrl_sha256_final(mrl_sha256_ctx *s, uint8_t out[32]);
