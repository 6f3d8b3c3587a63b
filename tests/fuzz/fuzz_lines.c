/* core/data/lines.c: the line index of a JSONL file (the datasets' first
 * pass). Input: the file. Property: the index is exactly that of a plain
 * reference scan: every non-blank line ('\n' or "\r\n" ends a line, and a
 * '\r' ending the last line is dropped too; a line of spaces, tabs and '\r'
 * only is blank), its offset, its length without the line end, and its
 * 1-based number. */
#include <string.h>
#include "fuzz.h"
#include "moonrl/data.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file("data.jsonl", data, size);
    mrl_line_index *ix = NULL;
    if (size % 2) { /* in one call, or in steps of a few bytes (a step may end inside a line) */
        FUZZ_ASSERT(mrl_line_index_build(path, &ix) == MRL_OK);
    } else {
        FUZZ_ASSERT(mrl_line_index_open(path, &ix) == MRL_OK);
        int done = 0;
        while (!done) FUZZ_ASSERT(mrl_line_index_scan(ix, 1 + (int64_t)(size % 7), &done) == MRL_OK);
    }
    FUZZ_ASSERT(mrl_line_index_file_size(ix) == (int64_t)size);
    int64_t n = mrl_line_index_count(ix), k = 0, number = 0;
    mrl_line line;
    for (size_t start = 0; start < size;) {
        const uint8_t *nl = memchr(data + start, '\n', size - start);
        size_t end = nl ? (size_t)(nl - data) : size, next = nl ? end + 1 : size;
        number++;
        size_t stop = end;
        if (stop > start && data[stop - 1] == '\r') stop--; /* also at the end of a last line without '\n' */
        int blank = 1;
        for (size_t i = start; i < end && blank; i++) blank = data[i] == ' ' || data[i] == '\t' || data[i] == '\r';
        if (!blank) {
            FUZZ_ASSERT(k < n && mrl_line_index_get(ix, k, &line) == 0);
            FUZZ_ASSERT(line.offset == (int64_t)start && line.length == (int64_t)(stop - start) && line.number == number);
            k++;
        }
        start = next;
    }
    FUZZ_ASSERT(k == n && mrl_line_index_get(ix, n, &line) == -1);
    mrl_line_index_free(ix);
    return 0;
}
