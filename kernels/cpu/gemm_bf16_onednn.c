/* oneDNN's matmul as a bf16 (and fp32) product path (gemm_bf16.h), through
 * its C API. Built with oneDNN where libdnnl is found (MRL_HAVE_DNNL);
 * without it every entry says "cannot" (-1) and the dispatcher goes on.
 *
 * Primitives are made once per shape (sizes, strides, alpha, beta, data
 * type, thread count) and kept in a small table: making one takes tens of
 * microseconds, as long as a whole decode-sized product. Each product takes
 * its scratchpad from the calling thread's scratch (user scratchpad mode),
 * so one primitive may run on several threads at once.
 *
 * Threads: Debian's libdnnl runs on OpenMP (DNNL_CPU_RUNTIME_OMP), the same
 * libgomp as mrl_parallel_for, so it shares our worker threads rather than
 * competing with them. It sizes its work from omp_get_max_threads(), which
 * we set to mrl_parallel_threads() around each call (and restore); inside a
 * parallel region it runs on the calling thread alone, which is what the
 * primitive is then made for. */
#include <stdint.h>
#include <string.h>
#include "cpu/gemm_bf16.h"

#ifndef MRL_HAVE_DNNL

const char *mrl_cpu_onednn_isa(void) { return NULL; }
int mrl_cpu_gemm_bf16_onednn(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                             const void *A, int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb,
                             float beta, float *C, int64_t ldc) {
    return -1;
}
int mrl_cpu_gemm_f32_onednn(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                            int64_t ldc) {
    return -1;
}

#else

#include <omp.h>
#include <pthread.h>
#include <oneapi/dnnl/dnnl.h>
#include "moonrl/dtype.h"
#include "base/parallel.h"

static dnnl_engine_t engine;
static pthread_once_t engine_once = PTHREAD_ONCE_INIT;

static void engine_init(void) {
    if (dnnl_engine_create(&engine, dnnl_cpu, 0) != dnnl_success) engine = NULL;
}

const char *mrl_cpu_onednn_isa(void) {
    switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx2: return "avx2";
    default: return "sse41";
    }
}

/* ---- primitive table ---------------------------------------------------------- */

/* What a primitive is made for; compared bytewise (built zeroed). */
typedef struct prim_key {
    int64_t M, N, K;
    int64_t a_strides[2], b_strides[2], ldc;
    int32_t dtype, threads;
    uint32_t alpha, beta; /* bits */
} prim_key;

typedef struct prim_entry {
    prim_key key;
    dnnl_primitive_t prim; /* NULL: free slot */
    dnnl_memory_desc_t a_md, b_md, c_md, scratch_md;
    size_t scratch_bytes;
    int refs;       /* products running on it now: not evicted while > 0 */
    uint64_t used;  /* last use, for eviction */
} prim_entry;

#define SLOTS 128
static prim_entry table[SLOTS];
static uint64_t clock_ticks;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

static int make(prim_entry *e, const prim_key *k) {
    dnnl_dims_t a_dims = {k->M, k->K}, b_dims = {k->K, k->N}, c_dims = {k->M, k->N}, c_strides = {k->ldc, 1};
    dnnl_dims_t a_strides = {k->a_strides[0], k->a_strides[1]}, b_strides = {k->b_strides[0], k->b_strides[1]};
    dnnl_data_type_t dt = (dnnl_data_type_t)k->dtype;
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t post = NULL;
    dnnl_primitive_desc_t pd = NULL;
    float alpha, beta;
    memcpy(&alpha, &k->alpha, 4);
    memcpy(&beta, &k->beta, 4);
    int ok = dnnl_memory_desc_init_by_strides(&e->a_md, 2, a_dims, dt, a_strides) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&e->b_md, 2, b_dims, dt, b_strides) == dnnl_success &&
             dnnl_memory_desc_init_by_strides(&e->c_md, 2, c_dims, dnnl_f32, c_strides) == dnnl_success &&
             dnnl_matmul_desc_init(&desc, &e->a_md, &e->b_md, NULL, &e->c_md) == dnnl_success &&
             dnnl_primitive_attr_create(&attr) == dnnl_success &&
             dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user) == dnnl_success &&
             (alpha == 1 || dnnl_primitive_attr_set_output_scales(attr, 1, 0, &alpha) == dnnl_success);
    if (ok && beta != 0) /* C = beta C + alpha A B: a sum post-op */
        ok = dnnl_post_ops_create(&post) == dnnl_success && dnnl_post_ops_append_sum(post, beta) == dnnl_success &&
             dnnl_primitive_attr_set_post_ops(attr, post) == dnnl_success;
    ok = ok && dnnl_primitive_desc_create(&pd, &desc, attr, engine, NULL) == dnnl_success;
    if (ok) {
        e->scratch_md = *dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
        e->scratch_bytes = dnnl_memory_desc_get_size(&e->scratch_md);
        ok = dnnl_primitive_create(&e->prim, pd) == dnnl_success;
    }
    if (!ok) e->prim = NULL;
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (post) dnnl_post_ops_destroy(post);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return ok ? 0 : -1;
}

/* The table's entry for k, made if need be, with a reference taken; NULL
 * when oneDNN cannot make it. With every slot in use (more threads in
 * products than slots) the primitive lives in *spare for one product. */
static prim_entry *acquire(const prim_key *k, prim_entry *spare) {
    pthread_mutex_lock(&table_lock);
    prim_entry *e = NULL, *victim = NULL;
    for (int i = 0; i < SLOTS && !e; i++) {
        if (table[i].prim && memcmp(&table[i].key, k, sizeof *k) == 0) e = &table[i];
        else if (table[i].refs == 0 && (!victim || !table[i].prim || (victim->prim && table[i].used < victim->used)))
            victim = &table[i];
    }
    if (!e) { /* make it (under the lock: rare, and two threads would make the same one) */
        e = victim ? victim : spare;
        if (e->prim) dnnl_primitive_destroy(e->prim);
        e->key = *k;
        if (make(e, k) != 0) e = NULL;
    }
    if (e) e->refs++, e->used = ++clock_ticks;
    pthread_mutex_unlock(&table_lock);
    return e;
}

static void release(prim_entry *e, prim_entry *spare) {
    pthread_mutex_lock(&table_lock);
    e->refs--;
    pthread_mutex_unlock(&table_lock);
    if (e == spare && e->prim) dnnl_primitive_destroy(e->prim);
}

/* ---- one product ------------------------------------------------------------------ */

/* An operand as oneDNN takes it: data and the strides of its logical [rows,
 * cols]; an fp32 one given for a bf16 product is first copied to bf16
 * (src: the fp32 matrix stored [rows_stored, cols_stored] with leading
 * dimension ld; copies are contiguous). */
typedef struct dnnl_operand {
    const void *p;
    int64_t strides[2];
    const float *src;
    int64_t rows_stored, cols_stored, ld;
    uint16_t *copy;
} dnnl_operand;

/* op(X) [rows, cols] for X stored with leading dimension ld (transposed or
 * not); to_bf16: X is fp32 and the product is bf16. */
static dnnl_operand operand_of(const void *p, int trans, int64_t rows, int64_t cols, int64_t ld, int to_bf16) {
    dnnl_operand o = {.p = p};
    int64_t rs = trans ? cols : rows, cs = trans ? rows : cols; /* as stored */
    if (to_bf16) o.src = p, o.rows_stored = rs, o.cols_stored = cs, o.ld = ld, ld = cs;
    o.strides[0] = trans ? 1 : ld;
    o.strides[1] = trans ? ld : 1;
    return o;
}

static void copy_rows(void *vc, int64_t r0, int64_t r1) {
    const dnnl_operand *o = vc;
    for (int64_t r = r0; r < r1; r++)
        mrl_convert_f32_to_bf16(o->src + r * o->ld, o->copy + r * o->cols_stored, o->cols_stored);
}

static void copy_to_bf16(dnnl_operand *o) {
    if (o->ld == o->cols_stored) /* contiguous: one parallel conversion */
        mrl_convert_f32_to_bf16(o->src, o->copy, o->rows_stored * o->cols_stored);
    else
        mrl_parallel_for(o->rows_stored, 65536 / o->cols_stored + 1, copy_rows, o);
    o->p = o->copy;
}

#define ALIGN64(n) (((size_t)(n) + 63) & ~(size_t)63)

/* C = alpha op(A) op(B) + beta C with op(A) [M,K] and op(B) [K,N] in dtype. */
static int run(dnnl_data_type_t dtype, int64_t M, int64_t N, int64_t K, float alpha, dnnl_operand a, dnnl_operand b,
               float beta, float *C, int64_t ldc) {
    pthread_once(&engine_once, engine_init);
    if (!engine) return -1;
    int threads = omp_in_parallel() ? 1 : mrl_parallel_threads(), saved = omp_get_max_threads();
    prim_key k;
    memset(&k, 0, sizeof k);
    k.M = M, k.N = N, k.K = K, k.ldc = ldc, k.dtype = dtype, k.threads = threads;
    memcpy(k.a_strides, a.strides, sizeof a.strides);
    memcpy(k.b_strides, b.strides, sizeof b.strides);
    memcpy(&k.alpha, &alpha, 4);
    memcpy(&k.beta, &beta, 4);
    omp_set_num_threads(threads); /* what oneDNN sizes the primitive and its run for */
    prim_entry spare = {0}, *e = acquire(&k, &spare);
    size_t a_bytes = a.src ? ALIGN64(a.rows_stored * a.cols_stored * 2) : 0;
    size_t b_bytes = b.src ? ALIGN64(b.rows_stored * b.cols_stored * 2) : 0;
    char *scratch = e ? mrl_cpu_bf16_scratch_take(a_bytes + b_bytes + e->scratch_bytes) : NULL;
    int status = -1;
    if (scratch) {
        a.copy = (uint16_t *)scratch, b.copy = (uint16_t *)(scratch + a_bytes);
        if (a.src) copy_to_bf16(&a);
        if (b.src) copy_to_bf16(&b);
        dnnl_memory_t mem[4] = {NULL, NULL, NULL, NULL};
        dnnl_stream_t stream = NULL;
        if (dnnl_memory_create(&mem[0], &e->a_md, engine, (void *)a.p) == dnnl_success &&
            dnnl_memory_create(&mem[1], &e->b_md, engine, (void *)b.p) == dnnl_success &&
            dnnl_memory_create(&mem[2], &e->c_md, engine, C) == dnnl_success &&
            dnnl_memory_create(&mem[3], &e->scratch_md, engine, scratch + a_bytes + b_bytes) == dnnl_success &&
            dnnl_stream_create(&stream, engine, dnnl_stream_default_flags) == dnnl_success) {
            dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, mem[0]}, {DNNL_ARG_WEIGHTS, mem[1]}, {DNNL_ARG_DST, mem[2]},
                                       {DNNL_ARG_SCRATCHPAD, mem[3]}};
            if (dnnl_primitive_execute(e->prim, stream, 4, args) == dnnl_success &&
                dnnl_stream_wait(stream) == dnnl_success)
                status = 0;
        }
        if (stream) dnnl_stream_destroy(stream);
        for (int i = 0; i < 4; i++)
            if (mem[i]) dnnl_memory_destroy(mem[i]);
        mrl_cpu_bf16_scratch_give(scratch);
    }
    if (e) release(e, &spare);
    omp_set_num_threads(saved);
    return status;
}

int mrl_cpu_gemm_bf16_onednn(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                             const void *A, int a_bf16, int64_t lda, const void *B, int b_bf16, int64_t ldb,
                             float beta, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0 || K <= 0) return -1;
    return run(dnnl_bf16, M, N, K, alpha, operand_of(A, trans_a, M, K, lda, !a_bf16),
               operand_of(B, trans_b, K, N, ldb, !b_bf16), beta, C, ldc);
}

int mrl_cpu_gemm_f32_onednn(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                            int64_t ldc) {
    if (M <= 0 || N <= 0 || K <= 0) return -1;
    return run(dnnl_f32, M, N, K, alpha, operand_of(A, trans_a, M, K, lda, 0), operand_of(B, trans_b, K, N, ldb, 0),
               beta, C, ldc);
}

#endif
