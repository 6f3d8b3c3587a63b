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
#include <cstdio>
#include <ucontext.h>
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
void *emu_dyn_smem;
std::mutex emu_atomic;
int emu_gemm_calls[2];
enum { RUN, AT_BLOCK, AT_WARP, DONE };
struct fiber { ucontext_t ctx; int state; char *stack; };
static std::vector<fiber> fibers;
static ucontext_t sched_ctx;
static int cur, nthreads;
static std::function<void()> *kernel_fn;
// shuffle slots [warp][buffer][lane]: two buffers, alternated per shuffle,
// so that a lane may publish the next value while others still read
static unsigned char slots[32][2][32][8];
static int warp_buf[32][1024];
int emu_lane() { return cur % 32; }
static void yield(int st) { fibers[cur].state = st; swapcontext(&fibers[cur].ctx, &sched_ctx); }
void __syncthreads() { yield(AT_BLOCK); }
void emu_warp_exchange(const void *v, void *out, int src, size_t bytes) {
  int w = cur / 32, l = cur % 32, b = warp_buf[w][l]++ & 1;
  memcpy(slots[w][b][l], v, bytes);
  yield(AT_WARP);
  memcpy(out, slots[w][b][src], bytes);
}
cudaError_t cudaMalloc(void **p, size_t n) { *p = aligned_alloc(256, (n + 255) / 256 * 256 + 256); if (*p) memset(*p, 0xff, n); return *p ? 0 : 2; }
cudaError_t cudaFree(void *p) { free(p); return 0; }
static void entry() {
  (*kernel_fn)();
  fibers[cur].state = DONE;
  swapcontext(&fibers[cur].ctx, &sched_ctx);
}
void emu_run(std::function<void()> f, dim3 g, dim3 b, size_t smem) {
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
      getcontext(&fibers[t].ctx);
      fibers[t].ctx.uc_stack.ss_sp = fibers[t].stack; fibers[t].ctx.uc_stack.ss_size = SS; fibers[t].ctx.uc_link = NULL;
      makecontext(&fibers[t].ctx, entry, 0);
      fibers[t].state = RUN;
    }
    for (;;) {
      for (unsigned t = 0; t < nt; t++) {
        if (fibers[t].state != RUN) continue;
        cur = t; threadIdx = dim3(t % b.x, t / b.x % b.y, t / (b.x * b.y));
        swapcontext(&sched_ctx, &fibers[t].ctx);
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
