/* Datasets: a one-pass line index of a text file (JSONL) and deterministic
 * permutations. The records themselves are read and decoded in Lua
 * (lua/moonrl/data.lua): seek to a line's offset, read its bytes.
 *
 * The index records every non-blank line (a line holding only spaces, tabs
 * and '\r' is blank): its byte offset, its length without the line end
 * ('\n' or "\r\n"), and its 1-based line number in the file. Memory: 24
 * bytes a line; the file itself is never held in memory. */
#pragma once
#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mrl_line_index mrl_line_index;

/* Scan `path` once and index its non-blank lines. */
mrl_status mrl_line_index_build(const char *path, mrl_line_index **out);
void mrl_line_index_free(mrl_line_index *index);
/* Number of indexed (non-blank) lines. */
int64_t mrl_line_index_count(const mrl_line_index *index);
/* Size of the file in bytes when it was indexed. */
int64_t mrl_line_index_file_size(const mrl_line_index *index);
/* Arrays of mrl_line_index_count entries, owned by the index. */
const int64_t *mrl_line_index_offsets(const mrl_line_index *index);
const int64_t *mrl_line_index_lengths(const mrl_line_index *index);
const int64_t *mrl_line_index_numbers(const mrl_line_index *index);

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
