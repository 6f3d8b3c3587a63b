-- moonrl.tokenizer: the Lua wrapper over core/tok (ids are checked against
-- the Python package in ref_tokenizers.py; here the wrapper's behaviour).
local t = require('moonrl.testing')
local tokenizer = require('moonrl.tokenizer')
local ffi = require('ffi')

local FIX = 'tests/tok/fixtures/'
local tok = tokenizer.load(FIX .. 'llama3_split')

t.test('load a directory or a file, vocab and special ids', function()
  t.truthy(tok.vocab_size > 300, 'vocab size')
  t.eq(tok.bos_id, tok:token_to_id('<|begin_of_text|>'))
  t.eq(tok.eos_id, tok:token_to_id('<|eot_id|>'))
  local same = tokenizer.load(FIX .. 'llama3_split/tokenizer.json')
  t.eq(same.vocab_size, tok.vocab_size)
  t.eq(tok:id_to_token(tok.bos_id), '<|begin_of_text|>')
  t.eq(tok:id_to_token(-1), nil)
  t.eq(tok:token_to_id('surely not a token'), nil)
  t.truthy(tok:is_special(tok.eos_id) and not tok:is_special(100), 'is_special')
end)

t.test('encode options and decode round trip', function()
  local text = 'Hello, мир! 汉字 <|eot_id|> 12345'
  local ids = tok:encode(text)
  t.eq(ids[1], tok.bos_id, 'add_special by default')
  local plain = tok:encode(text, { add_special = false })
  t.eq(#plain, #ids - 1)
  t.eq(tok:decode(plain), text)
  t.eq(tok:decode(ids, { skip_special = true }), 'Hello, мир! 汉字  12345')
  local unparsed = tok:encode(text, { add_special = false, parse_special = false })
  t.truthy(#unparsed > #plain, 'special token text split when not parsed')
  t.eq(tok:decode(unparsed), text)
  local arr, n = tok:encode(text, { cdata = true, add_special = false })
  t.eq(n, #plain)
  t.truthy(ffi.istype('int32_t[?]', arr) or type(arr) == 'cdata', 'cdata array')
  for i = 1, n do t.eq(arr[i - 1], plain[i]) end
  t.eq(tok:decode(arr, n), text)
  t.eq(#tok:encode('', { add_special = false }), 0)
end)

t.test('encode_batch gives what encode gives', function()
  local texts = { 'one', '', 'Hello <|eot_id|> мир', string.rep('x ', 300) }
  local lists = tok:encode_batch(texts, { add_special = false })
  t.eq(#lists, #texts)
  for i, s in ipairs(texts) do
    local one = tok:encode(s, { add_special = false })
    t.eq(#lists[i], #one, 'length of text ' .. i)
    for k = 1, #one do t.eq(lists[i][k], one[k]) end
  end
  local ids, offsets, n = tok:encode_batch(texts, { cdata = true })
  t.eq(n, 4)
  t.eq(ids[tonumber(offsets[0])], tok.bos_id)
  t.eq(tonumber(offsets[2] - offsets[1]), 1, 'an empty text is only BOS')
  t.eq(#tok:encode_batch({}), 0)
end)

t.test('a long text needs more ids than the first guess', function()
  local sp = tokenizer.load(FIX .. 'sentencepiece_bytefallback')
  local text = string.rep('<s>', 500)
  local ids = sp:encode(text, { add_special = true })
  t.eq(#ids, 501)
end)

t.test('stream decoder emits whole characters', function()
  local sp = tokenizer.load(FIX .. 'sentencepiece_bytefallback')
  local text = 'héllo 😀 мир 汉字'
  local s = sp:stream({ skip_special = true })
  local parts = {}
  for _, id in ipairs(sp:encode(text)) do
    local piece = s:step(id)
    t.truthy(piece == '' or not piece:find('\239\191\189'), 'no replacement characters')
    parts[#parts + 1] = piece
  end
  t.eq(table.concat(parts), text)
  s:reset()
  t.eq(s:step(sp:token_to_id('<0x41>')), 'A')
end)

t.test('errors name the file', function()
  t.raises(function() tokenizer.load('tests/tok/no-such-dir') end, 'no-such-dir: cannot open')
  t.raises(function() tok:encode(42) end, 'expected a string')
end)

t.done()
