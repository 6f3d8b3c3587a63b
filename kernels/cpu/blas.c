/* The fp32 product library, chosen from what the CPU and OpenBLAS say
 * (blas.h has the why). */
#include "cpu/blas.h"
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cpu/gemm_bf16.h"
#include "cpu/isa.h"
#include "base/log.h"

/* OpenBLAS's own report; weak, so that a BLAS without it still links. */
extern char *openblas_get_corename(void) __attribute__((weak));

const char *mrl_openblas_core(void) {
    const char *c = openblas_get_corename ? openblas_get_corename() : NULL;
    return c && *c ? c : "unknown";
}

/* OpenBLAS's x86-64 kernel sets (driver/others/dynamic.c's names) by the
 * newest instructions they use. */
static const struct { const char *name; int level; } cores[] = {
    {"skylakex", 3}, {"cooperlake", 3}, {"sapphirerapids", 3},
    {"haswell", 2}, {"zen", 2}, {"excavator", 2}, {"steamroller", 1}, {"piledriver", 1}, {"bulldozer", 1},
    {"sandybridge", 1},
    {"prescott", 0}, {"core2", 0}, {"penryn", 0}, {"dunnington", 0}, {"nehalem", 0}, {"atom", 0},
    {"barcelona", 0}, {"opteron", 0}, {"opteron_sse3", 0}, {"bobcat", 0}, {"nano", 0}, {"katmai", 0},
    {"coppermine", 0}, {"northwood", 0}, {"banias", 0}, {"athlon", 0}, {"generic", 0},
};

int mrl_openblas_core_level(const char *core) {
    if (!core) return -1;
    char low[32];
    size_t n = 0;
    for (; core[n] && n + 1 < sizeof low; n++) low[n] = (char)tolower((unsigned char)core[n]);
    low[n] = 0;
    for (size_t i = 0; i < sizeof cores / sizeof cores[0]; i++)
        if (!strcmp(low, cores[i].name)) return cores[i].level;
    return -1;
}

/* OpenBLAS's kernels are below the CPU's set: a known core name of a level under the CPU's
 * (AVX-512 kernels for an AVX-512 CPU, AVX2 for AVX2; an SSE-only CPU has nothing better). */
static int openblas_below(int blas, int cpu_level) {
    return blas >= 0 && blas < (cpu_level == 2 ? 3 : cpu_level == 1 ? 2 : 0);
}

mrl_f32_path mrl_cpu_f32_rule(const char *core, int cpu_level, int have_onednn) {
    /* below the CPU's set (Prescott kernels on an AVX2/AVX-512 CPU, AVX2 kernels on AVX-512):
     * oneDNN is faster there (bench/RESULTS.md, "fp32 products") */
    if (have_onednn && openblas_below(mrl_openblas_core_level(core), cpu_level)) return MRL_F32_ONEDNN;
    return MRL_F32_OPENBLAS;
}

static mrl_f32_path path;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* oneDNN's fp32 product works here (built in, and a primitive runs). */
static int onednn_f32_runs(void) {
    float a[4] = {1, 2, 3, 4}, b[4] = {1, 0, 0, 1}, c[4] = {0};
    return mrl_cpu_gemm_f32_onednn(0, 0, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2) == 0 && c[3] == 4;
}

static void decide(void) {
    const char *env = getenv("MOONRL_FP32_GEMM");
    if (env && !strcmp(env, "openblas")) {
        path = MRL_F32_OPENBLAS;
    } else if (env && !strcmp(env, "onednn")) {
        path = onednn_f32_runs() ? MRL_F32_ONEDNN : MRL_F32_OPENBLAS;
        if (path != MRL_F32_ONEDNN) mrl_logf(MRL_LOG_WARN, "MOONRL_FP32_GEMM=onednn: oneDNN is not built in or does not run here; using OpenBLAS");
    } else {
        if (env && *env && strcmp(env, "auto"))
            mrl_logf(MRL_LOG_WARN, "MOONRL_FP32_GEMM must be openblas, onednn or auto (got '%s'); using auto", env);
        path = mrl_cpu_f32_rule(mrl_openblas_core(), mrl_cpu_isa_level(), onednn_f32_runs());
    }
}

mrl_f32_path mrl_cpu_f32_path(void) {
    pthread_once(&once, decide);
    return path;
}

int mrl_cpu_f32_force_path(mrl_f32_path p) {
    pthread_once(&once, decide);
    if (p == MRL_F32_ONEDNN && !onednn_f32_runs()) return -1;
    if (p != MRL_F32_ONEDNN && p != MRL_F32_OPENBLAS) return -1;
    path = p;
    return 0;
}

const char *mrl_cpu_f32_path_name(void) {
    static char text[160];
    static const char *isa[] = {"sse", "avx2", "avx512"};
    const char *core = mrl_openblas_core();
    int level = mrl_cpu_isa_level(), below = openblas_below(mrl_openblas_core_level(core), level);
    if (mrl_cpu_f32_path() == MRL_F32_ONEDNN) {
        const char *d = mrl_cpu_onednn_isa();
        snprintf(text, sizeof text, "oneDNN (%s)%s%s%s%s", d ? d : "?", below ? "; OpenBLAS's " : "",
                 below ? core : "", below ? " kernels are below this CPU's " : "", below ? isa[level] : "");
    } else {
        snprintf(text, sizeof text, "OpenBLAS %s%s%s%s", core, below ? " (below this CPU's " : "",
                 below ? isa[level] : "", below ? ")" : "");
    }
    return text;
}
