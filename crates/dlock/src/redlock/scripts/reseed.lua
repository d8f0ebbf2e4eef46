-- dlock Redlock: put a lock that a majority still holds back on a node that lost it
-- (restarted empty), only if nobody holds the key there and no break of this grant
-- (or a later one) ran here.
-- KEYS[1] the lock key, KEYS[2] the token counter, KEYS[3] token key, KEYS[4] metadata,
-- KEYS[5] the broken-grant mark (break.lua).
-- ARGV[1] owner token, ARGV[2] lease in ms, ARGV[3] the holder's fencing token,
-- ARGV[4] the grant's metadata (carrying its nonce).
local t = tonumber(ARGV[3])
if (tonumber(redis.call('get', KEYS[5]) or '0') or 0) >= t then
  return 0
end
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 0
end
if (tonumber(redis.call('get', KEYS[2]) or '0') or 0) < t then
  redis.call('set', KEYS[2], ARGV[3])
end
redis.call('set', KEYS[3], ARGV[3], 'PX', ARGV[2])
redis.call('set', KEYS[4], ARGV[4], 'PX', ARGV[2])
return 1
