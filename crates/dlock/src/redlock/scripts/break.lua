-- dlock Redlock: an operator's forced release on one node, of one grant only.
-- KEYS[1] the lock key, KEYS[2] metadata key, KEYS[3] token key, KEYS[4] token counter.
-- ARGV[1] the holder's owner token, ARGV[2] the grant's metadata (it carries the
-- grant's nonce), ARGV[3] the grant's fencing token.
-- The counter is raised past the token if not already, so every later grant here is
-- above it, and a renewal of the broken grant that lands after this (it may have
-- extended a majority just before the break reached those nodes) cannot put it back
-- here: reseed.lua refuses a node whose counter is past the grant's token.
-- Returns 1 when this node held that grant (now deleted), else 0.
local t = tonumber(ARGV[3]) + 1
if (tonumber(redis.call('get', KEYS[4]) or '0') or 0) < t then
  redis.call('set', KEYS[4], string.format('%d', t))
end
if redis.call('get', KEYS[1]) == ARGV[1] and redis.call('get', KEYS[2]) == ARGV[2] then
  redis.call('del', KEYS[1], KEYS[2], KEYS[3])
  return 1
end
return 0
