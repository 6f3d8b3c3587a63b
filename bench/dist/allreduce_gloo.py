#!/usr/bin/env python3
"""torch.distributed's side of bench/dist/allreduce.sh: all-reduce SUM of f32 tensors between --ranks
processes on this machine with the gloo backend (TCP over loopback), measured exactly as
bench_allreduce measures moonrl: each iteration refills the tensor from this rank's source values
(not timed), a barrier, one all_reduce timed on every rank; an iteration's time is the slowest
rank's; the median (and minimum) over the iterations after the warm-up. The first result is
checked against the exact sum. One JSON line per size on stdout (rank 0), the same fields as
bench_allreduce's.

usage: /usr/bin/python3 bench/dist/allreduce_gloo.py [--ranks 2] [--min-mib 1] [--max-mib 256]
       [--factor 4] [--iters N] [--warmup 3] [--threads 1] [--port 29517]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def value(n, rank):
    # the same small integers and halves as bench_allreduce: exact sums in any order
    return (torch.arange(n, dtype=torch.int64) % 1024).to(torch.float32) * 0.5 + rank


def worker(rank, a):
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=a.ranks)
    size = dist.get_world_size()
    max_n = int(a.max_mib * (1 << 20)) // 4
    src = value(max_n, rank)
    buf = src.clone()
    mib = a.min_mib
    while mib <= a.max_mib + 1e-9:
        n = int(mib * (1 << 20)) // 4
        nbytes = 4.0 * n
        iters = a.iters if a.iters > 0 else int(min(100, max(10, 4.0 * (1 << 30) / nbytes)))
        t = torch.zeros(a.warmup + iters, dtype=torch.float64)
        view, s = buf[:n], src[:n]
        for k in range(a.warmup + iters):
            view.copy_(s)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(view, op=dist.ReduceOp.SUM)
            t[k] = time.perf_counter() - t0
            if k == 0:
                want = torch.zeros(n, dtype=torch.float32)
                for r in range(size):
                    want += value(n, r)
                if not torch.equal(view, want):
                    bad = int((view != want).nonzero()[0])
                    sys.exit(f"allreduce_gloo: rank {rank}: wrong sum at {bad}: {float(view[bad])}, want {float(want[bad])}")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # an iteration lasts as long as its slowest rank
        timed = t[a.warmup:].sort().values
        med = float(timed.median()) if iters % 2 else float(0.5 * (timed[iters // 2 - 1] + timed[iters // 2]))
        algbw = nbytes / med / 1e9
        if rank == 0:
            print(json.dumps({"impl": "gloo", "ranks": size, "bytes": nbytes, "iters": iters, "median_s": med,
                              "min_s": float(timed[0]), "max_s": float(timed[-1]), "algbw_GBps": round(algbw, 3),
                              "busbw_GBps": round(algbw * 2.0 * (size - 1) / size, 3)}), flush=True)
        mib *= a.factor
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--min-mib", type=float, default=1)
    ap.add_argument("--max-mib", type=float, default=256)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--port", type=int, default=29517)
    a = ap.parse_args()
    mp.spawn(worker, args=(a,), nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()
