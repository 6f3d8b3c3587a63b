/* core/io/safetensors.c, one file: the u64 header length, the JSON header,
 * each tensor's dtype, shape and data_offsets checked against the file.
 * Input: the whole file. Properties: each tensor opened lies inside the
 * file with bytes = numel * dtype size, is found by its name, and reads
 * (F32 / BF16 / F16) into exactly its numel floats, and a range of it
 * (mrl_st_read_f32_range) into the same floats as that slice of the full read. */
#include <string.h>
#include "fuzz.h"
#include "moonrl/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file("model.safetensors", data, size);
    mrl_st *st = NULL;
    if (mrl_st_open(path, &st) != MRL_OK) {
        FUZZ_ASSERT(st == NULL);
        return 0;
    }
    int64_t n = mrl_st_count(st);
    for (int64_t i = 0; i < n; i++) {
        mrl_st_tensor t, u;
        FUZZ_ASSERT(mrl_st_info(st, i, &t) == MRL_OK);
        FUZZ_ASSERT(t.bytes == t.numel * (int64_t)mrl_dtype_size(t.dtype));
        FUZZ_ASSERT(t.bytes <= (int64_t)size);
        FUZZ_ASSERT(mrl_st_find(st, t.name, &u) == MRL_OK && u.data == t.data && mrl_st_has(st, t.name));
        if (t.numel > (1 << 16)) continue;
        float *dst = malloc((size_t)(t.numel + 1) * sizeof(float));
        dst[t.numel] = 12345.f;
        mrl_status s = mrl_st_read_f32(st, t.name, dst, t.numel);
        FUZZ_ASSERT(dst[t.numel] == 12345.f); /* no float written past numel */
        if (t.dtype == MRL_DTYPE_F32 || t.dtype == MRL_DTYPE_BF16 || t.dtype == MRL_DTYPE_F16) FUZZ_ASSERT(s == MRL_OK);
        if (t.numel > 0) FUZZ_ASSERT(mrl_st_read_f32(st, t.name, dst, t.numel - 1) != MRL_OK);
        /* ranges (chosen from the input's bytes) read as the same slice of the full read; past
         * the end or negative, an error */
        if (s == MRL_OK) {
            float *part = malloc((size_t)(t.numel + 1) * sizeof(float));
            for (int k = 0; k < 4; k++) {
                uint32_t r = (uint32_t)(size * 2654435761u) ^ (uint32_t)(i * 40503u + k * 97u);
                int64_t first = t.numel ? (int64_t)(r % (uint32_t)(t.numel + 1)) : 0;
                int64_t count = (int64_t)((r >> 7) % (uint32_t)(t.numel - first + 1));
                part[count] = 12345.f;
                FUZZ_ASSERT(mrl_st_read_f32_range(st, t.name, first, count, part) == MRL_OK);
                FUZZ_ASSERT(memcmp(part, dst + first, (size_t)count * sizeof(float)) == 0 && part[count] == 12345.f);
                FUZZ_ASSERT(mrl_st_read_f32_range(st, t.name, first, t.numel - first + 1, part) == MRL_ERR_INVALID);
                FUZZ_ASSERT(mrl_st_read_f32_range(st, t.name, -1 - first, count, part) == MRL_ERR_INVALID);
            }
            free(part);
        }
        free(dst);
    }
    mrl_st_metadata(st, "format");
    mrl_st_metadata(st, "");
    mrl_st_close(st);
    return 0;
}
