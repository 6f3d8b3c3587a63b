#!/usr/bin/env python3
"""A model saved past its shard limit (mrl_model_save_dir_sharded) read by the safetensors
library as transformers reads a sharded checkpoint: model.safetensors.index.json with json,
each tensor from the shard the index names with safe_open. The files are
model-0000K-of-0000N.safetensors, K = 1..N, filled in the model's view (state-dict) order;
every tensor is F32 with its view's shape and equals the parameters bit for bit, every file's
metadata is {"format": "pt"}, and metadata.total_size is the sum of the tensors' bytes.
Without transformers (hf_check.py) this is the check by Hugging Face's own reader; skipped
(exit 77) where numpy or safetensors is missing.

usage: ref_save_shards.py LIBMOONRL"""
import json
import os
import sys
import tempfile

try:
    import numpy as np
    from safetensors import safe_open
except ImportError as e:  # meson reads 77 as "skipped"
    print("skipped: %s" % e)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moonrl_ctypes  # noqa: E402
from moonrl_ctypes import Moonrl, check  # noqa: E402

lib = moonrl_ctypes.load(sys.argv[1])
cfg = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=101, hidden_size=64,
           intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
           tie_word_embeddings=False)
m = Moonrl(cfg, seed=7)
MAX_SHARD = 40000
failures = []
with tempfile.TemporaryDirectory() as d:
    check(lib.mrl_model_save_dir_sharded(m.h, d.encode(), MAX_SHARD))
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    n = len(files)
    if n < 3 or files != ["model-%05d-of-%05d.safetensors" % (k, n) for k in range(1, n + 1)]:
        failures.append("files %s" % files)
    if set(index["weight_map"]) != {v[0] for v in m.views} or set(index["weight_map"].values()) != set(files):
        failures.append("the index's weight_map %s" % index["weight_map"])
    total, last = 0, 0
    for name, off, shape, _ in m.views:
        shard = index["weight_map"][name]
        k = int(shard[6:11])
        if k < last:
            failures.append("%s in shard %d after shard %d: not in view order" % (name, k, last))
        last = k
        with safe_open(os.path.join(d, shard), "np") as f:
            a = f.get_tensor(name)
            if f.metadata() != {"format": "pt"}:
                failures.append("%s: metadata %s" % (shard, f.metadata()))
        size = int(np.prod(shape))
        want = m.params[off:off + size]
        if a.dtype != np.float32 or list(a.shape) != list(shape) or not np.array_equal(
                a.ravel().view(np.uint32), want.view(np.uint32)):
            failures.append("%s: %s %s, not the parameters" % (name, a.dtype, a.shape))
        total += a.nbytes
    if index["metadata"]["total_size"] != total:
        failures.append("total_size %s, the tensors hold %d bytes" % (index["metadata"]["total_size"], total))
lib.mrl_model_free(m.h)
for f in failures:
    print("FAIL:", f)
if failures:
    sys.exit(1)
print("safetensors reads the %d tensors of %d shards bit for bit" % (len(m.views), n))
