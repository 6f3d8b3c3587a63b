/* core/io/safetensors.c, a sharded model: model.safetensors.index.json,
 * whose weight_map names the shard of each tensor. Input: the index; the
 * directory also holds two real shards (written once, below) and a file
 * that is no safetensors file. Properties: as fuzz_safetensors, and each
 * tensor of the opened model comes from a shard its index names. */
#include <string.h>
#include "fuzz.h"
#include "moonrl/safetensors.h"

static void write_shard(const char *dir, const char *name, const char *t1, const char *t2) {
    mrl_st_writer *w;
    FUZZ_ASSERT(mrl_st_writer_create(&w) == MRL_OK);
    float x[6] = {1, 2, 3, 4, 5, 6};
    int64_t shape[2] = {2, 3};
    FUZZ_ASSERT(mrl_st_writer_add(w, t1, MRL_DTYPE_F32, 2, shape, x) == MRL_OK);
    if (t2) FUZZ_ASSERT(mrl_st_writer_add(w, t2, MRL_DTYPE_BF16, 2, shape, x) == MRL_OK);
    FUZZ_ASSERT(mrl_st_writer_set_metadata(w, "format", "pt") == MRL_OK);
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FUZZ_ASSERT(mrl_st_writer_write(w, path) == MRL_OK);
    mrl_st_writer_free(w);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int ready;
    if (!ready) {
        write_shard(fuzz_dir(), "model-00001-of-00002.safetensors", "model.embed_tokens.weight", "model.norm.weight");
        write_shard(fuzz_dir(), "model-00002-of-00002.safetensors", "lm_head.weight", NULL);
        static const uint8_t text[] = "{\"not\": \"a safetensors file\"}";
        fuzz_file("config.json", text, sizeof text - 1);
        ready = 1;
    }
    fuzz_file("model.safetensors.index.json", data, size);
    mrl_st *st = NULL;
    if (mrl_st_open(fuzz_dir(), &st) != MRL_OK) {
        FUZZ_ASSERT(st == NULL);
        return 0;
    }
    int64_t n = mrl_st_count(st);
    FUZZ_ASSERT(n <= 3);
    for (int64_t i = 0; i < n; i++) {
        mrl_st_tensor t;
        FUZZ_ASSERT(mrl_st_info(st, i, &t) == MRL_OK);
        float dst[6];
        FUZZ_ASSERT(t.numel == 6 && mrl_st_read_f32(st, t.name, dst, 6) == MRL_OK && dst[5] == 6);
    }
    mrl_st_close(st);
    return 0;
}
