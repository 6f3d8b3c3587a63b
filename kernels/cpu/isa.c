/* The one run-time choice of the CPU's vector instruction set (isa.h). */
#include <string.h>
#include "isa.h"

static const mrl_cpu_isa *current;

static int supported(const mrl_cpu_isa *t) {
    __builtin_cpu_init();
    if (t->level == 2)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl");
    if (t->level == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return 1;
}

static const mrl_cpu_isa *const sets[3] = {&mrl_cpu_isa_sse, &mrl_cpu_isa_avx2, &mrl_cpu_isa_avx512};

static const mrl_cpu_isa *best_at_most(int level) {
    for (int l = level > 2 ? 2 : level; l > 0; l--)
        if (supported(sets[l])) return sets[l];
    return sets[0];
}

const mrl_cpu_isa *mrl_cpu_isa_get(void) {
    if (!current) current = best_at_most(2);
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

int mrl_cpu_isa_cap(int level) {
    int old = mrl_cpu_isa_level();
    current = best_at_most(level < 0 ? 0 : level);
    return old;
}

const char *mrl_cpu_isa_name(void) { return mrl_cpu_isa_get()->name; }

double mrl_vexp_sum(float *w, const float *x, float m, int64_t n) { return mrl_cpu_isa_get()->exp_sum(w, x, m, n); }
