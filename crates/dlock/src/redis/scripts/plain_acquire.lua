-- dlock acquire, plain-string layouts (redis-py Lock, redsync, rslock, node-redlock,
-- python-redis-lock): the key holds the owner token, set with NX and a lease.
-- KEYS[1] the lock key, KEYS[2] dlock's token counter, KEYS[3] dlock's metadata key.
-- ARGV[1] lease in ms, ARGV[2] owner token, ARGV[3] metadata (JSON).
-- Granted: {1, fencing token}. Held: {0, remaining lease in ms or -1}.
if redis.call('set', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[1]) then
  redis.call('set', KEYS[3], ARGV[3], 'PX', ARGV[1])
  return {1, redis.call('incr', KEYS[2])}
end
return {0, redis.call('pttl', KEYS[1])}
