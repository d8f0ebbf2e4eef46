-- Undo an in-process hand-off whose reply was lost and whose waiter has gone.
-- KEYS[1] the lock hash, KEYS[2] the unlock channel.
-- ARGV[1] the owner it was handed to, ARGV[2] the nonce the hand-off wrote.
-- Gives back exactly the hand-off's hold, if it landed and was never claimed (the
-- 'dlock:handoff' marker): a hold the waiter's own attempt took, re-entering or on a
-- free lock, stays. Returns 1 if the hand-off's hold was given back, else 0.
local lock = KEYS[1]
if redis.call('hget', lock, 'dlock:handoff') ~= ARGV[2]
    or redis.call('hexists', lock, ARGV[1]) == 0 then
  return 0
end
redis.call('hdel', lock, 'dlock:handoff', 'dlock:g:' .. ARGV[2])
if redis.call('hincrby', lock, ARGV[1], -1) > 0 then
  return 1
end
redis.call('del', lock)
redis.call('publish', KEYS[2], '0')
return 1
