// A stand-in for NCCL (and the CUDA runtime calls core/dist/nccl.c makes) for
// the emulated GPU: the ranks of one job on one host exchange through POSIX
// shared memory, so that moonrl's NCCL paths (ZeRO's pieces, the model's
// tensor-parallel sums, the pipeline's sends) run in the default suites on a
// machine without a GPU. What it checks: that every rank issues the same
// collectives in the same order with the same sizes, the buffers' sides
// (device memory only), and the arithmetic of what moonrl asks; not NCCL's
// own algorithms, its speed or its rounding (sums here are in rank order).
//
// These are C symbols (nccl.c links them from libnccl and libcudart); the
// preloaded library's definitions win. A collective is queued on the
// communicator and progresses when nccl.c polls (cudaStreamQuery on the
// communicator's stream, ncclCommGetAsyncError), through three steps shared
// by every rank: publish its part in its file and arrive; once all arrived,
// read the others' and write its result; once all read, done. A rank that
// never comes leaves the others' queries "not ready", so nccl.c's deadlines
// and aborts run as on a GPU. Point to point (ncclSend / ncclRecv): a send
// is written to the pair's file and its (offset, length) to a ring in the
// shared control block, so a send never waits for its receive.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <mutex>
#include <set>
#include <string>
#include <vector>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

void emu_device_open();
void emu_device_close();
int emu_is_device(const void *p);

extern "C" {
// ---- the CUDA runtime calls of core/dist/nccl.c (the real header's C API) ----
typedef int cudaError_t;
enum { emu_cudaSuccess = 0, emu_cudaErrorInvalidValue = 1, emu_cudaErrorInvalidDevice = 101,
       emu_cudaErrorNotReady = 600 };
struct emu_attr { int type; int device; void *devicePointer, *hostPointer; long reserved[8]; };
struct emu_comm;
struct emu_stream { emu_comm *comm; };
static std::set<emu_stream *> streams;
static std::recursive_mutex lock;

const char *cudaGetErrorString(cudaError_t e) {
  return e == emu_cudaErrorNotReady ? "not ready (emulated)" : e ? "emulated error" : "no error";
}
cudaError_t cudaGetLastError(void) { return 0; }
cudaError_t cudaPeekAtLastError(void) { return 0; }
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return 0; }
cudaError_t cudaSetDevice(int d) { return d == 0 ? 0 : emu_cudaErrorInvalidDevice; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return 0; }
cudaError_t cudaPointerGetAttributes(emu_attr *a, const void *p) {
  int dev = p && emu_is_device(p);
  memset(a, 0, sizeof *a);
  a->type = dev ? 2 : 0;  // cudaMemoryTypeDevice : Unregistered
  a->devicePointer = dev ? (void *)p : NULL;
  return 0;
}
cudaError_t cudaStreamCreateWithFlags(emu_stream **s, unsigned) {
  std::lock_guard<std::recursive_mutex> g(lock);
  *s = new emu_stream{NULL};
  streams.insert(*s);
  return 0;
}
cudaError_t cudaStreamDestroy(emu_stream *s) {
  std::lock_guard<std::recursive_mutex> g(lock);
  if (streams.erase(s)) delete s;
  return 0;
}
static int progress(emu_comm *c);
// (another stream's work, the emulated kernels', ran when it was queued)
cudaError_t cudaStreamQuery(emu_stream *s) {
  std::lock_guard<std::recursive_mutex> g(lock);
  if (!s || !streams.count(s) || !s->comm) return 0;
  return progress(s->comm) ? emu_cudaErrorNotReady : 0;
}
// (nccl.c's copy of a rank's own block in an all-to-all: done when queued, as every emulated copy)
cudaError_t cudaMemcpyAsync(void *d, const void *src, size_t n, int, void *) {
  if (!n) return 0;
  if (!emu_is_device(d) || !emu_is_device(src)) { fprintf(stderr, "EMU: cudaMemcpyAsync: not device memory\n"); abort(); }
  emu_device_open();
  memmove(d, src, n);
  emu_device_close();
  return 0;
}
cudaError_t cudaEventCreateWithFlags(int **e, unsigned) { *e = new int(0); return 0; }
cudaError_t cudaEventDestroy(int *e) { delete e; return 0; }
cudaError_t cudaEventRecord(int *, void *) { return 0; }
cudaError_t cudaEventQuery(int *) { return 0; }

// ---- NCCL ----
typedef enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
               ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6, ncclInProgress = 7 } ncclResult_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef emu_comm *ncclComm_t;
enum { ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5, ncclFloat16 = 6,
       ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9 };
enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };
}

enum { MAX_RANKS = 16, RING = 32 };
// The control block every rank maps: arrivals and departures of collectives (monotonic), and
// each ordered pair's sends (counts and their places in the sender's file).
struct ctl_block {
  std::atomic<int64_t> joined, opened, arrive, depart;
  std::atomic<int64_t> sent[MAX_RANKS][MAX_RANKS], recvd[MAX_RANKS][MAX_RANKS];
  int64_t ring_off[MAX_RANKS][MAX_RANKS][RING], ring_len[MAX_RANKS][MAX_RANKS][RING];
  int64_t end[MAX_RANKS][MAX_RANKS];  // (the sender's) where its file's last pending send ends
};
enum kind { ALLREDUCE, BROADCAST, ALLGATHER, REDUCE_SCATTER, REDUCE, SEND, RECV };
struct op { kind k; const void *send; void *recv; size_t count; int dtype, redop, peer, phase; };
struct emu_comm {
  std::string name;
  int rank, size, state;  // state: 0 joining, 1 opening, 2 ready
  ctl_block *ctl;
  int coll_fd[MAX_RANKS];                 // each rank's part of a collective
  int out_fd[MAX_RANKS], in_fd[MAX_RANKS]; // this rank's sends to q, q's sends to it
  int64_t coll_seq;
  std::deque<op> ops;
  std::vector<op> group;
  emu_stream *stream;
};
static int group_depth;
static std::vector<emu_comm *> grouped;  // the communicators with ops in the open group

static size_t esize(int t) {
  switch (t) {
  case ncclInt8: case ncclUint8: return 1;
  case ncclFloat16: case ncclBfloat16: return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
  default: return 8;
  }
}
static double load(const unsigned char *p, int t) {
  switch (t) {
  case ncclInt8: return *(const int8_t *)p;
  case ncclUint8: return *p;
  case ncclInt32: return *(const int32_t *)p;
  case ncclUint32: return *(const uint32_t *)p;
  case ncclInt64: return (double)*(const int64_t *)p;
  case ncclUint64: return (double)*(const uint64_t *)p;
  case ncclFloat32: return *(const float *)p;
  case ncclFloat64: return *(const double *)p;
  case ncclBfloat16: { uint32_t u = (uint32_t)*(const uint16_t *)p << 16; float f; memcpy(&f, &u, 4); return f; }
  case ncclFloat16: { _Float16 h; memcpy(&h, p, 2); return (double)h; }
  }
  return 0;
}
static void store(unsigned char *p, int t, double v) {
  switch (t) {
  case ncclInt8: *(int8_t *)p = (int8_t)v; break;
  case ncclUint8: *p = (unsigned char)v; break;
  case ncclInt32: *(int32_t *)p = (int32_t)v; break;
  case ncclUint32: *(uint32_t *)p = (uint32_t)v; break;
  case ncclInt64: *(int64_t *)p = (int64_t)v; break;
  case ncclUint64: *(uint64_t *)p = (uint64_t)v; break;
  case ncclFloat32: *(float *)p = (float)v; break;
  case ncclFloat64: *(double *)p = v; break;
  case ncclBfloat16: {  // round to nearest even
    float f = (float)v; uint32_t u; memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    *(uint16_t *)p = (uint16_t)(u >> 16);
    break;
  }
  case ncclFloat16: { _Float16 h = (_Float16)v; memcpy(p, &h, 2); break; }
  }
}
// The reduction of every rank's count elements at byte offset `at` of its collective file into
// out (host memory), in rank order; integers exactly (int64 through int64), floats in the type's
// own precision (f32 in float, f64 in double, 16-bit types in float).
static void reduce_parts(emu_comm *c, size_t at, size_t count, int t, int redop, unsigned char *out) {
  size_t es = esize(t), chunk = 1 << 16;
  std::vector<unsigned char> part(chunk * es);
  for (size_t i0 = 0; i0 < count; i0 += chunk) {
    size_t n = count - i0 < chunk ? count - i0 : chunk;
    for (int q = 0; q < c->size; q++) {
      if (pread(c->coll_fd[q], part.data(), n * es, (off_t)(at + i0 * es)) != (ssize_t)(n * es)) abort();
      for (size_t i = 0; i < n; i++) {
        unsigned char *o = out + (i0 + i) * es;
        if (t == ncclInt64 || t == ncclUint64) {
          int64_t a, b;
          memcpy(&b, &part[i * es], 8);
          memcpy(&a, o, 8);
          a = q == 0 ? b : redop == ncclMax ? (a > b ? a : b) : redop == ncclMin ? (a < b ? a : b)
                                                         : redop == ncclProd ? a * b : a + b;
          memcpy(o, &a, 8);
          continue;
        }
        double b = load(&part[i * es], t), a = q == 0 ? b : load(o, t);
        if (q > 0) a = redop == ncclMax ? (a > b ? a : b) : redop == ncclMin ? (a < b ? a : b) : redop == ncclProd ? a * b
                     : t == ncclFloat32 ? (double)((float)a + (float)b) : t == ncclFloat64 ? a + b
                                                                         : (double)((float)a + (float)b);
        if (redop == ncclAvg && q == c->size - 1)
          a = t == ncclFloat64 ? a / c->size : (double)((float)a / (float)c->size);
        store(o, t, a);
      }
    }
  }
}

static void put(int fd, const void *dev, size_t bytes, size_t at) {
  emu_device_open();
  ssize_t w = pwrite(fd, dev, bytes, (off_t)at);
  emu_device_close();
  if (w != (ssize_t)bytes) { fprintf(stderr, "EMU NCCL: writing %zu bytes failed\n", bytes); abort(); }
}
static void get(int fd, void *dev, size_t bytes, size_t at) {
  emu_device_open();
  ssize_t r = pread(fd, dev, bytes, (off_t)at);
  emu_device_close();
  if (r != (ssize_t)bytes) { fprintf(stderr, "EMU NCCL: reading %zu bytes failed\n", bytes); abort(); }
}
static void to_dev(void *dev, const void *host, size_t bytes) {
  emu_device_open();
  memcpy(dev, host, bytes);
  emu_device_close();
}

// One step of the op at the queue's head: 1 while it waits for another rank.
static int step(emu_comm *c, op &o) {
  ctl_block *b = c->ctl;
  size_t es = esize(o.dtype), n = (size_t)c->size;
  if (o.k == SEND) {
    auto &sent = b->sent[c->rank][o.peer], &recvd = b->recvd[c->rank][o.peer];
    int64_t s = sent.load(), r = recvd.load();
    if (s - r >= RING) return 1;
    int64_t off = s == r ? 0 : b->end[c->rank][o.peer], len = (int64_t)(o.count * es);
    if (len) put(c->out_fd[o.peer], o.send, (size_t)len, (size_t)off);
    b->ring_off[c->rank][o.peer][s % RING] = off, b->ring_len[c->rank][o.peer][s % RING] = len;
    b->end[c->rank][o.peer] = off + len;
    sent.store(s + 1);
    return 0;
  }
  if (o.k == RECV) {
    auto &sent = b->sent[o.peer][c->rank], &recvd = b->recvd[o.peer][c->rank];
    int64_t r = recvd.load();
    if (sent.load() <= r) return 1;
    int64_t off = b->ring_off[o.peer][c->rank][r % RING], len = b->ring_len[o.peer][c->rank][r % RING];
    if (len != (int64_t)(o.count * es)) {
      fprintf(stderr, "EMU NCCL: rank %d receives %zu bytes from rank %d, which sent %lld\n", c->rank, o.count * es,
              o.peer, (long long)len);
      abort();
    }
    if (len) get(c->in_fd[o.peer], o.recv, (size_t)len, (size_t)off);
    recvd.store(r + 1);
    return 0;
  }
  int64_t k = c->coll_seq;
  if (o.phase == 0) {  // this rank's part, then arrive. (the part's size and the kind: a header)
    size_t bytes = o.k == REDUCE_SCATTER ? n * o.count * es : o.count * es;
    int64_t head[3] = {(int64_t)o.k, (int64_t)bytes, o.k == BROADCAST || o.k == REDUCE ? o.peer : -1};
    if (pwrite(c->coll_fd[c->rank], head, sizeof head, 0) != sizeof head) abort();
    if (bytes && (o.k != BROADCAST || c->rank == o.peer)) put(c->coll_fd[c->rank], o.send, bytes, sizeof head);
    b->arrive.fetch_add(1);
    o.phase = 1;
  }
  if (o.phase == 1) {
    if (b->arrive.load() < (k + 1) * (int64_t)n) return 1;
    for (int q = 0; q < c->size; q++) {  // every rank the same collective
      int64_t head[3];
      if (pread(c->coll_fd[q], head, sizeof head, 0) != sizeof head) abort();
      int64_t mine = o.k == REDUCE_SCATTER ? (int64_t)(n * o.count * es) : (int64_t)(o.count * es);
      int64_t root = o.k == BROADCAST || o.k == REDUCE ? o.peer : -1;
      if (head[0] != o.k || head[1] != mine || head[2] != root) {
        fprintf(stderr, "EMU NCCL: collective #%lld differs between rank %d (kind %d, %lld bytes, root %lld) and rank "
                "%d (kind %d, %lld bytes, root %lld)\n", (long long)k, c->rank, (int)o.k, (long long)mine,
                (long long)root, q, (int)head[0], (long long)head[1], (long long)head[2]);
        abort();
      }
    }
    size_t h = 3 * sizeof(int64_t), bytes = o.count * es;
    if (o.k == BROADCAST) {
      if (bytes) get(c->coll_fd[o.peer], o.recv, bytes, h);
    } else if (o.k == ALLGATHER) {
      for (int q = 0; q < c->size; q++)
        if (bytes) get(c->coll_fd[q], (char *)o.recv + q * bytes, bytes, h);
    } else if (o.k != REDUCE || c->rank == o.peer) {
      std::vector<unsigned char> out(bytes);
      size_t at = h + (o.k == REDUCE_SCATTER ? c->rank * bytes : 0);
      reduce_parts(c, at, o.count, o.dtype, o.redop, out.data());
      if (bytes) to_dev(o.recv, out.data(), bytes);
    }
    b->depart.fetch_add(1);
    o.phase = 2;
  }
  if (b->depart.load() < (k + 1) * (int64_t)n) return 1;  // (until every rank has read this rank's part)
  c->coll_seq++;
  return 0;
}

static void comm_close(emu_comm *c) {
  for (int q = 0; q < MAX_RANKS; q++) {
    if (c->coll_fd[q] >= 0) close(c->coll_fd[q]);
    if (c->out_fd[q] >= 0) close(c->out_fd[q]);
    if (c->in_fd[q] >= 0) close(c->in_fd[q]);
    c->coll_fd[q] = c->out_fd[q] = c->in_fd[q] = -1;
  }
  if (c->ctl) munmap(c->ctl, sizeof(ctl_block));
  c->ctl = NULL;
  if (c->stream) c->stream->comm = NULL;
}

static std::string file(const emu_comm *c, const char *what, int a, int b = -1) {
  char s[64];
  snprintf(s, sizeof s, ".%s%d.%d", what, a, b);
  return c->name + s;
}
static int create(const std::string &name) { return shm_open(name.c_str(), O_CREAT | O_RDWR, 0600); }

// Joining (every rank's files made, then the others' opened, then the names unlinked: the files
// live as long as their descriptors). 1 while another rank has not got as far.
static int joining(emu_comm *c) {
  ctl_block *b = c->ctl;
  if (c->state == 0) {
    if (b->joined.load() < c->size) return 1;
    for (int q = 0; q < c->size; q++) {
      if (q != c->rank) c->coll_fd[q] = shm_open(file(c, "c", q).c_str(), O_RDWR, 0);
      if (q != c->rank) c->in_fd[q] = shm_open(file(c, "p", q, c->rank).c_str(), O_RDWR, 0);
      if (c->coll_fd[q] < 0 || (q != c->rank && c->in_fd[q] < 0)) {
        fprintf(stderr, "EMU NCCL: rank %d cannot open rank %d's files\n", c->rank, q);
        abort();
      }
    }
    b->opened.fetch_add(1);
    c->state = 1;
  }
  if (c->state == 1) {
    if (b->opened.load() < c->size) return 1;
    shm_unlink(file(c, "c", c->rank).c_str());
    for (int q = 0; q < c->size; q++)
      if (q != c->rank) shm_unlink(file(c, "p", c->rank, q).c_str());
    if (c->rank == 0) shm_unlink(c->name.c_str());
    c->state = 2;
  }
  return 0;
}

static int progress(emu_comm *c) {
  if (c->state < 2 && joining(c)) return 1;
  while (!c->ops.empty()) {
    if (step(c, c->ops.front())) return 1;
    c->ops.pop_front();
  }
  return 0;
}

extern "C" {
const char *ncclGetErrorString(ncclResult_t r) {
  static const char *s[] = {"no error", "unhandled cuda error", "system error", "internal error",
                            "invalid argument", "invalid usage", "remote process exited or there was a network error",
                            "NCCL operation in progress"};
  return r >= 0 && r <= 7 ? s[r] : "unknown result code";
}
const char *ncclGetLastError(ncclComm_t) { return ""; }

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  static std::atomic<int> n;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  memset(id, 0, sizeof *id);
  snprintf(id->internal, sizeof id->internal, "/moonrl-emu-nccl-%d-%d-%ld", (int)getpid(), n++, (long)ts.tv_nsec);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *out, int size, ncclUniqueId id, int rank, void *) {
  std::lock_guard<std::recursive_mutex> g(lock);
  *out = NULL;
  if (size < 1 || size > MAX_RANKS || rank < 0 || rank >= size) return ncclInvalidArgument;
  emu_comm *c = new emu_comm();
  c->name = std::string(id.internal, strnlen(id.internal, sizeof id.internal));
  c->rank = rank, c->size = size;
  for (int q = 0; q < MAX_RANKS; q++) c->coll_fd[q] = c->out_fd[q] = c->in_fd[q] = -1;
  int fd = create(c->name);
  if (fd < 0 || ftruncate(fd, sizeof(ctl_block)) != 0) { if (fd >= 0) close(fd); delete c; return ncclSystemError; }
  void *p = mmap(NULL, sizeof(ctl_block), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) { delete c; return ncclSystemError; }
  c->ctl = (ctl_block *)p;
  c->coll_fd[rank] = create(file(c, "c", rank));
  for (int q = 0; q < size; q++)
    if (q != rank) c->out_fd[q] = create(file(c, "p", rank, q));
  c->ctl->joined.fetch_add(1);
  *out = c;
  return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *async) {
  std::lock_guard<std::recursive_mutex> g(lock);
  if (!c) return ncclInvalidArgument;
  *async = c->state < 2 && joining(c) ? ncclInProgress : ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t c) {
  std::lock_guard<std::recursive_mutex> g(lock);
  if (!c) return ncclSuccess;
  comm_close(c);
  delete c;
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t c) {
  std::lock_guard<std::recursive_mutex> g(lock);
  return c && c->ops.empty() ? ncclSuccess : ncclInProgress;
}
ncclResult_t ncclCommDestroy(ncclComm_t c) { return ncclCommAbort(c); }

static ncclResult_t enqueue(ncclComm_t c, emu_stream *s, op o) {
  std::lock_guard<std::recursive_mutex> g(lock);
  if (!c || c->state != 2) return ncclInvalidUsage;
  if (!streams.count(s)) return ncclInvalidArgument;  // (nccl.c uses the communicator's own stream)
  if ((o.k == SEND || o.k == RECV || o.k == BROADCAST || o.k == REDUCE) && (o.peer < 0 || o.peer >= c->size))
    return ncclInvalidArgument;
  if ((o.k == SEND || o.k == RECV) && o.peer == c->rank) return ncclInvalidArgument;
  s->comm = c, c->stream = s;
  if (group_depth) {
    if (c->group.empty()) grouped.push_back(c);
    c->group.push_back(o);
  } else {
    c->ops.push_back(o);
  }
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int redop, ncclComm_t c,
                           emu_stream *s) {
  return enqueue(c, s, op{ALLREDUCE, send, recv, count, dtype, redop, -1, 0});
}
ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, int dtype, int root, ncclComm_t c,
                           emu_stream *s) {
  return enqueue(c, s, op{BROADCAST, send, recv, count, dtype, ncclSum, root, 0});
}
ncclResult_t ncclReduce(const void *send, void *recv, size_t count, int dtype, int redop, int root, ncclComm_t c,
                        emu_stream *s) {
  return enqueue(c, s, op{REDUCE, send, recv, count, dtype, redop, root, 0});
}
ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, int dtype, ncclComm_t c, emu_stream *s) {
  return enqueue(c, s, op{ALLGATHER, send, recv, count, dtype, ncclSum, -1, 0});
}
ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, int dtype, int redop, ncclComm_t c,
                               emu_stream *s) {
  return enqueue(c, s, op{REDUCE_SCATTER, send, recv, count, dtype, redop, -1, 0});
}
ncclResult_t ncclSend(const void *send, size_t count, int dtype, int peer, ncclComm_t c, emu_stream *s) {
  return enqueue(c, s, op{SEND, send, NULL, count, dtype, ncclSum, peer, 0});
}
ncclResult_t ncclRecv(void *recv, size_t count, int dtype, int peer, ncclComm_t c, emu_stream *s) {
  return enqueue(c, s, op{RECV, NULL, recv, count, dtype, ncclSum, peer, 0});
}

ncclResult_t ncclGroupStart(void) {
  std::lock_guard<std::recursive_mutex> g(lock);
  group_depth++;
  return ncclSuccess;
}
// A group's sends go first (they never wait), then its other ops in their order: a group's
// sends and receives between two ranks then never wait on each other.
ncclResult_t ncclGroupEnd(void) {
  std::lock_guard<std::recursive_mutex> g(lock);
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth) return ncclSuccess;
  for (emu_comm *c : grouped) {
    for (op &o : c->group)
      if (o.k == SEND) c->ops.push_back(o);
    for (op &o : c->group)
      if (o.k != SEND) c->ops.push_back(o);
    c->group.clear();
  }
  grouped.clear();
  return ncclSuccess;
}
}
