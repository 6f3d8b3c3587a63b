/* The JSONL line index: offsets, lengths and line numbers of non-blank
 * lines against a plain scan of the same bytes; CRLF endings, no final
 * newline, blank lines first, last and in runs, a line longer than the read
 * chunk, scanning in steps, empty files, missing files. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "moonrl/data.h"
#include "moonrl/status.h"
#include "check.h"

static char path[64];

static mrl_line_index *index_of(const char *text) {
    FILE *f = fopen(path, "wb");
    fputs(text, f);
    fclose(f);
    mrl_line_index *ix = NULL;
    CHECK_OK(mrl_line_index_build(path, &ix));
    return ix;
}

static mrl_line line_of(const mrl_line_index *ix, int64_t row) {
    mrl_line l = {-1, -1, -1};
    CHECK(mrl_line_index_get(ix, row, &l) == 0);
    return l;
}

/* Rows of ix that differ from a plain scan of text (n bytes), plus the
 * difference in counts. */
static int64_t differences(const mrl_line_index *ix, const char *text, size_t n) {
    int64_t want = 0, bad = 0, line = 1, start = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && text[i] != '\n') continue;
        if (i == n && start == (int64_t)n) break; /* (nothing after the last newline) */
        int64_t end = (int64_t)i;
        if (end > start && text[end - 1] == '\r') end--;
        int blank = 1;
        for (int64_t k = start; k < end; k++) if (text[k] != ' ' && text[k] != '\t' && text[k] != '\r') blank = 0;
        if (!blank) {
            mrl_line l = {-1, -1, -1};
            if (mrl_line_index_get(ix, want, &l) != 0 || l.offset != start || l.length != end - start || l.number != line)
                bad++;
            want++;
        }
        start = (int64_t)i + 1;
        line++;
    }
    return bad + (mrl_line_index_count(ix) > want ? mrl_line_index_count(ix) - want : want - mrl_line_index_count(ix));
}

static void check_text(const char *text) {
    mrl_line_index *ix = index_of(text);
    CHECK(differences(ix, text, strlen(text)) == 0);
    mrl_line_index_free(ix);
}

int main(void) {
    snprintf(path, sizeof path, "/tmp/mrl_lines_%d.jsonl", (int)getpid());
    mrl_line_index *ix = index_of("{\"a\":1}\n\n  \t\n{\"b\":22}\r\n{\"c\":3}");
    CHECK(mrl_line_index_count(ix) == 3);
    mrl_line l0 = line_of(ix, 0), l1 = line_of(ix, 1), l2 = line_of(ix, 2), none;
    CHECK(l0.offset == 0 && l0.length == 7 && l0.number == 1);
    CHECK(l1.offset == 13 && l1.length == 8 && l1.number == 4); /* "\r" is not part of the line */
    CHECK(l2.offset == 23 && l2.length == 7 && l2.number == 5); /* no final newline */
    CHECK(mrl_line_index_get(ix, 3, &none) == -1 && mrl_line_index_get(ix, -1, &none) == -1);
    CHECK(mrl_line_index_file_size(ix) == 30);
    mrl_line_index_free(ix);

    check_text("\n\n \r\n{}\n\n\n{\"a\":1}\r\n \n{}\r\n\n\n"); /* blank first, in runs, last */
    check_text("{}\r");     /* a '\r' and no newline at the end */
    check_text("\r\n\r\n"); /* nothing but blank lines */
    check_text("x\n\ny");

    /* lines across the 1 MiB read chunks, CRLF and blank lines anywhere:
     * compare with a plain scan of the same bytes */
    {
        size_t cap = 3u << 20, n = 0;
        char *text = malloc(cap + 1);
        unsigned seed = 7;
        while (n + 300 < cap) {
            seed = seed * 1103515245u + 12345u;
            int len = (int)(seed >> 16) % 200, kind = (int)(seed >> 8) % 7;
            if (kind == 0) len = 0;
            for (int k = 0; k < len; k++) text[n++] = (char)('a' + k % 26);
            if (kind == 1) text[n++] = ' ';
            if (kind == 2 || kind == 0) text[n++] = '\r';
            text[n++] = '\n';
        }
        text[n] = 0;
        ix = index_of(text);
        CHECK(differences(ix, text, n) == 0);
        mrl_line_index_free(ix);

        /* in steps: the same index, and how far it is can be read between them */
        CHECK_OK(mrl_line_index_open(path, &ix));
        CHECK(mrl_line_index_file_size(ix) == (int64_t)n);
        int done = 0, steps = 0;
        int64_t last = 0;
        while (!done) {
            CHECK_OK(mrl_line_index_scan(ix, 1, &done));
            CHECK(mrl_line_index_scanned(ix) >= last);
            last = mrl_line_index_scanned(ix);
            steps++;
        }
        CHECK(steps >= 3 && last == (int64_t)n);
        CHECK(differences(ix, text, n) == 0);
        /* 8 bytes a line, and the blank lines' runs */
        CHECK(mrl_line_index_bytes(ix) < mrl_line_index_count(ix) * 8 + (1 << 20) + 24 * (int64_t)n / 8);
        mrl_line_index_free(ix);

        /* one line of 3 MiB between short ones, its length exact across the chunks */
        memset(text, 'x', n);
        text[0] = '{', text[1] = '\n', text[n - 2] = '\r', text[n - 1] = '\n';
        text[n / 2] = '\n'; /* two long lines: the first starts at 2 */
        ix = index_of(text);
        CHECK(mrl_line_index_count(ix) == 3 && differences(ix, text, n) == 0);
        mrl_line_index_free(ix);
        free(text);
    }

    ix = index_of("");
    CHECK(mrl_line_index_count(ix) == 0);
    mrl_line_index_free(ix);

    unlink(path);
    ix = NULL;
    CHECK(mrl_line_index_build(path, &ix) == MRL_ERR_IO && ix == NULL);
    CHECK(strstr(mrl_last_error(), path) != NULL);

    int64_t perm[1];
    CHECK(mrl_data_permutation(1, -1, perm) == MRL_ERR_INVALID);
    CHECK_OK(mrl_data_permutation(1, 0, NULL));
    CHECK_OK(mrl_data_permutation(1, 1, perm));
    CHECK(perm[0] == 0);
    CHECK_DONE();
}
