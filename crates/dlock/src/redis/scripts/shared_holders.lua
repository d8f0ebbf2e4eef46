-- Every live hold of a semaphore or read-write lock (read only).
-- KEYS: 1 entries hash, 2 expiry zset.
-- Returns {"kind token owner", ms left, ...}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local ends = redis.call('ZSCORE', KEYS[2], all[i])
  local kind = string.match(all[i + 1], '^(%S+) ')
  if ends and tonumber(ends) > now and kind and kind ~= 'want-write' then
    out[#out + 1] = all[i + 1]
    out[#out + 1] = math.floor(tonumber(ends) - now)
  end
end
return out
