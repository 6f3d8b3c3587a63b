"""An agent program for tests/recipes/test_agents.lua, talking to moonrl's OpenAI-compatible
endpoint in training mode with urllib alone. Two turns: the record's prompt, then the prompt, the
first completion and "0=" again, as token ids (the completion's ids read back with vLLM's
return_tokens_as_token_ids), so that the second prompt extends the first turn exactly. Its reward:
the number of '7' tokens it got. MOONRL_RECORD's meta.fault makes it misbehave: 'die' (exits 3
after its first completion), 'hang' (sleeps until killed), 'no_reward' (never reports one),
'disconnect' (drops a request mid-way, then goes on), 'rewrite' (its second prompt is not the
first turn extended), 'chat' (uses the chat endpoint: the template's rendering of its messages).
"""
import json
import os
import re
import socket
import sys
import time
import urllib.request

BASE = os.environ["OPENAI_BASE_URL"]
KEY = os.environ["OPENAI_API_KEY"]
REC = json.loads(os.environ["MOONRL_RECORD"])
FAULT = (REC.get("meta") or {}).get("fault")
SEVEN = 12  # the id of '7' in examples/agent's tokenizer


def post(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def complete(prompt_ids):
    # temperature 0.2 asked: the server samples at the trainer's temperature anyway
    out = post("/completions", {"model": os.environ["MOONRL_MODEL"], "prompt": prompt_ids, "max_tokens": 4,
                                "temperature": 0.2, "logprobs": 1, "return_tokens_as_token_ids": True})
    return [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]]


if FAULT == "disconnect":  # a request sent, its connection closed before the answer
    host, port = re.match(r"http://([^:/]+):(\d+)", BASE).groups()
    s = socket.create_connection((host, int(port)))
    body = json.dumps({"prompt": REC["prompt_ids"], "max_tokens": 4})
    s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
               "Content-Length: %d\r\n\r\n%s" % (KEY, len(body), body)).encode())
    s.close()
if FAULT == "hang":
    time.sleep(3600)
prompt = REC["prompt_ids"]
first = complete(prompt)
if FAULT == "die":
    sys.exit(3)
history = prompt + first if FAULT != "rewrite" else prompt + [SEVEN]
second = complete(history + [5, 16])  # "0="
if FAULT != "no_reward":
    post("/episodes/reward", {"reward": float((first + second).count(SEVEN))})
