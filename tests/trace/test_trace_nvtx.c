/* Where CUDA is built, each phase of the trace is an NVTX range on its thread. Checked without a
 * GPU or a profiler: nvtx_probe.so (an NVTX injection library, loaded by nvtx3 as Nsight Systems
 * would be) records every RangePushA and RangePop; the ranges must be the trace's phases, nested
 * as they were, and none while the trace is off.
 * usage: test_trace_nvtx PATH/TO/nvtx_probe.so */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "moonrl/trace.h"
#include "check.h"

static void *worker(void *arg) {
    (void)arg;
    mrl_trace_begin("engine batch"); /* its own thread: a range of that thread */
    mrl_trace_end("engine batch");
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s PATH/TO/nvtx_probe.so\n", argv[0]);
        return 2;
    }
    /* before the first NVTX call, which is when nvtx3 looks for its injection */
    setenv("NVTX_INJECTION64_PATH", argv[1], 1);
    mrl_trace_begin("before recording"); /* the trace is off: no range */
    mrl_trace_end("before recording");
    mrl_trace_enable(0);
    mrl_trace_begin("step");
    mrl_trace_begin("generate");
    mrl_trace_end("generate");
    mrl_trace_counter("reward", 0.5); /* a counter is not a range */
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_join(t, NULL);
    mrl_trace_begin("train");
    mrl_trace_end("train");
    mrl_trace_end("step");
    mrl_trace_disable();
    mrl_trace_begin("after");
    mrl_trace_end("after");

    void *probe = dlopen(argv[1], RTLD_NOW | RTLD_NOLOAD); /* the copy nvtx3 loaded */
    CHECK(probe != NULL);
    const char *(*log_of)(void) = probe ? (const char *(*)(void))dlsym(probe, "nvtx_probe_log") : NULL;
    CHECK(log_of != NULL);
    const char *got = log_of ? log_of() : "";
    const char *want = "+step\n+generate\n-\n+engine batch\n-\n+train\n-\n-\n";
    if (strcmp(got, want)) fprintf(stderr, "NVTX ranges:\n%s\nexpected:\n%s\n", got, want);
    CHECK(!strcmp(got, want));
    CHECK_DONE();
}
