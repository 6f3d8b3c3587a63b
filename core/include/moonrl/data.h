/* Datasets: a one-pass line index of a text file (JSONL) and deterministic
 * permutations. The records themselves are read and decoded in Lua
 * (lua/moonrl/data.lua): seek to a line's offset, read its bytes.
 *
 * The index records every non-blank line (a line holding only spaces, tabs
 * and '\r' is blank): its byte offset, its length without the line end
 * ('\n' or "\r\n"), and its 1-based line number in the file. Memory: 8
 * bytes a line (and 24 a run of blank lines); the file itself is never held
 * in memory. */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_line_index mrl_line_index;

/* One indexed line. */
typedef struct mrl_line {
    int64_t offset; /* of its first byte in the file */
    int64_t length; /* in bytes, without the line end */
    int64_t number; /* 1-based, counting blank lines too */
} mrl_line;

/* Scan `path` once and index its non-blank lines. */
mrl_status mrl_line_index_build(const char *path, mrl_line_index **out);
/* The same in steps, so that a caller can show how far it is: open the file
 * (a regular file, else an error naming it), then scan about max_bytes more
 * a call (0: to the end) until *done. The file is closed when done. */
mrl_status mrl_line_index_open(const char *path, mrl_line_index **out);
mrl_status mrl_line_index_scan(mrl_line_index *index, int64_t max_bytes, int *done);
/* Bytes scanned so far, and the file's size (at open; when done, what the
 * scan read). */
int64_t mrl_line_index_scanned(const mrl_line_index *index);
int64_t mrl_line_index_file_size(const mrl_line_index *index);
void mrl_line_index_free(mrl_line_index *index);
/* Number of indexed (non-blank) lines. */
int64_t mrl_line_index_count(const mrl_line_index *index);
/* Line `row` (0-based among the indexed ones) of a finished index into *out;
 * 0, or -1 for a row out of range or an index still scanning. */
int mrl_line_index_get(const mrl_line_index *index, int64_t row, mrl_line *out);
/* Bytes of memory the index holds. */
int64_t mrl_line_index_bytes(const mrl_line_index *index);

/* The seed of a permutation derived from x: splitmix64's first output from
 * state x. A dataset view takes its epoch's and its split's seeds so
 * (lua/moonrl/data.lua), which makes them part of the data order. */
uint64_t mrl_data_mix_seed(uint64_t x);
/* out[0..n) = a uniformly random permutation of 0..n-1, fully determined by
 * seed: a Fisher-Yates shuffle (i from n-1 down to 1, j uniform in [0, i]
 * by rejection sampling) drawing from xoshiro256** whose state is four
 * splitmix64 outputs starting from seed. */
mrl_status mrl_data_permutation(uint64_t seed, int64_t n, int64_t *out);

#ifdef __cplusplus
}
#endif
