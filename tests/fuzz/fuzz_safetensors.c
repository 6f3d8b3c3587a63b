/* core/io/safetensors.c, one file: the u64 header length, the JSON header,
 * each tensor's dtype, shape and data_offsets checked against the file.
 * Input: the whole file. Properties: each tensor opened lies inside the
 * file with bytes = numel * dtype size, is found by its name, and reads
 * (F32 / BF16 / F16) into exactly its numel floats. */
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
        free(dst);
    }
    mrl_st_metadata(st, "format");
    mrl_st_metadata(st, "");
    mrl_st_close(st);
    return 0;
}
