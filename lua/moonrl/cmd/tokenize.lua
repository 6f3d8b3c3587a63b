-- moonrl tokenize: encode stdin with a Hugging Face tokenizer and print the ids.
local moonrl = require('moonrl')

local M = {}

local USAGE = [[
usage: moonrl tokenize --tokenizer DIR_OR_FILE [options] < text
  --tokenizer PATH     a directory with tokenizer.json, or the file itself
  --tokens             print one "id<TAB>token" line per token instead of the ids
  --lines              encode each input line on its own (the newline is not encoded)
  --add-special        add BOS/EOS as the post-processor says (off by default)
  --no-parse-special   treat special tokens written in the text as plain text
  --decode             read ids (whitespace separated) and print the decoded text
  --skip-special       with --decode: leave special tokens out]]

local function parse(args)
  local o = { add_special = false, parse_special = true }
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == '--tokenizer' then
      o.tokenizer = args[i + 1]
      i = i + 1
      if not o.tokenizer then moonrl.usage_error('--tokenizer needs a path\n' .. USAGE) end
    elseif a:match('^%-%-tokenizer=') then o.tokenizer = a:match('^%-%-tokenizer=(.*)$')
    elseif a == '--tokens' then o.tokens = true
    elseif a == '--lines' then o.lines = true
    elseif a == '--add-special' then o.add_special = true
    elseif a == '--no-parse-special' then o.parse_special = false
    elseif a == '--decode' then o.decode = true
    elseif a == '--skip-special' then o.skip_special = true
    elseif a == '--help' or a == '-h' then print(USAGE) return nil
    else moonrl.usage_error(string.format("tokenize: unknown option '%s'\n%s", a, USAGE)) end
    i = i + 1
  end
  if not o.tokenizer then moonrl.usage_error('tokenize: --tokenizer is required\n' .. USAGE) end
  return o
end

local function show(tok, ids, o)
  if o.tokens then
    for _, id in ipairs(ids) do io.write(id, '\t', tok:id_to_token(id) or '', '\n') end
  else
    io.write(table.concat(ids, ' '), '\n')
  end
end

function M.main(args)
  local o = parse(args)
  if not o then return 0 end
  local ok, tok = pcall(require('moonrl.tokenizer').load, o.tokenizer)
  if not ok then moonrl.usage_error('tokenize: ' .. tostring(tok)) end
  local input = moonrl.exit_on_signal(io.read, '*a') or ''
  if o.decode then
    local ids = {}
    for w in input:gmatch('%S+') do
      local id = tonumber(w)
      if not id then moonrl.usage_error(string.format("tokenize --decode: '%s' is not an id", w)) end
      ids[#ids + 1] = id
    end
    io.write(tok:decode(ids, { skip_special = o.skip_special }))
    return 0
  end
  local opts = { add_special = o.add_special, parse_special = o.parse_special }
  if o.lines then
    for line in (input .. (input:sub(-1) == '\n' and '' or '\n')):gmatch('(.-)\n') do
      show(tok, tok:encode(line, opts), o)
    end
  else
    show(tok, tok:encode(input, opts), o)
  end
  return 0
end

return M
