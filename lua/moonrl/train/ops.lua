-- Ops over host arrays (cdata pointers), one C call per array.
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local M = {}

local sum_out = ffi.new('double[1]')
function M.sum(x, n)
  moonrl.check(C.mrl_ops_sum_f32(x, n, sum_out), 2)
  return sum_out[0]
end

return M
