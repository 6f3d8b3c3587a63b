/* The bf16 refresh after an optimizer step (mrl_model_refresh_bf16): the
 * plain bf16 copies alone, against the copies and the engine's bf16 weight
 * panels written by the same refresh (once an engine has asked for them,
 * mrl_model_bf16_panels), on the 100M Llama of bench/decode/generate_bench.py and
 * SmolLM2-135M's shape, alternating, best of reps.
 *   build/bench/bench_bf16_refresh [reps=7]
 * Prints, per model, both times, their ratio and the bytes of each layout. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "model/layer.h"
#include "moonrl/model.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static double refresh_time(mrl_model *m) {
    mrl_model_weights_changed(m);
    double t0 = now();
    if (mrl_model_refresh_bf16(m)) exit(1);
    return now() - t0;
}

static void run(const char *name, int vocab, int hidden, int inter, int layers, int heads, int kv, int tied,
                int reps) {
    mrl_model_config c;
    mrl_model_config_default(&c);
    c.vocab_size = vocab, c.hidden_size = hidden, c.intermediate_size = inter, c.num_hidden_layers = layers;
    c.num_attention_heads = heads, c.num_key_value_heads = kv, c.head_dim = hidden / heads;
    c.tie_word_embeddings = tied;
    mrl_model *plain = NULL, *packed = NULL;
    if (mrl_model_create(&c, 1, &plain) || mrl_model_create(&c, 1, &packed) ||
        mrl_model_set_dtype(plain, MRL_MODEL_BF16) || mrl_model_set_dtype(packed, MRL_MODEL_BF16) ||
        !mrl_model_bf16_panels(packed) || !mrl_model_bf16_params(plain)) {
        fprintf(stderr, "%s: could not make the models\n", name);
        exit(1);
    }
    double best_plain = 1e30, best_packed = 1e30;
    for (int r = 0; r < reps; r++) {
        double a = refresh_time(plain), b = refresh_time(packed);
        best_plain = a < best_plain ? a : best_plain;
        best_packed = b < best_packed ? b : best_packed;
    }
    printf("| %s | %.1fM | %.1f | %.1f | %.2fx | %.0f | %.0f |\n", name, mrl_model_num_params(plain) / 1e6,
           best_plain * 1e3, best_packed * 1e3, best_packed / best_plain, mrl_model_num_params(plain) * 2 / 1048576.0,
           mrl_model_panels16_bytes(packed) / 1048576.0);
    mrl_model_free(plain);
    mrl_model_free(packed);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 7;
    printf("| model | parameters | refresh, copies only (ms) | copies + panels (ms) | ratio | copies MiB | panels MiB |\n");
    printf("|---|---|---|---|---|---|---|\n");
    run("100M (bench/decode/generate_bench.py)", 32000, 768, 2048, 8, 12, 4, 0, reps);
    run("SmolLM2-135M shape", 49152, 576, 1536, 30, 9, 3, 1, reps);
    return 0;
}
