// The emulated launch (cuda_runtime.h): the threads of one block run as
// fibers (ucontext) on the calling thread, in thread order, each until its
// next sync point: __syncthreads, or a warp shuffle. When every fiber waits,
// the warps whose 32 lanes are all at a shuffle go on, else the block's
// barrier opens if every thread is at it; anything else is a deadlock
// (threads that left while others wait), reported and fatal. The fixed
// order hides races between warps that a GPU would show: this checks
// indices, barriers and arithmetic, not the absence of races.
#include "cuda_runtime.h"
#include "cublasLt.h"
#include "cuda.h"
#include <cstdio>
#include <sys/mman.h>
#include <csetjmp>
#include <ucontext.h>
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
void *emu_dyn_smem;
std::mutex emu_atomic;
int emu_gemm_calls[2];
enum { RUN, AT_BLOCK, AT_WARP, DONE };
// A fiber starts once through its ucontext (makecontext, the first block it
// runs) and switches with _setjmp / _longjmp after that: getcontext and
// swapcontext save and restore the signal mask, a system call each. Its entry
// never returns, so a later block's thread starts by a _longjmp to `start`,
// the top of that same frame.
struct fiber { ucontext_t ctx; jmp_buf jb, start; int state, started, made; char *stack; };
static std::vector<fiber> fibers;
static ucontext_t sched_ctx;
static jmp_buf sched_jb;
static int cur, nthreads;
static std::function<void()> *kernel_fn;
// shuffle slots [warp][buffer][lane]: two buffers, alternated per shuffle,
// so that a lane may publish the next value while others still read
static unsigned char slots[32][2][32][8];
static int warp_buf[32][1024];
int emu_lane() { return cur % 32; }
static void yield(int st) {
  fibers[cur].state = st;
  if (!_setjmp(fibers[cur].jb)) _longjmp(sched_jb, 1);
}
void __syncthreads() { yield(AT_BLOCK); }
void emu_warp_exchange(const void *v, void *out, int src, size_t bytes) {
  int w = cur / 32, l = cur % 32, b = warp_buf[w][l]++ & 1;
  memcpy(slots[w][b][l], v, bytes);
  yield(AT_WARP);
  memcpy(out, slots[w][b][src], bytes);
}
// ---- device memory: one mapping per allocation, PROT_NONE unless open ----
// (a reservation of the driver's virtual memory, vmm: only its mapped spans ever open)
struct allocation { char *base; size_t bytes; bool vmm; std::vector<std::pair<size_t, size_t>> mapped; };
static std::vector<allocation> allocations;
static std::mutex alloc_lock;
static int open_depth;
// EMU_PROTECT=0: device memory stays readable (faster; no check of host reads)
static int protecting() {
  static int on = -1;
  if (on < 0) on = !getenv("EMU_PROTECT") || strcmp(getenv("EMU_PROTECT"), "0");
  return on;
}
static void protect(allocation &a, int prot) {
  if (!a.vmm) mprotect(a.base, a.bytes, prot);
  else for (auto &m : a.mapped) mprotect(a.base + m.first, m.second, prot);
}
static void protect_all(int prot) {
  if (!protecting()) return;
  for (auto &a : allocations) protect(a, prot);
}
void emu_device_open() {
  std::lock_guard<std::mutex> g(alloc_lock);
  if (open_depth++ == 0) protect_all(PROT_READ | PROT_WRITE);
}
void emu_device_close() {
  std::lock_guard<std::mutex> g(alloc_lock);
  if (--open_depth == 0) protect_all(PROT_NONE);
}
int emu_is_device(const void *p) {
  std::lock_guard<std::mutex> g(alloc_lock);
  for (auto &a : allocations)
    if ((const char *)p >= a.base && (const char *)p < a.base + a.bytes) return 1;
  return 0;
}
// ---- graphs ----
struct emu_graph { std::vector<std::function<void()>> ops; int owners; };
static emu_graph *capture;  // the open capture
static const char *capture_spoiled;
static int spoil_next_launch;
int emu_capturing() { return capture != NULL; }
void emu_capture_spoil(const char *why) {
  if (capture && !capture_spoiled) capture_spoiled = why;
}
void emu_enqueue(std::function<void()> f) {
  if (capture && spoil_next_launch) {
    spoil_next_launch = 0;
    emu_capture_spoil("EMU_SPOIL_CAPTURE");
  }
  if (capture) capture->ops.push_back(std::move(f));
  else f();
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (capture || !s) return cudaErrorInvalidValue;  // one at a time; never the legacy stream
  capture = new emu_graph{{}, 1};
  capture_spoiled = NULL;
  // EMU_SPOIL_CAPTURE=1: every capture fails at its first launch (a test of the fallback)
  if (getenv("EMU_SPOIL_CAPTURE") && !strcmp(getenv("EMU_SPOIL_CAPTURE"), "1")) spoil_next_launch = 1;
  return 0;
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *g) {
  emu_graph *c = capture;
  capture = NULL;
  *g = NULL;
  if (!c) return cudaErrorInvalidValue;
  if (capture_spoiled) {
    fprintf(stderr, "EMU: capture failed: %s\n", capture_spoiled);
    delete c;
    return cudaErrorInvalidValue;
  }
  *g = c;
  return 0;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long) {
  if (!g) return cudaErrorInvalidValue;
  g->owners++;
  *e = g;
  return 0;
}
static void graph_drop(emu_graph *g) {
  if (g && --g->owners == 0) delete g;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) { graph_drop(g); return 0; }
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t g) { graph_drop(g); return 0; }
cudaError_t cudaGraphLaunch(cudaGraphExec_t g, cudaStream_t) {
  if (!g || capture) return cudaErrorInvalidValue;
  for (auto &op : g->ops) op();
  return 0;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  if (capture) { emu_capture_spoil("a wait for the stream"); return cudaErrorInvalidValue; }
  return 0;
}

cudaError_t cudaMalloc(void **p, size_t n) {
  if (capture) { emu_capture_spoil("cudaMalloc"); *p = NULL; return cudaErrorInvalidValue; }
  size_t bytes = (n + 4095) / 4096 * 4096 + 4096;  // a page more: reads just past the end stay inside
  void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) { *p = NULL; return 2; }
  memset(m, 0xff, n);  // NaN bytes: a read of memory never written shows
  std::lock_guard<std::mutex> g(alloc_lock);
  if (!open_depth && protecting()) mprotect(m, bytes, PROT_NONE);
  allocations.push_back({(char *)m, bytes, false, {}});
  *p = m;
  return 0;
}
cudaError_t cudaFree(void *p) {
  if (!p) return 0;
  if (capture) { emu_capture_spoil("cudaFree"); return cudaErrorInvalidValue; }
  std::lock_guard<std::mutex> g(alloc_lock);
  for (size_t i = 0; i < allocations.size(); i++)
    if (allocations[i].base == p) {
      munmap(allocations[i].base, allocations[i].bytes);
      allocations.erase(allocations.begin() + i);
      return 0;
    }
  fprintf(stderr, "EMU: cudaFree of %p, not an allocation\n", p);
  abort();
}
// ---- the driver's virtual memory (cuda.h): reserved address space, pages mapped one by one ----
static allocation *reservation(CUdeviceptr p, size_t size) {  // (alloc_lock held)
  for (auto &a : allocations)
    if (a.vmm && (char *)p >= a.base && (char *)p + size <= a.base + a.bytes) return &a;
  fprintf(stderr, "EMU: [%p, +%zu) is not inside a reserved range\n", (void *)p, size);
  abort();
}
static CUresult emu_reserve(CUdeviceptr *p, size_t size, size_t, CUdeviceptr, unsigned long long) {
  void *m = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return 2;
  std::lock_guard<std::mutex> g(alloc_lock);
  allocations.push_back({(char *)m, size, true, {}});
  *p = (CUdeviceptr)m;
  return 0;
}
static CUresult emu_address_free(CUdeviceptr p, size_t size) {
  std::lock_guard<std::mutex> g(alloc_lock);
  allocation *a = reservation(p, size);
  if (!a->mapped.empty()) { fprintf(stderr, "EMU: cuMemAddressFree with %zu spans mapped\n", a->mapped.size()); abort(); }
  munmap(a->base, a->bytes);
  allocations.erase(allocations.begin() + (a - allocations.data()));
  return 0;
}
static CUresult emu_create(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *, unsigned long long) {
  *h = (CUmemGenericAllocationHandle) new size_t(size);
  return 0;
}
static CUresult emu_release(CUmemGenericAllocationHandle h) { delete (size_t *)h; return 0; }
static CUresult emu_map(CUdeviceptr p, size_t size, size_t, CUmemGenericAllocationHandle h, unsigned long long) {
  std::lock_guard<std::mutex> g(alloc_lock);
  allocation *a = reservation(p, size);
  size_t at = (char *)p - a->base;
  if (*(size_t *)h != size) { fprintf(stderr, "EMU: cuMemMap of %zu bytes of a %zu-byte handle\n", size, *(size_t *)h); abort(); }
  for (auto &m : a->mapped)
    if (at < m.first + m.second && m.first < at + size) { fprintf(stderr, "EMU: cuMemMap over a mapped span\n"); abort(); }
  a->mapped.push_back({at, size});
  mprotect((char *)p, size, PROT_READ | PROT_WRITE);
  memset((char *)p, 0xff, size);  // NaN bytes: new memory holds nothing known
  if (!open_depth && protecting()) mprotect((char *)p, size, PROT_NONE);
  return 0;
}
static CUresult emu_unmap(CUdeviceptr p, size_t size) {
  std::lock_guard<std::mutex> g(alloc_lock);
  allocation *a = reservation(p, size);
  size_t at = (char *)p - a->base;
  for (size_t i = 0; i < a->mapped.size(); i++)
    if (a->mapped[i].first == at && a->mapped[i].second == size) {
      a->mapped.erase(a->mapped.begin() + i);
      madvise((char *)p, size, MADV_DONTNEED);
      mprotect((char *)p, size, PROT_NONE);
      return 0;
    }
  fprintf(stderr, "EMU: cuMemUnmap of [%zu, +%zu): not one mapped span\n", at, size);
  abort();
}
static CUresult emu_set_access(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t) { return 0; }
// pages of 4 KiB (a GPU's are 2 MiB): a tiny test model then has parts of its own
static CUresult emu_granularity(size_t *g, const CUmemAllocationProp *, CUmemAllocationGranularity_flags) {
  *g = 4096;
  return 0;
}
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned, unsigned long long,
                                             cudaDriverEntryPointQueryResult *q) {
  static const struct { const char *name; void *fn; } table[] = {
      {"cuMemAddressReserve", (void *)emu_reserve}, {"cuMemAddressFree", (void *)emu_address_free},
      {"cuMemCreate", (void *)emu_create},          {"cuMemRelease", (void *)emu_release},
      {"cuMemMap", (void *)emu_map},                {"cuMemUnmap", (void *)emu_unmap},
      {"cuMemSetAccess", (void *)emu_set_access},   {"cuMemGetAllocationGranularity", (void *)emu_granularity}};
  for (auto &e : table)
    if (!strcmp(e.name, symbol)) { *fn = e.fn; if (q) *q = cudaDriverEntryPointSuccess; return 0; }
  *fn = NULL;
  if (q) *q = cudaDriverEntryPointSymbolNotFound;
  return cudaErrorInvalidValue;
}
static void copy_side(const char *what, const void *p, int device) {
  if (emu_is_device(p) != device) {
    fprintf(stderr, "EMU: %s: %p is %s memory, expected %s memory\n", what, p, device ? "host" : "device",
            device ? "device" : "host");
    abort();
  }
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t) {
  if (!n) return 0;
  if (k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice) copy_side("cudaMemcpy destination", d, 1);
  if (k == cudaMemcpyDeviceToHost) copy_side("cudaMemcpy destination", d, 0);
  if (k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice) copy_side("cudaMemcpy source", s, 1);
  if (k == cudaMemcpyHostToDevice) copy_side("cudaMemcpy source", s, 0);
  if (capture && k != cudaMemcpyDeviceToDevice) { emu_capture_spoil("a copy to or from the host"); return cudaErrorInvalidValue; }
  emu_enqueue([=]() {
    emu_device_open();
    memmove(d, s, n);
    emu_device_close();
  });
  return 0;
}
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t) {
  if (!n) return 0;
  copy_side("cudaMemset", d, 1);
  emu_enqueue([=]() {
    emu_device_open();
    memset(d, v, n);
    emu_device_close();
  });
  return 0;
}
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *p) {
  int dev = p && emu_is_device(p);
  *a = cudaPointerAttributes{dev ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered, 0, dev ? (void *)p : NULL, NULL};
  return 0;
}
void emu_check_pointer(const char *kernel, int arg, const void *p) {
  if (p && !emu_is_device(p)) {
    fprintf(stderr, "EMU: kernel %s: argument %d (%p) is host memory, not device memory\n", kernel, arg, p);
    abort();
  }
}
static void entry() {
  _setjmp(fibers[cur].start);  // (each block's thread starts here: cur is its index)
  (*kernel_fn)();
  fibers[cur].state = DONE;
  _longjmp(sched_jb, 1);
}
static void run_grid(std::function<void()> &f, dim3 g, dim3 b, size_t smem);
void emu_run(std::function<void()> f, dim3 g, dim3 b, size_t smem) {
  emu_enqueue([=]() mutable {
    emu_device_open();
    run_grid(f, g, b, smem);
    emu_device_close();
  });
}
static void run_grid(std::function<void()> &f, dim3 g, dim3 b, size_t smem) {
  unsigned nt = b.x * b.y * b.z;
  if (nt % 32 || nt > 1024) { fprintf(stderr, "EMU: block of %u threads\n", nt); abort(); }
  blockDim = b, gridDim = g, nthreads = nt, kernel_fn = &f;
  std::vector<unsigned char> dyn(smem + 16, 0xff);  // NaN bytes: a read of unwritten shared memory shows
  emu_dyn_smem = dyn.data();
  const size_t SS = 256 * 1024;
  if (fibers.size() < nt) { fibers.resize(1024); for (auto &fb : fibers) if (!fb.stack) fb.stack = (char *)malloc(SS); }
  for (unsigned z = 0; z < g.z; z++) for (unsigned y = 0; y < g.y; y++) for (unsigned x = 0; x < g.x; x++) {
    blockIdx = dim3(x, y, z);
    memset(warp_buf, 0, sizeof warp_buf);
    for (unsigned t = 0; t < nt; t++) {
      if (!fibers[t].made) {
        getcontext(&fibers[t].ctx);
        fibers[t].ctx.uc_stack.ss_sp = fibers[t].stack; fibers[t].ctx.uc_stack.ss_size = SS; fibers[t].ctx.uc_link = NULL;
        makecontext(&fibers[t].ctx, entry, 0);
      }
      fibers[t].state = RUN;
      fibers[t].started = 0;
    }
    for (;;) {
      for (unsigned t = 0; t < nt; t++) {
        if (fibers[t].state != RUN) continue;
        cur = t; threadIdx = dim3(t % b.x, t / b.x % b.y, t / (b.x * b.y));
        if (!_setjmp(sched_jb)) {
          if (!fibers[t].started) {
            fibers[t].started = 1;
            if (fibers[t].made) _longjmp(fibers[t].start, 1);  // (its entry's frame, from an earlier block)
            fibers[t].made = 1;
            swapcontext(&sched_ctx, &fibers[t].ctx);  // never returns here: the fiber longjmps back
          }
          _longjmp(fibers[t].jb, 1);
        }
      }
      // every fiber is at a barrier or done: release what can go
      int done = 0, at_block = 0, moved = 0;
      for (unsigned t = 0; t < nt; t++) done += fibers[t].state == DONE, at_block += fibers[t].state == AT_BLOCK;
      if (done == (int)nt) break;
      for (unsigned w = 0; w < nt / 32; w++) {
        int at = 0, d = 0;
        for (int l = 0; l < 32; l++) at += fibers[w * 32 + l].state == AT_WARP, d += fibers[w * 32 + l].state == DONE;
        if (at == 32) { for (int l = 0; l < 32; l++) fibers[w * 32 + l].state = RUN; moved = 1; }
        else if (at && at + d == 32) { fprintf(stderr, "EMU: shuffle with exited lanes\n"); abort(); }
      }
      if (!moved && at_block == (int)nt) { for (unsigned t = 0; t < nt; t++) fibers[t].state = RUN; moved = 1; }
      if (!moved) { fprintf(stderr, "EMU: deadlock (%d done, %d at __syncthreads of %u)\n", done, at_block, nt); abort(); }
    }
  }
}
