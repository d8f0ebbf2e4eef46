-- Give back a hold that no guard owns: an in-process hand-off whose reply was lost and
-- whose waiter has gone, or the grant of an attempt that failed after a lost reply.
-- KEYS[1] the lock hash, KEYS[2] the unlock channel.
-- ARGV[1] the hold's owner, ARGV[2] the nonce that took it (the hand-off's or the
-- attempt's), ARGV[3] '1' when it is a failed attempt's own grant (its field is proof
-- enough: the nonce was that attempt's alone), '0' when it is a hand-off's, given back
-- only while it is unclaimed (the 'dlock:handoff' marker): a hold the waiter's own
-- attempt took, re-entering or on a free lock, stays. ARGV[4] '1' when the nonce is a
-- hand-off's that may not have run yet: if it has not, it is voided ('dlock:void:' ..
-- the nonce), so that when it runs it releases to everyone instead of handing over
-- (`redisson_handoff.lua`).
-- Returns 1 if a hold was given back, else 0.
local lock, grant = KEYS[1], 'dlock:g:' .. ARGV[2]
if redis.call('hexists', lock, grant) == 0 then
  if ARGV[4] == '1' and redis.call('exists', lock) == 1 then
    redis.call('hset', lock, 'dlock:void:' .. ARGV[2], '1')
  end
  return 0
end
local marked = redis.call('hget', lock, 'dlock:handoff') == ARGV[2]
if (ARGV[3] ~= '1' and not marked) or redis.call('hexists', lock, ARGV[1]) == 0 then
  return 0
end
if marked then
  redis.call('hdel', lock, grant, 'dlock:handoff')
else
  redis.call('hdel', lock, grant)
end
if redis.call('hincrby', lock, ARGV[1], -1) > 0 then
  return 1
end
redis.call('del', lock)
redis.call('publish', KEYS[2], '0')
return 1
