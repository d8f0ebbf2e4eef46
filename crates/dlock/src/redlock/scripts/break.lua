-- dlock Redlock: an operator's forced release on one node, of one grant only.
-- KEYS[1] the lock key, KEYS[2] metadata key, KEYS[3] token key, KEYS[4] token counter,
-- KEYS[5] the broken-grant mark.
-- ARGV[1] the holder's owner token, ARGV[2] the grant's metadata (it carries the
-- grant's nonce), ARGV[3] the grant's fencing token, ARGV[4] the mark's life in ms.
-- The counter is raised to the token if lower, so every later grant here is above it.
-- The mark (the highest token broken here) keeps a renewal of the broken grant that
-- lands after this from putting it back here (reseed.lua): such a renewal may have
-- extended the grant on a majority just before the break reached those nodes, and
-- re-seeds the nodes it then finds empty. Only a renewal already under way can, since
-- no later one reaches a majority, so the mark needs to live only as long as one.
-- Returns 1 when this node held that grant (now deleted), else 0.
local t = tonumber(ARGV[3])
if (tonumber(redis.call('get', KEYS[4]) or '0') or 0) < t then
  redis.call('set', KEYS[4], ARGV[3])
end
if (tonumber(redis.call('get', KEYS[5]) or '0') or 0) < t then
  redis.call('set', KEYS[5], ARGV[3], 'PX', ARGV[4])
end
if redis.call('get', KEYS[1]) == ARGV[1] and redis.call('get', KEYS[2]) == ARGV[2] then
  redis.call('del', KEYS[1], KEYS[2], KEYS[3])
  return 1
end
return 0
