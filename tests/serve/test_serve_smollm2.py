#!/usr/bin/env python3
"""`moonrl serve` on the real SmolLM2-135M-Instruct GGUF (dev.sh fetch_model; MOONRL_SMOLLM2_GGUF
names another copy; skipped, exit 77, when it is absent): a short greedy completion and a greedy
chat completion equal `moonrl generate --model that.gguf` (and `--chat`), and two concurrent
requests each equal their answer alone.

usage: test_serve_smollm2.py PATH/TO/moonrl
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

MOONRL = sys.argv[1]
cache = os.environ.get("MOONRL_CACHE") or os.path.join(os.environ.get("HOME", "/tmp"), ".cache", "moonrl")
GGUF = os.environ.get("MOONRL_SMOLLM2_GGUF") or os.path.join(cache, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
if not os.path.exists(GGUF):
    print("skipped: no %s (./dev.sh test fetches it)" % GGUF)
    sys.exit(77)

failed = 0


def check(name, ok, detail=""):
    global failed
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else " " + str(detail)))
    sys.stdout.flush()
    failed += 0 if ok else 1


def generate(prompt, tokens, chat=False):
    args = [MOONRL, "generate", "--model", GGUF, "--prompt", prompt, "--temperature", "0", "--max-tokens", str(tokens)]
    out = subprocess.run(args + (["--chat"] if chat else []), capture_output=True, check=True, timeout=600).stdout
    return out.decode("utf-8", "replace")[:-1]


def main():
    prompt, chat_prompt = "The capital of France is", "What is 2 + 3?"
    want = generate(prompt, 12)
    want_chat = generate(chat_prompt, 16, chat=True)
    err = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([MOONRL, "serve", "--model", GGUF, "--port", "0"], stdout=subprocess.DEVNULL, stderr=err)
    port, deadline = None, time.time() + 300
    while port is None and time.time() < deadline and proc.poll() is None:
        m = re.search(r"listening on http://[^ ]*:(\d+)", open(err.name).read())
        if m:
            port = int(m.group(1))
        time.sleep(0.1)
    if port is None:
        print(open(err.name).read())
        sys.exit(1)

    def post(path, body):
        req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    try:
        r = post("/v1/completions", {"model": GGUF, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        got = r["choices"][0]["text"]
        check("completion-equals-generate", got == want, "%r vs %r" % (got, want))
        r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": chat_prompt}], "max_tokens": 16,
                                          "temperature": 0})
        got_chat = r["choices"][0]["message"]["content"]
        check("chat-equals-generate", got_chat == want_chat, "%r vs %r" % (got_chat, want_chat))
        print("     %r -> %r" % (chat_prompt, got_chat))
        out = [None, None]

        def worker(i, body, path):
            out[i] = post(path, body)

        ts = [threading.Thread(target=worker, args=(0, {"prompt": prompt, "max_tokens": 12, "temperature": 0},
                                                     "/v1/completions")),
              threading.Thread(target=worker, args=(1, {"messages": [{"role": "user", "content": chat_prompt}],
                                                        "max_tokens": 16, "temperature": 0}, "/v1/chat/completions"))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        check("concurrent-same", out[0]["choices"][0]["text"] == want and
              out[1]["choices"][0]["message"]["content"] == want_chat, out)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    check("sigterm-exit-0", code == 0, code)
    sys.exit(1 if failed else 0)


main()
