-- dlock release with an in-process hand-off, Redisson layout.
-- KEYS[1] the lock hash, KEYS[2] the token counter, KEYS[3] the unlock channel.
-- ARGV[1] owner field, ARGV[2] fencing token, ARGV[3] the next owner,
-- ARGV[4] its lease in ms, ARGV[5] its metadata (JSON, the value of
-- its hold's own field, as in redisson_acquire.lua), ARGV[6] the hand-off's nonce
-- (never an attempt's),
-- ARGV[7] '1' when the hand-off streak is spent, ARGV[8] the nonce that took the
-- releasing hold (its own field goes with it: see redisson_acquire.lua).
-- Returns {holds left, 0} when this was not the last hold (nothing handed over),
-- {-1, 0} if not held, {0, next owner's fencing token} once handed over (no unlock
-- message: the lock never became free), {-2, 0} when the streak was spent and another
-- connection listens for the unlock message: then the lock is released to everyone.
-- Without the releasing hold's own field this has already run (see
-- redisson_release.lua): nothing more is given back or handed over. A hand-off its
-- waiter gave up on before it ran ('dlock:void:' .. its nonce: see
-- redisson_abandon.lua) releases to everyone, answering {-2, 0}.
local lock = KEYS[1]
local held = redis.call('hmget', lock, ARGV[1], 'dlock:fence', 'dlock:g:' .. ARGV[8],
  'dlock:void:' .. ARGV[6])
if not held[1] or held[2] ~= ARGV[2] or not held[3] then
  -- Sent again after it handed the lock over: the same answer as the first time, so
  -- the waiter gets the hold its hand-off made.
  if redis.call('hget', lock, 'dlock:handoff') == ARGV[6]
      and redis.call('hexists', lock, ARGV[3]) == 1
      and redis.call('hexists', lock, 'dlock:g:' .. ARGV[6]) == 1 then
    return {0, tonumber(redis.call('hget', lock, 'dlock:fence'))}
  end
  return {-1, 0}
end
-- The last hold (the usual case) needs no decrement: its field goes below.
if held[1] ~= '1' then
  local left = redis.call('hincrby', lock, ARGV[1], -1)
  if left > 0 then
    redis.call('hdel', lock, 'dlock:g:' .. ARGV[8])
    return {left, 0}
  end
end
if held[4] then
  redis.call('del', lock)
  redis.call('publish', KEYS[3], '0')
  return {-2, 0}
end
if ARGV[7] == '1' then
  -- Listeners besides this process's own subscriber? (If PUBSUB is not permitted,
  -- assume so.)
  local subs = redis.pcall('pubsub', 'numsub', KEYS[3])
  if type(subs) ~= 'table' or (tonumber(subs[2]) or 2) > 1 then
    redis.call('del', lock)
    redis.call('publish', KEYS[3], '0')
    return {-2, 0}
  end
end
redis.call('hdel', lock, ARGV[1], 'dlock:g:' .. ARGV[8])
local token = redis.call('incr', KEYS[2])
-- 'dlock:handoff' marks the hold as the hand-off's until its waiter picks it up: a
-- waiter that recovers it by this nonce claims it, one that left gives back exactly
-- this hold (`redisson_abandon.lua`), never a hold its own attempt took.
redis.call('hset', lock, ARGV[3], '1', 'dlock:fence', token,
  'dlock:g:' .. ARGV[6], ARGV[5], 'dlock:handoff', ARGV[6])
redis.call('pexpire', lock, ARGV[4])
return {0, token}
