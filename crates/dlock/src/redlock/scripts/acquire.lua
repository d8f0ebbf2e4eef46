-- dlock Redlock acquire on one node: the plain-string layout of node-redlock, redsync
-- and rslock (the resource name as key, the owner token as value, PX lease), plus
-- dlock's token counter.
-- KEYS[1] the lock key, KEYS[2] the token counter, KEYS[3] metadata key, KEYS[4] where
-- the holder's token is kept. ARGV[1] lease in ms, ARGV[2] owner token, ARGV[3]
-- metadata (JSON).
-- Granted: {1, this node's new counter value}. Held: {0, remaining lease in ms or -1}.
if redis.call('set', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[1]) then
  redis.call('set', KEYS[3], ARGV[3], 'PX', ARGV[1])
  local t = redis.call('incr', KEYS[2])
  redis.call('set', KEYS[4], t, 'PX', ARGV[1])
  return {1, t}
end
return {0, redis.call('pttl', KEYS[1])}
