"""AdamW step throughput: moonrl vs torch.optim.AdamW(foreach=True) on the
same number of parameters and the same thread count, in one script.

  /usr/bin/python3 bench/optim/optim_bench.py [--n 16777216] [--threads 2] [--steps 20]

Throughput counts the bytes of state one step touches: per parameter it
reads p, g, m, v and writes p, m, v (7 x 4 bytes). Best of 3 runs of
`steps` steps each, for both."""
import argparse
import os
import subprocess
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16 * 1024 * 1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--moonrl", default=os.environ.get("MOONRL_EXE", "build/moonrl"))
    a = ap.parse_args()

    env = dict(os.environ, BENCH_N=str(a.n), BENCH_STEPS=str(a.steps), MOONRL_THREADS=str(a.threads))
    out = subprocess.run([a.moonrl, "run", "bench/optim/optim_bench.lua"], env=env, check=True, capture_output=True,
                         text=True).stdout
    ours = float(out.split("seconds_per_step=")[1].split()[0])

    torch.set_num_threads(a.threads)
    p = torch.nn.Parameter(torch.randn(a.n) * 0.01)
    p.grad = torch.randn(a.n) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=True)
    opt.step()
    opt.step()
    theirs = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            opt.step()
        theirs = min(theirs, (time.perf_counter() - t0) / a.steps)

    gb = 28 * a.n / 1e9
    print("AdamW step, n=%d parameters, %d threads" % (a.n, a.threads))
    print("  moonrl            %8.2f ms/step  %6.2f GB/s" % (ours * 1e3, gb / ours))
    print("  torch %s foreach %8.2f ms/step  %6.2f GB/s" % (torch.__version__, theirs * 1e3, gb / theirs))
    print("  speed-up (torch time / moonrl time): %.2fx" % (theirs / ours))


if __name__ == "__main__":
    main()
