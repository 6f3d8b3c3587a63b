-- Train a small Llama-style language model on a text file with cross-entropy, and watch the loss
-- fall. The shortest complete use of the training core: model, packed batches, forward to
-- per-token log-probs, the SFT loss and its gradient (moonrl.algo), backward, clipping, AdamW with
-- a cosine schedule.
--
--   moonrl run examples/train_text.lua data=my.txt steps=300
--   moonrl run examples/train_text.lua data=my.txt tokenizer=/models/Qwen2.5-0.5B   (a HF tokenizer)
--
-- Without a tokenizer the model reads bytes (vocabulary 256). Each step trains on `batch` windows
-- of `seq_len` tokens drawn at random from the file; every `log_every` steps it prints the loss,
-- and at the end the first and last loss and where the model was saved (Hugging Face format).
local moonrl = require('moonrl')
local ffi = require('ffi')
local algo = require('moonrl.algo')
local session = require('moonrl.train.session')
local train = require('moonrl.train.step')

local cfg = moonrl.config {
  data = moonrl.config.optional('string', 'text file (default: moonrl README.md)'),
  tokenizer = moonrl.config.optional('string', 'Hugging Face tokenizer dir (default: bytes)'),
  steps = moonrl.config.integer(200, { min = 0 }),
  batch = moonrl.config.integer(8, { min = 1 }),
  seq_len = moonrl.config.integer(128, { min = 2 }),
  lr = moonrl.config.number(3e-3, { min = 0 }), warmup = moonrl.config.integer(20, { min = 0 }),
  weight_decay = moonrl.config.number(0.01, { min = 0 }), max_grad_norm = moonrl.config.number(1.0, { above = 0 }),
  model = { hidden_size = moonrl.config.integer(128, { min = 1 }), layers = moonrl.config.integer(2, { min = 1 }),
            heads = moonrl.config.integer(4, { min = 1 }), kv_heads = moonrl.config.integer(2, { min = 1 }),
            intermediate_size = moonrl.config.integer(384, { min = 1 }),
            dtype = 'fp32', -- fp32 | bf16 | auto (moonrl.model, "precision"; session.start applies it)
            device = 'cpu' }, -- cpu | cuda | cuda:N | auto (moonrl.model, "the device"; session.start applies it)
  log_every = moonrl.config.integer(20, { min = 1 }),
  save = true,
}
-- the text, as token ids
local path = cfg.data or (moonrl.home .. '/README.md')
local f, ferr = require('moonrl.io.fs').open(path)
if not f then moonrl.usage_error('data: ' .. ferr) end
local text = f:read('*a')
f:close()
local ids, vocab = {}, 256
if cfg.tokenizer then
  local tok = moonrl.tokenizer.load(cfg.tokenizer)
  ids, vocab = tok:encode(text, { add_special = false }), tok.vocab_size
else
  for i = 1, #text do ids[i] = text:byte(i) end
end
if #ids < cfg.seq_len + 1 then
  moonrl.usage_error(string.format('data: %s has %d tokens, fewer than seq_len + 1 = %d', path, #ids, cfg.seq_len + 1))
end
print(string.format('%s: %d tokens, vocabulary %d', path, #ids, vocab))

local model = moonrl.model.new({ model_type = 'llama', vocab_size = vocab, hidden_size = cfg.model.hidden_size,
  intermediate_size = cfg.model.intermediate_size, num_hidden_layers = cfg.model.layers,
  num_attention_heads = cfg.model.heads, num_key_value_heads = cfg.model.kv_heads,
  max_position_embeddings = cfg.seq_len, tie_word_embeddings = true }, { seed = cfg.run.seed })
-- the session: run directory, checkpoints, resume (moonrl.train.session); its state is the model, the
-- optimizer and the generator that draws the windows
local S = session.start(cfg, { name = 'train_text', steps = cfg.steps, steps_key = 'steps', policy = model,
  tokenizer_dir = cfg.tokenizer })
local p, n_params = model:param_buffer() -- (on a GPU: its memory there, where the optimizer steps)
local opt = S:optimizer('policy', moonrl.optim.adamw({ params = p, grads = model:grads(), n = n_params, lr = cfg.lr,
  weight_decay = cfg.weight_decay, no_decay = model:no_decay_ranges(), model = model })) -- model: told after each step
local lr_at = moonrl.optim.schedule({ kind = 'cosine', warmup = cfg.warmup, total = cfg.steps, lr = cfg.lr })
print(string.format('model: %d parameters', n_params))

-- windows drawn with a seeded generator: the same run on every machine
local rng = S:rng('windows', cfg.run.seed)

local first_loss, last_loss
for step in S:steps() do
  local seqs = {}
  for b = 1, cfg.batch do
    local start = rng:int(#ids - cfg.seq_len) + 1
    local s = {}
    for i = 1, cfg.seq_len do s[i] = ids[start + i - 1] end
    seqs[b] = s
  end
  local batch = moonrl.model.batch(seqs) -- targets: the next token; the last token has none
  local n = batch.n_tokens
  local mask = ffi.new('float[?]', n)
  for i = 0, n - 1 do mask[i] = batch.targets[i] >= 0 and 1 or 0 end
  local grad = ffi.new('float[?]', n)
  local loss
  S:phase('train', function()
    model:zero_grad()
    local logprob = model:forward(batch)
    loss = algo.sft.loss({ logprob = logprob, mask = mask, cu_seqlens = batch.cu_seqlens,
      nseq = batch.n_seqs, grad = grad })
    model:backward(grad, nil)
  end)
  local m = { loss = loss, grad_norm = opt:clip_grad_norm(cfg.max_grad_norm), lr = lr_at(step) }
  train.apply_update(S, opt, m.lr, m)
  first_loss = first_loss or loss
  last_loss = loss
  S:log(m, { quiet = step % cfg.log_every ~= 0 })
end
print(string.format('loss: %.4f at step 1 -> %.4f at step %d', first_loss or 0, last_loss or 0, cfg.steps))
local dirs = S:finish()
if dirs.policy then print('model saved in ' .. dirs.policy) end
