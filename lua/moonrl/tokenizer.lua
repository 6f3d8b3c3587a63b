-- Tokenizers: Hugging Face tokenizer.json files, encoded and decoded exactly
-- as the Python `tokenizers` package does (core/tok, moonrl/tok.h).
--
--   local tokenizer = require('moonrl.tokenizer')
--   local tok = tokenizer.load('models/qwen3')          -- a directory or a tokenizer.json
--   local ids = tok:encode('Hello', { add_special = false })  -- Lua table of ids
--   local lists = tok:encode_batch({ 'a', 'b' })              -- in parallel, one C call
--   local arr, n = tok:encode('Hello', { cdata = true })      -- int32_t[n] cdata
--   print(tok:decode(ids, { skip_special = true }))
--   local s = tok:stream()  -- s:step(id) returns the newly complete text ('' if none)
--
-- encode options: add_special (default true: BOS/EOS per the post-processor,
-- as add_special_tokens in tokenizers), parse_special (default true: special
-- tokens written in the text become their ids), cdata (return int32 cdata and
-- its length instead of a table). decode options: skip_special (default false).
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local M = {}

local Tokenizer = {}
Tokenizer.__index = Tokenizer

local Stream = {}
Stream.__index = Stream

local size_out = ffi.new('size_t[1]')
local ptr_out = ffi.new('const char *[1]')

function M.load(path)
  if type(path) ~= 'string' then error('tokenizer.load: expected a path (string)', 2) end
  local h = ffi.new('mrl_tok *[1]')
  moonrl.check(C.mrl_tok_load(path, h), 2)
  local self = setmetatable({ handle = ffi.gc(h[0], C.mrl_tok_free), path = path }, Tokenizer)
  self.vocab_size = tonumber(C.mrl_tok_vocab_size(self.handle))
  local bos, eos = tonumber(C.mrl_tok_bos_id(self.handle)), tonumber(C.mrl_tok_eos_id(self.handle))
  self.bos_id = bos >= 0 and bos or nil
  self.eos_id = eos >= 0 and eos or nil
  return self
end

local function encode_flags(opts)
  local flags = 0
  if opts == nil or opts.add_special ~= false then flags = flags + C.MRL_TOK_ADD_SPECIAL end
  if opts == nil or opts.parse_special ~= false then flags = flags + C.MRL_TOK_PARSE_SPECIAL end
  return flags
end

-- Encode a string. Returns a Lua table of ids, or (int32_t[n] cdata, n)
-- with opts.cdata.
function Tokenizer:encode(text, opts)
  if type(text) ~= 'string' then error('tokenizer:encode: expected a string', 2) end
  local flags = encode_flags(opts)
  -- a first guess that fits nearly always; else ask for the exact size
  local cap = #text + 16
  local ids = ffi.new('int32_t[?]', cap)
  local st = C.mrl_tok_encode(self.handle, text, #text, flags, ids, cap, size_out)
  if st == C.MRL_ERR_INVALID and size_out[0] > cap then
    cap = tonumber(size_out[0])
    ids = ffi.new('int32_t[?]', cap)
    st = C.mrl_tok_encode(self.handle, text, #text, flags, ids, cap, size_out)
  end
  moonrl.check(st, 2)
  local n = tonumber(size_out[0])
  if opts and opts.cdata then return ids, n end
  local out = {}
  for i = 0, n - 1 do out[i + 1] = ids[i] end
  return out
end

-- Encode a list of strings in one C call, on the worker threads. Returns a
-- list of id tables, or with opts.cdata (int32_t ids cdata, size_t offsets
-- cdata, n): text i's ids are ids[offsets[i-1] .. offsets[i]-1] (0-based cdata).
function Tokenizer:encode_batch(texts, opts)
  if type(texts) ~= 'table' then error('tokenizer:encode_batch: expected a list of strings', 2) end
  local n = #texts
  local ptrs = ffi.new('const char *[?]', math.max(n, 1))
  local lens = ffi.new('size_t[?]', math.max(n, 1))
  local guess = 16
  for i = 1, n do
    local s = texts[i]
    if type(s) ~= 'string' then error(string.format('tokenizer:encode_batch: texts[%d] is not a string', i), 2) end
    ptrs[i - 1], lens[i - 1] = s, #s
    guess = guess + #s + 16
  end
  local flags = encode_flags(opts)
  local offsets = ffi.new('size_t[?]', n + 1)
  local ids = ffi.new('int32_t[?]', guess)
  local st = C.mrl_tok_encode_batch(self.handle, ptrs, lens, n, flags, ids, guess, offsets)
  if st == C.MRL_ERR_INVALID and offsets[n] > guess then
    guess = tonumber(offsets[n])
    ids = ffi.new('int32_t[?]', guess)
    st = C.mrl_tok_encode_batch(self.handle, ptrs, lens, n, flags, ids, guess, offsets)
  end
  moonrl.check(st, 2)
  if opts and opts.cdata then return ids, offsets, n end
  local out = {}
  for i = 1, n do
    local list = {}
    for k = tonumber(offsets[i - 1]), tonumber(offsets[i]) - 1 do list[#list + 1] = ids[k] end
    out[i] = list
  end
  return out
end

-- ids: a Lua table, or cdata with n given.
local function as_array(ids, n)
  if type(ids) == 'table' then
    n = #ids
    local arr = ffi.new('int32_t[?]', math.max(n, 1))
    for i = 1, n do arr[i - 1] = ids[i] end
    return arr, n
  end
  if n == nil then error('tokenizer:decode: cdata ids need a count (ids, n, opts)', 3) end
  return ids, n
end

-- Decode ids (a table, or cdata plus n) to a string.
function Tokenizer:decode(ids, n, opts)
  if type(n) == 'table' then opts, n = n, nil end
  local arr, count = as_array(ids, n)
  local flags = (opts and opts.skip_special) and C.MRL_TOK_SKIP_SPECIAL or 0
  moonrl.check(C.mrl_tok_decode(self.handle, arr, count, flags, nil, 0, size_out), 2)
  local len = tonumber(size_out[0])
  local buf = ffi.new('char[?]', math.max(len, 1))
  moonrl.check(C.mrl_tok_decode(self.handle, arr, count, flags, buf, len, size_out), 2)
  return ffi.string(buf, len)
end

function Tokenizer:token_to_id(token)
  local id = tonumber(C.mrl_tok_token_to_id(self.handle, token, #token))
  return id >= 0 and id or nil
end

function Tokenizer:id_to_token(id)
  local p = C.mrl_tok_id_to_token(self.handle, id, size_out)
  if p == nil then return nil end
  return ffi.string(p, size_out[0])
end

function Tokenizer:is_special(id) return C.mrl_tok_is_special(self.handle, id) ~= 0 end

-- A streaming decoder: s:step(id) returns the text that became complete
-- (UTF-8 characters are never cut), '' when none; s:reset() starts over.
function Tokenizer:stream(opts)
  local flags = (opts and opts.skip_special) and C.MRL_TOK_SKIP_SPECIAL or 0
  local h = ffi.new('mrl_tok_stream *[1]')
  moonrl.check(C.mrl_tok_stream_new(self.handle, flags, h), 2)
  -- the stream keeps the tokenizer alive through `tok`
  return setmetatable({ handle = ffi.gc(h[0], C.mrl_tok_stream_free), tok = self }, Stream)
end

function Stream:step(id)
  moonrl.check(C.mrl_tok_stream_step(self.handle, id, ptr_out, size_out), 2)
  local n = tonumber(size_out[0])
  if n == 0 then return '' end
  return ffi.string(ptr_out[0], n)
end

function Stream:reset() C.mrl_tok_stream_reset(self.handle) end

return M
