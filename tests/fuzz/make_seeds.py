#!/usr/bin/python3
"""Write the generated seeds of tests/fuzz/corpus (the others are findings kept as seeds, and
files copied by hand: tests/fuzz/corpus/README.md says which is which).

    /usr/bin/python3 tests/fuzz/make_seeds.py [--moonrl build/moonrl] [SMOLLM2_GGUF]

Each seed is small (a fuzzer mutates faster and deeper on small inputs) and taken from the real
files the tests already use: the example and fixture tokenizers trimmed to their first few hundred
tokens, the SmolLM2 GGUF file's metadata with its arrays cut short and a tiny tensor of each type
moonrl reads, the shapes of real Hugging Face config.json files, the chat templates of tests/chat;
with --moonrl, the files of a checkpoint that a session of that moonrl writes (make_seeds.lua).
Run from anywhere; rewrites only the files it names (gen-*)."""
import json
import os
import random
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, 'corpus')
rng = random.Random(20261205)


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, 'gen-' + name), 'wb') as f:
        f.write(data)


def compact(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(',', ':'))


# ---- tokenizer.json: the example's, and the small fixtures' cut to their first tokens

def trim_tokenizer(tok, keep):
    """The tokenizer with the model's vocabulary cut to ids < keep and the merges that stay within
    it (a merge's parts and result all kept); added tokens stay."""
    m = tok['model']
    if m.get('type') != 'BPE':
        return tok
    vocab = {t: i for t, i in m['vocab'].items() if i < keep}
    merges = []
    for mg in m['merges']:
        a, b = mg.split(' ', 1) if isinstance(mg, str) else mg
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(mg)
    tok = dict(tok)
    tok['model'] = dict(m, vocab=vocab, merges=merges)
    return tok


def tokenizers():
    with open(os.path.join(ROOT, 'examples/default/tokenizer.json'), 'rb') as f:
        put('tokenizer', 'default.json', f.read())
    fixtures = os.path.join(ROOT, 'tests/tok/fixtures')
    for name in sorted(os.listdir(fixtures)):
        path = os.path.join(fixtures, name, 'tokenizer.json')
        if not os.path.exists(path) or os.path.getsize(path) > 200_000:
            continue  # the three real ones (gpt2, openllama, bora) are megabytes
        with open(path) as f:
            tok = json.load(f)
        put('tokenizer', name + '.json', compact(trim_tokenizer(tok, 300)))


# ---- safetensors

def safetensors_file(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, raw bytes)."""
    header, data = {}, b''
    if metadata is not None:
        header['__metadata__'] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [len(data), len(data) + len(raw)]}
        data += raw
    h = compact(header).encode()
    h += b' ' * (-len(h) % 8)
    return struct.pack('<Q', len(h)) + h + data


def f32(xs):
    return struct.pack('<%df' % len(xs), *xs)


def bf16(xs):
    return b''.join(struct.pack('<f', x)[2:] for x in xs)


def f16(xs):
    return struct.pack('<%de' % len(xs), *xs)


def safetensors():
    xs = [rng.uniform(-2, 2) for _ in range(24)]
    put('safetensors', 'model.safetensors', safetensors_file([
        ('model.embed_tokens.weight', 'F32', [4, 3], f32(xs[:12])),
        ('model.layers.0.input_layernorm.weight', 'BF16', [3], bf16(xs[12:15])),
        ('model.norm.weight', 'F16', [3], f16(xs[15:18])),
        ('lm_head.weight', 'F32', [2, 3], f32(xs[18:24])),
    ], {'format': 'pt'}))
    put('safetensors', 'kinds.safetensors', safetensors_file([
        ('scalar', 'F32', [], f32([1.5])),
        ('empty', 'F32', [0, 4], b''),
        ('cube', 'BF16', [2, 2, 2], bf16(xs[:8])),
        ('ids', 'I64', [2], struct.pack('<2q', 7, -1)),
        ('mask', 'BOOL', [3], b'\x01\x00\x01'),
        ('bytes', 'U8', [4], b'\x00\x7f\x80\xff'),
        ('f64', 'F64', [1], struct.pack('<d', 0.25)),
    ], {'format': 'pt', 'moonrl': 'x'}))
    index = {'metadata': {'total_size': 96},
             'weight_map': {'lm_head.weight': 'model-00002-of-00002.safetensors',
                            'model.embed_tokens.weight': 'model-00001-of-00002.safetensors',
                            'model.norm.weight': 'model-00001-of-00002.safetensors'}}
    put('st_index', 'model.safetensors.index.json', json.dumps(index, indent=2))
    put('st_index', 'one-shard.json', compact({'weight_map': {'lm_head.weight': 'model-00002-of-00002.safetensors'}}))


# ---- GGUF

GGUF_TYPES = {'UINT8': 0, 'INT8': 1, 'UINT16': 2, 'INT16': 3, 'UINT32': 4, 'INT32': 5, 'FLOAT32': 6, 'BOOL': 7,
              'STRING': 8, 'ARRAY': 9, 'UINT64': 10, 'INT64': 11, 'FLOAT64': 12}
SCALAR = {0: '<B', 1: '<b', 2: '<H', 3: '<h', 4: '<I', 5: '<i', 6: '<f', 7: '<?', 10: '<Q', 11: '<q', 12: '<d'}
# ggml type: (id, block elements, block bytes, offsets of the fp16 scales in a block)
GGML = {'F32': (0, 1, 4, []), 'F16': (1, 1, 2, []), 'Q4_0': (2, 32, 18, [0]), 'Q4_1': (3, 32, 20, [0, 2]),
        'Q8_0': (8, 32, 34, [0]), 'Q4_K': (12, 256, 144, [0, 2]), 'Q5_K': (13, 256, 176, [0, 2]),
        'Q6_K': (14, 256, 210, [208]), 'BF16': (30, 1, 2, [])}


def gguf_string(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack('<Q', len(b)) + b


def gguf_value(vtype, value, elem=None):
    if vtype == 8:
        return gguf_string(value)
    if vtype == 9:
        out = struct.pack('<IQ', elem, len(value))
        return out + b''.join(gguf_value(elem, v) for v in value)
    return struct.pack(SCALAR[vtype], value)


def gguf_file(kvs, tensors, version=3, align=32):
    """kvs: list of (key, type, value, elem type); tensors: list of (name, ggml type name, shape)."""
    out = b'GGUF' + struct.pack('<IQQ', version, len(tensors), len(kvs))
    for key, vtype, value, elem in kvs:
        out += gguf_string(key) + struct.pack('<I', vtype) + gguf_value(vtype, value, elem)
    blobs, offset = [], 0
    for name, tname, shape in tensors:
        tid, block, nbytes, scales = GGML[tname]
        numel = 1
        for d in shape:
            numel *= d
        raw = bytearray(rng.getrandbits(8) for _ in range(numel // block * nbytes))
        for b in range(numel // block):  # finite, modest fp16 scales
            for at in scales:
                raw[b * nbytes + at:b * nbytes + at + 2] = struct.pack('<e', rng.uniform(-0.1, 0.1))
        if tname in ('F32', 'F16', 'BF16'):
            xs = [rng.uniform(-1, 1) for _ in range(numel)]
            raw = {'F32': f32, 'F16': f16, 'BF16': bf16}[tname](xs)
        out_info = gguf_string(name) + struct.pack('<I', len(shape)) + b''.join(struct.pack('<Q', d) for d in shape)
        out_info += struct.pack('<IQ', tid, offset)
        blobs.append(bytes(raw))
        out += out_info
        offset += len(raw) + (-len(raw) % align)
    out += b'\0' * (-len(out) % align)
    for raw in blobs:
        out += raw + b'\0' * (-len(raw) % align)
    return out


def gguf(smollm2):
    tensors = [('token_embd.weight', 'Q4_1', [64, 2]), ('output_norm.weight', 'F32', [8]),
               ('blk.0.attn_q.weight', 'Q8_0', [32, 2]), ('blk.0.ffn_up.weight', 'Q4_K', [256]),
               ('blk.0.ffn_down.weight', 'Q6_K', [256]), ('blk.0.attn_k.weight', 'Q5_K', [256]),
               ('blk.0.attn_v.weight', 'Q4_0', [32]), ('blk.0.attn_norm.weight', 'F16', [4]),
               ('blk.0.ffn_norm.weight', 'BF16', [4])]
    kvs = []
    if smollm2 and os.path.exists(smollm2):
        import gguf as gg  # the llama.cpp package the reference tests use
        r = gg.GGUFReader(smollm2)
        for key, field in r.fields.items():
            if key.startswith('GGUF.'):
                continue
            vtype = int(field.types[0])
            if vtype == 9:
                elem = int(field.types[1])
                parts = [field.parts[i] for i in field.data[:48]]  # arrays cut to their first 48
                value = [bytes(p) for p in parts] if elem == 8 else [p.tolist()[0] for p in parts]
                kvs.append((key, 9, value, elem))
            elif vtype == 8:
                value = bytes(field.parts[field.data[0]])
                if key == 'tokenizer.chat_template':
                    value = value[:400]
                kvs.append((key, 8, value, None))
            else:
                kvs.append((key, vtype, field.parts[field.data[0]].tolist()[0], None))
        put('gguf', 'smollm2-metadata.gguf', gguf_file(kvs, tensors))
    else:
        print('make_seeds.py: no SmolLM2 GGUF file; the gguf seeds from it are not rewritten')
    small = [('general.architecture', 8, 'llama', None), ('general.alignment', 4, 64, None),
             ('llama.block_count', 4, 1, None), ('llama.rope.freq_base', 6, 10000.0, None),
             ('tokenizer.ggml.tokens', 9, ['<s>', 'a', 'bc'], 8), ('tokenizer.ggml.scores', 9, [0.0, -1.5, 2.0], 6),
             ('tokenizer.ggml.token_type', 9, [3, 1, 1], 5), ('flag', 7, True, None), ('i64', 11, -5, None),
             ('f64', 12, 0.5, None), ('u16', 2, 65535, None), ('i8', 1, -128, None)]
    put('gguf', 'types-v3.gguf', gguf_file(small, tensors[:4], align=64))
    put('gguf', 'types-v2.gguf', gguf_file(small[2:], tensors[4:], version=2))


# ---- config.json: the shapes of real Hugging Face models

def configs():
    llama = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'vocab_size': 49152, 'hidden_size': 576,
             'intermediate_size': 1536, 'num_hidden_layers': 30, 'num_attention_heads': 9,
             'num_key_value_heads': 3, 'max_position_embeddings': 8192, 'rms_norm_eps': 1e-05,
             'rope_theta': 100000, 'rope_scaling': None, 'tie_word_embeddings': True, 'bos_token_id': 1,
             'eos_token_id': 2, 'attention_bias': False, 'mlp_bias': False, 'hidden_act': 'silu',
             'initializer_range': 0.041666666666666664, 'torch_dtype': 'bfloat16', 'use_cache': True}
    put('config', 'smollm2-135m.json', json.dumps(llama, indent=2))
    llama3 = dict(llama, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  rope_theta=500000.0, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
                  rope_scaling={'factor': 32.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,
                                'original_max_position_embeddings': 8192, 'rope_type': 'llama3'})
    put('config', 'llama-3.2-1b.json', compact(llama3))
    qwen2 = {'architectures': ['Qwen2ForCausalLM'], 'model_type': 'qwen2', 'vocab_size': 151936,
             'hidden_size': 896, 'intermediate_size': 4864, 'num_hidden_layers': 24, 'num_attention_heads': 14,
             'num_key_value_heads': 2, 'max_position_embeddings': 32768, 'max_window_layers': 21,
             'rms_norm_eps': 1e-06, 'rope_theta': 1000000.0, 'sliding_window': 32768, 'use_sliding_window': False,
             'tie_word_embeddings': True, 'bos_token_id': 151643, 'eos_token_id': 151645,
             'hidden_act': 'silu', 'torch_dtype': 'bfloat16'}
    put('config', 'qwen2.5-0.5b.json', compact(qwen2))
    qwen3 = dict(qwen2, architectures=['Qwen3ForCausalLM'], model_type='qwen3', hidden_size=1024,
                 intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, attention_bias=False, eos_token_id=151645)
    put('config', 'qwen3-0.6b.json', compact(qwen3))
    moe = dict(qwen3, architectures=['Qwen3MoeForCausalLM'], model_type='qwen3_moe', hidden_size=2048,
               intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.001)
    put('config', 'qwen3-30b-a3b.json', compact(moe))
    tiny = dict(moe, vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8, decoder_sparse_step=2, mlp_only_layers=[0], bos_token_id=None)
    put('config', 'tiny-moe.json', compact(tiny))


# ---- HTTP request heads, as clients send them

def http():
    body = compact({'model': 'm', 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 8})
    post = ('POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n'
            'Authorization: Bearer sk-test\r\nContent-Length: %d\r\n\r\n%s' % (len(body), body))
    put('http', 'post.txt', post)
    put('http', 'get.txt', 'GET /v1/models?limit=2 HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n')
    put('http', 'pipelined.txt', 'GET /health HTTP/1.1\r\nHost: x\r\n\r\n' + post +
        'GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n')
    put('http', 'http10.txt', 'GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n')
    put('http', 'expect.txt', 'POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n'
        'Connection: keep-alive, Upgrade\r\n\r\nabc')
    put('http', 'chunked.txt', 'POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n')
    put('http', 'lf-only.txt', '\r\n\r\nGET /x HTTP/1.1\nHost: y\nContent-Length: 0\n\r\n\r\n')


# ---- JSONL lines

def lines():
    recs = [{'question': 'What is 2 + 3?', 'answer': '5'}, {'question': 'caf\u00e9 \u4f60\u597d', 'answer': 7},
            {'prompt': [{'role': 'user', 'content': 'hi'}], 'meta': {'level': 2}}]
    text = '\n'.join(compact(r) for r in recs)
    for target in ('lines', 'jsonl'):  # the C line index, and the records moonrl.data reads through it
        put(target, 'plain.jsonl', text + '\n')
        put(target, 'crlf-blank.jsonl', '\r\n  \t\r\n' + text.replace('\n', '\r\n\r\n') + '\r')
        put(target, 'no-final-newline.jsonl', text)
    put('jsonl', 'bad-lines.jsonl', text + '\n{"question": 1}\n[1, 2]\n{"question": "q", "meta": 3}\n{broken\n')


# ---- chat templates: the real ones of tests/chat, and tokenizer_config.json files that carry them

def chat():
    for sub in ('templates', 'synthetic'):
        d = os.path.join(ROOT, 'tests/chat', sub)
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), 'rb') as f:
                put('jinja', name, f.read())
    with open(os.path.join(ROOT, 'tests/chat/templates/HuggingFaceTB-SmolLM2-1.7B-Instruct.jinja')) as f:
        smol = f.read()
    for name in ('bora', 'openllama', 'qwen2_split'):
        with open(os.path.join(ROOT, 'tests/tok/fixtures', name, 'tokenizer_config.json'), 'rb') as f:
            cfg = json.loads(f.read())
        cfg.setdefault('chat_template', smol)
        put('tokenizer_config', name + '.json', json.dumps(cfg, indent=2))
    put('tokenizer_config', 'named-templates.json', json.dumps({
        'bos_token': {'content': '<s>', 'lstrip': False}, 'eos_token': '</s>',
        'chat_template': [{'name': 'default', 'template': smol}, {'name': 'tool_use', 'template': '{{ tools }}'}]}))


def main():
    args = sys.argv[1:]
    moonrl = None
    if args[:1] == ['--moonrl']:
        moonrl, args = os.path.abspath(args[1]), args[2:]
    tokenizers()
    safetensors()
    gguf(args[0] if args else os.path.expanduser('~/.cache/moonrl/models/SmolLM2-135M-Instruct.Q4_1.gguf'))
    configs()
    http()
    lines()
    chat()
    if moonrl:  # the checkpoint targets' seeds: a real checkpoint's files
        import subprocess
        subprocess.run([moonrl, 'run', 'tests/fuzz/make_seeds.lua', 'corpus=' + CORPUS], cwd=ROOT, check=True)


if __name__ == '__main__':
    main()
