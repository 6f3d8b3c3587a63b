-- Loss aggregation over packed batches, and the small helpers every loss in
-- moonrl.algo shares (argument checks, scratch arrays, masked statistics).
--
-- A packed batch is described by three things, passed as fields of an args table:
--   cu_seqlens  int array [nseq+1]   cumulative token offsets; sequence i owns tokens cu[i] .. cu[i+1]-1
--   nseq        number               sequences in this (micro-)batch
--   mask        numeric array [ntok] per token: 1 = response token that counts, 0 = prompt/padding
-- where ntok = cu_seqlens[nseq]. Arrays are cdata (float/double/int/uint8 arrays or pointers); indexes
-- are 0-based.
--
-- Aggregation is expressed as one weight per SEQUENCE: for every mode,
--     loss = Σ_i w_i · Σ_{t in i} m_t · L_t
-- so dloss/dL_t = w_i · m_t. Modes (veRL's names):
--   'token-mean'              w_i = 1 / D_tok             D_tok = Σ m over the global batch
--   'seq-mean-token-sum'      w_i = 1 / D_seq             D_seq = number of sequences with Σ m > 0
--   'seq-mean-token-mean'     w_i = 1 / (D_seq · Σ_{t∈i} m_t)
--   'seq-mean-token-sum-norm' w_i = 1 / norm              norm: a constant, e.g. the max response length
-- Fully masked sequences get w_i = 0 and are not counted in D_seq (veRL's agg_loss counts them in
-- seq-mean-token-sum and gets 0/0 for them in seq-mean-token-mean). veRL's sum-norm constant is the
-- padded response width; pass it (or any fixed budget) as args.norm. The denominators default to this
-- micro-batch's counts; under gradient accumulation (or data parallelism) pass the GLOBAL ones:
--   args.global_tokens (D_tok), args.global_seqs (D_seq), args.norm (the constant)
-- so that the micro-batch losses (and gradients) sum to those of the whole batch. agg.counts() gives a
-- micro-batch's counts to sum.
local ffi = require('ffi')

local M = {}

M.MODES = {
  ['token-mean'] = true,
  ['seq-mean-token-sum'] = true,
  ['seq-mean-token-mean'] = true,
  ['seq-mean-token-sum-norm'] = true,
}

-- ---------------------------------------------------------------- argument checks

-- Element count of a cdata array, or nil for a pointer (whose length cannot be known).
local function cdata_len(x)
  local ct = tostring(ffi.typeof(x))
  if not ct:find('%[') then return nil end
  local elem = ffi.cast('const char *', x + 1) - ffi.cast('const char *', x)
  return tonumber(ffi.sizeof(x)) / tonumber(elem)
end

-- Raise unless args[name] is a cdata array with at least n elements (pointers are trusted).
function M.check_array(args, name, n, fn, optional)
  local x = args[name]
  if x == nil then
    if optional then return nil end
    error(string.format('%s: argument %s is required', fn, name), 3)
  end
  if type(x) ~= 'cdata' then
    error(string.format('%s: argument %s must be a cdata array, got %s', fn, name, type(x)), 3)
  end
  local len = cdata_len(x)
  if len and len < n then
    error(string.format('%s: argument %s has %d elements, needs %d', fn, name, len, n), 3)
  end
  return x
end

-- Check cu_seqlens / nseq / mask; returns nseq, ntok.
function M.check_batch(args, fn, need_mask)
  local nseq = args.nseq
  if type(nseq) ~= 'number' or nseq < 0 or nseq % 1 ~= 0 then
    error(string.format('%s: argument nseq must be a non-negative integer, got %s', fn, tostring(nseq)), 3)
  end
  local cu = M.check_array(args, 'cu_seqlens', nseq + 1, fn)
  if cu[0] ~= 0 then error(string.format('%s: cu_seqlens[0] must be 0, got %d', fn, tonumber(cu[0])), 3) end
  for i = 1, nseq do
    if cu[i] < cu[i - 1] then
      error(string.format('%s: cu_seqlens must not decrease (cu_seqlens[%d] = %d < cu_seqlens[%d] = %d)',
        fn, i, tonumber(cu[i]), i - 1, tonumber(cu[i - 1])), 3)
    end
  end
  local ntok = tonumber(cu[nseq])
  if need_mask ~= false then M.check_array(args, 'mask', ntok, fn) end
  return nseq, ntok
end

-- The checks run once per call, in the interpreter: reading a ctype's name (tostring) is not
-- compiled by LuaJIT, and keeping them out of traces keeps the data loops' traces clean.
jit.off(cdata_len)
jit.off(M.check_array)
jit.off(M.check_batch)

function M.check_mode(mode, fn)
  if not M.MODES[mode] then
    local names = {}
    for k in pairs(M.MODES) do names[#names + 1] = k end
    table.sort(names)
    error(string.format("%s: unknown aggregation mode '%s' (known: %s)", fn, tostring(mode),
      table.concat(names, ', ')), 3)
  end
end

-- ---------------------------------------------------------------- arrays

-- A zeroed double array of n elements (ffi.new zero-fills).
function M.zeros(n, ctype)
  return ffi.new((ctype or 'double') .. '[?]', math.max(n, 1))
end

-- A double array from a Lua list (tests and small inputs).
function M.array(list, ctype)
  local a = ffi.new((ctype or 'double') .. '[?]', math.max(#list, 1))
  for i = 1, #list do a[i - 1] = list[i] end
  return a
end

-- cu_seqlens (int32) from a list of sequence lengths; returns cu, nseq, ntok.
function M.cu_from_lengths(lengths)
  local cu = ffi.new('int32_t[?]', #lengths + 1)
  for i = 1, #lengths do cu[i] = cu[i - 1] + lengths[i] end
  return cu, #lengths, cu[#lengths]
end

-- Scratch double arrays reused across calls, keyed by purpose: valid until the next call that uses
-- the same key. Not thread-shared state to keep: copy what must outlive the call.
local scratch = {}
function M.scratch(key, n)
  local s = scratch[key]
  if not s or s.n < n then
    s = { n = math.max(n, 16), buf = ffi.new('double[?]', math.max(n, 16)) }
    scratch[key] = s
  end
  return s.buf
end

-- ---------------------------------------------------------------- counts and weights

local function mask_counts(cu, mask, nseq, len_out)
  local tokens, seqs = 0, 0
  for i = 0, nseq - 1 do
    local s = 0
    for t = cu[i], cu[i + 1] - 1 do s = s + mask[t] end
    len_out[i] = s
    tokens = tokens + s
    if s > 0 then seqs = seqs + 1 end
  end
  return tokens, seqs
end

-- Counts of a micro-batch: {tokens = Σ m, seqs = sequences with Σ m > 0}. Sum them over the
-- micro-batches (and ranks) of one step and pass them as global_tokens / global_seqs.
function M.counts(args)
  local nseq = M.check_batch(args, 'agg.counts')
  local tokens, seqs = mask_counts(args.cu_seqlens, args.mask, nseq, M.scratch('counts', nseq))
  return { tokens = tokens, seqs = seqs }
end

-- Per-sequence weights w[0..nseq-1] (see the top of this file). args: cu_seqlens, nseq, mask,
-- and optionally global_tokens, global_seqs, norm. mode defaults to args.agg or 'token-mean'.
-- out: a double array [nseq] (when nil, a scratch array valid until the next seq_weights call).
-- Returns out.
function M.seq_weights(args, mode, out)
  local fn = 'agg.seq_weights'
  mode = mode or args.agg or 'token-mean'
  M.check_mode(mode, fn)
  local nseq = M.check_batch(args, fn)
  out = out or M.scratch('seq_weights', nseq)
  local len = M.scratch('seq_len', nseq)
  local tokens, seqs = mask_counts(args.cu_seqlens, args.mask, nseq, len)
  if mode == 'token-mean' then
    local d = args.global_tokens or tokens
    local w = d > 0 and 1 / d or 0
    for i = 0, nseq - 1 do out[i] = w end
  elseif mode == 'seq-mean-token-sum-norm' then
    local d = args.norm
    if type(d) ~= 'number' or d <= 0 then
      error(fn .. ": mode 'seq-mean-token-sum-norm' needs args.norm > 0 (e.g. the max response length)", 2)
    end
    for i = 0, nseq - 1 do out[i] = 1 / d end
  else
    local d = args.global_seqs or seqs
    local per_token = mode == 'seq-mean-token-mean'
    for i = 0, nseq - 1 do
      local l = len[i]
      if l > 0 and d > 0 then
        out[i] = per_token and 1 / (d * l) or 1 / d
      else
        out[i] = 0
      end
    end
  end
  return out
end

-- The common frame of a per-token loss: checks the batch and args.grad, weighs each sequence by
-- the aggregation mode (args.agg, else default_mode), calls token_fn(state, t, m) -> L_t, dL_t/dx_t
-- for every token with m ≠ 0, and ADDS coef · w_i · m_t · dL_t/dx_t into args.grad when given.
-- Returns coef · agg(L), agg(L). This is the helper a new Lua objective builds on.
-- Define token_fn once (at module level) and pass what it reads in `state` rather than creating a
-- closure per call: a closure over the caller's locals ends the caller with a UCLO bytecode, which
-- LuaJIT does not compile (NYI) when a trace runs into it.
--
-- Each token_fn gets its own copy of the loop (the same source compiled again), so that every loss
-- has its own monomorphic trace instead of one loop whose trace must branch on the callee.
local TOKEN_LOOP = [[
local token_fn = ...
return function(nseq, cu, mask, w, grad, coef, state)
  local total = 0
  for i = 0, nseq - 1 do
    local wi = w[i]
    local s = 0
    for t = cu[i], cu[i + 1] - 1 do
      local m = mask[t]
      if m ~= 0 then
        local L, dL = token_fn(state, t, m)
        s = s + m * L
        if grad ~= nil then grad[t] = grad[t] + coef * wi * m * dL end
      end
    end
    total = total + wi * s
  end
  return total
end
]]
local loops = setmetatable({}, { __mode = 'k' })
local function token_loop(token_fn)
  local loop = loops[token_fn]
  if not loop then
    loop = assert(loadstring(TOKEN_LOOP, '@lua/moonrl/algo/agg.lua (token loop)'))(token_fn)
    loops[token_fn] = loop
  end
  return loop
end

function M.token_loss(args, fn, default_mode, token_fn, state)
  local nseq, ntok = M.check_batch(args, fn)
  local grad = M.check_array(args, 'grad', ntok, fn, true)
  local coef = args.coef or 1
  local w = M.seq_weights(args, args.agg or default_mode)
  local total = token_loop(token_fn)(nseq, args.cu_seqlens, args.mask, w, grad, coef, state)
  return coef * total, total
end

-- Aggregate a per-token array L [ntok] with the mode: Σ_i w_i Σ_t m_t L_t.
function M.aggregate(L, args, mode)
  local nseq = M.check_batch(args, 'agg.aggregate')
  local w = M.seq_weights(args, mode)
  local cu, mask = args.cu_seqlens, args.mask
  local total = 0
  for i = 0, nseq - 1 do
    local s = 0
    for t = cu[i], cu[i + 1] - 1 do s = s + mask[t] * L[t] end
    total = total + w[i] * s
  end
  return total
end

-- Σ m·x and Σ m over the whole batch.
function M.masked_sums(x, mask, ntok)
  local s, n = 0, 0
  for t = 0, ntok - 1 do
    local m = mask[t]
    s = s + m * x[t]
    n = n + m
  end
  return s, n
end

-- Masked mean of a per-token array over the whole batch (metrics; no gradient).
function M.masked_mean(x, mask, ntok)
  local s, n = M.masked_sums(x, mask, ntok)
  return n > 0 and s / n or 0
end

-- Masked whitening in place over the whole batch (veRL masked_whiten): mean and UNBIASED variance
-- over the tokens with m = 1, x <- (x - mean) / sqrt(var + eps) on those tokens, 0 on the others.
-- With a single unmasked token the variance is taken as 0.
function M.masked_whiten(x, mask, ntok, eps)
  eps = eps or 1e-8
  local s, n = M.masked_sums(x, mask, ntok)
  if n == 0 then
    for t = 0, ntok - 1 do x[t] = 0 end
    return 0, 0
  end
  local mean = s / n
  local ss = 0
  for t = 0, ntok - 1 do
    local d = x[t] - mean
    ss = ss + mask[t] * d * d
  end
  local var = n > 1 and ss / (n - 1) or 0
  local inv = 1 / math.sqrt(var + eps)
  for t = 0, ntok - 1 do
    if mask[t] ~= 0 then x[t] = (x[t] - mean) * inv else x[t] = 0 end
  end
  return mean, var
end

return M
