// A stand-in for <cuda_runtime.h>: what kernels/cuda uses of CUDA, on the
// CPU (tests/gpu/emu/build.sh). Device memory is host memory the host code
// cannot touch: each allocation is its own mapping, readable only while a
// kernel, a copy or the emulated cuBLASLt runs (emu_device_open/close), so
// host code that reads device memory dies with SIGSEGV as it would read
// garbage on a GPU; and every pointer given to a kernel must be device
// memory (or NULL), or the launch aborts naming the kernel and argument.
// A launch runs its blocks one after the other, each block's threads as
// fibers (emu.cpp) that meet at __syncthreads and at every warp shuffle;
// __shared__ variables are statics (one block runs at a time); atomics take
// a lock. The fp32 intrinsics are the plain operations, compiled with
// -ffp-contract=off; the math functions are the host's.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstddef>
#include <cstdlib>
#include <algorithm>
#include <barrier>
#include <mutex>
#include <thread>
#include <vector>
#include <functional>
#include <type_traits>
using std::min; using std::max; using std::isinf; using std::isnan;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
extern thread_local dim3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
extern void *emu_dyn_smem;
typedef struct CUstream_st *cudaStream_t;
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2 };
struct cudaPointerAttributes { cudaMemoryType type; int device; void *devicePointer, *hostPointer; };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount };
#define cudaStreamNonBlocking 1
struct cudaDeviceProp { char name[256]; size_t totalGlobalMem; int major, minor; };
inline const char *cudaGetErrorString(cudaError_t e) { return e ? "emulated error" : "no error"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return 0; }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int) { strcpy(p->name, "CPU emulation"); p->totalGlobalMem = 1ull << 30; p->major = 9; p->minor = 0; return 0; }
inline cudaError_t cudaSetDevice(int) { return 0; }
inline cudaError_t cudaGetDevice(int *d) { *d = 0; return 0; }
inline cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr, int) { *v = 2; return 0; }
cudaError_t cudaMalloc(void **p, size_t n);
template <class T> cudaError_t cudaMalloc(T **p, size_t n) { return cudaMalloc((void **)p, n); }
cudaError_t cudaFree(void *p);
// device memory readable by the host between open and close (nested)
void emu_device_open();
void emu_device_close();
// 1 when p is inside a live device allocation
int emu_is_device(const void *p);
// each copy checks that its device side is device memory and its host side is not
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t = 0);
inline cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k) { return cudaMemcpyAsync(d, s, n, k); }
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t = 0);
inline cudaError_t cudaMemset(void *d, int v, size_t n) { return cudaMemsetAsync(d, v, n); }
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *p);
// the launch's pointer arguments: device memory or NULL (a host pointer aborts)
void emu_check_pointer(const char *kernel, int arg, const void *p);
template <class T> void emu_check_arg(const char *kernel, int arg, const T &v) {
  if constexpr (std::is_pointer<T>::value) emu_check_pointer(kernel, arg, (const void *)v);
}
template <class... A> void emu_check_args(const char *kernel, const A &...a) {
  int i = 0;
  (emu_check_arg(kernel, i++, a), ...);
}
// the driver's functions by name (cuda.h: its virtual memory, emulated in emu.cpp)
enum cudaDriverEntryPointQueryResult { cudaDriverEntryPointSuccess = 0, cudaDriverEntryPointSymbolNotFound = 1 };
enum { cudaEnableDefault = 0 };
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned version, unsigned long long flags,
                                             cudaDriverEntryPointQueryResult *q);
// waits: nothing to wait for (launches run at once), but not allowed while capturing
cudaError_t cudaStreamSynchronize(cudaStream_t);
inline cudaError_t cudaDeviceSynchronize() { return cudaStreamSynchronize(0); }
// graphs: while a capture is open, launches, device-to-device copies, memsets and the emulated
// cuBLASLt / CUB calls are recorded instead of run (emu_enqueue); a launch of the graph runs
// them in order. An allocation, a free, a wait or a copy to or from the host while capturing
// fails and spoils the capture (cudaStreamEndCapture then fails), as on a GPU.
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed };
typedef struct emu_graph *cudaGraph_t;
typedef struct emu_graph *cudaGraphExec_t;
cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode);
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *, cudaGraph_t, unsigned long long);
cudaError_t cudaGraphDestroy(cudaGraph_t);
cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t);
// run f now, or record it into the open capture
void emu_enqueue(std::function<void()> f);
// 1 while a capture is open; emu_capture_spoil(why) fails it
int emu_capturing();
void emu_capture_spoil(const char *why);
// page-locked host memory: every copy of the emulator is synchronous, nothing to lock
enum { cudaHostRegisterDefault = 0 };
inline cudaError_t cudaHostRegister(void *, size_t, unsigned) { return 0; }
inline cudaError_t cudaHostUnregister(void *) { return 0; }
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, int) { *s = (cudaStream_t)malloc(1); return 0; }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) { free(s); return 0; }
template <class K> cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int) { return 0; }
// every thread of the block arrives before any goes on
void __syncthreads();
// a warp's lanes publish v, then each reads lane src's (one sync point)
void emu_warp_exchange(const void *v, void *out, int src, size_t bytes);
int emu_lane();
template <class T> T __shfl_sync(unsigned, T v, int src) { T r; emu_warp_exchange(&v, &r, src & 31, sizeof(T)); return r; }
template <class T> T __shfl_xor_sync(unsigned, T v, int m) { return __shfl_sync(0u, v, emu_lane() ^ m); }
template <class T> T __shfl_up_sync(unsigned, T v, int d) { int s = emu_lane() - d; T r = __shfl_sync(0u, v, s < 0 ? emu_lane() : s); return r; }
extern std::mutex emu_atomic;
template <class T> T atomicAdd(T *p, T v) { std::lock_guard<std::mutex> g(emu_atomic); T o = *p; *p = o + v; return o; }
template <class T> T atomicMin(T *p, T v) { std::lock_guard<std::mutex> g(emu_atomic); T o = *p; if (v < o) *p = v; return o; }
template <class T> T atomicMax(T *p, T v) { std::lock_guard<std::mutex> g(emu_atomic); T o = *p; if (v > o) *p = v; return o; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
// run f as every thread of every block of the grid, with smem bytes of dynamic shared memory
void emu_run(std::function<void()> f, dim3 g, dim3 b, size_t smem);
template <class F> void emu_launch(F f, dim3 g, dim3 b, size_t smem = 0, cudaStream_t = 0) { emu_run(f, g, b, smem); }
