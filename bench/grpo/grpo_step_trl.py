#!/usr/bin/env python3
"""TRL's side of bench/grpo/grpo_step.sh: one GRPOTrainer step (generation of PROMPTS x SAMPLES
completions, the reward, log-probs and the update) on the same model directory as moonrl's side:
--warmup warm-up steps, then --steps timed steps (a TrainerCallback). Prints one JSON line with the mean
seconds per step and the mean completion length TRL logged.

usage: python grpo_step_trl.py MODEL_DIR --prompts 16 --samples 8 --max-tokens 64 --threads 2
                               --steps 3 --warmup 2 --lengths natural|fixed
"""
import argparse
import json
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def sevens(completions, **kwargs):
    # the same reward as moonrl's side: the share of the characters '7' in the completion
    return [c.count("7") / max(len(c), 1) for c in completions]


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self.lengths = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
            self.lengths.append(logs["completions/mean_length"])

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lengths", choices=["natural", "fixed"], default="natural")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")  # bf16: TRL's bf16=True (autocast)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    prompts = [f"{10 + i}+{30 + 2 * i}=" for i in range(1, a.prompts + 1)]
    data = Dataset.from_list([{"prompt": p} for p in prompts] * (a.warmup + a.steps + 1))
    cfg = GRPOConfig(
        output_dir="/tmp/moonrl-bench-trl-out", per_device_train_batch_size=a.prompts * a.samples,
        num_generations=a.samples, max_completion_length=a.max_tokens,
        temperature=1.0, learning_rate=1e-6, beta=0.0, max_steps=a.warmup + a.steps, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, bf16=a.dtype == "bf16", seed=1, shuffle_dataset=False,
        gradient_checkpointing=False,  # moonrl keeps activations too (no recompute)
        # fixed: no EOS, every completion runs to the end (the same arithmetic as moonrl's side)
        generation_kwargs={"min_new_tokens": a.max_tokens} if a.lengths == "fixed" else {},
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[sevens], args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    timed = timer.times[a.warmup:]
    lengths = timer.lengths[a.warmup:]
    print(json.dumps({"total": sum(timed) / len(timed), "steps": timed, "lengths": a.lengths,
                      "mean_length": sum(lengths) / len(lengths) if lengths else None}))


if __name__ == "__main__":
    main()
