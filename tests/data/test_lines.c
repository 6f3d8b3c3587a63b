/* The JSONL line index: offsets, lengths and line numbers of non-blank
 * lines; CRLF endings, no final newline, empty files, missing files. */
#include <stdlib.h>
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

int main(void) {
    snprintf(path, sizeof path, "/tmp/mrl_lines_%d.jsonl", (int)getpid());
    mrl_line_index *ix = index_of("{\"a\":1}\n\n  \t\n{\"b\":22}\r\n{\"c\":3}");
    CHECK(mrl_line_index_count(ix) == 3);
    const int64_t *off = mrl_line_index_offsets(ix), *len = mrl_line_index_lengths(ix);
    const int64_t *num = mrl_line_index_numbers(ix);
    CHECK(off[0] == 0 && len[0] == 7 && num[0] == 1);
    CHECK(off[1] == 13 && len[1] == 8 && num[1] == 4); /* "\r" is not part of the line */
    CHECK(off[2] == 23 && len[2] == 7 && num[2] == 5); /* no final newline */
    CHECK(mrl_line_index_file_size(ix) == 30);
    mrl_line_index_free(ix);

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
        int64_t want = 0, bad = 0, line = 1, start = 0;
        for (size_t i = 0; i < n; i++) {
            if (text[i] != '\n') continue;
            int64_t end = (int64_t)i;
            if (end > start && text[end - 1] == '\r') end--;
            int blank = 1;
            for (int64_t k = start; k < end; k++) if (text[k] != ' ' && text[k] != '\t' && text[k] != '\r') blank = 0;
            if (!blank) {
                if (want >= mrl_line_index_count(ix) || mrl_line_index_offsets(ix)[want] != start ||
                    mrl_line_index_lengths(ix)[want] != end - start || mrl_line_index_numbers(ix)[want] != line) bad++;
                want++;
            }
            start = (int64_t)i + 1;
            line++;
        }
        CHECK(mrl_line_index_count(ix) == want);
        CHECK(bad == 0);
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
