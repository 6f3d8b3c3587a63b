#!/usr/bin/env python3
"""`moonrl serve` end to end on a tiny random model (standard library only).

Checks: /health and /v1/models; greedy /v1/completions equals `moonrl generate` (text) and the
engine (token ids, log-probs); chat completions with the model's template; n > 1 with a seed;
stop strings; streaming (SSE) concatenating to the non-streamed text; 12 concurrent requests
answered as when alone, overlapping in the engine (the /metrics peaks); every error case (400,
404, 405, 411, 413, 431, malformed HTTP); keep-alive, pipelining, Expect: 100-continue; a client
leaving mid-stream; SIGTERM while a stream runs (it completes, exit 0); CLI usage errors (exit 2).
Hardening (issue 32): a burst of 400 requests at once, all answered; a half-closed request
answered; the details refused with a 400 (an empty stop string, an invalid UTF-8 body, a NUL in a
header, unknown roles, missing content, nested prompts, max_tokens 2^63); and, on a server with
second-long deadlines: a 15 MB prompt refused before it is tokenised (the server's peak memory
barely moves), sockets trickling heads and bodies (cut at the deadline with 408, more of them than
--max-connections: /health and new clients still answered), requests past --request-timeout (503,
an error event on a stream, their samples stopped).
--tp 2 (where mpirun is): the answers of one process from 2 tensor-parallel ranks, a drain on
SIGTERM, exit 2 for a degree the heads do not take.
Prints tokens/s with 1 and 8 concurrent clients.

usage: test_serve.py PATH/TO/moonrl SOURCE_DIR
"""
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

MOONRL, SRC = sys.argv[1], sys.argv[2]
failed = 0


def check(name, ok, detail=""):
    global failed
    if ok:
        print("ok   " + name)
    else:
        failed += 1
        print("FAIL %s %s" % (name, detail))
    sys.stdout.flush()


class Server:
    def __init__(self, model, *extra):
        self.err = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen([MOONRL, "serve", "--model", model, "--port", "0"] + list(extra),
                                     stdout=subprocess.DEVNULL, stderr=self.err)
        deadline = time.time() + 120
        self.port = None
        while time.time() < deadline and self.port is None:
            if self.proc.poll() is not None:
                break
            m = re.search(r"listening on http://[^ ]*:(\d+)", open(self.err.name).read())
            if m:
                self.port = int(m.group(1))
            else:
                time.sleep(0.05)
        if self.port is None:
            raise SystemExit("the server did not start:\n" + open(self.err.name).read())

    def log(self):
        return open(self.err.name).read()

    def request(self, method, path, body=None, headers=None, timeout=60):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        c.request(method, path, body=data, headers=headers or ({"Content-Type": "application/json"} if data else {}))
        r = c.getresponse()
        raw = r.read()
        c.close()
        return r.status, raw, r

    def post(self, path, body):
        status, raw, _ = self.request("POST", path, body)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    def stream(self, path, body):
        """The events of a streamed response (the JSON objects), and whether [DONE] ended it."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("POST", path, body=json.dumps(dict(body, stream=True)), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        events, done = [], False
        ctype = r.getheader("Content-Type")
        for line in r.read().decode("utf-8").split("\n\n"):
            if not line.strip():
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
            else:
                events.append(json.loads(payload))
        c.close()
        return r.status, ctype, events, done

    def metrics(self):
        _, raw, _ = self.request("GET", "/metrics")
        out = {}
        for line in raw.decode().splitlines():
            k, v = line.split()
            out[k] = float(v)
        return out

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "hung"


def read_to_close(s, read_until_close=True):
    """What s receives up to its close (or its first bytes), and whether its timeout came first;
    s is closed."""
    chunks, timed_out = [], False
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
            if not read_until_close:
                break
    except socket.timeout:
        timed_out = True
    s.close()
    return b"".join(chunks), timed_out


def raw_exchange(port, data, read_until_close=True, timeout=10):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    return read_to_close(s, read_until_close)[0]


def error_ok(status, body, want_status, param=None):
    if status != want_status or not isinstance(body, dict) or "error" not in body:
        return False
    e = body["error"]
    if not all(k in e for k in ("message", "type", "param", "code")) or not e["message"]:
        return False
    return param is None or e["param"] == param


def main():
    tmp = tempfile.mkdtemp()
    model = os.path.join(tmp, "tiny")
    env = dict(os.environ, OUT=model, TOK=os.path.join(SRC, "tests/tok/fixtures/qwen2_split"), PROMPT="Hello world")
    subprocess.run([MOONRL, "run", os.path.join(SRC, "tests/engine/make_tiny_model.lua")], env=env, check=True)
    exp_path = os.path.join(tmp, "expect.json")
    subprocess.run([MOONRL, "run", os.path.join(SRC, "tests/serve/expect.lua")],
                   env=dict(os.environ, DIR=model, OUT=exp_path), check=True)
    exp = json.load(open(exp_path))
    gen = subprocess.run([MOONRL, "generate", "--model", model, "--prompt", "Hello world", "--temperature", "0",
                          "--max-tokens", "20"], capture_output=True, check=True).stdout
    gen_text = gen.decode("utf-8", "replace")[:-1]  # generate ends with a newline
    gen_chat = subprocess.run([MOONRL, "generate", "--model", model, "--prompt", "Hi", "--chat", "--temperature", "0",
                               "--max-tokens", "8"], capture_output=True, check=True).stdout.decode("utf-8", "replace")[:-1]

    srv = Server(model, "--max-seqs", "32", "--max-body-mb", "1", "--served-model-name", "tiny-test",
                 "--shutdown-timeout", "20")
    try:
        run_checks(srv, exp, gen_text, gen_chat, model)
    finally:
        code = srv.stop()
    check("sigterm-idle-exit-0", code == 0, "exit %s\n%s" % (code, srv.log()[-2000:]))
    check("no-traceback", "traceback" not in srv.log().lower() and "internal error" not in srv.log(), srv.log()[-2000:])
    record_checks(model, tmp)
    control_checks(model, tmp, env)
    echo_checks(model)
    tp_checks(model, exp, gen_text, gen_chat)
    lora_checks(model, tmp, gen_text)
    hardening_checks(model)
    cli_checks(model)
    print("%d failed" % failed)
    sys.exit(1 if failed else 0)


def run_checks(srv, exp, gen_text, gen_chat, model):
    status, raw, _ = srv.request("GET", "/health")
    check("health", status == 200)
    status, models = srv.post("/v1/models", {})  # wrong method first
    check("models-wrong-method-405", error_ok(status, models, 405))
    status, raw, _ = srv.request("GET", "/v1/models")
    models = json.loads(raw)
    check("models", status == 200 and models["object"] == "list" and models["data"][0]["id"] == "tiny-test", raw)

    # greedy: the same text as `moonrl generate`, the same ids and log-probs as the engine
    g = exp["greedy"][0]
    status, r = srv.post("/v1/completions", {"model": "tiny-test", "prompt": "Hello world", "max_tokens": 20,
                                             "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True})
    ok = status == 200 and r["object"] == "text_completion" and r["model"] == "tiny-test" and r["id"].startswith("cmpl-")
    check("completion-shape", ok and len(r["choices"]) == 1 and isinstance(r["created"], int), r)
    c = r["choices"][0]
    check("greedy-equals-generate", c["text"] == gen_text, "%r vs %r" % (c["text"], gen_text))
    ids = [int(t.split(":")[1]) for t in c["logprobs"]["tokens"]]
    check("greedy-token-ids", ids == g["ids"], "%s vs %s" % (ids, g["ids"]))
    lps = c["logprobs"]["token_logprobs"]
    check("greedy-logprobs", len(lps) == len(g["logprobs"]) and
          max(abs(a - b) for a, b in zip(lps, g["logprobs"])) < 1e-5, "%s vs %s" % (lps, g["logprobs"]))
    check("finish-length", c["finish_reason"] == "length")
    u = r["usage"]
    check("usage", u == {"prompt_tokens": len(exp["prompt_ids"]), "completion_tokens": 20,
                         "total_tokens": len(exp["prompt_ids"]) + 20}, u)
    # a prompt of token ids gives the same
    status, r2 = srv.post("/v1/completions", {"prompt": exp["prompt_ids"], "max_tokens": 20, "temperature": 0})
    check("token-prompt", status == 200 and r2["choices"][0]["text"] == c["text"])
    # a batch of prompts: one choice each
    status, r2 = srv.post("/v1/completions", {"prompt": ["Hello world", "Hello world"], "max_tokens": 20,
                                              "temperature": 0})
    check("prompt-list", status == 200 and [x["index"] for x in r2["choices"]] == [0, 1] and
          all(x["text"] == c["text"] for x in r2["choices"]), r2)

    # n > 1 with a seed: the engine's samples of (seed, 0, 0, j), and again the same
    body = {"prompt": "Hello world", "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7}
    status, r = srv.post("/v1/completions", body)
    texts = [x["text"] for x in sorted(r["choices"], key=lambda x: x["index"])] if status == 200 else None
    check("n3-seeded", texts == [s["text"] for s in exp["sampled"]], "%s vs %s" % (texts, exp["sampled"]))
    status, r = srv.post("/v1/completions", body)
    check("n3-repeat", status == 200 and [x["text"] for x in r["choices"]] == texts)
    check("n3-distinct", texts is not None and len(set(texts)) > 1, texts)

    # chat with the model's template: `moonrl generate --chat`, the engine's ids
    status, r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                                  "temperature": 0, "logprobs": True, "top_logprobs": 3})
    ok = status == 200 and r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    check("chat-shape", ok, r)
    chat_text = r["choices"][0]["message"]["content"] if ok else None
    check("chat-equals-generate", chat_text == gen_chat, "%r vs %r" % (chat_text, gen_chat))
    check("chat-equals-engine", ok and chat_text == exp["chat"][0]["text"])
    content = r["choices"][0]["logprobs"]["content"] if ok else []
    check("chat-logprobs", len(content) == len(exp["chat"][0]["ids"]) and
          max(abs(x["logprob"] - y) for x, y in zip(content, exp["chat"][0]["logprobs"])) < 1e-5 and
          all(len(x["top_logprobs"]) == 3 for x in content))
    # the 3 alternatives: the engine's, best first; greedy, so the first is the chosen token
    want_top = exp["chat"][0]["top"]
    check("chat-top-logprobs", len(want_top) == len(content) and all(
        abs(a["logprob"] - w[1]) < 1e-5 for x, ws in zip(content, want_top) for a, w in zip(x["top_logprobs"], ws)) and
        all(x["top_logprobs"][0]["token"] == x["token"] and abs(x["top_logprobs"][0]["logprob"] - x["logprob"]) < 1e-6 and
            x["top_logprobs"][0]["logprob"] >= x["top_logprobs"][1]["logprob"] >= x["top_logprobs"][2]["logprob"]
            for x in content), content)
    status, r3 = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 5, "temperature": 0, "logprobs": 2})
    tops = r3["choices"][0]["logprobs"]["top_logprobs"] if status == 200 else []
    toks = r3["choices"][0]["logprobs"]["tokens"] if status == 200 else []
    check("completion-top-logprobs", len(tops) == 5 and all(len(d) == 2 and t in d for d, t in zip(tops, toks)), r3)
    check("chat-usage", ok and r["usage"]["prompt_tokens"] == len(exp["chat_prompt_ids"]))
    # content as a list of text parts renders the same
    status, r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                                  "max_tokens": 8, "temperature": 0})
    check("chat-content-parts", status == 200 and r["choices"][0]["message"]["content"] == chat_text)

    # stop strings: cut before the stop, finish_reason stop; streamed the same
    full = c["text"]
    stop = full[3:5]
    want = full[:full.index(stop)]
    status, r = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 20, "temperature": 0, "stop": [stop]})
    check("stop-string", status == 200 and r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop",
          "%r vs %r" % (r, want))
    status, ctype, events, done = srv.stream("/v1/completions", {"prompt": "Hello world", "max_tokens": 20,
                                                                 "temperature": 0, "stop": stop})
    check("stop-string-stream", "".join(e["choices"][0]["text"] for e in events) == want and done and
          events[-1]["choices"][0]["finish_reason"] == "stop")

    # streaming: SSE chunks that concatenate to the non-streamed text
    status, ctype, events, done = srv.stream("/v1/completions", {"prompt": "Hello world", "max_tokens": 20,
                                                                 "temperature": 0, "logprobs": 0,
                                                                 "stream_options": {"include_usage": True}})
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    check("stream-sse", status == 200 and ctype.startswith("text/event-stream") and done and len(events) > 3, events[:2])
    check("stream-text", text == full, "%r vs %r" % (text, full))
    check("stream-finish", [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length")
    check("stream-usage", events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 20)
    slps = [x for e in events if e["choices"] and e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    check("stream-logprobs", len(slps) == 20 and max(abs(a - b) for a, b in zip(slps, exp["greedy"][0]["logprobs"])) < 1e-5)
    status, ctype, events, done = srv.stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                      "max_tokens": 8, "temperature": 0})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    check("chat-stream", done and text == chat_text and events[0]["choices"][0]["delta"].get("role") == "assistant" and
          events[0]["object"] == "chat.completion.chunk" and events[-1]["choices"][0]["finish_reason"] == "length",
          "%r vs %r" % (text, chat_text))
    status, ctype, events, done = srv.stream("/v1/completions", {"prompt": "Hello world", "max_tokens": 6, "n": 2,
                                                                 "seed": 3})
    per = {}
    for e in events:
        for ch in e["choices"]:
            per[ch["index"]] = per.get(ch["index"], "") + ch["text"]
    status, r = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 6, "n": 2, "seed": 3})
    check("stream-n2", done and sorted(per) == [0, 1] and [per[0], per[1]] == [x["text"] for x in r["choices"]])

    concurrency_checks(srv)
    error_checks(srv)
    detail_checks(srv)
    http_checks(srv)
    burst_check(srv)
    disconnect_checks(srv)
    sigterm_check(model)


def concurrency_checks(srv):
    prompts = ["Hello world", "Hi", "one two three", "the quick brown fox", "a", "bb", "ccc", "dddd",
               "moon", "rl", "serve", "batch"]
    bodies = [{"prompt": p, "max_tokens": 48, "temperature": 0, "logprobs": 0} for p in prompts]
    t0 = time.time()
    alone = [srv.post("/v1/completions", b)[1] for b in bodies]
    t_seq = time.time() - t0
    before = srv.metrics()
    results = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def worker(i):
        barrier.wait()
        results[i] = srv.post("/v1/completions", bodies[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(bodies))]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t_par = time.time() - t0
    ok = all(r is not None and r[0] == 200 for r in results)
    same = ok and all(r[1]["choices"][0]["text"] == a["choices"][0]["text"] for r, a in zip(results, alone))
    check("concurrent-12-answered", ok)
    check("concurrent-12-same-as-alone", same)
    lp_ok = ok and all(max(abs(x - y) for x, y in zip(r[1]["choices"][0]["logprobs"]["token_logprobs"],
                                                       a["choices"][0]["logprobs"]["token_logprobs"])) < 1e-4
                       for r, a in zip(results, alone))
    check("concurrent-12-logprobs", lp_ok)
    m = srv.metrics()
    check("concurrent-overlap", m["moonrl_requests_running_peak"] >= 4 and m["moonrl_engine_sequences_running_peak"] >= 4,
          m)
    toks = sum(r[1]["usage"]["completion_tokens"] for r in results) if ok else 0
    print("     tiny model, %d requests x 48 tokens: one at a time %.2f s (%.0f tokens/s), %d concurrent %.2f s "
          "(%.0f tokens/s); engine steps %d vs %d" % (len(bodies), t_seq, toks / t_seq, len(bodies), t_par,
                                                     toks / t_par, before["moonrl_engine_steps"],
                                                     m["moonrl_engine_steps"] - before["moonrl_engine_steps"]))


def error_checks(srv):
    def post(body, path="/v1/completions"):
        return srv.post(path, body)

    st, b = srv.post("/v1/completions", b"{not json")
    check("err-invalid-json", error_ok(st, b, 400))
    st, b = srv.post("/v1/completions", b"[1, 2]")
    check("err-not-object", error_ok(st, b, 400))
    check("err-missing-prompt", error_ok(*post({"max_tokens": 3}), 400, "prompt"))
    check("err-missing-messages", error_ok(*post({"max_tokens": 3}, "/v1/chat/completions"), 400, "messages"))
    check("err-empty-messages", error_ok(*post({"messages": []}, "/v1/chat/completions"), 400, "messages"))
    check("err-bad-message", error_ok(*post({"messages": [{"content": "x"}]}, "/v1/chat/completions"), 400, "messages"))
    check("err-max-tokens-type", error_ok(*post({"prompt": "x", "max_tokens": "5"}), 400, "max_tokens"))
    check("err-max-tokens-zero", error_ok(*post({"prompt": "x", "max_tokens": 0}), 400, "max_tokens"))
    check("err-temperature", error_ok(*post({"prompt": "x", "temperature": -1}), 400, "temperature"))
    check("err-top-p", error_ok(*post({"prompt": "x", "top_p": 0}), 400, "top_p"))
    check("err-top-p-big", error_ok(*post({"prompt": "x", "top_p": 1.5}), 400, "top_p"))
    check("err-top-k", error_ok(*post({"prompt": "x", "top_k": 1.5}), 400, "top_k"))
    check("err-min-p", error_ok(*post({"prompt": "x", "min_p": 2}), 400, "min_p"))
    check("err-n", error_ok(*post({"prompt": "x", "n": 0}), 400, "n"))
    check("err-n-huge", error_ok(*post({"prompt": "x", "n": 100000}), 400, "n"))
    check("err-stream-type", error_ok(*post({"prompt": "x", "stream": "yes"}), 400, "stream"))
    check("err-stop-type", error_ok(*post({"prompt": "x", "stop": 5}), 400, "stop"))
    check("err-logprobs", error_ok(*post({"prompt": "x", "logprobs": 99}), 400, "logprobs"))
    check("err-seed", error_ok(*post({"prompt": "x", "seed": 0.5}), 400, "seed"))
    check("err-prompt-type", error_ok(*post({"prompt": {"a": 1}}), 400, "prompt"))
    check("err-token-out-of-vocab", error_ok(*post({"prompt": [1, 2, 10 ** 9]}), 400, "prompt"))
    check("err-unknown-model", error_ok(*post({"prompt": "x", "model": "gpt-9"}), 404, "model"))
    st, b = post({"prompt": [5] * 600, "max_tokens": 4})
    check("err-prompt-too-long", error_ok(st, b, 400, "prompt") and "maximum context length" in b["error"]["message"], b)
    check("err-max-tokens-past-context", error_ok(*post({"prompt": "x", "max_tokens": 100000}), 400))
    check("err-penalty", error_ok(*post({"prompt": "x", "presence_penalty": 0.5}), 400, "presence_penalty"))
    st, raw, _ = srv.request("GET", "/v1/nothing")
    check("err-404", st == 404 and "error" in json.loads(raw))
    st, raw, _ = srv.request("GET", "/v1/completions")
    check("err-405", st == 405 and "error" in json.loads(raw))
    st, raw, _ = srv.request("POST", "/v1/completions", b"x" * (1 << 20 + 1) * 2)
    check("err-413", st == 413 and "error" in json.loads(raw), st)
    # after all that, a good request still works
    st, b = post({"prompt": "Hello world", "max_tokens": 3, "temperature": 0})
    check("after-errors", st == 200 and b["usage"]["completion_tokens"] == 3)


def detail_checks(srv):
    """Issue 32, item 9: what OpenAI and vLLM refuse is refused; a half-closed request is answered."""
    def post(body, path="/v1/completions"):
        return srv.post(path, body)

    def raw_post(body, path="/v1/completions", extra=b""):
        return raw_exchange(srv.port, b"POST %s HTTP/1.1\r\nContent-Length: %d\r\nConnection: close\r\n%s\r\n%s" % (
            path.encode(), len(body), extra, body))

    check("detail-stop-empty", error_ok(*post({"prompt": "x", "stop": ""}), 400, "stop"))
    check("detail-stop-list-empty", error_ok(*post({"prompt": "x", "stop": ["a", ""]}), 400, "stop"))
    st, b = srv.post("/v1/completions", b'{"prompt": "x", "max_tokens": 9223372036854775808}')
    msg = b["error"]["message"] if isinstance(b, dict) and "error" in b else ""
    check("detail-max-tokens-2^63", error_ok(st, b, 400) and "9223372036854775808" in msg and
          not re.search(r"-\d", msg), b)
    check("detail-top-k-2^40", error_ok(*post({"prompt": "x", "top_k": 2 ** 40}), 400, "top_k"))
    for prompt in ([[[1]]], [[1, [2]]], [[1, None]], [1, {"a": 1}]):
        st, b = post({"prompt": prompt})
        check("detail-nested-prompt %s" % json.dumps(prompt), error_ok(st, b, 400, "prompt") and
              "table:" not in b["error"]["message"], b)
    out = raw_post(b'{"prompt": "Hi \xff\xfe", "max_tokens": 2}')
    check("detail-invalid-utf8-400", out.startswith(b"HTTP/1.1 400") and b"UTF-8" in out, out[:300])
    out = raw_post(b'{"prompt": "Hi \xed\xa0\x80", "max_tokens": 2}')  # an encoded surrogate
    check("detail-surrogate-utf8-400", out.startswith(b"HTTP/1.1 400"), out[:300])
    out = raw_post('{"prompt": "Hi \u00e9\u4e16\U0001F600", "max_tokens": 2}'.encode("utf-8"))
    check("detail-valid-utf8-200", out.startswith(b"HTTP/1.1 200"), out[:300])
    out = raw_exchange(srv.port, b"GET /health HTTP/1.1\r\nX-A: a\x00b\r\n\r\n")
    check("detail-nul-header-400", out.startswith(b"HTTP/1.1 400"), out[:80])
    out = raw_post(b'{"prompt": "Hi", "max_tokens": 2}', extra=b"X-A: a\x00b\r\n")
    check("detail-nul-header-post-400", out.startswith(b"HTTP/1.1 400"), out[:80])
    chat = "/v1/chat/completions"
    check("detail-unknown-role", error_ok(*post({"messages": [{"role": "wizard", "content": "Hi"}]}, chat), 400, "messages"))
    check("detail-missing-content", error_ok(*post({"messages": [{"role": "user"}]}, chat), 400, "messages"))
    check("detail-null-content", error_ok(*post({"messages": [{"role": "user", "content": None}]}, chat), 400, "messages"))
    check("detail-missing-content-later", error_ok(*post({"messages": [{"role": "user", "content": "Hi"},
                                                                       {"role": "assistant"}]}, chat), 400, "messages"))
    st, b = post({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                  "max_tokens": 2}, chat)
    check("detail-known-roles-200", st == 200, b)
    # a complete POST, then the client shuts its write side: answered, as a GET is
    body = json.dumps({"prompt": "Hello world", "max_tokens": 5, "temperature": 0}).encode()
    for name, req in (("post", b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)),
                      ("get", b"GET /health HTTP/1.1\r\n\r\n"),
                      ("stream", b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (
                          len(body) + 16, body[:-1] + b', "stream": true}'))):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(req)
        s.shutdown(socket.SHUT_WR)
        out, timed_out = read_to_close(s)
        if out.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):  # the probe of a half-close (an HTTP/1.1 client skips it)
            out = out[25:]
        want = {"post": b'"completion_tokens": 5', "get": b"Content-Length: 0", "stream": b"data: [DONE]"}[name]
        check("detail-half-close-%s" % name, out.startswith(b"HTTP/1.1 200") and want in out and not timed_out,
              out[-200:])


def burst_check(srv):
    """Issue 32, item 1: more requests ready at once than one poll takes (256), all answered."""
    n = 400
    # a long request keeps the engine stepping, so that the burst lands between two polls
    heavy = json.dumps({"prompt": "Hello world", "max_tokens": 150, "n": 32, "ignore_eos": True}).encode()
    h = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    h.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(heavy), heavy))
    time.sleep(0.1)
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    req = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(n)]
    t0 = time.time()
    for s in socks:
        s.sendall(req)
    outs = []
    for s in socks:
        s.settimeout(max(0.1, 20 - (time.time() - t0)))
        outs.append(read_to_close(s)[0])
    answered = sum(1 for o in outs if o.startswith(b"HTTP/1.1 200") and b"text_completion" in o)
    check("burst-%d-all-answered" % n, answered == n, "%d of %d answered in %.1f s" % (answered, n, time.time() - t0))
    out = b""
    while b'"usage"' not in out:  # the long request too (answered, not left running for the next checks)
        x = h.recv(65536)
        if not x:
            break
        out += x
    h.close()
    check("burst-long-request", out.startswith(b"HTTP/1.1 200"), out[:100])


def http_checks(srv):
    p = srv.port
    out = raw_exchange(p, b"GARBAGE\r\n\r\n")
    check("http-malformed-400", out.startswith(b"HTTP/1.1 400") or out.startswith(b"HTTP/1.0 400"), out[:80])
    out = raw_exchange(p, b"GET / HTTP/2.0\r\n\r\n")
    check("http-version-505", out.startswith(b"HTTP/1.1 505"), out[:80])
    out = raw_exchange(p, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n")
    check("http-header-431", out.startswith(b"HTTP/1.1 431"), out[:80])
    out = raw_exchange(p, b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    check("http-chunked-411", out.startswith(b"HTTP/1.1 411"), out[:80])
    out = raw_exchange(p, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n")
    check("http-content-length-413", out.startswith(b"HTTP/1.1 413"), out[:80])
    # keep-alive: three requests on one connection
    c = http.client.HTTPConnection("127.0.0.1", p, timeout=30)
    statuses = []
    for _ in range(3):
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 2}))
        r = c.getresponse()
        r.read()
        statuses.append(r.status)
    c.request("GET", "/health")
    r = c.getresponse()
    r.read()
    statuses.append(r.status)
    c.close()
    check("http-keep-alive", statuses == [200, 200, 200, 200], statuses)
    # pipelining: two requests in one write, two responses in order, then close
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    req = b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    out = raw_exchange(p, req + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    check("http-pipelined", out.count(b"HTTP/1.1 200") == 2 and out.index(b"text_completion") < out.rindex(b"HTTP/1.1 200"),
          out[:300])
    # Expect: 100-continue (what curl sends for bodies over 1 KiB)
    s = socket.create_connection(("127.0.0.1", p), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body))
    first = s.recv(100)
    s.sendall(body)
    rest = b""
    while b"text_completion" not in rest:
        b2 = s.recv(65536)
        if not b2:
            break
        rest += b2
    s.close()
    check("http-100-continue", first.startswith(b"HTTP/1.1 100 Continue") and b"200 OK" in first + rest, first + rest[:80])
    # HTTP/1.0: close-delimited
    out = raw_exchange(p, b"GET /health HTTP/1.0\r\n\r\n")
    check("http-1.0", out.startswith(b"HTTP/1.0 200"), out[:80])
    # many idle connections, then a request still answered
    socks = [socket.create_connection(("127.0.0.1", p), timeout=10) for _ in range(100)]
    st, raw, _ = srv.request("GET", "/health")
    for s in socks:
        s.close()
    check("http-100-idle-connections", st == 200)


def disconnect_checks(srv):
    """Clients that leave before their answer: a stream (found out by its next write) and a plain
    request (found out by the probe its EOF gets); each step waits for the server to get there, so
    that neither request can finish first, however fast the machine."""
    def wait_metrics(ok, seconds=10):
        deadline = time.time() + seconds
        m = srv.metrics()
        while time.time() < deadline and not ok(m):
            time.sleep(0.02)
            m = srv.metrics()
        return m

    def gone(m):
        return m["moonrl_requests_gone_total"] - before["moonrl_requests_gone_total"]

    before = srv.metrics()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    # heavy enough (64 x 480 tokens) to be running still when the client leaves, on any machine
    body = json.dumps({"prompt": "Hello world", "max_tokens": 480, "n": 64, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(65536)
    s.close()  # mid-stream
    wait_metrics(lambda m: gone(m) >= 1 and m["moonrl_requests_running"] == 0)
    # a non-streaming request whose client leaves once it runs (128 x 480 tokens, ignoring EOS)
    s2 = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    body = json.dumps({"prompt": "Hello world", "max_tokens": 480, "n": 128, "ignore_eos": True}).encode()
    s2.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    running = wait_metrics(lambda m: m["moonrl_requests_running"] == 1)["moonrl_requests_running"]
    s2.close()
    st, b = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 5, "temperature": 0})
    check("disconnect-server-answers", st == 200 and b["usage"]["completion_tokens"] == 5)
    m = wait_metrics(lambda m: m["moonrl_engine_running"] == 0 and gone(m) >= 2)
    check("disconnect-counted", running == 1 and gone(m) == 2, m)
    check("disconnect-samples-stopped", m["moonrl_engine_running"] == 0 and m["moonrl_engine_kv_blocks_used"] == 0 and
          m["moonrl_engine_generated_tokens"] - before["moonrl_engine_generated_tokens"] < 0.75 * (64 + 128) * 480, m)


def sigterm_check(model):
    """SIGTERM while a stream runs: the stream completes ([DONE]), then the server exits 0."""
    srv = Server(model, "--shutdown-timeout", "30")
    result = {}

    def streamer():
        result["r"] = srv.stream("/v1/completions", {"prompt": "Hello world", "max_tokens": 480, "n": 8})

    t = threading.Thread(target=streamer)
    t.start()
    time.sleep(0.3)
    code = srv.stop()
    t.join(timeout=60)
    r = result.get("r")
    check("sigterm-stream-completes", r is not None and r[3] and
          sum(1 for e in r[2] if e["choices"][0]["finish_reason"]) == 8, r and r[2][-1:])
    check("sigterm-exit-0", code == 0, "exit %s\n%s" % (code, srv.log()[-2000:]))
    # a refused connection afterwards: nothing listens
    try:
        socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
        check("sigterm-closed", False)
    except OSError:
        check("sigterm-closed", True)


def record_checks(model, tmp):
    """--record FILE (training mode): the requests that name an episode are recorded with their exact
    token ids and log-probs (a second turn's prompt extends the first's tokens), rewards appended;
    requests naming none are served and not recorded; n > 1 in an episode and a bad reward refused."""
    path = os.path.join(tmp, "episodes.jsonl")
    srv = Server(model, "--record", path)
    try:
        def post(body, key=None):
            headers = {"Content-Type": "application/json"}
            if key:
                headers["Authorization"] = "Bearer " + key
            status, raw, _ = srv.request("POST", "/v1/completions", body, headers)
            return status, json.loads(raw)
        s1, r1 = post({"prompt": "Hello", "max_tokens": 5, "logprobs": 1, "return_tokens_as_token_ids": True}, "ep-a")
        first = [int(t.split(":")[1]) for t in r1["choices"][0]["logprobs"]["tokens"]]
        s2, _ = post({"prompt": "Hello", "max_tokens": 3}, None)
        s3, _ = post({"prompt": "Hello", "max_tokens": 3, "user": "ep-b"}, None)
        s4, _ = post({"prompt": "Hello", "max_tokens": 3, "n": 2}, "ep-a")
        status, raw, _ = srv.request("POST", "/v1/episodes/reward", {"reward": 0.75},
                                     {"Authorization": "Bearer ep-a", "Content-Type": "application/json"})
        bad, _, _ = srv.request("POST", "/v1/episodes/reward", {"episode_id": "ep-b", "reward": None})
        done, _, _ = srv.request("POST", "/v1/episodes/done", {"episode_id": "ep-b", "error": "gave up"})
        nxt, _, _ = srv.request("POST", "/v1/episodes/next", {})
        check("record-served", (s1, s2, s3, s4, status, bad, done, nxt) == (200, 200, 200, 400, 200, 400, 200, 404),
              (s1, s2, s3, s4, status, bad, done, nxt))
    finally:
        code = srv.stop()
    check("record-exit-0", code == 0, srv.log()[-1000:])
    lines = [json.loads(l) for l in open(path)]
    check("record-lines", [(l["episode_id"], "reward" in l) for l in lines] == [("ep-a", False), ("ep-b", False), ("ep-a", True),
                                                                       ("ep-b", True)], lines)
    check("record-done", lines[3] == {"episode_id": "ep-b", "done": True, "reward": None, "error": "gave up"}, lines[3])
    a = lines[0]
    check("record-exact-ids", a["ids"] == first and len(a["logprobs"]) == len(first) and a["turn"] == 1, a)
    check("record-reward", lines[2]["reward"] == 0.75, lines[2])


def control_checks(model, tmp, env):
    """The control protocol of vLLM's RL API: pause (wait, keep, abort) holds new requests until
    resume; reload_weights reads another model's weights in (the greedy text then that model's),
    update_weight_version labels them, and return_token_ids reports the ids and the version spans;
    a request paused with mode=keep across an update has two spans; moonrl_stream pins a sample's
    random stream; bad calls are 400s that leave the weights alone."""
    other = os.path.join(tmp, "tiny_other")
    subprocess.run([MOONRL, "run", os.path.join(SRC, "tests/engine/make_tiny_model.lua")],
                   env=dict(env, OUT=other, SEED="11"), check=True)
    other_text = open(os.path.join(other, "expected.txt")).read()[:-1]
    mine_text = open(os.path.join(model, "expected.txt")).read()[:-1]
    srv = Server(model)
    try:
        greedy = {"prompt": "Hello world", "max_tokens": 20, "temperature": 0}

        def text():
            return srv.post("/v1/completions", greedy)[1]["choices"][0]["text"]

        def ctl(path, body=None):
            status, raw, _ = srv.request("POST" if body is not None else "GET", path, body)
            return status, (json.loads(raw) if raw else None)

        check("control-weight-info", ctl("/weight_info") == (200, {"weight_version": "default"}))
        st, r = srv.post("/v1/completions", dict(greedy, return_token_ids=True))
        c = r["choices"][0]
        check("control-token-ids", len(c["token_ids"]) > 0 and len(c["prompt_token_ids"]) > 0 and
              c["weight_versions"] == [{"version": "default", "start": 0, "end": len(c["token_ids"])}], c)
        check("control-text-before", text() == mine_text, text())
        check("control-pause", ctl("/pause", {}) == (200, {"status": "paused"}) and
              ctl("/is_paused") == (200, {"is_paused": True}))
        held = {}

        def later():
            held["r"] = srv.post("/v1/completions", dict(greedy, return_token_ids=True))
        t = threading.Thread(target=later)
        t.start()
        time.sleep(0.5)
        check("control-held-while-paused", "r" not in held)
        bad = [ctl("/collective_rpc", {"method": "sleep"})[0],
               ctl("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": os.path.join(tmp, "none")}})[0],
               ctl("/update_weight_version", {})[0], srv.request("POST", "/pause?mode=later", "")[0]]
        check("control-bad-calls", bad == [400, 400, 400, 400], bad)
        check("control-reload", ctl("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": other}}) ==
              (200, {"results": [None]}))
        check("control-version", ctl("/update_weight_version", {"new_version": "7"}) == (200, {"success": True, "new_version": "7"})
              and ctl("/weight_info") == (200, {"weight_version": "7"}))
        check("control-resume", ctl("/resume", {}) == (200, {"status": "resumed"}))
        t.join(60)
        c = held.get("r", (0, {"choices": [{}]}))[1]["choices"][0]
        check("control-held-served-new", c.get("text") == other_text and c.get("weight_versions") ==
              [{"version": "7", "start": 0, "end": len(c.get("token_ids", []))}], c)
        check("control-text-after", text() == other_text, text())
        # paused with keep while a request runs: its later tokens under the next weights, two spans
        longer = {"prompt": "Hello world", "max_tokens": 480, "n": 64, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True}
        out = {}

        def long_req():
            out["r"] = srv.post("/v1/completions", longer)
        t = threading.Thread(target=long_req)
        t.start()
        time.sleep(0.2)
        kept = ctl("/pause?mode=keep", {})
        ctl("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model}})
        ctl("/update_weight_version", {"new_version": "8"})
        ctl("/resume", {})
        t.join(60)
        spans = out.get("r", (0, {"choices": [{}]}))[1]["choices"][0].get("weight_versions")
        check("control-keep-two-spans", kept == (200, {"status": "paused"}) and spans is not None and len(spans) == 2 and
              [x["version"] for x in spans] == ["7", "8"] and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 480,
              spans)
        check("control-text-back", text() == mine_text, text())
        # abort: what the requests in flight have, finish_reason "abort"
        def long_req2():
            out["a"] = srv.post("/v1/completions", dict(longer, return_token_ids=False))
        t = threading.Thread(target=long_req2)
        t.start()
        time.sleep(0.2)
        ctl("/pause?mode=abort", {})
        t.join(60)
        ctl("/resume", {})
        ch = out.get("a", (0, {"choices": [{}]}))[1]["choices"][0]
        check("control-abort", ch.get("finish_reason") == "abort" and len(ch.get("text", "")) > 0, ch.get("finish_reason"))
        # a pinned random stream: the same sample whatever else the server did meanwhile
        pinned = {"prompt": "Hello", "max_tokens": 12, "temperature": 1.0, "seed": 5, "moonrl_stream": [3, 2, 1],
                  "return_token_ids": True}
        a = srv.post("/v1/completions", pinned)[1]["choices"][0]["token_ids"]
        srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 5})
        b = srv.post("/v1/completions", pinned)[1]["choices"][0]["token_ids"]
        c2 = srv.post("/v1/completions", dict(pinned, moonrl_stream=[3, 2, 2]))[1]["choices"][0]["token_ids"]
        check("control-pinned-stream", a == b and a != c2, (a, b, c2))
        check("control-pinned-bad", srv.post("/v1/completions", dict(pinned, moonrl_stream=[1, 2]))[0] == 400)
        transfer_checks(ctl, text, model, other, other_text, mine_text, tmp)
    finally:
        code = srv.stop()
    check("control-exit-0", code == 0, srv.log()[-1000:])


def st_read(path):
    """A safetensors file's tensors: name -> (dtype, shape, bytes), in file order."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    head.pop("__metadata__", None)
    order = sorted(head.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [(k, v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]) for k, v in order]


def st_write(path, tensors):
    head, off = {}, 0
    for name, dtype, shape, data in tensors:
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(head).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(t[3] for t in tensors))


def transfer_checks(ctl, text, model, other, other_text, mine_text, tmp):
    """The weight-transfer routes (buckets as safetensors files): out of order and hostile calls are
    400s that change nothing; another model's tensors in two buckets, then the update finished
    with a label, serve its text; a bucket refused after another of its update landed leaves the
    weights labelled 'mixed' until an update finishes."""
    theirs, mine = st_read(os.path.join(other, "model.safetensors")), st_read(os.path.join(model, "model.safetensors"))
    half = len(theirs) // 2

    def bucket(name, tensors, **extra):
        path = os.path.join(tmp, name)
        st_write(path, tensors)
        info = {"names": [t[0] for t in tensors], "dtype_names": ["float32" for _ in tensors],
                "shapes": [t[2] for t in tensors], "path": path}
        info.update(extra)
        return {"update_info": info}
    a, b = bucket("b1.safetensors", theirs[:half]), bucket("b2.safetensors", theirs[half:])
    early = [ctl("/start_weight_update", {})[0], ctl("/update_weights", a)[0], ctl("/finish_weight_update", {})[0],
             ctl("/init_weight_transfer_engine", {"init_info": {"backend": "nccl"}})[0]]
    check("transfer-out-of-order", early == [400, 400, 400, 400], early)
    check("transfer-init", ctl("/init_weight_transfer_engine", {"init_info": {"backend": "shm"}})[0] == 200 and
          ctl("/start_weight_update", {})[0] == 200 and ctl("/start_weight_update", {})[0] == 400)
    shape = [list(t[2]) for t in theirs[:half]]
    shape[0] = shape[0] + [1]
    wrong = dict(a["update_info"], shapes=shape)
    hostile = [ctl("/update_weights", {"update_info": wrong})[0],
               ctl("/update_weights", {"update_info": dict(a["update_info"], crc32c="00000000")})[0],
               ctl("/update_weights", {"update_info": dict(a["update_info"], path=os.path.join(tmp, "none"))})[0],
               ctl("/update_weights", {"update_info": dict(a["update_info"], names=["nope"] + a["update_info"]["names"][1:])})[0],
               ctl("/update_weights", {"update_info": dict(a["update_info"], dtype_names=["int8"] * half)})[0],
               ctl("/update_weights", {"update_info": dict(a["update_info"], names=a["update_info"]["names"][:1],
                                                          dtype_names=["float32"], shapes=shape[:1])})[0],
               ctl("/update_weights", {"update_info": "x"})[0]]
    check("transfer-hostile-400", hostile == [400] * 7, hostile)
    check("transfer-refused-changed-nothing", ctl("/finish_weight_update", {"weight_version": "t0"})[0] == 200 and
          ctl("/weight_info") == (200, {"weight_version": "t0"}) and text() == mine_text, text())
    ok = [ctl("/start_weight_update", {})[0], ctl("/update_weights", a)[0], ctl("/update_weights", b)[0],
          ctl("/finish_weight_update", {"weight_version": "t1"})[0]]
    check("transfer-two-buckets", ok == [200] * 4 and ctl("/weight_info") == (200, {"weight_version": "t1"}) and
          text() == other_text, (ok, text()))
    # half of mine lands, the other half is refused: no version until an update finishes
    m1, m2 = bucket("m1.safetensors", mine[:half]), bucket("m2.safetensors", mine[half:])
    st = [ctl("/start_weight_update", {})[0], ctl("/update_weights", m1)[0],
          ctl("/update_weights", {"update_info": dict(m2["update_info"], crc32c="00000000")})[0],
          ctl("/update_weights", m2)[0], ctl("/finish_weight_update", {"weight_version": "t2"})[0]]
    check("transfer-failed-is-mixed", st == [200, 200, 400, 400, 400] and
          ctl("/weight_info") == (200, {"weight_version": "mixed"}), (st, ctl("/weight_info")))
    st = [ctl("/start_weight_update", {})[0], ctl("/update_weights", m2)[0], ctl("/finish_weight_update", {"weight_version": "t3"})[0]]
    check("transfer-partial-update", st == [200] * 3 and ctl("/weight_info") == (200, {"weight_version": "t3"}) and
          text() == mine_text, (st, text()))


def echo_checks(model):
    """echo (and vLLM's prompt_logprobs) score the prompt with the served model: with max_tokens 0
    (lm-evaluation-harness's log-likelihood requests) the prompt's tokens and log-probs, the
    first null; the log-probs of a greedy continuation scored as a prompt are those the engine
    gave as it generated it, each the largest of its position (is_greedy); ranks; the refusals."""
    srv = Server(model)
    try:
        def post(body, path="/v1/completions"):
            return srv.post(path, body)
        st, r = post({"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "logprobs": 1,
                      "return_token_ids": True})
        c = r["choices"][0]
        prompt, gen, gen_lps = c["prompt_token_ids"], c["token_ids"], c["logprobs"]["token_logprobs"]
        st, r = post({"prompt": prompt + gen, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0})
        e = r["choices"][0]
        lps, tops = e["logprobs"]["token_logprobs"], e["logprobs"]["top_logprobs"]
        check("echo-shape", st == 200 and len(lps) == len(prompt) + len(gen) and lps[0] is None and tops[0] is None and
              e["text"] == "".join(e["logprobs"]["tokens"]) and r["usage"]["completion_tokens"] == 0, r)
        scored = lps[len(prompt):]
        check("echo-equals-generation", all(abs(a - b) < 1e-4 for a, b in zip(scored, gen_lps)), (scored, gen_lps))
        greedy = [abs(lp - max(t.values())) < 1e-6 for lp, t in zip(lps[len(prompt):], tops[len(prompt):])]
        check("echo-greedy-continuation", all(greedy), greedy)
        # lm-evaluation-harness's request: the continuation's log-likelihood and whether it is greedy
        st, r = post({"prompt": prompt + gen, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234})
        e = r["choices"][0]["logprobs"]
        check("echo-lm-eval", st == 200 and len(e["token_logprobs"]) == len(prompt) + len(gen) + 1, r)
        st, r = post({"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0})
        pl = r["choices"][0]["prompt_logprobs"]
        ok = pl[0] is None and len(pl) == len(prompt)
        for i, pos in enumerate(pl[1:], 1):
            mine = pos.get(str(prompt[i]))
            ok = ok and mine is not None and mine["rank"] >= 1 and any(v["rank"] == 1 for v in pos.values())
        check("prompt-logprobs", ok, pl)
        refused = [post({"prompt": "Hi", "echo": True, "stream": True})[0],
                   post({"prompt": "Hi", "prompt_logprobs": 21})[0],
                   post({"messages": [{"role": "user", "content": "Hi"}], "echo": True}, "/v1/chat/completions")[0],
                   post({"prompt": "Hi", "max_tokens": 0})[0]]
        check("echo-refused", refused == [400, 400, 400, 400], refused)
    finally:
        code = srv.stop()
    check("echo-exit-0", code == 0, srv.log()[-1000:])


def tp_checks(model, exp, gen_text, gen_chat):
    """--tp 2 (where mpirun is): the server starts itself on 2 ranks, each with its slices of every
    layer, rank 0 answering HTTP: the greedy text, ids and log-probs, seeded samples, chat and a
    stream of one process; concurrent requests; an idle pause longer than the ranks' sends (the
    lead's ticks); SIGTERM while a stream runs drains it and exits 0. A degree the heads do not take,
    a port in use: exit 2 naming them."""
    if not shutil.which("mpirun"):
        print("skip tp: no mpirun")
        return
    srv = Server(model, "--tp", "2", "--served-model-name", "tiny-test", "--shutdown-timeout", "30")
    try:
        g = exp["greedy"][0]
        status, r = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 20, "temperature": 0,
                                                 "logprobs": 1, "return_tokens_as_token_ids": True})
        c = r["choices"][0] if status == 200 else {"text": None, "logprobs": {"tokens": [], "token_logprobs": []}}
        check("tp-greedy-equals-generate", c["text"] == gen_text, "%r vs %r" % (c["text"], gen_text))
        ids = [int(t.split(":")[1]) for t in c["logprobs"]["tokens"]]
        check("tp-greedy-token-ids", ids == g["ids"], "%s vs %s" % (ids, g["ids"]))
        lps = c["logprobs"]["token_logprobs"]
        check("tp-greedy-logprobs", len(lps) == len(g["logprobs"]) and
              max(abs(a - b) for a, b in zip(lps, g["logprobs"])) < 1e-5, "%s vs %s" % (lps, g["logprobs"]))
        status, r = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 12, "temperature": 1.0, "n": 3,
                                                 "seed": 7})
        texts = [x["text"] for x in sorted(r["choices"], key=lambda x: x["index"])] if status == 200 else None
        check("tp-n3-seeded", texts == [s["text"] for s in exp["sampled"]], "%s vs %s" % (texts, exp["sampled"]))
        status, r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                                      "temperature": 0})
        check("tp-chat-equals-generate", status == 200 and r["choices"][0]["message"]["content"] == gen_chat, r)
        status, _, events, done = srv.stream("/v1/completions", {"prompt": "Hello world", "max_tokens": 20,
                                                                 "temperature": 0})
        check("tp-stream", done and "".join(e["choices"][0]["text"] for e in events if e["choices"]) == gen_text)
        got = [None] * 6

        def one(i):
            st, b = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 20, "temperature": 0})
            got[i] = b["choices"][0]["text"] if st == 200 else st
        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        check("tp-concurrent", got == [gen_text] * 6, got)
        time.sleep(2.5)  # idle: the lead's ticks keep the other rank in step
        st, b = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 5, "temperature": 0})
        check("tp-after-idle", st == 200 and b["usage"]["completion_tokens"] == 5, b)
        result = {}

        def streamer():
            result["r"] = srv.stream("/v1/completions", {"prompt": "Hello world", "max_tokens": 200, "n": 4})
        t = threading.Thread(target=streamer)
        t.start()
        time.sleep(0.5)
    finally:
        code = srv.stop()
    t.join(timeout=60)
    r = result.get("r")
    check("tp-sigterm-stream-completes", r is not None and r[3] and
          sum(1 for e in r[2] if e["choices"][0]["finish_reason"]) == 4, r and r[2][-1:])
    check("tp-sigterm-exit-0", code == 0, "exit %s\n%s" % (code, srv.log()[-2000:]))
    check("tp-no-traceback", "traceback" not in srv.log().lower(), srv.log()[-2000:])
    p = subprocess.run([MOONRL, "serve", "--tp", "3", "--model", model, "--port", "0"], capture_output=True, timeout=120)
    err = p.stderr.decode("utf-8", "replace")
    check("tp-bad-degree", p.returncode == 2 and "num_attention_heads (4) is not a multiple of 3" in err, err)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    p = subprocess.run([MOONRL, "serve", "--tp", "2", "--model", model, "--port", str(busy.getsockname()[1])],
                       capture_output=True, timeout=120)
    busy.close()
    err = p.stderr.decode("utf-8", "replace")
    check("tp-port-in-use", p.returncode == 2 and "in use" in err, err)


def lora_checks(model, tmp, gen_text):
    """--lora NAME=DIR (multi-LoRA): requests naming an adapter get what `moonrl generate --lora`
    gives, batched with the base's and each other's; /v1/models lists them; adapters loaded and
    unloaded at run time (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter); bad ones refused."""
    a, b = os.path.join(tmp, "lora_a"), os.path.join(tmp, "lora_b")
    subprocess.run([MOONRL, "run", os.path.join(SRC, "tests/serve/make_adapters.lua")],
                   env=dict(os.environ, DIR=model, OUT1=a, OUT2=b), check=True)

    def generate(lora):
        return subprocess.run([MOONRL, "generate", "--model", model, "--lora", lora, "--prompt", "Hello world",
                               "--temperature", "0", "--max-tokens", "12"], capture_output=True,
                              check=True).stdout.decode("utf-8", "replace")[:-1]
    want = {"lora-a": generate(a), "lora-b": generate(b)}
    check("lora-generate-differs", want["lora-a"] != want["lora-b"] and want["lora-a"] != gen_text[:len(want["lora-a"])],
          repr(want))
    srv = Server(model, "--lora", "lora-a=" + a, "--lora", "lora-b=" + b, "--served-model-name", "tiny")
    try:
        models = json.loads(srv.request("GET", "/v1/models")[1])
        ids = [(m["id"], m.get("parent")) for m in models["data"]]
        check("lora-models", ids == [("tiny", None), ("lora-a", "tiny"), ("lora-b", "tiny")], repr(ids))
        # the three at once: one batch of the base's rows and each adapter's
        results = {}

        def ask(name):
            results[name] = srv.post("/v1/completions", {"model": name, "prompt": "Hello world", "max_tokens": 12,
                                                         "temperature": 0})
        threads = [threading.Thread(target=ask, args=(n,)) for n in ("lora-a", "lora-b", "tiny", "lora-a")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name in ("lora-a", "lora-b"):
            st, body = results[name]
            check("lora-completion-" + name, st == 200 and body["choices"][0]["text"] == want[name] and body["model"] == name,
                  "%s %r want %r" % (st, body, want[name]))
        st, body = results["tiny"]
        check("lora-base-unchanged", st == 200 and gen_text.startswith(body["choices"][0]["text"]), repr(body))
        st, body = srv.post("/v1/completions", {"model": "lora-c", "prompt": "Hi", "max_tokens": 2})
        check("lora-unknown-404", st == 404, repr(body))
        st, body = srv.post("/v1/completions", {"model": "lora-a", "prompt": "Hi", "max_tokens": 0, "echo": True})
        check("lora-echo-refused", error_ok(st, body, 400, "echo"), repr(body))
        st, body = srv.post("/v1/load_lora_adapter", {"lora_name": "lora-c", "lora_path": b})
        check("lora-load", st == 200 and b"added successfully" in body, repr(body))
        st, body = srv.post("/v1/completions", {"model": "lora-c", "prompt": "Hello world", "max_tokens": 12,
                                                "temperature": 0})
        check("lora-loaded-serves", st == 200 and body["choices"][0]["text"] == want["lora-b"], repr(body))
        st, body = srv.post("/v1/load_lora_adapter", {"lora_name": "lora-c", "lora_path": a})  # the same name: replaced
        st2, body2 = srv.post("/v1/completions", {"model": "lora-c", "prompt": "Hello world", "max_tokens": 12,
                                                  "temperature": 0})
        check("lora-replaced", st == 200 and st2 == 200 and body2["choices"][0]["text"] == want["lora-a"], repr(body2))
        st, body = srv.post("/v1/unload_lora_adapter", {"lora_name": "lora-c"})
        check("lora-unload", st == 200, repr(body))
        st, body = srv.post("/v1/completions", {"model": "lora-c", "prompt": "Hi", "max_tokens": 2})
        check("lora-unloaded-404", st == 404, repr(body))
        st, body = srv.post("/v1/unload_lora_adapter", {"lora_name": "lora-c"})
        check("lora-unload-twice-404", st == 404, repr(body))
        st, body = srv.post("/v1/load_lora_adapter", {"lora_name": "lora-d", "lora_path": os.path.join(tmp, "nothing")})
        check("lora-load-bad-path", error_ok(st, body, 400, "lora_path"), repr(body))
    finally:
        code = srv.stop()
    check("lora-exit-0", code == 0, srv.log()[-2000:])
    r = subprocess.run([MOONRL, "serve", "--model", model, "--port", "0", "--lora", "x=" + os.path.join(tmp, "nothing")],
                       capture_output=True, timeout=60)
    check("lora-bad-dir-usage-error", r.returncode == 2 and b"--lora x=" in r.stderr, r.stderr.decode()[-500:])


def hwm_mb(pid):
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/%d/status" % pid).read()).group(1)) / 1024.0


def hardening_checks(model):
    """Issue 32, items 2 and 5, and the deadline of item 1, on a server with second-long limits."""
    srv = Server(model, "--max-connections", "32", "--header-timeout", "1.5", "--body-timeout", "1.5",
                 "--request-timeout", "0.5", "--max-n", "512")
    try:
        big_prompt_check(srv)
        slow_socket_checks(srv)
        deadline_checks(srv)
    finally:
        code = srv.stop()
    check("hardening-exit-0", code == 0, "exit %s\n%s" % (code, srv.log()[-2000:]))
    check("hardening-no-traceback", "traceback" not in srv.log().lower() and "internal error" not in srv.log(),
          srv.log()[-2000:])


def big_prompt_check(srv):
    """A 15 MB prompt (under the 16 MB body limit) cannot fit 512 tokens: refused before it is
    tokenised. Tokenising it first raised the server's peak memory by ~360 MB with this tokenizer
    (~1.5 GB with a real one); the bodies alone take ~60 MB."""
    st, _, _ = srv.request("GET", "/health")
    pid = srv.proc.pid
    text = "hello world " * (15 * 2 ** 20 // 12)
    rises = []
    for name, path, body in (("prompt", "/v1/completions", {"prompt": text}),
                             ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                             ("64-prompts", "/v1/completions", {"prompt": [text[:200 * 1024]] * 64})):
        data = json.dumps(body)
        try:  # "5": reset the peak (VmHWM) to the current resident size
            with open("/proc/%d/clear_refs" % pid, "w") as f:
                f.write("5")
            before = hwm_mb(pid)
        except OSError:
            before = None
        t0 = time.time()
        st, b = srv.post(path, data)
        took = time.time() - t0
        check("big-prompt-400 %s" % name, error_ok(st, b, 400) and "maximum context length" in b["error"]["message"]
              and took < 10, "%s %.1f s %s" % (st, took, str(b)[:300]))
        if before is not None:
            rise = hwm_mb(pid) - before
            rises.append("%s %.0f MB" % (name, rise))
            check("big-prompt-peak-memory %s" % name, rise < 150, "the peak rose by %.0f MB" % rise)
    print("     15 MB prompts refused; the server's peak memory rose by: %s" % (", ".join(rises) or "(not measured)"))
    st, b = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 3})
    check("big-prompt-after", st == 200, b)


def slow_socket_checks(srv):
    """Sockets that trickle a head or a body, a byte every 0.3 s: each is cut at the 1.5 s deadline
    (408) while its bytes go on coming; more of them than --max-connections (32) do not lock new
    clients out."""
    p = srv.port
    ends = (b"HTTP/1.1 408", b"HTTP/1.1 503", b"closed", b"reset")

    def trickle(socks, seconds):
        """A byte to each socket every 0.3 s for up to `seconds`, until each has an answer (or its
        end): the first bytes each got, b"open" for none."""
        outs = {}
        end = time.time() + seconds
        while time.time() < end and len(outs) < len(socks):
            for s in socks:
                if s not in outs:
                    try:
                        s.send(b"a")
                    except OSError:
                        pass
            time.sleep(0.3)
            for s in select.select([s for s in socks if s not in outs], [], [], 0)[0]:
                try:
                    out = s.recv(4096)
                    outs[s] = out[:12] if out else b"closed"
                except OSError:
                    outs[s] = b"reset"
        return [outs.get(s, b"open") for s in socks]

    # under the limit: 16 slow heads, 8 slow bodies (were a byte to move the deadline, they would be
    # open for as long as the bytes came)
    t0 = time.time()
    heads = [socket.create_connection(("127.0.0.1", p), timeout=5) for _ in range(16)]
    for s in heads:
        s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
    bodies = [socket.create_connection(("127.0.0.1", p), timeout=5) for _ in range(8)]
    for s in bodies:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{")
    trickle(heads + bodies, 0.9)
    try:
        st, _, _ = srv.request("GET", "/health", timeout=5)
    except (OSError, http.client.HTTPException) as e:
        st = repr(e)
    check("slow-under-limit-health", st == 200, st)
    outs = trickle(heads + bodies, 8)
    took = time.time() - t0
    check("slow-cut-at-deadline-408", all(o == b"HTTP/1.1 408" for o in outs), "%s after %.1f s" % (outs, took))
    for s in heads + bodies:
        s.close()

    # over the limit: 100 slow heads hold every slot; /health and new clients are still answered
    m0 = srv.metrics()
    slow = []
    for _ in range(100):
        try:
            s = socket.create_connection(("127.0.0.1", p), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
            slow.append(s)
        except OSError:
            pass
    answered = []
    for _ in range(4):
        trickle(slow, 0.3)
        try:
            st, _, _ = srv.request("GET", "/health", timeout=5)
            st2, b = srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            answered.append((st, st2))
        except (OSError, http.client.HTTPException) as e:
            answered.append(repr(e))
    check("slow-over-limit-answered", all(a == (200, 200) for a in answered), answered)
    outs = trickle(slow, 8)
    check("slow-over-limit-all-closed", all(o in ends for o in outs), [o for o in outs if o not in ends][:5])
    for s in slow:
        s.close()
    m = srv.metrics()
    check("slow-metrics", m["moonrl_http_evicted_total"] > m0["moonrl_http_evicted_total"] and
          m["moonrl_http_timed_out_total"] >= 24, m)


def deadline_checks(srv):
    """--request-timeout 0.5: a request that takes longer gets a 503 (a stream: an error event, then
    its end), its samples stopped; a short one is untouched."""
    # (245760 tokens: seconds of work for the tiny model where 61440 took 0.5 s on a fast machine)
    body = {"prompt": "Hello world", "max_tokens": 480, "n": 512, "ignore_eos": True}
    t0 = time.time()
    st, b = srv.post("/v1/completions", body)
    took = time.time() - t0
    check("deadline-503", error_ok(st, b, 503) and "--request-timeout" in b["error"]["message"] and took > 0.4,
          "%s %.2f s %s" % (st, took, str(b)[:200]))
    status, ctype, events, done = srv.stream("/v1/completions", body)
    check("deadline-stream-error-event", status == 200 and events and "error" in events[-1] and
          events[-1]["error"]["code"] == 503 and not done, events[-1:])
    st, b = srv.post("/v1/completions", {"prompt": "Hello world", "max_tokens": 3})
    check("deadline-short-request", st == 200, b)
    deadline = time.time() + 5
    m = srv.metrics()
    while time.time() < deadline and (m["moonrl_engine_running"] > 0 or m["moonrl_engine_kv_blocks_used"] > 0):
        time.sleep(0.05)
        m = srv.metrics()
    check("deadline-samples-stopped", m["moonrl_requests_timed_out_total"] == 2 and m["moonrl_engine_running"] == 0 and
          m["moonrl_engine_kv_blocks_used"] == 0, m)


def cli_checks(model):
    def run(*args):
        p = subprocess.run([MOONRL, "serve"] + list(args), capture_output=True, timeout=120)
        return p.returncode, p.stderr.decode("utf-8", "replace")

    code, err = run()
    check("cli-no-model", code == 2 and "--model" in err, err)
    code, err = run("--model", model, "--port", "x")
    check("cli-bad-port", code == 2 and "--port" in err, err)
    code, err = run("--model", model, "--port", "70000")
    check("cli-port-range", code == 2 and "--port" in err, err)
    code, err = run("--model", model, "--bogus")
    check("cli-unknown-option", code == 2 and "--bogus" in err, err)
    code, err = run("--model", model + "/nothing")
    check("cli-bad-model", code == 2 and "nothing" in err, err)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    code, err = run("--model", model, "--port", str(busy.getsockname()[1]))
    busy.close()
    check("cli-port-in-use", code == 2 and "in use" in err, err)
    for flag in ("--header-timeout", "--body-timeout", "--keep-alive-timeout", "--request-timeout"):
        code, err = run("--model", model, flag, "0")
        check("cli-bad %s" % flag, code == 2 and flag in err, err)
    code, err = run("--model", model, "--dtype", "int8")
    check("cli-bad-dtype", code == 2 and "--dtype int8" in err, err)
    code, err = run("--help")
    check("cli-help", code == 0)


if __name__ == "__main__":
    main()
