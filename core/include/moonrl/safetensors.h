/* Reading and writing safetensors files (the Hugging Face weight format).
 *
 * Reader: a single .safetensors file, or a model directory holding either
 * model.safetensors or shards named by model.safetensors.index.json. Files
 * are memory-mapped read-only and every header field is checked against
 * the file size before use; errors name the file and the tensor or field.
 *
 * Writer: collects tensors (fp32 sources converted to F32/BF16/F16 on
 * write), writes one file or a sharded directory atomically (temporary
 * file, fsync, rename), laid out as the Python safetensors library does;
 * or streams a sharded directory out one tensor at a time (mrl_st_stream_*). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "status.h"
#include "dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MRL_ST_MAX_DIMS = 8 };

typedef struct mrl_st mrl_st; /* an open file or model directory */

typedef struct mrl_st_tensor {
    const char *name;      /* valid until mrl_st_close */
    mrl_dtype dtype;
    int ndim;
    int64_t shape[8];      /* shape[0..ndim) */
    int64_t numel;         /* product of the shape (1 for a scalar) */
    const void *data;      /* the mapped bytes (little-endian, may be unaligned) */
    int64_t bytes;         /* numel * mrl_dtype_size(dtype) */
    int shard;             /* which file of a sharded model (0 otherwise) */
} mrl_st_tensor;

/* Open a .safetensors file or a model directory (see above). */
mrl_status mrl_st_open(const char *path, mrl_st **out);
void mrl_st_close(mrl_st *st);
/* Number of tensors (all shards together). */
int64_t mrl_st_count(const mrl_st *st);
/* Tensor by index in [0, count): tensors are listed sorted by name. */
mrl_status mrl_st_info(const mrl_st *st, int64_t index, mrl_st_tensor *out);
/* Tensor by name; MRL_ERR_INVALID naming the tensor and file when absent. */
mrl_status mrl_st_find(const mrl_st *st, const char *name, mrl_st_tensor *out);
/* 1 when the tensor exists, else 0. */
int mrl_st_has(const mrl_st *st, const char *name);
/* Copy a F32 / BF16 / F16 tensor into dst as fp32 (exact conversions);
 * numel must equal the tensor's element count. Reads the file (pread), not
 * the mapping: a file truncated since it was opened is MRL_ERR_IO naming it
 * (reading `data` of such a file directly raises SIGBUS). */
mrl_status mrl_st_read_f32(const mrl_st *st, const char *name, float *dst, int64_t numel);
/* Elements [first, first + count) of the tensor, flattened in row-major
 * order, into dst[0..count) as fp32 (F32 / BF16 / F16, as mrl_st_read_f32).
 * Reads those bytes alone from the file (pread), whatever the tensor's size.
 * A range outside [0, numel) (negative first or count, first + count past
 * numel or overflowing) is MRL_ERR_INVALID naming the file, tensor and range. */
mrl_status mrl_st_read_f32_range(const mrl_st *st, const char *name, int64_t first, int64_t count, float *dst);
/* A value of the __metadata__ map (first shard that has the key), or NULL. */
const char *mrl_st_metadata(const mrl_st *st, const char *key);

typedef struct mrl_st_writer mrl_st_writer;

mrl_status mrl_st_writer_create(mrl_st_writer **out);
void mrl_st_writer_free(mrl_st_writer *w);
/* Add a tensor stored as dtype (F32, BF16 or F16) from fp32 values src
 * (numel = product of shape). src is NOT copied: it must stay valid and
 * unchanged until mrl_st_writer_write / _write_dir returns. */
mrl_status mrl_st_writer_add(mrl_st_writer *w, const char *name, mrl_dtype dtype, int ndim,
                             const int64_t *shape, const float *src);
/* Add a tensor from bytes already in dtype (any dtype; bytes must equal
 * numel * size). Not copied either. */
mrl_status mrl_st_writer_add_raw(mrl_st_writer *w, const char *name, mrl_dtype dtype, int ndim,
                                 const int64_t *shape, const void *data, int64_t bytes);
/* Set a __metadata__ entry (copied; a key set twice keeps the last value). */
mrl_status mrl_st_writer_set_metadata(mrl_st_writer *w, const char *key, const char *value);
/* Write one .safetensors file at path, atomically. */
mrl_status mrl_st_writer_write(mrl_st_writer *w, const char *path);
/* Write into directory dir (created if missing): model.safetensors when
 * everything fits in max_shard_bytes (0: no limit), else
 * model-0000i-of-0000N.safetensors shards plus model.safetensors.index.json
 * (metadata.total_size and weight_map), each file atomically. What an earlier
 * write into dir left of the other layout (the single file or the index, the
 * shards of another count) is removed, as by mrl_st_stream_finish. */
mrl_status mrl_st_writer_write_dir(mrl_st_writer *w, const char *dir, int64_t max_shard_bytes);

/* Streamed writing into a model directory, for a model whose tensors are
 * produced one at a time and never held all together (a sharded model
 * gathered layer by layer). Declare every tensor first (name, dtype, shape:
 * no data), then write each tensor's data once, in any order; the first
 * write closes the declarations. Files and layout are those of
 * mrl_st_writer_write_dir, but shards are filled in declaration order (as
 * transformers' save_pretrained fills them in state-dict order):
 * model-0000K-of-0000N.safetensors of at most max_shard_bytes of tensor data
 * each (0: no limit; a larger tensor gets a shard of its own), or
 * model.safetensors when one holds everything. A shard is written to a
 * temporary file and fsync'ed and renamed into place as soon as its last
 * tensor is written; mrl_st_stream_finish then writes
 * model.safetensors.index.json (metadata.total_size, weight_map). Writing in
 * declaration order keeps one file open at a time. Each file is atomic, the
 * directory as a whole is not: write into a new directory. */
typedef struct mrl_st_stream mrl_st_stream;

/* Start a stream into dir (created if missing). */
mrl_status mrl_st_stream_open(const char *dir, int64_t max_shard_bytes, mrl_st_stream **out);
/* Declare the next tensor (any dtype); MRL_ERR_INVALID after the first write. */
mrl_status mrl_st_stream_declare(mrl_st_stream *st, const char *name, mrl_dtype dtype, int ndim, const int64_t *shape);
/* A __metadata__ entry of every file (copied), before the first write. */
mrl_status mrl_st_stream_set_metadata(mrl_st_stream *st, const char *key, const char *value);
/* Write a declared tensor from numel fp32 values, converted to its dtype
 * (F32, BF16 or F16). src is not kept: it may be reused when this returns. */
mrl_status mrl_st_stream_write(mrl_st_stream *st, const char *name, const float *src, int64_t numel);
/* Write a declared tensor from bytes already in its dtype (numel * size). */
mrl_status mrl_st_stream_write_raw(mrl_st_stream *st, const char *name, const void *data, int64_t bytes);
/* Check that every declared tensor was written, then write the index. An
 * I/O error on any call ends the stream: only _free is left. */
mrl_status mrl_st_stream_finish(mrl_st_stream *st);
/* Free the stream; a shard still being written has its temporary file removed. */
void mrl_st_stream_free(mrl_st_stream *st);

#ifdef __cplusplus
}
#endif
