/* One pass over a text file recording where each non-blank line starts. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "moonrl/data.h"
#include "moonrl/mem.h"
#include "base/error.h"
#include "io/write.h"

#define READ_CHUNK (1 << 20)

struct mrl_line_index {
    int64_t count, capacity, file_size;
    int64_t *offsets, *lengths, *numbers;
};

static mrl_status grow(mrl_line_index *ix, const char *path) {
    int64_t cap = ix->capacity ? ix->capacity * 2 : 1024;
    int64_t *arrays[3] = {ix->offsets, ix->lengths, ix->numbers};
    int64_t *fresh[3] = {NULL, NULL, NULL};
    for (int a = 0; a < 3; a++) {
        fresh[a] = mrl_mem_alloc((size_t)cap * sizeof(int64_t), MRL_MEM_OTHER);
        if (!fresh[a]) {
            for (int b = 0; b < a; b++) mrl_mem_free(fresh[b]);
            return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory indexing %lld lines", path, (long long)cap);
        }
        if (ix->count) memcpy(fresh[a], arrays[a], (size_t)ix->count * sizeof(int64_t));
        mrl_mem_free(arrays[a]);
    }
    ix->offsets = fresh[0];
    ix->lengths = fresh[1];
    ix->numbers = fresh[2];
    ix->capacity = cap;
    return MRL_OK;
}

/* Record the line [start, end) (end excludes '\n'; a trailing '\r' is dropped). */
static mrl_status add_line(mrl_line_index *ix, const char *path, int64_t start, int64_t end, int64_t number,
                           int has_cr) {
    if (has_cr) end--;
    if (ix->count == ix->capacity) {
        mrl_status st = grow(ix, path);
        if (st) return st;
    }
    ix->offsets[ix->count] = start;
    ix->lengths[ix->count] = end - start;
    ix->numbers[ix->count] = number;
    ix->count++;
    return MRL_OK;
}

mrl_status mrl_line_index_build(const char *path, mrl_line_index **out) {
    if (!path || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_line_index_build: NULL argument");
    *out = NULL;
    FILE *f;
    mrl_status opened = mrl_io_fopen_read(path, &f);
    if (opened) return opened;
    mrl_line_index *ix = mrl_mem_alloc(sizeof *ix, MRL_MEM_OTHER);
    char *buf = mrl_mem_alloc(READ_CHUNK, MRL_MEM_OTHER);
    if (!ix || !buf) {
        fclose(f);
        mrl_mem_free(ix);
        mrl_mem_free(buf);
        return mrl_set_error(MRL_ERR_NOMEM, "%s: out of memory", path);
    }
    mrl_status st = MRL_OK;
    int64_t pos = 0, line_start = 0, line_number = 1;
    int blank = 1, last_cr = 0;
    size_t got;
    while (st == MRL_OK && (got = fread(buf, 1, READ_CHUNK, f)) > 0) {
        size_t i = 0;
        while (i < got) {
            /* until the line shows a non-blank byte, look at each byte */
            while (blank && i < got && buf[i] != '\n') {
                char c = buf[i++];
                last_cr = c == '\r';
                if (c != ' ' && c != '\t' && c != '\r') blank = 0;
            }
            if (i == got) break;
            /* then jump to the line end */
            const char *nl = buf[i] == '\n' ? buf + i : memchr(buf + i, '\n', got - i);
            if (!nl) {
                last_cr = buf[got - 1] == '\r';
                break;
            }
            size_t at = (size_t)(nl - buf);
            if (at > i) last_cr = buf[at - 1] == '\r';
            if (!blank) st = add_line(ix, path, line_start, pos + (int64_t)at, line_number, last_cr);
            if (st) break;
            line_start = pos + (int64_t)at + 1;
            line_number++;
            blank = 1;
            last_cr = 0;
            i = at + 1;
        }
        pos += (int64_t)got;
    }
    if (st == MRL_OK && ferror(f)) st = mrl_set_error(MRL_ERR_IO, "%s: read error: %s", path, strerror(errno));
    if (st == MRL_OK && !blank) st = add_line(ix, path, line_start, pos, line_number, last_cr);
    fclose(f);
    mrl_mem_free(buf);
    ix->file_size = pos;
    if (st) {
        mrl_line_index_free(ix);
        return st;
    }
    *out = ix;
    return MRL_OK;
}

void mrl_line_index_free(mrl_line_index *ix) {
    if (!ix) return;
    mrl_mem_free(ix->offsets);
    mrl_mem_free(ix->lengths);
    mrl_mem_free(ix->numbers);
    mrl_mem_free(ix);
}

int64_t mrl_line_index_count(const mrl_line_index *ix) { return ix ? ix->count : 0; }
int64_t mrl_line_index_file_size(const mrl_line_index *ix) { return ix ? ix->file_size : 0; }
const int64_t *mrl_line_index_offsets(const mrl_line_index *ix) { return ix ? ix->offsets : NULL; }
const int64_t *mrl_line_index_lengths(const mrl_line_index *ix) { return ix ? ix->lengths : NULL; }
const int64_t *mrl_line_index_numbers(const mrl_line_index *ix) { return ix ? ix->numbers : NULL; }
