/* Version, build features, the CPU features (as the probe of core/base/cpu.h
 * found them), process initialisation. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "moonrl/runtime.h"
#include "base/cpu.h"
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


/* The names moonrl version prints and mrl_cpu_has takes, and where the CPU
 * probe (core/base/cpu.h) keeps each. */
#define FEATURE(name, field) {name, offsetof(mrl_cpu_info, field)}
static const struct {
    const char *name;
    size_t offset;
} features[] = {
    FEATURE("sse4.2", sse4_2),     FEATURE("avx", avx),           FEATURE("avx2", avx2),
    FEATURE("fma", fma),           FEATURE("f16c", f16c),         FEATURE("avx512f", avx512f),
    FEATURE("avx512bw", avx512bw), FEATURE("avx512dq", avx512dq), FEATURE("avx512vl", avx512vl),
    FEATURE("avx512vnni", avx512vnni), FEATURE("avx512bf16", avx512bf16), FEATURE("amx_bf16", amx_bf16),
};
#define N_FEATURES (sizeof features / sizeof features[0])

static int has_feature(size_t i) { return *(const int *)((const char *)mrl_cpu() + features[i].offset); }

const char *mrl_kernel_isas_built(void) {
    static char text[64];
    if (!text[0])
        snprintf(text, sizeof text, "%s %s %s", mrl_cpu_isa_avx512.name, mrl_cpu_isa_avx2.name, mrl_cpu_isa_sse.name);
    return text;
}

const char *mrl_kernel_isa(void) { return mrl_cpu_isa_get()->name; }

const char *mrl_bf16_products(void) { return mrl_cpu_bf16_available() ? mrl_cpu_bf16_path() : "none"; }

const char *mrl_fp32_products(void) { return mrl_cpu_f32_path_name(); }

int mrl_cpu_has(const char *feature) {
    for (size_t i = 0; feature && i < N_FEATURES; i++)
        if (strcmp(feature, features[i].name) == 0) return has_feature(i);
    return 0;
}

const char *mrl_cpu_features(void) {
    static char text[256];
    if (!text[0]) {
        size_t used = 0;
        for (size_t i = 0; i < N_FEATURES; i++)
            if (has_feature(i))
                used += (size_t)snprintf(text + used, sizeof text - used, "%s%s", used ? " " : "", features[i].name);
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
