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
