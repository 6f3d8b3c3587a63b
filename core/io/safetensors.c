/* safetensors reader and writer (stub: being filled in). */
#include <stdlib.h>
#include "moonrl/safetensors.h"

struct mrl_st { int unused; };
struct mrl_st_writer { int unused; };

#define TODO(fn) return mrl_set_error(MRL_ERR_UNSUPPORTED, fn ": not implemented yet")
mrl_status mrl_st_open(const char *path, mrl_st **out) { if (out) *out = NULL; TODO("st_open"); }
void mrl_st_close(mrl_st *st) { free(st); }
int64_t mrl_st_count(const mrl_st *st) { return 0; }
mrl_status mrl_st_info(const mrl_st *st, int64_t index, mrl_st_tensor *out) { TODO("st_info"); }
mrl_status mrl_st_find(const mrl_st *st, const char *name, mrl_st_tensor *out) { TODO("st_find"); }
int mrl_st_has(const mrl_st *st, const char *name) { return 0; }
mrl_status mrl_st_read_f32(const mrl_st *st, const char *name, float *dst, int64_t numel) { TODO("st_read_f32"); }
const char *mrl_st_metadata(const mrl_st *st, const char *key) { return NULL; }
const char *mrl_st_path(const mrl_st *st) { return ""; }
mrl_status mrl_st_writer_create(mrl_st_writer **out) { if (out) *out = NULL; TODO("st_writer_create"); }
void mrl_st_writer_free(mrl_st_writer *w) { free(w); }
mrl_status mrl_st_writer_add(mrl_st_writer *w, const char *name, mrl_dtype dtype, int ndim, const int64_t *shape,
                             const float *src) { TODO("st_writer_add"); }
mrl_status mrl_st_writer_add_raw(mrl_st_writer *w, const char *name, mrl_dtype dtype, int ndim, const int64_t *shape,
                                 const void *data, int64_t bytes) { TODO("st_writer_add_raw"); }
mrl_status mrl_st_writer_set_metadata(mrl_st_writer *w, const char *key, const char *value) { TODO("st_writer_set_metadata"); }
mrl_status mrl_st_writer_write(mrl_st_writer *w, const char *path) { TODO("st_writer_write"); }
mrl_status mrl_st_writer_write_dir(mrl_st_writer *w, const char *dir, int64_t max_shard_bytes) { TODO("st_writer_write_dir"); }
