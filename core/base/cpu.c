/* The one CPU-feature probe (cpu.h): cpuid and xgetbv, and the AMX tile
 * permission, asked of Linux once per process. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include "base/cpu.h"

static mrl_cpu_info info;
static pthread_once_t once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* CPUID says AMX, the OS saves the tile state in XCR0 and this process is
 * granted it. xgetbv only where CPUID.1:ECX.OSXSAVE says it may run. */
static int amx_tiles_granted(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo >> 17 & 3) == 3 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

static void probe(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    info.sse4_2 = __builtin_cpu_supports("sse4.2") != 0;
    info.avx = __builtin_cpu_supports("avx") != 0;
    info.avx2 = __builtin_cpu_supports("avx2") != 0;
    info.fma = __builtin_cpu_supports("fma") != 0;
    unsigned a, b, c, d;
    /* F16C: CPUID.1:ECX bit 29, usable where AVX is (clang 14's __builtin_cpu_supports knows no "f16c") */
    info.f16c = info.avx && __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
    info.avx512f = __builtin_cpu_supports("avx512f") != 0;
    info.avx512bw = __builtin_cpu_supports("avx512bw") != 0;
    info.avx512dq = __builtin_cpu_supports("avx512dq") != 0;
    info.avx512vl = __builtin_cpu_supports("avx512vl") != 0;
    info.avx512vnni = __builtin_cpu_supports("avx512vnni") != 0;
    info.avx512bf16 = __builtin_cpu_supports("avx512bf16") != 0;
    info.amx_bf16 = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
    const char *amx = getenv("MOONRL_AMX");
    info.amx_tiles = info.amx_bf16 && !(amx && strcmp(amx, "0") == 0) && amx_tiles_granted();
#endif
}

const mrl_cpu_info *mrl_cpu(void) {
    pthread_once(&once, probe);
    return &info;
}
