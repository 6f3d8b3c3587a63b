/* Reading GGUF files (llama.cpp's model format, what Ollama and LM Studio
 * users hold): the header, the metadata key/value pairs and the tensors,
 * dequantized to fp32.
 *
 * Every count, length and offset of the header is checked against the file
 * size before it is used, so a corrupt or truncated file is an error naming
 * the file and the field, never a crash or a huge allocation. The tensors are
 * checked against each other as llama.cpp's loader does: their data follow
 * one another in the order of their infos, each where the one before it ends
 * (aligned), so no two overlap and none is longer than its place; no key or
 * tensor name appears twice. The header is
 * read into memory with pread; tensor data is read with pread when asked for
 * (a file truncated after it was opened is MRL_ERR_IO, not SIGBUS).
 *
 * Shapes are as GGUF stores them: shape[0] is the fastest-varying dimension
 * (ggml's ne[0]), so a weight W [out, in] of PyTorch is shape {in, out}.
 * Tensor types are ggml's numbers (MRL_GGML_*); dequantization of F32, F16,
 * BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K follows ggml's reference
 * (dequantize_row_*), in the same float operations, so it gives the bits of
 * the gguf Python package's dequantize. */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_gguf mrl_gguf;

/* Metadata value types (the file's numbers). */
typedef enum mrl_gguf_value_type {
    MRL_GGUF_UINT8 = 0, MRL_GGUF_INT8 = 1, MRL_GGUF_UINT16 = 2, MRL_GGUF_INT16 = 3,
    MRL_GGUF_UINT32 = 4, MRL_GGUF_INT32 = 5, MRL_GGUF_FLOAT32 = 6, MRL_GGUF_BOOL = 7,
    MRL_GGUF_STRING = 8, MRL_GGUF_ARRAY = 9, MRL_GGUF_UINT64 = 10, MRL_GGUF_INT64 = 11,
    MRL_GGUF_FLOAT64 = 12
} mrl_gguf_value_type;

/* Tensor types (ggml_type numbers) that can be read. */
typedef enum mrl_ggml_type {
    MRL_GGML_F32 = 0, MRL_GGML_F16 = 1, MRL_GGML_Q4_0 = 2, MRL_GGML_Q4_1 = 3, MRL_GGML_Q8_0 = 8,
    MRL_GGML_Q4_K = 12, MRL_GGML_Q5_K = 13, MRL_GGML_Q6_K = 14, MRL_GGML_BF16 = 30
} mrl_ggml_type;

typedef struct mrl_gguf_tensor {
    const char *name;     /* valid until mrl_gguf_close */
    int type;             /* ggml_type (mrl_ggml_type) */
    const char *type_name; /* "Q4_K", ... */
    int ndim;             /* 1..4 */
    int64_t shape[4];     /* shape[0] fastest (ggml ne[0]) */
    int64_t numel;
    int64_t offset;       /* of its data in the file */
    int64_t bytes;        /* of its data */
} mrl_gguf_tensor;

mrl_status mrl_gguf_open(const char *path, mrl_gguf **out);
void mrl_gguf_close(mrl_gguf *g);
int mrl_gguf_version(const mrl_gguf *g);

/* Metadata: pairs 0..count-1 in file order; find gives the index of a key or -1. */
int64_t mrl_gguf_kv_count(const mrl_gguf *g);
int64_t mrl_gguf_find_kv(const mrl_gguf *g, const char *key);
const char *mrl_gguf_kv_key(const mrl_gguf *g, int64_t i);
/* The value's type; for an array MRL_GGUF_ARRAY, with its element type and length. */
int mrl_gguf_kv_type(const mrl_gguf *g, int64_t i);
int mrl_gguf_kv_array_type(const mrl_gguf *g, int64_t i);
int64_t mrl_gguf_kv_array_len(const mrl_gguf *g, int64_t i);
/* A number (any integer, float or bool type) as a double: the scalar value
 * (j = -1) or element j of an array of numbers. 64-bit integers beyond 2^53
 * lose precision (none of GGUF's known keys hold one). */
mrl_status mrl_gguf_kv_number(const mrl_gguf *g, int64_t i, int64_t j, double *out);
/* A string (not NUL-terminated: *len bytes): the scalar (j = -1) or element j of an array of strings. */
mrl_status mrl_gguf_kv_string(const mrl_gguf *g, int64_t i, int64_t j, const char **s, int64_t *len);

/* Tensors: 0..count-1 in file order; find gives the index of a name or -1. */
int64_t mrl_gguf_tensor_count(const mrl_gguf *g);
int64_t mrl_gguf_find_tensor(const mrl_gguf *g, const char *name);
mrl_status mrl_gguf_tensor_info(const mrl_gguf *g, int64_t i, mrl_gguf_tensor *out);
/* Tensor i dequantized into dst (numel floats, which must be its count).
 * MRL_ERR_FORMAT naming the tensor when a value comes out NaN or infinite. */
mrl_status mrl_gguf_read_f32(const mrl_gguf *g, int64_t i, float *dst, int64_t numel);

/* Tensor i's bytes as the file holds them into dst (bytes, which must be its size): a Q4_0,
 * Q4_1 or Q8_0 tensor's blocks (a quantized base keeps them, mrl_model_create_quantized).
 * MRL_ERR_FORMAT naming the tensor when a block's scale (or minimum) is a NaN or an infinity. */
mrl_status mrl_gguf_read_raw(const mrl_gguf *g, int64_t i, void *dst, int64_t bytes);

/* Dequantize n elements (a multiple of the block size) of `type` from
 * src_bytes bytes (which must be exactly n / block size blocks). */
mrl_status mrl_ggml_dequantize(int type, const void *src, int64_t src_bytes, float *dst, int64_t n);

#ifdef __cplusplus
}
#endif
