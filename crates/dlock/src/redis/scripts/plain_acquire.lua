-- dlock acquire, plain-string layouts (redis-py Lock, redsync, rslock, node-redlock,
-- python-redis-lock): the key holds the owner token, set with NX and a lease.
-- KEYS[1] the lock key, KEYS[2] dlock's token counter, KEYS[3] dlock's metadata key.
-- ARGV[1] lease in ms, ARGV[2] owner token, ARGV[3] metadata (JSON carrying the
-- attempt's nonce), ARGV[4] the nonce, ARGV[5] '1' when retrying after a lost reply.
-- Answers as redisson_acquire.lua does: the fencing token (>= 0) when granted, else
-- -3 - the lock's PTTL (always < 0).
if ARGV[5] == '1' and redis.call('get', KEYS[1]) == ARGV[2] then
  local meta = redis.call('get', KEYS[3])
  if meta and string.find(meta, ARGV[4], 1, true) then
    -- The first try was granted and only its reply was lost.
    return tonumber(redis.call('get', KEYS[2]) or '0')
  end
end
if redis.call('set', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[1]) then
  redis.call('set', KEYS[3], ARGV[3], 'PX', ARGV[1])
  return redis.call('incr', KEYS[2])
end
return -3 - redis.call('pttl', KEYS[1])
