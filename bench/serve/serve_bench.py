#!/usr/bin/env python3
"""Throughput of `moonrl serve` with 1, 8 and 32 concurrent clients (standard library only).

Starts the server on MODEL (a directory or a .gguf), then for each concurrency C runs C client
threads, each sending REQUESTS greedy /v1/completions of TOKENS tokens (distinct prompts, so no
prefix-cache hits across clients), and prints the generated tokens/s, the mean request latency and
the engine's peak of running sequences (/metrics).

usage: bench/serve/serve_bench.py build/moonrl MODEL [TOKENS=64] [REQUESTS=4] [CONCURRENCY=1,8,32]
"""
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

moonrl, model = sys.argv[1], sys.argv[2]
tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
per_client = int(sys.argv[4]) if len(sys.argv) > 4 else 4
levels = [int(x) for x in (sys.argv[5] if len(sys.argv) > 5 else "1,8,32").split(",")]

err = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
proc = subprocess.Popen([moonrl, "serve", "--model", model, "--port", "0", "--max-seqs", str(max(levels))],
                        stdout=subprocess.DEVNULL, stderr=err)
port = None
while port is None:
    if proc.poll() is not None:
        sys.exit(open(err.name).read())
    m = re.search(r"listening on http://[^ ]*:(\d+)", open(err.name).read())
    port = int(m.group(1)) if m else None
    time.sleep(0.1)
base = "http://127.0.0.1:%d" % port


def post(body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def peak():
    with urllib.request.urlopen(base + "/metrics") as r:
        m = dict(line.split() for line in r.read().decode().splitlines())
    return int(float(m["moonrl_engine_sequences_running_peak"]))


post({"prompt": "warm up", "max_tokens": 4, "temperature": 0})
print("model %s, %d tokens a request, %d requests a client" % (model, tokens, per_client))
print("%11s %10s %10s %12s %s" % ("concurrency", "seconds", "tokens/s", "latency (s)", "peak running"))
serial = [0]
try:
    for c in levels:
        lat, gen, lock = [], [0], threading.Lock()

        def client(k):
            for r in range(per_client):
                with lock:
                    serial[0] += 1
                    n = serial[0]
                t0 = time.time()
                out = post({"prompt": "Request %d: tell me about number %d." % (n, n * 7), "max_tokens": tokens,
                            "temperature": 0, "ignore_eos": True})
                with lock:
                    lat.append(time.time() - t0)
                    gen[0] += out["usage"]["completion_tokens"]

        ts = [threading.Thread(target=client, args=(k,)) for k in range(c)]
        t0 = time.time()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.time() - t0
        print("%11d %10.2f %10.1f %12.2f %d" % (c, dt, gen[0] / dt, sum(lat) / len(lat), peak()))
        sys.stdout.flush()
finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait()
