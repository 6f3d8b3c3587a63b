/* The one run-time choice of the CPU's vector instruction set (isa.h):
 * every fast CPU kernel follows it. */
#include <string.h>
#include "isa.h"
#include "base/cpu.h"

static const mrl_cpu_isa *current;

/* AVX2 comes with FMA and F16C (the conversions); AVX-512 needs those too
 * (its loops fall back on AVX2 code for tails and half-width steps). */
static int supported(const mrl_cpu_isa *t) {
    const mrl_cpu_info *c = mrl_cpu();
    int avx2 = c->avx2 && c->fma && c->f16c;
    if (t->level == 2) return avx2 && c->avx512f && c->avx512dq && c->avx512vl;
    if (t->level == 1) return avx2;
    return 1;
}

static const mrl_cpu_isa *const sets[3] = {&mrl_cpu_isa_sse, &mrl_cpu_isa_avx2, &mrl_cpu_isa_avx512};

const mrl_cpu_isa *mrl_cpu_isa_get(void) {
    if (!current) { /* the best this CPU has */
        int l = 2;
        while (l > 0 && !supported(sets[l])) l--;
        current = sets[l];
    }
    return current;
}

int mrl_cpu_isa_set(const char *name) {
    for (int l = 0; l < 3; l++)
        if (name && strcmp(name, sets[l]->name) == 0) {
            if (!supported(sets[l])) return -1;
            current = sets[l];
            return 0;
        }
    return -1;
}

int mrl_cpu_isa_level(void) { return mrl_cpu_isa_get()->level; }

const char *mrl_cpu_isa_name(void) { return mrl_cpu_isa_get()->name; }

double mrl_vexp_sum(float *w, const float *x, float m, int64_t n) { return mrl_cpu_isa_get()->exp_sum(w, x, m, n); }
