#!/usr/bin/env python3
"""The calculator agent of examples/agent_calculator.lua as a program of its own, written with the
official `openai` client: moonrl runs it once an episode (examples/agent_openai.lua sets
agent.command to it) with OPENAI_BASE_URL and OPENAI_API_KEY pointing at its training server, and
trains on the completions it asks for. Any agent harness that takes a base_url and an api_key
plugs in the same way.

The episode's question is in MOONRL_RECORD ({"prompt": "347*812=", "answer": ...}). The agent
asks the policy for a first turn; when the policy calls the calculator (the question's
expression and '?'), the agent computes the product and asks for a second turn after it, the
conversation so far as the prompt text. It reports no reward: the recipe's reward (exact) judges
the last completion, as for the in-process episodes.

    pip install openai
    moonrl run examples/agent_openai.lua
"""
import json
import os
import re

from openai import OpenAI

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY (the episode's id) from the environment
model = os.environ.get("MOONRL_MODEL", "policy")
record = json.loads(os.environ["MOONRL_RECORD"])


def turn(prompt):
    # the server samples with the recipe's temperature and max_tokens, whatever is asked here
    return client.completions.create(model=model, prompt=prompt, max_tokens=9).choices[0].text


question = record["prompt"]  # "347*812="
first = turn(question)
call = re.fullmatch(r"(\d+)\*(\d+)\?", first)
if call:
    result = int(call.group(1)) * int(call.group(2))  # the calculator
    # the conversation so far: the question, the call with its end token, the result and '='
    turn(question + first + "<|eos|>" + f"{result}=")
