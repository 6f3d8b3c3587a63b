-- Format reward: the response is made of the required tags, each present once, well formed, in
-- order — by default <think>...</think><answer>...</answer> (DeepSeek-R1 style).
--
--   local f = require('rewards.format')
--   f.reward{ response = '<think>...</think>\n<answer>42</answer>' }    --> 1
--   local g = f.new{ tags = { 'reasoning', 'answer' }, strict = false, prefix = '<reasoning>' }
--
-- opts:
--   tags       ({'think', 'answer'}) the tags, in the order they must appear
--   strict     (true) nothing but whitespace before, between and after the tags; false allows text
--   nonempty   (true) every tag's content must hold something other than whitespace
--   prefix     ('') text prepended to the response first (when the prompt already opened <think>)
--   score      (1) the reward when the format holds, 0 otherwise
-- Each of <tag> and </tag> must occur exactly once, <tag> before </tag>, and no required tag may
-- open or close inside another's content.
local rewards = require('moonrl.rewards')

local M = {}

local function count(s, needle)
  local n, init = 0, 1
  while true do
    local a, b = s:find(needle, init, true)
    if not a then return n end
    n, init = n + 1, b + 1
  end
end

-- true when s has the format; else false and the reason.
function M.check(s, opts)
  opts = opts or {}
  local tags = opts.tags or { 'think', 'answer' }
  local strict = opts.strict ~= false
  local nonempty = opts.nonempty ~= false
  s = (opts.prefix or '') .. s
  for _, tag in ipairs(tags) do
    if count(s, '<' .. tag .. '>') ~= 1 then return false, '<' .. tag .. '> must occur exactly once' end
    if count(s, '</' .. tag .. '>') ~= 1 then return false, '</' .. tag .. '> must occur exactly once' end
  end
  local pos = 1
  for _, tag in ipairs(tags) do
    local open, close = '<' .. tag .. '>', '</' .. tag .. '>'
    local a, b = s:find(open, pos, true)
    if not a then return false, open .. ' out of order' end
    if strict and s:sub(pos, a - 1):find('%S') then return false, 'text before ' .. open end
    local c, d = s:find(close, b + 1, true)
    if not c then return false, close .. ' missing after ' .. open end
    local content = s:sub(b + 1, c - 1)
    for _, other in ipairs(tags) do
      if content:find('<' .. other .. '>', 1, true) or content:find('</' .. other .. '>', 1, true) then
        return false, '<' .. other .. '> inside ' .. open
      end
    end
    if nonempty and not content:find('%S') then return false, open .. ' is empty' end
    pos = d + 1
  end
  if strict and s:sub(pos):find('%S') then return false, 'text after the last tag' end
  return true
end

function M.new(opts)
  opts = opts or {}
  local score = opts.score or 1
  return function(sample)
    return M.check(rewards.response_of(sample, 'reward format'), opts) and score or 0
  end
end

M.reward = M.new()
-- loaded (by moonrl.rewards.get through moonrl.registry.plugin, or a require), it registers its built-in reward
rewards.register('format', M.reward, { builtin = true })

return M
