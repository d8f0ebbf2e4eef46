-- dlock release, plain-string layouts.
-- KEYS[1] the lock key, KEYS[2] where to signal waiters, KEYS[3] dlock's metadata key.
-- ARGV[1] owner token, ARGV[2] signal kind: 'publish' (dlock's unlock channel) or
-- 'list' (python-redis-lock: one element pushed to the signal list, which expires).
-- Returns 0 when released, -1 when not held by this owner.
if redis.call('get', KEYS[1]) ~= ARGV[1] then
  return -1
end
redis.call('del', KEYS[1], KEYS[3])
if ARGV[2] == 'list' then
  redis.call('del', KEYS[2])
  redis.call('lpush', KEYS[2], 1)
  redis.call('pexpire', KEYS[2], 1000)
else
  redis.call('publish', KEYS[2], '0')
end
return 0
