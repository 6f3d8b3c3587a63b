/* core/io/gguf.c: the GGUF header (magic, version, key/value pairs with
 * scalars, strings and arrays, tensor infos, alignment) and the
 * dequantization of each supported type. Input: the whole file.
 * Properties: every tensor opened lies inside the file; every key and
 * tensor is found by its name; each value reads as what its type says;
 * a tensor reads into exactly its numel floats. */
#include <string.h>
#include "fuzz.h"
#include "moonrl/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file("model.gguf", data, size);
    mrl_gguf *g = NULL;
    if (mrl_gguf_open(path, &g) != MRL_OK) {
        FUZZ_ASSERT(g == NULL);
        return 0;
    }
    FUZZ_ASSERT(mrl_gguf_version(g) == 2 || mrl_gguf_version(g) == 3);
    for (int64_t i = 0; i < mrl_gguf_kv_count(g); i++) {
        const char *key = mrl_gguf_kv_key(g, i);
        FUZZ_ASSERT(key != NULL);
        int64_t found = mrl_gguf_find_kv(g, key);
        FUZZ_ASSERT(found >= 0 && !strcmp(mrl_gguf_kv_key(g, found), key));
        double v;
        const char *s;
        int64_t len;
        int type = mrl_gguf_kv_type(g, i);
        mrl_status sn = mrl_gguf_kv_number(g, i, -1, &v), ss = mrl_gguf_kv_string(g, i, -1, &s, &len);
        if (type == MRL_GGUF_STRING) FUZZ_ASSERT(ss == MRL_OK && len >= 0 && len <= (int64_t)size && sn != MRL_OK);
        if (type != MRL_GGUF_ARRAY) continue;
        int64_t n = mrl_gguf_kv_array_len(g, i);
        FUZZ_ASSERT(n >= 0 && n <= (int64_t)size);
        for (int64_t j = 0; j < n && j < 64; j++) {
            mrl_gguf_kv_number(g, i, j, &v);
            if (mrl_gguf_kv_string(g, i, j, &s, &len) == MRL_OK) FUZZ_ASSERT(len >= 0 && len <= (int64_t)size);
        }
        FUZZ_ASSERT(mrl_gguf_kv_number(g, i, n, &v) != MRL_OK && mrl_gguf_kv_string(g, i, n, &s, &len) != MRL_OK);
    }
    for (int64_t i = 0; i < mrl_gguf_tensor_count(g); i++) {
        mrl_gguf_tensor t;
        FUZZ_ASSERT(mrl_gguf_tensor_info(g, i, &t) == MRL_OK);
        FUZZ_ASSERT(t.offset >= 0 && t.bytes >= 0 && t.offset + t.bytes <= (int64_t)size);
        FUZZ_ASSERT(mrl_gguf_find_tensor(g, t.name) >= 0);
        if (t.numel > (1 << 16)) continue;
        float *dst = malloc((size_t)(t.numel + 1) * sizeof(float));
        dst[t.numel] = 12345.f;
        /* any bytes read: a tensor's values, or its refusal for holding a NaN or an infinity */
        mrl_status st = mrl_gguf_read_f32(g, i, dst, t.numel);
        FUZZ_ASSERT(st == MRL_OK || (st == MRL_ERR_FORMAT && strstr(mrl_last_error(), "must be finite")));
        FUZZ_ASSERT(dst[t.numel] == 12345.f); /* no float written past numel */
        FUZZ_ASSERT(mrl_gguf_read_f32(g, i, dst, t.numel - 1) != MRL_OK);
        free(dst);
    }
    mrl_gguf_close(g);
    return 0;
}
