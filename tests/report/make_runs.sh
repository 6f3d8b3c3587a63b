# Run directories for the report tests (sourced): make_runs DIR writes
#   DIR/a, DIR/b   two short real runs of the default example (b another seed, its GRPO on LoRA
#                  adapters of rank 4; a with a skipped update from fault injection: a "skip" event
#                  and guard/skipped = 1)
#   DIR/syn        a synthetic run: nested objects, NaN / +-inf, missing values, a metric logged at
#                  one step only, booleans and strings, events of every kind, a manifest.json, and
#                  memory metrics of known peaks (resident 1536 MiB at step 3, KV cache 300 MiB at
#                  step 2, activations 0.5 MiB, phase generate 1500 MiB resident / 320 MiB allocated;
#                  a sharded state at step 3: the largest rank 1600 MiB, shard 60, gathered 12.5,
#                  the engine's copy 240)
#   DIR/empty      a run that has not logged a step (config.json, an empty metrics.jsonl)
make_runs() {
  local dir=$1
  MOONRL_FAULT='nan:step=3' "$MOONRL" sft.steps=20 grpo.steps=4 grpo.prompts=4 heldout=8 quiet=true \
    run.dir="$dir/a" > "$dir/a.log" 2>&1 || { echo "FAIL: the real run a did not finish:"; cat "$dir/a.log"; exit 1; }
  "$MOONRL" sft.steps=20 grpo.steps=4 grpo.prompts=4 heldout=8 quiet=true run.seed=2 model.lora.rank=4 \
    run.dir="$dir/b" > "$dir/b.log" 2>&1 || { echo "FAIL: the real run b did not finish:"; cat "$dir/b.log"; exit 1; }
  mkdir -p "$dir/syn" "$dir/empty"
  cat > "$dir/syn/config.json" <<'JSON'
{"recipe": "synthetic", "moonrl": "0.1.0", "git": "abc", "backends": "cpu", "world_size": 2,
 "config": {"lr": 0.001, "grpo": {"samples": 8, "reward": "exact"}, "list": [1, 2], "run": {"seed": 7}}}
JSON
  cat > "$dir/syn/metrics.jsonl" <<'JSON'
{"step": 1, "time": 0.5, "loss": 1.5, "reward": {"mean": 0.1, "std": 0.3}, "time/generate": 0.2, "time/train": 0.25, "time/step": 0.5, "note": "text", "flag": true, "memory": {"rss_peak_mb": 1000, "peak_mb": 400, "params_mb": 120, "grads_mb": 120, "optim_mb": 240, "activations_mb": 0.25, "kv_cache_mb": 0, "other_mb": 3, "phase": {"generate": {"rss_peak_mb": 900, "peak_mb": 300}}}}
{"step": 2, "time": 1.0, "loss": NaN, "reward": {"mean": 0.2, "std": 0.3}, "time/generate": 0.2, "time/train": 0.2, "time/step": 0.45, "guard": {"skipped": 1}, "memory": {"rss_peak_mb": 1200, "peak_mb": 700, "params_mb": 120, "grads_mb": 120, "optim_mb": 240, "activations_mb": 0.5, "kv_cache_mb": 300, "other_mb": 3, "phase": {"generate": {"rss_peak_mb": 1500, "peak_mb": 320}}}}

{"step": 3, "time": 1.6, "loss": 1.2, "reward": {"mean": Infinity}, "time/generate": 0.3, "time/train": 0.25, "time/step": 0.6, "nested": {"a": {"b": 3}}, "async": {"dropped_stale": 5}, "memory": {"rss_peak_mb": 1536, "peak_mb": 650, "params_mb": 120, "kv_cache_mb": 100, "max_rank_peak_mb": 1600, "params_shard_mb": 60, "params_gathered_peak_mb": 12.5, "engine_copy_mb": 240}}
{"step": 4, "time": 2.1, "loss": 1.0, "reward": {"mean": 0.5, "std": null}, "time/generate": 0.2, "time/train": 0.2, "time/step": 0.41, "only_once": 7, "neg": -Infinity}
JSON
  cat > "$dir/syn/events.jsonl" <<'JSON'
{"event": "skip", "time": 1796136142, "pid": 1, "detector": "nonfinite_loss", "step": 2, "value": NaN}
{"event": "rollback", "time": 1796136143, "pid": 1, "detector": "grad_spike", "step": 3, "to_step": 2}
{"event": "restart", "time": 1796136144, "pid": 1, "attempt": 1, "cause": "killed by signal 9"}
{"event": "resume", "time": 1796136145, "pid": 2, "checkpoint": "ckpt/<step-2>", "step": 2}
JSON
  echo '{"moonrl": {"version": "0.1.0", "git": "abc"}, "seeds": {"run": 7}, "machine": {"cpu": "synthetic-cpu-xyz"}}' \
    > "$dir/syn/manifest.json"
  cp "$dir/syn/config.json" "$dir/empty/config.json"
  : > "$dir/empty/metrics.jsonl"
}
