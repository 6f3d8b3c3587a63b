/* Version, build features, CPU feature detection, process initialisation. */
#include <stdio.h>
#include <stdlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <string.h>
#include <unistd.h>
#include "moonrl/runtime.h"
#include "base/log.h"
#include "runtime/loop_internal.h"
#include "moonrl/parallel.h"
#include "moonrl/device.h"
#include "build_info.h"
#include "cpu/isa.h"
#include "cpu/blas.h"
#include "cpu/gemm_bf16.h"
#include "base/error.h"

const char *mrl_version(void) { return MRL_VERSION; }

int mrl_process_id(void) { return (int)getpid(); }


/* The backends that run the model: the CPU, and CUDA where it is built in
 * (model.device=cuda: the training step and the engine; moonrl version says
 * how far it has been checked). */
const char *mrl_backends(void) {
#ifdef MRL_HAVE_CUDA
    return "cpu, cuda";
#else
    return "cpu";
#endif
}


static int has_feature(const char *name) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!strcmp(name, "sse4.2")) return __builtin_cpu_supports("sse4.2");
    if (!strcmp(name, "avx")) return __builtin_cpu_supports("avx");
    if (!strcmp(name, "avx2")) return __builtin_cpu_supports("avx2");
    if (!strcmp(name, "fma")) return __builtin_cpu_supports("fma");
    if (!strcmp(name, "f16c")) return __builtin_cpu_supports("f16c");
    if (!strcmp(name, "avx512f")) return __builtin_cpu_supports("avx512f");
    if (!strcmp(name, "avx512bw")) return __builtin_cpu_supports("avx512bw");
    if (!strcmp(name, "avx512dq")) return __builtin_cpu_supports("avx512dq");
    if (!strcmp(name, "avx512vl")) return __builtin_cpu_supports("avx512vl");
    if (!strcmp(name, "avx512vnni")) return __builtin_cpu_supports("avx512vnni");
    if (!strcmp(name, "avx512bf16")) return __builtin_cpu_supports("avx512bf16");
    if (!strcmp(name, "amx_bf16")) { /* CPUID.(7,0):EDX bits 22 (AMX-BF16) and 24 (AMX-TILE) */
        unsigned a, b, c, d;
        return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
    }
#else
    (void)name;
#endif
    return 0;
}

const char *mrl_kernel_isas_built(void) {
    static char text[64];
    if (!text[0])
        snprintf(text, sizeof text, "%s %s %s", mrl_cpu_isa_avx512.name, mrl_cpu_isa_avx2.name, mrl_cpu_isa_sse.name);
    return text;
}

const char *mrl_kernel_isa(void) { return mrl_cpu_isa_get()->name; }

const char *mrl_bf16_products(void) { return mrl_cpu_bf16_available() ? mrl_cpu_bf16_path() : "none"; }

const char *mrl_fp32_products(void) { return mrl_cpu_f32_path_name(); }

int mrl_cpu_has(const char *feature) { return feature ? has_feature(feature) : 0; }

const char *mrl_cpu_features(void) {
    static char text[256];
    if (!text[0]) {
        static const char *names[] = {"sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                                      "avx512dq", "avx512vl", "avx512vnni", "avx512bf16", "amx_bf16"};
        size_t used = 0;
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (has_feature(names[i]))
                used += (size_t)snprintf(text + used, sizeof text - used, "%s%s", used ? " " : "", names[i]);
        if (!used) snprintf(text, sizeof text, "none");
    }
    return text;
}

static int initialised = 0;

mrl_status mrl_init(void) {
    if (initialised) return MRL_OK;
    const char *level = getenv("MOONRL_LOG");
    if (level) {
        int parsed = mrl_log_level_parse(level);
        if (parsed < 0) return mrl_set_error(MRL_ERR_INVALID, "MOONRL_LOG=%s: expected error, warn, info, debug or trace", level);
        mrl_log_set_level((mrl_log_level)parsed);
    }
    mrl_parallel_threads();
    mrl_status st = mrl_loop_start();
    if (st != MRL_OK) return st;
    initialised = 1;
    return MRL_OK;
}

void mrl_shutdown(void) {
    if (!initialised) return;
    mrl_loop_stop();
    initialised = 0;
}
