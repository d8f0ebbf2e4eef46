-- An attempt at a semaphore permit, a read or a write (dlock's own layout; the rule is
-- crate::shared_holds::decide, kept in step with it).
-- KEYS: 1 entries hash (acquisition -> "kind fence owner"), 2 expiry zset
-- (acquisition -> expiry ms, server time), 3 token counter.
-- ARGV: 1 acquisition, 2 owner, 3 asked (permit | read | write), 4 permits,
-- 5 ttl ms, 6 a waiting writer's entry ttl ms (0: leave none).
-- Returns {1, token} granted, {0, ms until the soonest hold ends or -1} busy,
-- {-1, 0} an upgrade refused.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, m in ipairs(dead) do redis.call('HDEL', KEYS[1], m) end
if #dead > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end

local acq, owner, asked = ARGV[1], ARGV[2], ARGV[3]
local permits_held = 0
local foreign_write, foreign_hold, writer_waits = false, false, false
local owner_holds, owner_writes, owner_reads = false, false, false
local soonest = -1
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local kind, who = string.match(all[i + 1], '^(%S+) %d+ (.*)$')
  local ends = redis.call('ZSCORE', KEYS[2], all[i])
  if not ends then
    -- An entry without an expiry (its sorted set was removed): dead, never a hold.
    redis.call('HDEL', KEYS[1], all[i])
    kind = nil
  end
  if kind and all[i] ~= acq then
    local hold = kind ~= 'want-write'
    if kind == 'permit' then permits_held = permits_held + 1 end
    if kind == 'want-write' then writer_waits = true end
    if hold and who == owner then owner_holds = true end
    if hold and who ~= owner then foreign_hold = true end
    if kind == 'write' and who ~= owner then foreign_write = true end
    if kind == 'write' and who == owner then owner_writes = true end
    if kind == 'read' and who == owner then owner_reads = true end
    if hold then
      local left = tonumber(ends) - now
      if soonest < 0 or left < soonest then soonest = left end
    end
  end
end

local grant
if asked == 'permit' then
  grant = permits_held < tonumber(ARGV[4])
elseif asked == 'read' then
  grant = not (foreign_write or (writer_waits and not owner_holds))
else
  if owner_reads and not owner_writes then return {-1, 0} end
  grant = not foreign_hold
end

-- The keys live as long as their longest entry.
local function keep()
  local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  if last[2] then
    local ms = math.floor(tonumber(last[2]) - now) + 1000
    redis.call('PEXPIRE', KEYS[1], ms)
    redis.call('PEXPIRE', KEYS[2], ms)
  end
end

if grant then
  local token = redis.call('INCR', KEYS[3])
  redis.call('HSET', KEYS[1], acq, asked .. ' ' .. token .. ' ' .. owner)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), acq)
  keep()
  return {1, token}
end
if asked == 'write' and tonumber(ARGV[6]) > 0 then
  redis.call('HSET', KEYS[1], acq, 'want-write 0 ' .. owner)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), acq)
  keep()
end
return {0, soonest}
