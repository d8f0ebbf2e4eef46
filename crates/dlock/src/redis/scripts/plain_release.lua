-- dlock release, plain-string layouts.
-- KEYS[1] the lock key, KEYS[2] where to signal waiters, KEYS[3] dlock's metadata key,
-- KEYS[4] dlock's token counter.
-- ARGV[1] owner token, ARGV[2] signal kind: 'publish' (dlock's unlock channel) or
-- 'list' (python-redis-lock: one element pushed to the signal list, which expires),
-- ARGV[3] the grant's fencing token.
-- Only this grant is released: the owner must match and no grant may have come since
-- (the counter still shows this grant's token). Another task sharing the owner may
-- hold a later grant; a late release of an earlier one must not free it.
-- Returns 0 when released, -1 when this grant does not hold the lock.
if redis.call('get', KEYS[1]) ~= ARGV[1] or redis.call('get', KEYS[4]) ~= ARGV[3] then
  return -1
end
redis.call('del', KEYS[1], KEYS[3])
signal_waiters(KEYS[2], ARGV[2])
return 0
