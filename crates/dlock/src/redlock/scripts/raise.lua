-- dlock Redlock: after a majority granted, write the grant's fencing token back.
-- KEYS[1] the token counter, KEYS[2] the lock key, KEYS[3] where the holder's token is
-- kept (for inspect). ARGV[1] the token T (max of the granting nodes' counters),
-- ARGV[2] owner token.
-- The counter is raised to T if lower (never lowered): any later majority grant meets
-- a node that has seen T, so its token is higher.
local t = tonumber(ARGV[1])
if (tonumber(redis.call('get', KEYS[1]) or '0') or 0) < t then
  redis.call('set', KEYS[1], ARGV[1])
end
if redis.call('get', KEYS[2]) == ARGV[2] then
  local pttl = redis.call('pttl', KEYS[2])
  if pttl > 0 then
    redis.call('set', KEYS[3], ARGV[1], 'PX', pttl)
  end
end
return 1
