-- moonrl.batch: samples and the packed batch the model computes on. Every recipe, the
-- advantage estimators (moonrl.algo), the update step and the evaluation speak these two types.
--
--   local batch = require('moonrl.batch')
--   local reqs = batch.requests(records, n)              -- records -> engine requests, n completions each
--   local samples = batch.flatten(records, engine:generate(reqs, sampling))
--   local b = batch.pack(samples)                        -- one packed batch with a response mask
--   for b, first, last in batch.micro_batches(samples, 4096) do ... end
--   local lists = batch.gather(b, lp)                    -- per-token outputs -> per-sample lists
--   local x = batch.scatter(b, lists)                    -- and back
--
-- The sample contract: a sample is a Lua table; these fields have these meanings everywhere.
--   prompt_ids        Lua list of the prompt's token ids. The samples of one prompt share ONE
--                     table (flatten does), which is how pack shares the prompt's rows.
--   ids               Lua list of the response's token ids (the packed sequence is prompt_ids .. ids).
--   loss_mask         optional Lua list, one 0/1 per response token: the tokens a loss counts (an
--                     environment's tokens inside an episode are 0); absent: every response token.
--   score             the reward (a number); advantages: adv (one number for the response) or
--                     adv_tokens (a list, one per response token).
--   old_logprobs      optional list, log π_old per response token (absent: on-policy, log πθ detached).
--   rollout_logprobs  the engine's log-probs of the sampled tokens (the behaviour policy).
--   version           the policy version of the first token; version_switches: {position, version}
--                     pairs of later tokens generated with newer weights.
--   routing           a qwen3_moe engine's record of the experts each position went to (int16 cdata).
--   record, prompt, answer, meta, group, rank, response, finish_reason: where it came from (its
--                     dataset record, the group index, the rank that generated it), its text and why
--                     it ended ('stop', 'length').
-- The log-prob of token t+1 sits at output t (model.h), so the response's log-probs are outputs
-- P-1 .. P+R-2 of a sequence with a prompt of P tokens and R response tokens: the mask's ones.
local ffi = require('ffi')
local model_mod = require('moonrl.model')

local M = {}

-- A sample's loss_mask, checked: one 0 or 1 per response token (nil: none).
local function loss_mask(s)
  local m = s.loss_mask
  if m == nil then return nil end
  if type(m) ~= 'table' or #m ~= #s.ids then
    error(string.format("sample field 'loss_mask': %s for a response of %d tokens (one 0 or 1 per token)",
      type(m) == 'table' and #m .. ' entries' or 'a ' .. type(m), #s.ids), 3)
  end
  for k = 1, #m do
    if m[k] ~= 0 and m[k] ~= 1 then
      error(string.format("sample field 'loss_mask': entry %d is %s (0 or 1)", k, tostring(m[k])), 3)
    end
  end
  return m
end

-- The tokens of a sample its losses count: the response tokens, less those loss_mask zeroes.
function M.loss_tokens(s)
  local m = loss_mask(s)
  if not m then return #s.ids end
  local n = 0
  for k = 1, #s.ids do n = n + m[k] end
  return n
end

-- A list of prompt records -> engine requests and, after generate(), the flat list of samples
-- (one per completion) that carry their record (prompt, answer, meta), group index and results.
function M.requests(records, n)
  local reqs = {}
  -- prompt_index: the record's place in the step's global batch (S:prompts), so that a rank
  -- draws the samples one process would draw for it
  for i, r in ipairs(records) do reqs[i] = { prompt_ids = r.prompt_ids, n = n, prompt_index = r.prompt_index } end
  return reqs
end

function M.flatten(records, results)
  local samples = {}
  for i, r in ipairs(records) do
    for j, out in ipairs(results[i]) do
      samples[#samples + 1] = { prompt_ids = r.prompt_ids, ids = out.ids, rollout_logprobs = out.logprobs, routing = out.routing,
        response = out.text or '', finish_reason = out.finish_reason, prompt = r.prompt, answer = r.answer,
        meta = r.meta, group = i, record = r, version = out.version, version_switches = out.version_switches }
    end
  end
  return samples
end

-- Packed batch of samples: b (moonrl.model batch) plus b.mask (float[n_tokens]: 1 at the response
-- outputs a loss counts, the loss_mask's ones, else 0), b.first[i] (the 0-based output index of sample i's first response log-prob) and b.len[i] (response tokens).
-- With opts.share_prompts, consecutive samples with the same prompt (the same prompt_ids table,
-- as flatten gives the samples of a group) share it: the prompt without its last token is packed
-- once and each sample continues it with "last prompt token + response" (mrl_batch.prefix in
-- model.h), so the prompt is computed once per group; log-probs and gradients are those of
-- packing every sample whole. Then b.n_seqs counts the shared prompts too (fully masked), and
-- b.sample_cu (int32[#samples + 1]) cuts the rows into one segment per sample instead (a shared
-- prompt's rows go with its first sample; they are masked): the cu_seqlens of per-sample losses.
-- Without sharing b.sample_cu is b.cu_seqlens.
function M.pack(samples, first, last, opts)
  first, last = first or 1, last or #samples
  local share = opts and opts.share_prompts
  local seqs, prefix, starts, lens = {}, {}, {}, {}
  local src = {} -- src[k] = { sample, position of its first token }: where sequence k's routing rows come from
  local i = first
  while i <= last do
    local s = samples[i]
    local P = #s.prompt_ids
    local j = i -- samples i..j share the prompt
    if share and P >= 2 then
      while j < last and samples[j + 1].prompt_ids == s.prompt_ids do j = j + 1 end
    end
    local parent = false
    if j > i then
      local seq = {}
      for k = 1, P - 1 do seq[k] = s.prompt_ids[k] end
      seqs[#seqs + 1] = seq
      parent = #seqs
      src[#seqs] = { s, 0 }
    end
    for k = i, j do
      local sk = samples[k]
      local seq, keep = {}, parent and 1 or P -- prompt tokens this sequence carries
      for t = 1, keep do seq[t] = sk.prompt_ids[P - keep + t] end
      for t = 1, #sk.ids do seq[keep + t] = sk.ids[t] end
      seqs[#seqs + 1] = seq
      prefix[#seqs] = parent
      src[#seqs] = { sk, P - keep }
      starts[#starts + 1] = { #seqs, keep }
      lens[#lens + 1] = #sk.ids
    end
    i = j + 1
  end
  local b = model_mod.batch(seqs, { prefix = share and prefix or nil })
  local mask = ffi.new('float[?]', b.n_tokens)
  b.first, b.len = {}, lens
  b.sample_cu = b.cu_seqlens
  if #starts ~= b.n_seqs then b.sample_cu = ffi.new('int32_t[?]', #starts + 1) end -- zeroed
  for k = 1, #starts do
    local seq = starts[k][1]
    local off = b.cu_seqlens[seq - 1] + starts[k][2] - 1
    b.first[k] = off
    local lm = loss_mask(samples[first + k - 1]) -- the response tokens a loss counts (absent: all)
    for t = off, off + lens[k] - 1 do mask[t] = lm and lm[t - off + 1] or 1 end
    -- sample k ends where its sequence ends and starts where sample k-1 ended
    if b.sample_cu ~= b.cu_seqlens then b.sample_cu[k] = b.cu_seqlens[seq] end
  end
  b.mask = mask
  if opts and opts.routing then b.routing = M.pack_routing(b, src, opts.routing) end
  return b
end

-- Routing replay (moe.routing_replay): the batch's mrl_batch.routing rows, width = sparse layers x
-- num_experts_per_tok, from each sample's engine record (s.routing, one row per position of
-- prompt + response); -1 (the trainer's own top-k) where a sample has none, or one that does not
-- match its tokens (ids changed after generation). nil when no sample has one.
function M.pack_routing(b, src, width)
  local r, any = ffi.new('int16_t[?]', b.n_tokens * width), false
  ffi.fill(r, 2 * b.n_tokens * width, 0xff)
  for k = 1, b.n_seqs do
    local s, pos0 = src[k][1], src[k][2]
    if s.routing and ffi.sizeof(s.routing) == 2 * width * (#s.prompt_ids + #s.ids) then
      any = true
      local t0, t1 = b.cu_seqlens[k - 1], b.cu_seqlens[k]
      ffi.copy(r + t0 * width, s.routing + pos0 * width, 2 * (t1 - t0) * width)
    end
  end
  return any and r or nil
end

-- Iterate over consecutive slices of samples whose packed size stays within max_tokens (a
-- sample longer than the budget gets a micro-batch of its own). Yields the packed batch and
-- the first and last sample index. opts: as pack's (the budget counts every sample whole), and
-- unit (1): runs of that many consecutive samples stay in one micro-batch (DPO's chosen and
-- rejected completions of a pair: 2), the budget counting each run whole.
function M.micro_batches(samples, max_tokens, opts)
  local unit = opts and opts.unit or 1
  local i = 1
  return function()
    if i > #samples then return nil end
    local j, tokens = i, 0
    while j + unit - 1 <= #samples do
      local n = 0
      for k = j, j + unit - 1 do n = n + #samples[k].prompt_ids + #samples[k].ids end
      if j > i and tokens + n > max_tokens then break end
      tokens = tokens + n
      j = j + unit
    end
    if j == i then j = #samples + 1 end -- fewer than unit samples left: them alone
    local first = i
    i = j
    return M.pack(samples, first, j - 1, opts), first, j - 1
  end
end

-- Per-sample copy of a per-token array over the response outputs: out[i] = Lua list of R floats.
function M.gather(b, x, out, first)
  out = out or {}
  first = first or 1
  for i = 1, #b.len do
    local t, list = b.first[i], {}
    for k = 1, b.len[i] do list[k] = x[t + k - 1] end
    out[first + i - 1] = list
  end
  return out
end

-- The inverse: a float[n_tokens] array with per-sample lists scattered onto the response outputs.
function M.scatter(b, lists, first)
  local x = ffi.new('float[?]', b.n_tokens)
  for i = 1, #b.len do
    local t, list = b.first[i], lists[(first or 1) + i - 1]
    for k = 1, b.len[i] do x[t + k - 1] = list[k] end
  end
  return x
end

-- The list of samples[i][field] (per-sample lists to scatter).
function M.gather_field(samples, field)
  local out = {}
  for i, s in ipairs(samples) do out[i] = s[field] end
  return out
end

-- The scores of samples (their .score) as a double array (the advantages' input).
function M.scores(samples)
  local out = ffi.new('double[?]', math.max(#samples, 1))
  for i, s in ipairs(samples) do out[i - 1] = s.score end
  return out
end

return M
