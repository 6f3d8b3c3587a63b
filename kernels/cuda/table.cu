// The CUDA op table: the slots of kernels/kernels.h on device pointers,
// gathered from the op files of this folder, and the little state they
// share: the stream, one scratch buffer, the first error of a void op.
//
// One table per process, driven from one thread at a time on one stream:
// mrl_cuda_ops_set_stream chooses it (between ops), and since ops on one
// stream run in order, one scratch buffer serves them all. An op whose slot
// returns nothing records its failure (bad shape, launch error, cuBLASLt
// status) as the pending error, which mrl_cuda_ops_check returns.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "ops.cuh"
#include "base/error.h"

static cudaStream_t g_stream;
static void *g_scratch;
static size_t g_scratch_bytes;
static int *g_flag;  // [1]: the first bad sequence of paged attention (NO_FLAG: none)
static mrl_status g_pending;
static char g_pending_msg[512];
static int g_sms;
static uint64_t g_epoch;  // mrl_cuda_ops_epoch

void cuda_ops_memory_changed(void) { g_epoch++; }
extern "C" uint64_t mrl_cuda_ops_epoch(void) { return g_epoch; }

#define NO_FLAG 0x7f7f7f7f  // what cudaMemset(.., 0x7f, ..) leaves in an int

cudaStream_t cuda_ops_stream(void) { return g_stream; }

mrl_status cuda_ops_fail(mrl_status st, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (g_pending == MRL_OK) {
        g_pending = st;
        snprintf(g_pending_msg, sizeof g_pending_msg, "%s", msg);
    }
    return mrl_set_error(st, "%s", msg);
}

mrl_status cuda_ops_launched(const char *what) {
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return MRL_OK;
    return cuda_ops_fail(MRL_ERR_DEVICE, "cuda %s: launch failed: %s", what, cudaGetErrorString(err));
}

void *cuda_ops_scratch(size_t bytes) {
    if (bytes <= g_scratch_bytes) return g_scratch;
    size_t want = bytes + bytes / 4 + 4096;  // grow by a quarter more: fewer reallocations
    if (g_scratch) {
        cudaStreamSynchronize(g_stream);  // earlier ops may still read the old buffer
        cudaFree(g_scratch);
        g_scratch = NULL, g_scratch_bytes = 0;
    }
    cudaError_t err = cudaMalloc(&g_scratch, want);
    g_epoch++;
    if (err != cudaSuccess) {
        g_scratch = NULL;
        cuda_ops_fail(MRL_ERR_NOMEM, "cuda ops: no device memory for %zu bytes of scratch: %s", want,
                      cudaGetErrorString(err));
        return NULL;
    }
    g_scratch_bytes = want;
    return g_scratch;
}

int *cuda_ops_device_flag(void) {
    if (!g_flag) {
        g_epoch++;
        if (cudaMalloc(&g_flag, sizeof(int)) != cudaSuccess) {
            g_flag = NULL;
            cuda_ops_fail(MRL_ERR_NOMEM, "cuda ops: no device memory for the error flag");
            return NULL;
        }
        // set before any stream's kernel reads it (the table's stream may not wait for the legacy one)
        if (cudaMemset(g_flag, 0x7f, sizeof(int)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
            cudaFree(g_flag);
            g_flag = NULL;
            cuda_ops_fail(MRL_ERR_DEVICE, "cuda ops: could not set the error flag");
        }
    }
    return g_flag;
}

int cuda_ops_sm_count(void) {
    if (!g_sms) {
        int dev = 0;
        cudaGetDevice(&dev);
        if (cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || g_sms < 1)
            g_sms = 1;
    }
    return g_sms;
}

extern "C" void mrl_cuda_ops_set_stream(void *stream) { g_stream = (cudaStream_t)stream; }
extern "C" void *mrl_cuda_ops_stream(void) { return (void *)g_stream; }

extern "C" mrl_status mrl_cuda_ops_check(void) {
    cudaError_t err = cudaStreamSynchronize(g_stream);
    if (err != cudaSuccess)
        cuda_ops_fail(MRL_ERR_DEVICE, "cuda ops: a kernel failed: %s", cudaGetErrorString(err));
    if (g_flag) {
        int bad = NO_FLAG;
        if (cudaMemcpy(&bad, g_flag, sizeof bad, cudaMemcpyDeviceToHost) == cudaSuccess && bad != NO_FLAG) {
            cuda_ops_fail(MRL_ERR_INVALID,
                          "paged_attention_cuda: sequence %d has more queries than tokens or more tokens than "
                          "its blocks hold (its output is NaN)",
                          bad);
            cudaMemsetAsync(g_flag, 0x7f, sizeof(int), g_stream);
            cudaStreamSynchronize(g_stream);
        }
    }
    mrl_status st = g_pending;
    if (st != MRL_OK) {
        mrl_set_error(st, "%s", g_pending_msg);
        g_pending = MRL_OK;
    }
    return st;
}

extern "C" void mrl_cuda_ops_release(void) {
    cudaStreamSynchronize(g_stream);
    cuda_gemm_release();
    if (g_scratch) cudaFree(g_scratch);
    if (g_flag) cudaFree(g_flag);
    g_scratch = NULL, g_scratch_bytes = 0, g_flag = NULL;
    g_epoch++;
}

// ---- the table's memory (kernels.h): device memory, moved on the table's stream ----

static void cuda_copy(void *dst, const void *src, int64_t bytes) {
    if (bytes <= 0 || dst == src) return;
    cudaError_t err = cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDeviceToDevice, g_stream);
    if (err != cudaSuccess)
        cuda_ops_fail(MRL_ERR_DEVICE, "cuda copy of %lld bytes: %s", (long long)bytes, cudaGetErrorString(err));
}

static void cuda_zero(void *dst, int64_t bytes) {
    if (bytes <= 0) return;
    cudaError_t err = cudaMemsetAsync(dst, 0, (size_t)bytes, g_stream);
    if (err != cudaSuccess)
        cuda_ops_fail(MRL_ERR_DEVICE, "cuda zero of %lld bytes: %s", (long long)bytes, cudaGetErrorString(err));
}

// From pageable host memory, cudaMemcpyAsync returns once the source is
// staged: the caller may reuse it at once (moonrl never pins host memory).
static mrl_status cuda_to_device(void *dst, const void *src, int64_t bytes) {
    if (bytes <= 0) return MRL_OK;
    cudaError_t err = cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyHostToDevice, g_stream);
    if (err != cudaSuccess)
        return mrl_set_error(MRL_ERR_DEVICE, "cuda copy of %lld bytes to the device: %s", (long long)bytes,
                             cudaGetErrorString(err));
    return MRL_OK;
}

static mrl_status cuda_to_host(void *dst, const void *src, int64_t bytes) {
    if (bytes <= 0) return MRL_OK;
    cudaError_t err = cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDeviceToHost, g_stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(g_stream);
    if (err != cudaSuccess)
        return mrl_set_error(MRL_ERR_DEVICE, "cuda copy of %lld bytes to the host: %s", (long long)bytes,
                             cudaGetErrorString(err));
    return MRL_OK;
}

static const mrl_kernels cuda_table = {
    .name = "cuda",
    .on_device = 1,
    .copy = cuda_copy,
    .zero = cuda_zero,
    .to_device = cuda_to_device,
    .to_host = cuda_to_host,
    .sync = mrl_cuda_ops_check,
    .copy_rows = cuda_copy_rows,
    .gemm = cuda_gemm,
    .gemm_group = cuda_gemm_group,
    .qgemm = cuda_qgemm,
    .gemm_bf16 = cuda_gemm_bf16,
    .gemm_bf16_panels = cuda_gemm_bf16_panels,
    .gemm_bf16_panels_group = cuda_gemm_bf16_panels_group,
    .rmsnorm_fwd = cuda_rmsnorm_fwd,
    .rmsnorm_bwd = cuda_rmsnorm_bwd,
    .rope = cuda_rope,
    .mla_qkv = cuda_mla_qkv,
    .mla_qkv_bwd = cuda_mla_qkv_bwd,
    .swiglu_fwd = cuda_swiglu_fwd,
    .swiglu_bwd = cuda_swiglu_bwd,
    .attn_fwd = cuda_attn_fwd,
    .attn_bwd = cuda_attn_bwd,
    .head_fwd = cuda_head_fwd,
    .head_bwd = cuda_head_bwd,
    .gather_rows = cuda_gather_rows,
    .scatter_add_rows = cuda_scatter_add_rows,
    .bias_add = cuda_bias_add,
    .bias_bwd = cuda_bias_bwd,
    .lora_fwd = cuda_lora_fwd,
    .panels_pack = cuda_panels_pack,
    .panels16_pack = cuda_panels16_pack,
    .paged_kv_write = cuda_paged_kv_write,
    .paged_kv_write_bf16 = cuda_paged_kv_write_bf16,
    .paged_attn_workspace = cuda_paged_attn_workspace,
    .paged_attn = cuda_paged_attn,
    .mla_paged_attn = cuda_mla_paged_attn,
    .latent_kv_write = cuda_latent_kv_write,
    .sample = cuda_sample,
    .top_logprobs = cuda_top_logprobs,
    .moe_route = cuda_moe_route,
    .moe_route_grouped = cuda_moe_route_grouped,
    .moe_group = cuda_moe_group,
    .adamw = cuda_adamw,
    .sum = cuda_sum,
    .scale = cuda_scale,
    .add = cuda_add,
    .bf16_to_f32 = cuda_bf16_to_f32,
    .f32_to_bf16 = cuda_f32_to_bf16,
    .f16_to_f32 = cuda_f16_to_f32,
    .f32_to_f16 = cuda_f32_to_f16,
    .dequant = cuda_dequant,
};

extern "C" const mrl_kernels *mrl_kernels_cuda(void) { return &cuda_table; }
