// CUDA device, memory and stream layer. Plain cudaMalloc (no managed
// memory); every call's error is turned into an mrl_status with the CUDA
// error string.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

// ---- virtual memory: address space whose pages get GPU memory one by one ----
// (a sharded model's parameter region: core/base/mem.h's backing, runtime/device.c). The
// driver's functions come through the runtime (cudaGetDriverEntryPointByVersion), so that
// libmoonrl does not link libcuda, which a machine without a driver lacks. Each page is an
// allocation of its own, so that any page can be given back; pages given back are kept for
// the next map (a part gathered and let go every layer of every step).
typedef CUresult (*fn_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*fn_addr_free)(CUdeviceptr, size_t);
typedef CUresult (*fn_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*fn_release)(CUmemGenericAllocationHandle);
typedef CUresult (*fn_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*fn_unmap)(CUdeviceptr, size_t);
typedef CUresult (*fn_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*fn_granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);

static struct {
    int loaded; /* 1: the functions are there; -1: they are not */
    fn_reserve reserve;
    fn_addr_free addr_free;
    fn_create create;
    fn_release release;
    fn_map map;
    fn_unmap unmap;
    fn_access access;
    fn_granularity granularity;
} vmm;

static mrl_status vmm_load(void) {
    if (vmm.loaded == 0) {
        struct { const char *name; void **fn; } want[] = {
            {"cuMemAddressReserve", (void **)&vmm.reserve}, {"cuMemAddressFree", (void **)&vmm.addr_free},
            {"cuMemCreate", (void **)&vmm.create},          {"cuMemRelease", (void **)&vmm.release},
            {"cuMemMap", (void **)&vmm.map},                {"cuMemUnmap", (void **)&vmm.unmap},
            {"cuMemSetAccess", (void **)&vmm.access},       {"cuMemGetAllocationGranularity", (void **)&vmm.granularity}};
        vmm.loaded = 1;
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
            cudaDriverEntryPointQueryResult q;
            if (cudaGetDriverEntryPointByVersion(want[i].name, want[i].fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
                q != cudaDriverEntryPointSuccess || !*want[i].fn)
                vmm.loaded = -1;
        }
    }
    if (vmm.loaded < 0)
        return mrl_set_error(MRL_ERR_UNSUPPORTED, "CUDA virtual memory (cuMemCreate, cuMemMap): not in this driver");
    return MRL_OK;
}

static mrl_status drv(CUresult r, const char *what) {
    if (r == CUDA_SUCCESS) return MRL_OK;
    return mrl_set_error(MRL_ERR_DEVICE, "CUDA %s failed (CUresult %d)", what, (int)r);
}

static CUmemAllocationProp vmm_prop(int device) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    return p;
}

struct vmm_region {
    int device;
    int64_t page, pages;
    CUmemGenericAllocationHandle *handles; /* [pages]: 0 where unmapped */
    CUmemGenericAllocationHandle *spare;   /* pages given back, for the next map */
    int64_t n_spare;
};

extern "C" mrl_status mrl_cuda_vmm_page(int device, int64_t *page) {
    mrl_status st = vmm_load();
    if (st) return st;
    CUmemAllocationProp p = vmm_prop(device);
    size_t g = 0;
    if ((st = drv(vmm.granularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")))
        return st;
    *page = (int64_t)g;
    return MRL_OK;
}

extern "C" mrl_status mrl_cuda_vmm_reserve(int device, int64_t bytes, int64_t page, void **base, void **state) {
    mrl_status st = vmm_load();
    if (st) return st;
    vmm_region *r = (vmm_region *)calloc(1, sizeof *r);
    if (r) r->handles = (CUmemGenericAllocationHandle *)calloc((size_t)(bytes / page), sizeof *r->handles);
    if (r) r->spare = (CUmemGenericAllocationHandle *)calloc((size_t)(bytes / page), sizeof *r->spare);
    if (!r || !r->handles || !r->spare) {
        if (r) free(r->handles), free(r->spare), free(r);
        return mrl_set_error(MRL_ERR_NOMEM, "out of memory");
    }
    r->device = device, r->page = page, r->pages = bytes / page;
    CUdeviceptr p = 0;
    if ((st = drv(vmm.reserve(&p, (size_t)bytes, (size_t)page, 0, 0), "cuMemAddressReserve"))) {
        free(r->handles), free(r->spare), free(r);
        return st;
    }
    *base = (void *)p;
    *state = r;
    return MRL_OK;
}

extern "C" mrl_status mrl_cuda_vmm_map(void *state, void *base, int64_t lo, int64_t hi) {
    vmm_region *r = (vmm_region *)state;
    CUmemAllocationProp prop = vmm_prop(r->device);
    mrl_status st = MRL_OK;
    int64_t p = lo / r->page;
    for (; p < hi / r->page && !st; p++) {
        CUmemGenericAllocationHandle h = 0;
        if (r->n_spare) h = r->spare[--r->n_spare];
        else if ((st = drv(vmm.create(&h, (size_t)r->page, &prop, 0), "cuMemCreate"))) break;
        if ((st = drv(vmm.map((CUdeviceptr)base + p * r->page, (size_t)r->page, 0, h, 0), "cuMemMap"))) {
            r->spare[r->n_spare++] = h;
            break;
        }
        r->handles[p] = h;
    }
    if (!st) {
        CUmemAccessDesc a;
        memset(&a, 0, sizeof a);
        a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        a.location.id = r->device;
        a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        st = drv(vmm.access((CUdeviceptr)base + lo, (size_t)(hi - lo), &a, 1), "cuMemSetAccess");
    }
    if (!st) st = check(cudaMemset((char *)base + lo, 0, (size_t)(hi - lo)), "cudaMemset"); /* zero-filled, as the host's */
    if (st) mrl_cuda_vmm_unmap(state, base, lo, p * r->page);
    return st;
}

extern "C" void mrl_cuda_vmm_unmap(void *state, void *base, int64_t lo, int64_t hi) {
    vmm_region *r = (vmm_region *)state;
    int synced = 0;
    for (int64_t p = lo / r->page; p < hi / r->page; p++) {
        if (!r->handles[p]) continue;
        /* kernels queued on the pages finish first (unmapping does not wait for them) */
        if (!synced) cudaDeviceSynchronize(), synced = 1;
        vmm.unmap((CUdeviceptr)base + p * r->page, (size_t)r->page);
        r->spare[r->n_spare++] = r->handles[p];
        r->handles[p] = 0;
    }
}

extern "C" void mrl_cuda_vmm_release(void *state, void *base, int64_t bytes) {
    vmm_region *r = (vmm_region *)state;
    if (!r) return;
    mrl_cuda_vmm_unmap(state, base, 0, bytes);
    for (int64_t i = 0; i < r->n_spare; i++) vmm.release(r->spare[i]);
    vmm.addr_free((CUdeviceptr)base, (size_t)bytes);
    free(r->handles), free(r->spare), free(r);
}
