-- Undo an in-process hand-off whose reply was lost and whose waiter has gone.
-- KEYS[1] the lock hash, KEYS[2] the unlock channel.
-- ARGV[1] the owner it was handed to, ARGV[2] the nonce the hand-off wrote.
-- Returns 1 if that hand-off had landed (the lock is now freed), else 0.
local lock = KEYS[1]
if redis.call('hget', lock, 'dlock:nonce') ~= ARGV[2] or redis.call('hexists', lock, ARGV[1]) == 0 then
  return 0
end
redis.call('del', lock)
redis.call('publish', KEYS[2], '0')
return 1
