-- The model presets of bench/models.json for the Lua sides of the benchmarks.
--   local preset = dofile(moonrl.home .. '/bench/models.lua')
--   local cfg = preset('100m', { max_position_embeddings = 1024 }) -- a fresh plain table: the preset, then the keys given
local moonrl = require('moonrl')
local json = require('moonrl.io.json')

local presets = json.read_file(moonrl.home .. '/bench/models.json')

return function(name, extra)
  local p = presets[name]
  if type(p) ~= 'table' or name == '_about' then error('bench/models.json has no preset ' .. tostring(name), 2) end
  local cfg = {}
  for _, k in ipairs(json.keys(p)) do cfg[k] = p[k] end
  for k, v in pairs(extra or {}) do cfg[k] = v end
  return cfg
end
