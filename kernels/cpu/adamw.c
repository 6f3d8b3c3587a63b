/* AdamW on the CPU: the scalar element loop (the reference table's; each
 * ISA set has its vector one, isa_impl.h), and the two tables' ops, which
 * walk the buffer in segments split at the no-decay ranges. All loops do the same fp32 operations in the same order
 * with no fused multiply-add, so every table and set gives the same bits
 * (tests/kernels/test_ops.c):
 *   p = p * decay
 *   m = m * beta1 + (1 - beta1) * g
 *   v = v * beta2 + (1 - beta2) * g * g
 *   p = p + neg_step * (m / (sqrt(v) / bc2_sqrt + eps))
 * The update is element-wise, so the fast op's split over threads cannot
 * change a result either. */
#include <math.h>
#include "cpu/adamw.h"
#include "cpu/isa.h"
#include "base/parallel.h"

#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))

NO_CONTRACT void mrl_cpu_adamw_scalar(float *p, const float *g, float *m, float *v, int64_t n,
                                      const mrl_adamw_coeffs *c) {
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float pi = p[i] * c->decay;
        float mi = m[i] * c->beta1 + c->one_minus_beta1 * gi;
        float vi = v[i] * c->beta2 + c->one_minus_beta2 * gi * gi;
        float denom = sqrtf(vi) / c->bc2_sqrt + c->eps;
        p[i] = pi + c->neg_step * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
}

typedef void (*adamw_loop)(float *p, const float *g, float *m, float *v, int64_t n, const mrl_adamw_coeffs *c);

/* The loop over [begin, end), in segments split at the no-decay ranges. */
static void adamw_segments(const mrl_adamw_args *a, adamw_loop loop, int64_t begin, int64_t end) {
    const int64_t *r = a->ranges;
    int64_t lo = 0, hi = a->n_ranges; /* the first range whose end > begin */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (r[2 * mid + 1] <= begin) lo = mid + 1; else hi = mid;
    }
    int64_t pos = begin, k = lo;
    while (pos < end) {
        int64_t seg_end;
        const mrl_adamw_coeffs *co;
        if (k < a->n_ranges && pos >= r[2 * k]) {
            seg_end = r[2 * k + 1] < end ? r[2 * k + 1] : end;
            co = &a->no_decay;
            k++;
        } else {
            seg_end = k < a->n_ranges && r[2 * k] < end ? r[2 * k] : end;
            co = &a->decay;
        }
        loop(a->p + pos, a->g + pos, a->m + pos, a->v + pos, seg_end - pos, co);
        pos = seg_end;
    }
}

void mrl_cpu_ref_adamw(const mrl_adamw_args *a) { adamw_segments(a, mrl_cpu_adamw_scalar, 0, a->n); }

typedef struct adamw_ctx {
    const mrl_adamw_args *a;
    adamw_loop loop;
} adamw_ctx;

static void adamw_range(void *vctx, int64_t begin, int64_t end) {
    adamw_ctx *c = vctx;
    adamw_segments(c->a, c->loop, begin, end);
}

void mrl_cpu_fast_adamw(const mrl_adamw_args *a) {
    adamw_ctx c = {a, mrl_cpu_isa_get()->adamw};
    mrl_parallel_for(a->n, 1 << 15, adamw_range, &c);
}
