#!/usr/bin/env python3
"""The calculator agent of examples/agent_calculator.lua as a program of its own, written with the
official `openai` client: moonrl starts it with OPENAI_BASE_URL pointing at its training server
(examples/agent_openai.lua sets agent.command to it) and trains on the completions it asks for.
Any agent harness that takes a base_url and an api_key plugs in the same way.

It runs in either of moonrl's two ways (docs/agents.md):
- once an episode (agent.workers=0): the API key is the episode's id, and the episode's record is
  in MOONRL_RECORD;
- as a worker (agent.workers=N, what agent_openai.lua asks for): it asks for episodes
  (POST /v1/episodes/next), plays MOONRL_AGENT_CONCURRENCY of them at once on threads, each named
  in its requests' `user`, ends each (POST /v1/episodes/done), and exits when none is left.

An episode: the question ({"prompt": "347*812=", ...}) goes to the policy; when the policy calls
the calculator (the question's expression and '?'), the agent computes the product and asks for a
second turn after it, the conversation so far as the prompt text. It reports no reward: the
recipe's reward (exact) judges the last completion, as for the in-process episodes.

    pip install openai
    moonrl run examples/agent_openai.lua
"""
import json
import os
import re
import threading
import urllib.request

from openai import OpenAI

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
model = os.environ.get("MOONRL_MODEL", "policy")


def play(record, episode=None):
    named = {"user": episode} if episode else {}

    def turn(prompt):
        # the server samples with the recipe's temperature and max_tokens, whatever is asked here
        return client.completions.create(model=model, prompt=prompt, max_tokens=9, **named).choices[0].text

    question = record["prompt"]  # "347*812="
    first = turn(question)
    call = re.fullmatch(r"(\d+)\*(\d+)\?", first)
    if call:
        result = int(call.group(1)) * int(call.group(2))  # the calculator
        # the conversation so far: the question, the call with its end token, the result and '='
        turn(question + first + "<|eos|>" + f"{result}=")


def episodes(path, body):
    """moonrl's own endpoints (/v1/episodes/next, /v1/episodes/done), with the standard library."""
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + path, data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def worker():
    while True:
        got = episodes("/episodes/next", {})
        if got["episode_id"] is None:
            return
        try:
            play(got["record"], got["episode_id"])
            episodes("/episodes/done", {"episode_id": got["episode_id"]})
        except Exception as e:  # the episode fails, the worker goes on
            episodes("/episodes/done", {"episode_id": got["episode_id"], "error": repr(e)[:200]})


if os.environ.get("MOONRL_WORKER_ID"):
    threads = [threading.Thread(target=worker) for _ in range(int(os.environ.get("MOONRL_AGENT_CONCURRENCY", "8")))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
else:
    play(json.loads(os.environ["MOONRL_RECORD"]))
