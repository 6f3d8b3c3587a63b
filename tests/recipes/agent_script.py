"""An agent program for tests/recipes/test_agents.lua, talking to moonrl's OpenAI-compatible
endpoint in training mode with urllib alone. Two turns: the record's prompt, then the prompt, the
first completion and "0=" again, as token ids (the completion's ids read back with vLLM's
return_tokens_as_token_ids), so that the second prompt extends the first turn exactly. Its reward:
the number of '7' tokens it got. MOONRL_RECORD's meta.fault makes it misbehave: 'die' (exits 3
after its first completion), 'hang' (sleeps until killed), 'no_reward' (never reports one),
'disconnect' (drops a request mid-way, then goes on), 'rewrite' (its second prompt is not the
first turn extended), 'fail' (ends its episode with an error).

Run once an episode (MOONRL_EPISODE_ID set: the API key is the episode's id), or as a worker
(agent.workers: MOONRL_WORKER_ID set), which asks for episodes (/episodes/next) and plays
MOONRL_AGENT_CONCURRENCY of them at once on threads, naming each in its requests' `user`, until
none is left.
"""
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.request

BASE = os.environ["OPENAI_BASE_URL"]
KEY = os.environ["OPENAI_API_KEY"]
SEVEN = 12  # the id of '7' in examples/agent's tokenizer


def post(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def play(rec, episode=None):
    """One episode; episode: its id, named in the requests (a worker's), else the API key names it."""
    fault = (rec.get("meta") or {}).get("fault")
    named = {"user": episode} if episode else {}

    def complete(prompt_ids):
        # temperature 0.2 asked: the server samples at the trainer's temperature anyway
        out = post("/completions", dict(named, model=os.environ["MOONRL_MODEL"], prompt=prompt_ids, max_tokens=4,
                                        temperature=0.2, logprobs=1, return_tokens_as_token_ids=True))
        return [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]]

    if fault == "disconnect":  # a request sent, its connection closed before the answer
        host, port = re.match(r"http://([^:/]+):(\d+)", BASE).groups()
        s = socket.create_connection((host, int(port)))
        body = json.dumps(dict(named, prompt=rec["prompt_ids"], max_tokens=4))
        s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
                   "Content-Length: %d\r\n\r\n%s" % (KEY, len(body), body)).encode())
        s.close()
    if fault == "hang":
        time.sleep(3600)
    prompt = rec["prompt_ids"]
    first = complete(prompt)
    if fault == "die":
        os._exit(3)
    if fault == "fail":
        return post("/episodes/done", {"episode_id": episode or KEY, "error": "the tool broke"})
    history = prompt + first if fault != "rewrite" else prompt + [SEVEN]
    second = complete(history + [5, 16])  # "0="
    reward = {} if fault == "no_reward" else {"reward": float((first + second).count(SEVEN))}
    if episode:
        post("/episodes/done", dict(reward, episode_id=episode))
    elif reward:
        post("/episodes/reward", reward)


def worker():
    while True:
        got = post("/episodes/next", {})
        if got["episode_id"] is None:
            return
        play(got["record"], got["episode_id"])


if os.environ.get("MOONRL_WORKER_ID"):
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(int(os.environ["MOONRL_AGENT_CONCURRENCY"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.exit(0)
play(json.loads(os.environ["MOONRL_RECORD"]))
