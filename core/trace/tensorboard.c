/* TensorBoard event files: TFRecord framing (length, masked CRC32C of the
 * length, the bytes, masked CRC32C of the bytes) around Event protocol
 * buffers, encoded by hand: the few fields we write need no protobuf
 * library.
 *   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
 *   Summary { repeated Value value = 1; }
 *   Value   { string tag = 1; float simple_value = 2; } */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "moonrl/trace.h"
#include "moonrl/fs.h"
#include "base/error.h"

struct mrl_tb_writer {
    FILE *file;
    char *path;
};

static uint32_t crc_table[256];

static void crc_init(void) {
    if (crc_table[1]) return;
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0x82F63B78u ^ (c >> 1) : c >> 1; /* Castagnoli, reflected */
        crc_table[i] = c;
    }
}

static uint32_t crc32c(const uint8_t *data, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ data[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static uint32_t masked_crc(const uint8_t *data, size_t n) {
    uint32_t c = crc32c(data, n);
    return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

/* protobuf encoding into a fixed buffer; tags are capped so events stay small */
typedef struct pb {
    uint8_t buf[1024];
    size_t len;
} pb;

static void pb_varint(pb *p, uint64_t v) {
    while (v >= 0x80) {
        p->buf[p->len++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p->buf[p->len++] = (uint8_t)v;
}

static void pb_bytes(pb *p, int field, const void *data, size_t n) {
    pb_varint(p, (uint64_t)(field << 3 | 2));
    pb_varint(p, n);
    memcpy(p->buf + p->len, data, n);
    p->len += n;
}

static void pb_fixed(pb *p, int field, int wire, const void *le, size_t n) {
    pb_varint(p, (uint64_t)(field << 3 | wire));
    memcpy(p->buf + p->len, le, n); /* x86-64 and the other targets we build for are little-endian */
    p->len += n;
}

static mrl_status write_record(mrl_tb_writer *w, const uint8_t *data, size_t n) {
    uint64_t len = n;
    uint32_t len_crc = masked_crc((const uint8_t *)&len, 8), data_crc = masked_crc(data, n);
    if (fwrite(&len, 8, 1, w->file) != 1 || fwrite(&len_crc, 4, 1, w->file) != 1 ||
        fwrite(data, 1, n, w->file) != n || fwrite(&data_crc, 4, 1, w->file) != 1)
        return mrl_set_error(MRL_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    return MRL_OK;
}

static void event_header(pb *e, double wall_time, int64_t step) {
    pb_fixed(e, 1, 1, &wall_time, 8);
    if (step) {
        pb_varint(e, 2 << 3 | 0);
        pb_varint(e, (uint64_t)step);
    }
}

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

mrl_status mrl_tb_open(const char *dir, mrl_tb_writer **out) {
    *out = NULL;
    crc_init();
    mrl_status st = mrl_fs_mkdirs(dir);
    if (st != MRL_OK) return st;
    char host[128] = "localhost";
    gethostname(host, sizeof host - 1);
    static int sequence;
    size_t n = strlen(dir) + strlen(host) + 96;
    char *path = malloc(n);
    if (!path) return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    snprintf(path, n, "%s/events.out.tfevents.%010ld.%s.%d.%d", dir, (long)time(NULL), host, (int)getpid(),
             sequence++);
    FILE *f = fopen(path, "wb");
    if (!f) {
        st = mrl_set_error(MRL_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
        free(path);
        return st;
    }
    mrl_tb_writer *w = calloc(1, sizeof *w);
    if (!w) {
        fclose(f);
        free(path);
        return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    }
    w->file = f;
    w->path = path;
    pb e = {{0}, 0};
    event_header(&e, wall_now(), 0);
    pb_bytes(&e, 3, "brain.Event:2", 13);
    st = write_record(w, e.buf, e.len);
    if (st != MRL_OK) {
        mrl_tb_close(w);
        return st;
    }
    *out = w;
    return MRL_OK;
}

mrl_status mrl_tb_scalar(mrl_tb_writer *w, const char *tag, double value, int64_t step) {
    if (!w || !tag) return mrl_set_error(MRL_ERR_INVALID, "tensorboard scalar: no writer or tag");
    size_t tag_len = strlen(tag);
    if (tag_len > 512) return mrl_set_error(MRL_ERR_INVALID, "tensorboard tag longer than 512 bytes: %.40s...", tag);
    pb v = {{0}, 0}, s = {{0}, 0}, e = {{0}, 0};
    float f = (float)value;
    pb_bytes(&v, 1, tag, tag_len);
    pb_fixed(&v, 2, 5, &f, 4);
    pb_bytes(&s, 1, v.buf, v.len);
    event_header(&e, wall_now(), step);
    pb_bytes(&e, 5, s.buf, s.len);
    return write_record(w, e.buf, e.len);
}

mrl_status mrl_tb_flush(mrl_tb_writer *w) {
    if (w && fflush(w->file) != 0) return mrl_set_error(MRL_ERR_IO, "%s: flush failed: %s", w->path, strerror(errno));
    return MRL_OK;
}

const char *mrl_tb_path(mrl_tb_writer *w) { return w ? w->path : ""; }

void mrl_tb_close(mrl_tb_writer *w) {
    if (!w) return;
    fclose(w->file);
    free(w->path);
    free(w);
}
