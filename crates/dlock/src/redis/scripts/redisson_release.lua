-- dlock release, Redisson layout.
-- KEYS[1] the lock hash, KEYS[2] the unlock channel.
-- ARGV[1] owner field, ARGV[2] fencing token, ARGV[3] this hold's own field,
-- 'dlock:g:' .. the nonce that took it (it goes with the hold: see
-- redisson_acquire.lua).
-- Returns the holds left (0: freed, and the unlock message published), -1 if not held.
-- Without the hold's own field this release has already run (the client library may
-- send a command again after a dropped connection): it must not give back another
-- hold of the same owner, nor delete the lock under it.
local lock = KEYS[1]
local held = redis.call('hmget', lock, ARGV[1], 'dlock:fence', ARGV[3])
if not held[1] or held[2] ~= ARGV[2] or not held[3] then
  return -1
end
-- The last hold (the usual case) needs no decrement: the key goes.
if held[1] ~= '1' then
  local left = redis.call('hincrby', lock, ARGV[1], -1)
  if left > 0 then
    redis.call('hdel', lock, ARGV[3])
    return left
  end
end
redis.call('del', lock)
redis.call('publish', KEYS[2], '0')
return 0
