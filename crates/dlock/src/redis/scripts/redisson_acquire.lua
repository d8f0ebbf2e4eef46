-- dlock acquire, Redisson RLock/RFencedLock layout.
-- KEYS[1] the lock hash (the name itself), KEYS[2] the token counter.
-- ARGV[1] lease in ms, ARGV[2] owner field, ARGV[3] metadata (JSON),
-- ARGV[4] this attempt's nonce, ARGV[5] '1' when retrying after a lost reply.
-- Granted: {1, fencing token}. Held by another: {0, remaining lease in ms or -1}.
local lock, counter = KEYS[1], KEYS[2]
local lease, owner, nonce = tonumber(ARGV[1]), ARGV[2], ARGV[4]
if ARGV[5] == '1' then
  -- An in-process hand-off to this acquisition whose reply was lost, never picked up
  -- since: claim its hold (the marker goes, so a leaving waiter cannot undo it later).
  if redis.call('hget', lock, 'dlock:handoff') == nonce then
    redis.call('hdel', lock, 'dlock:handoff')
    redis.call('hset', lock, 'dlock:nonce', nonce)
    return {1, tonumber(redis.call('hget', lock, 'dlock:fence') or '0')}
  end
  -- A retry whose first try was granted (only the reply was lost) finds its own nonce:
  -- report that grant instead of taking a second hold.
  if redis.call('hget', lock, 'dlock:nonce') == nonce then
    return {1, tonumber(redis.call('hget', lock, 'dlock:fence') or '0')}
  end
end
if redis.call('exists', lock) == 0 then
  local token = redis.call('incr', counter)
  redis.call('hset', lock, owner, 1, 'dlock:fence', token, 'dlock:meta', ARGV[3],
    'dlock:nonce', nonce)
  redis.call('pexpire', lock, lease)
  return {1, token}
end
if redis.call('hexists', lock, owner) == 1 then
  redis.call('hincrby', lock, owner, 1)
  redis.call('hset', lock, 'dlock:nonce', nonce)
  if redis.call('pttl', lock) < lease then
    redis.call('pexpire', lock, lease)
  end
  local token = redis.call('hget', lock, 'dlock:fence') or redis.call('get', counter) or '0'
  return {1, tonumber(token)}
end
return {0, redis.call('pttl', lock)}
