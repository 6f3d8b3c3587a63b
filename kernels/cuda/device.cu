// CUDA device, memory and stream layer. Plain cudaMalloc (no managed
// memory); every call's error is turned into an mrl_status with the CUDA
// error string.
#include <cuda_runtime.h>
#include <stdio.h>
#include "cuda_backend.h"
#include "base/error.h"

static mrl_status check(cudaError_t err, const char *what) {
    if (err == cudaSuccess) return MRL_OK;
    return mrl_set_error(MRL_ERR_DEVICE, "CUDA %s failed: %s", what, cudaGetErrorString(err));
}

extern "C" int mrl_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // no driver or no GPU: report zero, clear the sticky error
        return 0;
    }
    return n;
}

extern "C" mrl_status mrl_cuda_describe(int device, char *buf, size_t buf_size) {
    cudaDeviceProp prop;
    mrl_status st = check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    if (st != MRL_OK) return st;
    snprintf(buf, buf_size, "cuda:%d (%s, %.0f GiB, sm_%d%d)", device, prop.name,
             prop.totalGlobalMem / 1073741824.0, prop.major, prop.minor);
    return MRL_OK;
}

extern "C" mrl_status mrl_cuda_malloc(int device, size_t bytes, void **out) {
    mrl_status st = check(cudaSetDevice(device), "cudaSetDevice");
    if (st != MRL_OK) return st;
    return check(cudaMalloc(out, bytes ? bytes : 1), "cudaMalloc");
}

extern "C" void mrl_cuda_free(void *ptr) {
    if (ptr) cudaFree(ptr);
}

extern "C" mrl_status mrl_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind, void *stream) {
    cudaMemcpyKind k = kind == 0                 ? cudaMemcpyHostToDevice
                       : kind == 1 || kind == 4 ? cudaMemcpyDeviceToHost
                       : kind == 2              ? cudaMemcpyDeviceToDevice
                                                : cudaMemcpyDefault;
    mrl_status st = check(cudaMemcpyAsync(dst, src, bytes, k, (cudaStream_t)stream), "cudaMemcpyAsync");
    if (st != MRL_OK) return st;
    // a copy to the host must be complete when the call returns
    if (kind == 1 || kind == 3) return check(cudaStreamSynchronize((cudaStream_t)stream), "cudaStreamSynchronize");
    return MRL_OK;
}

extern "C" mrl_status mrl_cuda_host_register(void *ptr, size_t bytes) {
    return check(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault), "cudaHostRegister");
}

extern "C" void mrl_cuda_host_unregister(void *ptr) {
    if (ptr) cudaHostUnregister(ptr);
}

extern "C" int mrl_cuda_pointer_device(const void *ptr, int *device) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
        cudaGetLastError();  // a plain host pointer on an old driver: not an error of ours
        return 0;
    }
    if (attr.type != cudaMemoryTypeDevice) return 0;
    *device = attr.device;
    return 1;
}

extern "C" mrl_status mrl_cuda_memset_zero(void *ptr, size_t bytes, void *stream) {
    return check(cudaMemsetAsync(ptr, 0, bytes, (cudaStream_t)stream), "cudaMemsetAsync");
}

extern "C" mrl_status mrl_cuda_stream_create(int device, void **out) {
    mrl_status st = check(cudaSetDevice(device), "cudaSetDevice");
    if (st != MRL_OK) return st;
    cudaStream_t s;
    st = check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    if (st == MRL_OK) *out = (void *)s;
    return st;
}

extern "C" mrl_status mrl_cuda_stream_sync(void *stream) {
    return check(cudaStreamSynchronize((cudaStream_t)stream), "cudaStreamSynchronize");
}

extern "C" void mrl_cuda_stream_destroy(void *stream) {
    if (stream) cudaStreamDestroy((cudaStream_t)stream);
}

// ---- CUDA graphs (the engine's decode steps) ----

extern "C" mrl_status mrl_cuda_graph_begin(void *stream) {
    // thread-local: a call of this thread that may not be captured (an allocation, a
    // synchronisation) fails the capture instead of running
    return check(cudaStreamBeginCapture((cudaStream_t)stream, cudaStreamCaptureModeThreadLocal),
                 "cudaStreamBeginCapture");
}

extern "C" mrl_status mrl_cuda_graph_end(void *stream, void **exec) {
    *exec = NULL;
    cudaGraph_t graph = NULL;
    cudaError_t err = cudaStreamEndCapture((cudaStream_t)stream, &graph);
    if (err == cudaSuccess) {
        cudaGraphExec_t e = NULL;
        err = cudaGraphInstantiate(&e, graph, 0);
        if (err == cudaSuccess) *exec = (void *)e;
    }
    if (graph) cudaGraphDestroy(graph);
    if (err != cudaSuccess) {
        const char *why = cudaGetErrorString(err);
        cudaGetLastError();  // a failed capture's error is ours to report, not sticky for the next op
        return mrl_set_error(MRL_ERR_DEVICE, "CUDA graph capture failed: %s", why);
    }
    return MRL_OK;
}

extern "C" mrl_status mrl_cuda_graph_launch(void *exec, void *stream) {
    return check(cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream), "cudaGraphLaunch");
}

extern "C" void mrl_cuda_graph_free(void *exec) {
    if (exec) cudaGraphExecDestroy((cudaGraphExec_t)exec);
}
