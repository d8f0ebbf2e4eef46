-- dlock Redlock: an operator's forced release on one node, of one grant only.
-- KEYS[1] the lock key, KEYS[2] metadata key, KEYS[3] token key, KEYS[4] token counter.
-- ARGV[1] the holder's owner token, ARGV[2] the grant's metadata (it carries the
-- grant's nonce), ARGV[3] the grant's fencing token.
-- The counter is raised to the token if lower, so every later grant here is above it.
-- Returns 1 when this node held that grant (now deleted), else 0.
local t = tonumber(ARGV[3])
if (tonumber(redis.call('get', KEYS[4]) or '0') or 0) < t then
  redis.call('set', KEYS[4], ARGV[3])
end
if redis.call('get', KEYS[1]) == ARGV[1] and redis.call('get', KEYS[2]) == ARGV[2] then
  redis.call('del', KEYS[1], KEYS[2], KEYS[3])
  return 1
end
return 0
