/* An NVTX injection library for test_trace_nvtx: what Nsight Systems is to a real run, a
 * recorder of the ranges pushed and popped. nvtx3 loads it from NVTX_INJECTION64_PATH at the
 * first NVTX call and calls InitializeInjectionNvtx2, which points the core table's RangePushA
 * and RangePop at the functions here. The test reads the record with nvtx_probe_log(). */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <nvtx3/nvToolsExt.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char record[1 << 16];
static size_t used;

static void note(const char *what, const char *name) {
    pthread_mutex_lock(&lock);
    int n = snprintf(record + used, sizeof record - used, "%s%s\n", what, name ? name : "");
    if (n > 0 && (size_t)n < sizeof record - used) used += (size_t)n;
    pthread_mutex_unlock(&lock);
}

static int push_a(const char *message) {
    note("+", message);
    return 0;
}

static int pop(void) {
    note("-", NULL);
    return 0;
}

__attribute__((visibility("default"))) const char *nvtx_probe_log(void) { return record; }

__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
    const NvtxExportTableCallbacks *callbacks = (const NvtxExportTableCallbacks *)get_table(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable table = NULL;
    unsigned int size = 0;
    if (!callbacks || !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size)) return 0;
    if (size <= NVTX_CBID_CORE_RangePop) return 0;
    *table[NVTX_CBID_CORE_RangePushA] = (NvtxFunctionPointer)push_a;
    *table[NVTX_CBID_CORE_RangePop] = (NvtxFunctionPointer)pop;
    return 1;
}
