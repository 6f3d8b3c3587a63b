#!/usr/bin/env python3
"""Decode throughput on one GPU (tests/gpu/run.sh runs it): moonrl's engine with
model.device=cuda (bench/decode/generate_bench.lua, BENCH_DEVICE=cuda) against
PyTorch eager (Hugging Face transformers' generate, greedy, use_cache, the
model and its KV cache in bfloat16) on the same GPU and the same weights
(moonrl saves the random model in Hugging Face format; transformers loads
that directory). Batch 1, 16 and 64 distinct prompts of 128 tokens, 256 new
tokens each, no EOS (every row runs to the end). Each case runs moonrl (in a
child process) then PyTorch, one after the other.

usage: python3 bench/gpu/gpu_decode.py [--moonrl build-gpu/moonrl] [--model qwen0.5b|tiny] [--cases 1,16,64]
                                   [--dtype bf16|fp32] [--device cuda] [--new 256] [--prompt 128]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.join(ROOT, "bench"))
from models import preset  # noqa: E402  (bench/models.json)

MODELS = {
    # Qwen2.5-0.5B's shape (bench/gpu/gpu_train.lua's), random weights
    "qwen0.5b": preset("qwen0.5b"),
    # a check of the script itself (a CPU, an emulated GPU)
    "tiny": preset("qwen2-tiny", max_position_embeddings=1024),
}


def moonrl_case(exe, model_dir, B, args):
    env = dict(os.environ, BENCH_MODE="run", BENCH_DIR=model_dir, BENCH_DTYPE=args.dtype, BENCH_DEVICE=args.device,
               BENCH_CASE=json.dumps(dict(prompts=B, n=1, prompt_len=args.prompt, new=args.new, temperature=0.0,
                                          repeats=args.repeats)))
    out = subprocess.run([exe, "run", os.path.join(ROOT, "bench/decode/generate_bench.lua")], env=env, check=True,
                         capture_output=True, text=True).stdout
    st = json.loads(out.strip().splitlines()[-1])
    return st["generated"] / st["seconds"], st


def torch_case(model, V, B, args, torch):
    ids = torch.tensor([[(k * 31 + i * 7 + 1) % V for k in range(args.prompt)] for i in range(B)],
                       device=args.device)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, use_cache=True, pad_token_id=0,
              eos_token_id=None)
    model.generate(ids[:1, :16], attention_mask=mask[:1, :16], **dict(kw, max_new_tokens=4, min_new_tokens=4))
    best = float("inf")
    for _ in range(args.repeats):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    assert out.shape[1] == args.prompt + args.new, out.shape
    return B * args.new / best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moonrl", default=os.path.join(ROOT, "build-gpu/moonrl"))
    ap.add_argument("--model", default="qwen0.5b", choices=sorted(MODELS))
    ap.add_argument("--cases", default="1,16,64")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import torch
    import transformers
    cfg = MODELS[args.model]
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, BENCH_MODE="save", BENCH_DIR=d, BENCH_CONFIG=json.dumps(cfg))
        subprocess.run([args.moonrl, "run", os.path.join(ROOT, "bench/decode/generate_bench.lua")], env=env, check=True)
        dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        try:  # transformers >= 4.56 names it dtype, older ones torch_dtype
            model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dt)
        except TypeError:
            model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=dt)
        model = model.to(args.device).eval()
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        print(f"decode, {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M), {args.dtype}, "
              f"{args.prompt} + {args.new} tokens, on {name}; torch {torch.__version__}, "
              f"transformers {transformers.__version__}")
        rows = []
        with torch.no_grad():
            for c in args.cases.split(","):
                B = int(c)
                m, st = moonrl_case(args.moonrl, d, B, args)
                p = torch_case(model, cfg["vocab_size"], B, args, torch)
                rows.append(dict(batch=B, moonrl_tok_s=m, torch_tok_s=p, ratio=m / p, moonrl_steps=st["steps"]))
                print(f"batch {B:3d}: moonrl {m:10.1f} tok/s, torch eager {p:10.1f} tok/s, ratio {m / p:.2f}x",
                      flush=True)
        print(json.dumps(rows))


if __name__ == "__main__":
    sys.exit(main())
