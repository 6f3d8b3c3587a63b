/* A line index of a text file, built in one streaming pass at 8 bytes a
 * line: where each non-blank line starts. Its end is where the next one
 * starts (less the '\n'), so it is not stored; nor is its line number, which
 * is its row + 1 until a blank line comes. Blank lines, rare in JSONL, are
 * the exception recorded apart (a gap: where the line before them ended, and
 * how many blank lines there have been so far).
 *
 * Rows are kept in blocks that are never moved, so the index grows without
 * copying and never holds more than one block it does not need. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "moonrl/data.h"
#include "moonrl/mem.h"
#include "base/error.h"
#include "io/write.h"

#define READ_CHUNK (1 << 20)
#define BLOCK_BITS 16
#define BLOCK_ROWS ((int64_t)1 << BLOCK_BITS)

/* Blank lines before row `row` (and after row - 1, which ended at `end`,
 * the position of its '\r' or '\n'); `blanks`: all blank lines before row. */
typedef struct gap {
    int64_t row, end, blanks;
} gap;

struct mrl_line_index {
    char *path;
    FILE *file;
    int64_t file_size, pos; /* bytes in the file, and scanned so far */
    int64_t count;          /* rows so far */
    /* start of each row << 1, | 1 when it ends in "\r\n"; one entry past the
     * last row: where a line after it would start */
    int64_t **blocks;
    int64_t n_blocks, cap_blocks;
    gap *gaps;
    int64_t n_gaps, cap_gaps;
    char *buf;
    /* the line being scanned: its start, whether only blank bytes
     * were seen, whether its last byte was '\r'; blank lines since the last row */
    int64_t line_start, pending_blanks, last_end;
    int blank, last_cr;
};

static int64_t *slot(const mrl_line_index *ix, int64_t row) {
    return &ix->blocks[row >> BLOCK_BITS][row & (BLOCK_ROWS - 1)];
}

/* make room for entry `row` of the blocks */
static mrl_status reserve_row(mrl_line_index *ix, int64_t row) {
    int64_t b = row >> BLOCK_BITS;
    if (b < ix->n_blocks) return MRL_OK;
    if (b == ix->cap_blocks) {
        int64_t cap = ix->cap_blocks ? ix->cap_blocks * 2 : 64;
        int64_t **grown = mrl_mem_alloc((size_t)cap * sizeof *grown, MRL_MEM_OTHER);
        if (!grown) return mrl_wrap_error(MRL_ERR_NOMEM, "%s: indexing %lld lines", ix->path, (long long)row);
        if (ix->n_blocks) memcpy(grown, ix->blocks, (size_t)ix->n_blocks * sizeof *grown);
        mrl_mem_free(ix->blocks);
        ix->blocks = grown;
        ix->cap_blocks = cap;
    }
    ix->blocks[b] = mrl_mem_alloc((size_t)BLOCK_ROWS * sizeof(int64_t), MRL_MEM_OTHER);
    if (!ix->blocks[b]) return mrl_wrap_error(MRL_ERR_NOMEM, "%s: indexing %lld lines", ix->path, (long long)row);
    ix->n_blocks++;
    return MRL_OK;
}

static mrl_status add_gap(mrl_line_index *ix, int64_t row, int64_t end, int64_t blanks) {
    if (ix->n_gaps == ix->cap_gaps) {
        int64_t cap = ix->cap_gaps ? ix->cap_gaps * 2 : 16;
        gap *grown = mrl_mem_alloc((size_t)cap * sizeof *grown, MRL_MEM_OTHER);
        if (!grown) return mrl_wrap_error(MRL_ERR_NOMEM, "%s: indexing blank lines", ix->path);
        if (ix->n_gaps) memcpy(grown, ix->gaps, (size_t)ix->n_gaps * sizeof *grown);
        mrl_mem_free(ix->gaps);
        ix->gaps = grown;
        ix->cap_gaps = cap;
    }
    ix->gaps[ix->n_gaps++] = (gap){row, end, blanks};
    return MRL_OK;
}

/* The line [line_start, end) ended (end: its '\n', or the end of the file). */
static mrl_status end_line(mrl_line_index *ix, int64_t end) {
    if (ix->blank) {
        ix->pending_blanks++;
        return MRL_OK;
    }
    mrl_status st = reserve_row(ix, ix->count + 1); /* (the entry past it too) */
    if (st) return st;
    if (ix->pending_blanks) {
        int64_t before = ix->n_gaps ? ix->gaps[ix->n_gaps - 1].blanks : 0;
        st = add_gap(ix, ix->count, ix->last_end, before + ix->pending_blanks);
        if (st) return st;
        ix->pending_blanks = 0;
    }
    *slot(ix, ix->count) = ix->line_start << 1 | (int64_t)ix->last_cr;
    ix->count++;
    *slot(ix, ix->count) = (end + 1) << 1; /* where the next row starts when no blank line comes */
    ix->last_end = end - ix->last_cr;
    return MRL_OK;
}

void mrl_line_index_free(mrl_line_index *ix) {
    if (!ix) return;
    if (ix->file) fclose(ix->file);
    for (int64_t b = 0; b < ix->n_blocks; b++) mrl_mem_free(ix->blocks[b]);
    mrl_mem_free(ix->blocks);
    mrl_mem_free(ix->gaps);
    mrl_mem_free(ix->buf);
    mrl_mem_free(ix->path);
    mrl_mem_free(ix);
}

mrl_status mrl_line_index_open(const char *path, mrl_line_index **out) {
    if (!path || !out) return mrl_set_error(MRL_ERR_INVALID, "mrl_line_index_open: NULL argument");
    *out = NULL;
    FILE *f;
    mrl_status st = mrl_io_fopen_read(path, &f);
    if (st) return st;
    mrl_line_index *ix = mrl_mem_alloc(sizeof *ix, MRL_MEM_OTHER);
    if (ix) {
        memset(ix, 0, sizeof *ix);
        ix->file = f;
        ix->path = mrl_mem_alloc(strlen(path) + 1, MRL_MEM_OTHER);
        ix->buf = mrl_mem_alloc(READ_CHUNK, MRL_MEM_OTHER);
    } else {
        fclose(f);
    }
    if (!ix || !ix->path || !ix->buf) {
        mrl_line_index_free(ix);
        return mrl_wrap_error(MRL_ERR_NOMEM, "%s", path);
    }
    strcpy(ix->path, path);
    if (reserve_row(ix, 0)) { /* (its error names the path) */
        mrl_line_index_free(ix);
        return MRL_ERR_NOMEM;
    }
    if (fseeko(f, 0, SEEK_END) == 0) ix->file_size = ftello(f);
    rewind(f);
    *slot(ix, 0) = 0;
    ix->blank = 1;
    *out = ix;
    return MRL_OK;
}

/* Scan what the file holds from ix->pos, at most about max_bytes more. */
mrl_status mrl_line_index_scan(mrl_line_index *ix, int64_t max_bytes, int *done) {
    *done = ix->file == NULL;
    if (*done) return MRL_OK;
    int64_t until = ix->pos + (max_bytes > 0 ? max_bytes : INT64_MAX - ix->pos);
    mrl_status st = MRL_OK;
    size_t got = 0;
    char *buf = ix->buf;
    while (st == MRL_OK && ix->pos < until && (got = fread(buf, 1, READ_CHUNK, ix->file)) > 0) {
        size_t i = 0;
        while (i < got) {
            /* until the line shows a non-blank byte, look at each byte */
            while (ix->blank && i < got && buf[i] != '\n') {
                char c = buf[i++];
                ix->last_cr = c == '\r';
                if (c != ' ' && c != '\t' && c != '\r') ix->blank = 0;
            }
            if (i == got) break;
            /* then jump to the line end */
            const char *nl = buf[i] == '\n' ? buf + i : memchr(buf + i, '\n', got - i);
            if (!nl) {
                ix->last_cr = buf[got - 1] == '\r';
                break;
            }
            size_t at = (size_t)(nl - buf);
            if (at > i) ix->last_cr = buf[at - 1] == '\r';
            st = end_line(ix, ix->pos + (int64_t)at);
            if (st) break;
            ix->line_start = ix->pos + (int64_t)at + 1;
            ix->blank = 1;
            ix->last_cr = 0;
            i = at + 1;
        }
        ix->pos += (int64_t)got;
    }
    if (st == MRL_OK && ferror(ix->file)) st = mrl_set_error(MRL_ERR_IO, "%s: read error: %s", ix->path, strerror(errno));
    if (st) return st;
    if (got == 0 || feof(ix->file)) { /* the end: a last line without '\n' counts too */
        if (ix->line_start < ix->pos) st = end_line(ix, ix->pos);
        fclose(ix->file);
        ix->file = NULL;
        ix->file_size = ix->pos;
        mrl_mem_free(ix->buf);
        ix->buf = NULL;
        *done = 1;
    }
    return st;
}

mrl_status mrl_line_index_build(const char *path, mrl_line_index **out) {
    mrl_line_index *ix;
    mrl_status st = mrl_line_index_open(path, &ix);
    if (st) return st;
    int done = 0;
    st = mrl_line_index_scan(ix, 0, &done);
    if (st) {
        mrl_line_index_free(ix);
        return st;
    }
    *out = ix;
    return MRL_OK;
}

int64_t mrl_line_index_count(const mrl_line_index *ix) { return ix ? ix->count : 0; }
int64_t mrl_line_index_file_size(const mrl_line_index *ix) { return ix ? ix->file_size : 0; }
int64_t mrl_line_index_scanned(const mrl_line_index *ix) { return ix ? ix->pos : 0; }

int64_t mrl_line_index_bytes(const mrl_line_index *ix) {
    if (!ix) return 0;
    return (int64_t)sizeof *ix + ix->n_blocks * BLOCK_ROWS * (int64_t)sizeof(int64_t) +
           ix->cap_blocks * (int64_t)sizeof(int64_t *) + ix->cap_gaps * (int64_t)sizeof(gap);
}

/* the last gap at or before row (NULL: none) */
static const gap *gap_before(const mrl_line_index *ix, int64_t row) {
    int64_t lo = 0, hi = ix->n_gaps; /* first gap with .row > row */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (ix->gaps[mid].row <= row) lo = mid + 1;
        else hi = mid;
    }
    return lo > 0 ? &ix->gaps[lo - 1] : NULL;
}

int mrl_line_index_get(const mrl_line_index *ix, int64_t row, mrl_line *out) {
    if (!ix || !out || row < 0 || row >= ix->count || ix->file) return -1;
    int64_t here = *slot(ix, row), start = here >> 1;
    const gap *g = gap_before(ix, row + 1);
    int64_t end = g && g->row == row + 1 ? g->end : (*slot(ix, row + 1) >> 1) - 1 - (here & 1);
    g = gap_before(ix, row);
    out->offset = start;
    out->length = end - start;
    out->number = row + 1 + (g ? g->blanks : 0);
    return 0;
}
