-- moonrl.serve.mirror: one engine stepped by the ranks of a tensor-parallel group (moonrl serve
-- --tp). Each rank's engine runs on its slices of the model, and a step is a collective of the
-- group (its layers' sums, the logits' gather): every rank must hold the same requests and take
-- the same steps. The lead (the group's rank 0, which serves HTTP) queues each call that changes
-- its engine (add, stop_sample, release) once it succeeded there, and sends the queue with the
-- step that follows it in one broadcast; the other ranks apply the same calls in the same order
-- (a request gets the same id everywhere, checked) and step with it. An idle lead sends the queue
-- every second with no step, so that no rank's wait reaches the group's timeout; close() ends
-- the others' loop.
--
--   lead:   local eng = mirror.lead(engine, world)   -- the engine's methods, mirrored
--           ... eng:add(...), eng:step(), eng:tick() ... eng:close()
--   others: mirror.follow(engine, world)            -- returns when the lead closes
local json = require('moonrl.io.json')
local moonrl = require('moonrl')

local M = {}

local IDLE_SECONDS = 1 -- an idle lead's sends: far below any timeout a group is given

local Lead = {}
Lead.__index = Lead

function M.lead(engine, world)
  return setmetatable({ engine = engine, world = world, handle = engine.handle, model = engine.model, queue = {},
    sent = moonrl.now() }, Lead)
end

function Lead:send(op)
  self.world:broadcast_string(json.encode({ op = op, calls = self.queue }), 0)
  self.queue, self.sent = {}, moonrl.now()
end

function Lead:add(q, opts)
  local id = self.engine:add(q, opts) -- (a refused request goes nowhere)
  self.queue[#self.queue + 1] = { 'add', q, opts or {}, id }
  return id
end

function Lead:stop_sample(id, j)
  self.engine:stop_sample(id, j)
  self.queue[#self.queue + 1] = { 'stop_sample', id, j }
end

function Lead:release(id)
  self.engine:release(id)
  self.queue[#self.queue + 1] = { 'release', id }
end

function Lead:step()
  self:send('step')
  return self.engine:step()
end

-- Called by the server's loop: after IDLE_SECONDS without a send, the queue alone.
function Lead:tick()
  if moonrl.now() - self.sent >= IDLE_SECONDS then self:send('calls') end
end

function Lead:close() self:send('close') end

-- what only reads the engine: its own
for _, name in ipairs({ 'output', 'top_logprobs', 'done', 'num_unfinished', 'stats' }) do
  Lead[name] = function(self, ...) return self.engine[name](self.engine, ...) end
end

function M.follow(engine, world)
  while true do
    local msg = json.decode(world:broadcast_string(nil, 0))
    for _, c in ipairs(msg.calls) do
      if c[1] == 'add' then
        local id = engine:add(c[2], c[3])
        if id ~= c[4] then
          error(string.format('serve --tp: rank %d gave request id %d where the lead gave %d', world.rank, id, c[4]), 0)
        end
      elseif c[1] == 'stop_sample' then
        engine:stop_sample(c[2], c[3])
      else
        engine:release(c[2])
      end
    end
    if msg.op == 'close' then return end
    -- a step that fails fails alike on every rank (the same logits): the lead's server goes on, and so do we
    if msg.op == 'step' then pcall(engine.step, engine) end
  end
end

return M
