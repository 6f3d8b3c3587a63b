/* The model on a GPU (mrl_model_set_device) against the same model on the
 * CPU, from the same weights, for each arch (Llama with a value head,
 * Qwen2's biases, Qwen3's per-head norms), in fp32 and bf16, with and
 * without recomputation:
 *   - log-probs, entropy and values of a packed batch (a shared prompt
 *     included); the gradients of a random weighting of the three;
 *   - the clipped gradient norm, one AdamW step (state on the device) and
 *     the forward after it (the bf16 copies refreshed on the device);
 *   - the parameters back on the host three ways: mrl_device_memcpy,
 *     save_raw / save_dir (loaded again on the CPU), and the model moved
 *     back to the CPU: the same bits each time; load_raw into a GPU model;
 *   - the optimizer state loaded from host arrays and read back;
 *   - device memory accounting (moonrl/mem.h) by category;
 *   - a region in the GPU's virtual memory (a sharded model's parameters):
 *     pages mapped where pinned, zero-filled, counted as device memory, the
 *     values kept while pinned, given back when the last pin goes;
 *   - the refusals: CPU kernels for a GPU model, a mixture of experts, the
 *     reference AdamW step (the engine's: tests/gpu/test_cuda_engine.c).
 * Skips (exit 77) where no GPU is visible. Without a GPU,
 * tests/gpu/emu/build.sh makes an emulated one to LD_PRELOAD (the
 * cuda_model_emu test of tests/gpu/meson.build does): then every host read
 * of device memory and every host pointer given to a kernel fails too. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "check.h"
#include "models.h"
#include "moonrl/device.h"
#include "moonrl/mem.h"
#include "moonrl/model.h"
#include "moonrl/optim.h"
#include "moonrl/runtime.h"
#include "base/mem.h"
#include "runtime/device_internal.h"

/* ---- bounds, and why ----
 * fp32: the same operations in other orders (cuBLASLt's fp32 products, the
 * kernels' tree sums, against OpenBLAS and the fast table's loops): a few
 * fp32 ulps per op, through ~8 products forward and more backward. Log-probs
 * of size ~3: 1e-4 absolute is ~100 ulps; gradients 1e-4 of each matrix's
 * norm. A wrong operand, a missed copy or a stale buffer moves them by O(1).
 * bf16: the two sides round the same fp32 activations to bf16, which agree
 * until an fp32 ulp of difference crosses a bf16 rounding edge (2^-8
 * relative) now and then: the bounds of tests/model/test_bf16.c for two
 * tables (LP_TABLES, GRAD_TABLES). */
#define LP_FP32 1e-4
#define GRAD_FP32 1e-4
#define LP_BF16 0.025
#define GRAD_BF16 0.015

static const mrl_device GPU = {MRL_DEVICE_CUDA, 0}, CPU = {MRL_DEVICE_CPU, 0};

/* tests/lib/models.h's, the Llama one with a value head (values and their gradient) */
static mrl_model_config config(int arch) {
    mrl_model_config c = small_config(arch);
    if (arch == MRL_ARCH_LLAMA) c.value_head = 1;
    return c;
}

static mrl_model *make_model(int arch, uint64_t seed) {
    mrl_model_config c = config(arch);
    return small_model(&c, seed);
}

/* n floats of a device (or host) buffer, in a new host array */
static float *fetch(const float *p, int64_t n) {
    float *h = malloc(sizeof(float) * n);
    CHECK_OK(mrl_device_memcpy(h, p, sizeof(float) * n));
    return h;
}

typedef struct outputs {
    float lp[96], ent[96], val[96];
} outputs;

static void forward(mrl_model *m, const batch *x, outputs *o) {
    memset(o, 0, sizeof *o);
    int critic = mrl_model_get_config(m)->value_head;
    CHECK_OK(mrl_model_forward(m, &x->b, 0.9f, o->lp, o->ent, critic ? o->val : NULL));
}

static void compare_outputs(const char *what, const outputs *g, const outputs *c, int64_t T, int critic, double tol) {
    double lp = max_abs_diff(g->lp, c->lp, T), ent = max_abs_diff(g->ent, c->ent, T);
    double val = critic ? max_abs_diff(g->val, c->val, T) : 0;
    printf("  %s: max |d logprob| %.3g, |d entropy| %.3g, |d value| %.3g\n", what, lp, ent, val);
    CHECK(lp <= tol);
    CHECK(ent <= tol);
    CHECK(val <= tol);
}

static void case_model(int arch, int bf16, int recompute) {
    printf("arch %d, %s%s:\n", arch, bf16 ? "bf16" : "fp32", recompute ? ", recompute" : "");
    batch x;
    make_batch(&x, config(arch).vocab_size);
    int64_t T = x.b.n_tokens;
    mrl_model *c = make_model(arch, 7 + arch), *g = make_model(arch, 7 + arch);
    int64_t n = mrl_model_num_params(c);
    int critic = config(arch).value_head;
    double lp_tol = bf16 ? LP_BF16 : LP_FP32, grad_tol = bf16 ? GRAD_BF16 : GRAD_FP32;
    for (int side = 0; side < 2; side++) {
        mrl_model *m = side ? g : c;
        if (bf16) CHECK_OK(mrl_model_set_dtype(m, MRL_MODEL_BF16));
        mrl_model_set_recompute(m, recompute);
    }
    CHECK_OK(mrl_model_set_device(g, GPU));
    CHECK(mrl_model_get_device(g).kind == MRL_DEVICE_CUDA);
    CHECK(mrl_device_of(mrl_model_params(g)).kind == MRL_DEVICE_CUDA);
    CHECK(mrl_device_of(mrl_model_params(c)).kind == MRL_DEVICE_CPU);

    /* forward, backward */
    outputs oc, og;
    forward(c, &x, &oc);
    forward(g, &x, &og);
    compare_outputs("forward", &og, &oc, T, critic, lp_tol);
    for (int side = 0; side < 2; side++) {
        mrl_model *m = side ? g : c;
        mrl_model_zero_grad(m);
        CHECK_OK(mrl_model_backward(m, x.dlp, x.dent, critic ? x.dval : NULL));
    }
    float *gg = fetch(mrl_model_grads(g), n), *gc = mrl_model_grads(c);
    const char *which = "";
    double ge = worst_view(c, gg, gc, &which);
    printf("  gradients: worst ||d|| / ||g|| %.3g (%s)\n", ge, which);
    CHECK(ge <= grad_tol);
    free(gg);

    /* clip, one AdamW step, the forward after it */
    double norm_c = 0, norm_g = 0;
    CHECK_OK(mrl_grad_clip_norm(mrl_model_grads(c), n, 0.5, &norm_c));
    CHECK_OK(mrl_grad_clip_norm(mrl_model_grads(g), n, 0.5, &norm_g));
    printf("  gradient norm %.6g (CPU) %.6g (GPU)\n", norm_c, norm_g);
    CHECK(fabs(norm_g - norm_c) <= grad_tol * norm_c);
    /* the step from the same gradients on both sides (the CPU's): an AdamW step turns the
     * gradients' last bits into whole steps of lr where a gradient is near 0 (m / sqrt(v) is
     * its sign at step 1), so from the GPU's own they would differ by that; from the same
     * ones, the CUDA step must give the CPU's bits */
    CHECK_OK(mrl_device_memcpy(mrl_model_grads(g), mrl_model_grads(c), sizeof(float) * n));
    mrl_adamw_config ac = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1};
    mrl_adamw *oc_ = NULL, *og_ = NULL;
    CHECK_OK(mrl_adamw_create(mrl_model_params(c), mrl_model_grads(c), n, &ac, &oc_));
    CHECK_OK(mrl_adamw_create(mrl_model_params(g), mrl_model_grads(g), n, &ac, &og_));
    int64_t no_decay[2] = {0, 64}; /* some range: the mask's path */
    CHECK_OK(mrl_adamw_set_no_decay(oc_, no_decay, 1));
    CHECK_OK(mrl_adamw_set_no_decay(og_, no_decay, 1));
    CHECK_OK(mrl_adamw_step(oc_, -1));
    CHECK_OK(mrl_adamw_step(og_, -1));
    mrl_model_weights_changed(c);
    mrl_model_weights_changed(g);
    float *pg = fetch(mrl_model_params(g), n);
    double pe = worst_view(c, pg, mrl_model_params(c), &which);
    printf("  after AdamW: parameters worst ||d|| / ||p|| %.3g (%s)\n", pe, which);
    CHECK(memcmp(pg, mrl_model_params(c), sizeof(float) * n) == 0);
    forward(c, &x, &oc);
    forward(g, &x, &og);
    compare_outputs("forward after the step", &og, &oc, T, critic, lp_tol);

    /* the optimizer state: GPU memory, loaded from the host and read back */
    mrl_adamw_state s;
    CHECK_OK(mrl_adamw_get_state(og_, &s));
    CHECK(mrl_device_of(s.m).kind == MRL_DEVICE_CUDA);
    float *mv = malloc(sizeof(float) * 2 * n);
    for (int64_t i = 0; i < 2 * n; i++) mv[i] = (float)(urand() * 1e-3);
    CHECK_OK(mrl_adamw_load_state(og_, mv, mv + n, n, 5));
    CHECK(mrl_adamw_steps(og_) == 5);
    float *m_back = fetch(s.m, n), *v_back = fetch(s.v, n);
    CHECK(memcmp(m_back, mv, sizeof(float) * n) == 0 && memcmp(v_back, mv + n, sizeof(float) * n) == 0);
    free(m_back), free(v_back), free(mv);
    CHECK(mrl_adamw_step_reference(og_, -1) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "GPU");
    mrl_adamw_free(oc_);
    mrl_adamw_free(og_);

    /* the parameters back on the host: a raw file, a directory, the model moved back */
    char raw[64], dir[64];
    snprintf(raw, sizeof raw, "/tmp/moonrl_cuda_model_%d.raw", (int)getpid());
    snprintf(dir, sizeof dir, "/tmp/moonrl_cuda_model_%d", (int)getpid());
    CHECK_OK(mrl_model_save_raw(g, raw));
    mrl_model *back = make_model(arch, 99);
    CHECK_OK(mrl_model_load_raw(back, raw));
    CHECK(memcmp(mrl_model_params(back), pg, sizeof(float) * n) == 0);
    CHECK_OK(mrl_model_save_dir(g, dir));
    mrl_model *loaded = NULL;
    CHECK_OK(mrl_model_load_dir(dir, &loaded));
    if (loaded) CHECK(memcmp(mrl_model_params(loaded), pg, sizeof(float) * n) == 0);
    mrl_model_free(loaded);
    loaded = NULL; /* and in shards: each view through the host buffer of one */
    CHECK_OK(mrl_model_save_dir_sharded(g, dir, (int64_t)n)); /* a quarter of the model's bytes a file */
    char index[128];
    snprintf(index, sizeof index, "%s/model.safetensors.index.json", dir);
    CHECK(access(index, F_OK) == 0);
    CHECK_OK(mrl_model_load_dir(dir, &loaded));
    if (loaded) CHECK(memcmp(mrl_model_params(loaded), pg, sizeof(float) * n) == 0);
    mrl_model_free(loaded);
    /* load_raw into a GPU model: the CPU's weights, then its forward is the CPU's */
    CHECK_OK(mrl_model_save_raw(c, raw));
    CHECK_OK(mrl_model_set_device(back, GPU));
    if (bf16) CHECK_OK(mrl_model_set_dtype(back, MRL_MODEL_BF16));
    CHECK_OK(mrl_model_load_raw(back, raw));
    outputs ob;
    forward(back, &x, &ob);
    compare_outputs("load_raw on the GPU", &ob, &oc, T, critic, lp_tol);
    mrl_model_free(back);
    unlink(raw);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    CHECK_OK(mrl_model_set_device(g, CPU));
    CHECK(memcmp(mrl_model_params(g), pg, sizeof(float) * n) == 0);
    forward(g, &x, &og); /* and it runs there: the CPU's own kernels again */
    compare_outputs("moved back to the CPU", &og, &oc, T, critic, lp_tol);
    free(pg);
    mrl_model_free(c);
    mrl_model_free(g);
}

/* What the GPU's memory holds, by category, while a model trains there. */
static void case_memory(void) {
    mrl_model *g = make_model(MRL_ARCH_QWEN3, 3);
    int64_t n = mrl_model_num_params(g);
    mrl_mem_stats before, s;
    mrl_mem_get_device_stats(&before);
    CHECK_OK(mrl_model_set_device(g, GPU));
    batch x;
    make_batch(&x, config(MRL_ARCH_QWEN3).vocab_size);
    outputs o;
    forward(g, &x, &o);
    CHECK_OK(mrl_model_backward(g, x.dlp, NULL, NULL));
    mrl_adamw_config ac = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0};
    mrl_adamw *opt = NULL;
    CHECK_OK(mrl_adamw_create(mrl_model_params(g), mrl_model_grads(g), n, &ac, &opt));
    mrl_mem_get_device_stats(&s);
    int64_t bytes = n * (int64_t)sizeof(float), acts = mrl_model_activation_bytes(g, x.b.n_tokens);
    printf("device memory: params %lld, grads %lld, optim %lld, activations %lld (expected %lld, %lld, %lld, %lld)\n",
           (long long)(s.current[MRL_MEM_PARAMS] - before.current[MRL_MEM_PARAMS]),
           (long long)(s.current[MRL_MEM_GRADS] - before.current[MRL_MEM_GRADS]),
           (long long)(s.current[MRL_MEM_OPTIM] - before.current[MRL_MEM_OPTIM]),
           (long long)(s.current[MRL_MEM_ACTIVATIONS] - before.current[MRL_MEM_ACTIVATIONS]), (long long)bytes,
           (long long)bytes, (long long)(2 * bytes), (long long)acts);
    CHECK(s.current[MRL_MEM_PARAMS] - before.current[MRL_MEM_PARAMS] == bytes);
    CHECK(s.current[MRL_MEM_GRADS] - before.current[MRL_MEM_GRADS] == bytes);
    CHECK(s.current[MRL_MEM_OPTIM] - before.current[MRL_MEM_OPTIM] == 2 * bytes);
    CHECK(s.current[MRL_MEM_ACTIVATIONS] - before.current[MRL_MEM_ACTIVATIONS] == acts);
    mrl_adamw_free(opt);
    mrl_model_free(g);
    mrl_mem_get_device_stats(&s);
    for (int i = 0; i < MRL_MEM_NUM_CATEGORIES; i++) CHECK(s.current[i] == before.current[i]);
}

static void case_refusals(void) {
    mrl_model *g = make_model(MRL_ARCH_LLAMA, 5);
    CHECK_OK(mrl_model_set_device(g, GPU));
    CHECK(mrl_model_set_kernels(g, MRL_KERNELS_CPU_REFERENCE) == MRL_ERR_INVALID);
    CHECK_STR_CONTAINS(mrl_last_error(), "cuda:0");
    mrl_model_free(g);
    mrl_model_config c = config(MRL_ARCH_QWEN3_MOE);
    c.value_head = 0;
    c.num_experts = 4, c.num_experts_per_tok = 2, c.moe_intermediate_size = 32, c.decoder_sparse_step = 1;
    mrl_model *moe = NULL;
    CHECK_OK(mrl_model_create(&c, 1, &moe));
    CHECK(mrl_model_set_device(moe, GPU) == MRL_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(mrl_last_error(), "mixture-of-experts");
    mrl_model_free(moe);
    mrl_model *far = make_model(MRL_ARCH_LLAMA, 6);
    CHECK(mrl_model_set_device(far, (mrl_device){MRL_DEVICE_CUDA, 99}) == MRL_ERR_INVALID);
    CHECK(mrl_model_get_device(far).kind == MRL_DEVICE_CPU); /* still where it was, and usable */
    mrl_model_free(far);
}

static void case_region(void) {
    mrl_mem_stats before, s;
    mrl_mem_get_device_stats(&before);
    mrl_mem_region *r = NULL;
    CHECK_OK(mrl_device_region_create(GPU, 5 << 20, MRL_MEM_PARAMS, &r));
    int64_t page = mrl_mem_region_page(r);
    char *base = mrl_mem_region_base(r);
    CHECK(page > 0 && mrl_device_of(base).kind == MRL_DEVICE_CUDA);
    CHECK(mrl_mem_region_resident(r) == 0);
    /* [page / 2, page + page / 2): two pages, zero-filled */
    int64_t lo = page / 2, hi = page + page / 2, n = (hi - lo) / 4;
    CHECK_OK(mrl_mem_region_pin(r, lo, hi));
    CHECK(mrl_mem_region_resident(r) == 2 * page);
    mrl_mem_get_device_stats(&s);
    CHECK(s.current[MRL_MEM_PARAMS] - before.current[MRL_MEM_PARAMS] == 2 * page);
    float *host = malloc((size_t)(hi - lo)), *back = malloc((size_t)(hi - lo));
    CHECK_OK(mrl_device_memcpy(back, base + lo, (size_t)(hi - lo)));
    int64_t nonzero = 0;
    for (int64_t i = 0; i < n; i++) nonzero += back[i] != 0;
    CHECK(nonzero == 0);
    for (int64_t i = 0; i < n; i++) host[i] = (float)i * 0.5f;
    CHECK_OK(mrl_device_memcpy(base + lo, host, (size_t)(hi - lo)));
    /* a nested pin of the second page, then the first pin let go: the second page keeps its values */
    CHECK_OK(mrl_mem_region_pin(r, page, hi));
    mrl_mem_region_unpin(r, lo, hi);
    CHECK(mrl_mem_region_resident(r) == page);
    CHECK_OK(mrl_device_memcpy(back, base + page, (size_t)(hi - page)));
    CHECK(memcmp(back, host + (page - lo) / 4, (size_t)(hi - page)) == 0);
    /* pinned again: the first page zero-filled */
    CHECK_OK(mrl_mem_region_pin(r, 0, page));
    CHECK_OK(mrl_device_memcpy(back, base, (size_t)page));
    nonzero = 0;
    for (int64_t i = 0; i < page / 4; i++) nonzero += back[i] != 0;
    CHECK(nonzero == 0);
    mrl_mem_region_free(r); /* pages still pinned given back with it */
    mrl_mem_get_device_stats(&s);
    CHECK(s.current[MRL_MEM_PARAMS] == before.current[MRL_MEM_PARAMS]);
    free(host);
    free(back);
}

int main(void) {
    rng = MRL_GOLDEN64; /* the stream its tolerances were set on */
    if (mrl_device_cuda_count() < 1) {
        printf("no CUDA device visible: skipped\n");
        return 77;
    }
    char what[160];
    CHECK_OK(mrl_device_describe(GPU, what, sizeof what));
    printf("%s\n", what);
    static const int arches[4] = {MRL_ARCH_LLAMA, MRL_ARCH_QWEN2, MRL_ARCH_QWEN3, MRL_ARCH_DEEPSEEK_V3};
    for (int a = 0; a < 4; a++)
        for (int bf16 = 0; bf16 < 2; bf16++) case_model(arches[a], bf16, 0);
    case_model(MRL_ARCH_QWEN3, 0, 1);
    case_model(MRL_ARCH_LLAMA, 1, 1);
    case_memory();
    case_region();
    case_refusals();
    mrl_shutdown();
    CHECK_DONE();
}
