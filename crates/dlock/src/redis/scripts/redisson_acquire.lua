-- dlock acquire, Redisson RLock/RFencedLock layout.
-- KEYS[1] the lock hash (the name itself), KEYS[2] the token counter.
-- ARGV[1] lease in ms, ARGV[2] owner field, ARGV[3] metadata (JSON).
-- Granted: {1, fencing token}. Held by another: {0, remaining lease in ms or -1}.
local lock, counter = KEYS[1], KEYS[2]
local lease, owner = tonumber(ARGV[1]), ARGV[2]
if redis.call('exists', lock) == 0 then
  local token = redis.call('incr', counter)
  redis.call('hset', lock, owner, 1, 'dlock:fence', token, 'dlock:meta', ARGV[3])
  redis.call('pexpire', lock, lease)
  return {1, token}
end
if redis.call('hexists', lock, owner) == 1 then
  redis.call('hincrby', lock, owner, 1)
  if redis.call('pttl', lock) < lease then
    redis.call('pexpire', lock, lease)
  end
  local token = redis.call('hget', lock, 'dlock:fence') or redis.call('get', counter) or '0'
  return {1, tonumber(token)}
end
return {0, redis.call('pttl', lock)}
