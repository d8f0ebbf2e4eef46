-- dlock acquire, Redisson RLock/RFencedLock layout.
-- KEYS[1] the lock hash (the name itself), KEYS[2] the token counter.
-- ARGV[1] lease in ms, ARGV[2] owner field, ARGV[3] metadata (JSON: stored as the value
-- of this hold's own field, not in a field of its own, which would cost every grant a
-- hash entry more),
-- ARGV[4] this attempt's grant field, 'dlock:g:' .. its nonce (sent whole: building it
-- here costs the server a string per call), ARGV[5] '1' when retrying after a lost
-- reply, '2' when recovering an in-process hand-off whose reply was lost (the nonce is
-- the hand-off's).
-- Each hold has a field of its own, 'dlock:g:' .. the nonce of the attempt (or hand-off)
-- that took it, until that hold's release: a retry after a lost reply finds its own
-- grant there even when another task sharing the owner re-entered in between (one field
-- naming the latest grant would by then name the other's, and the retry would count a
-- second hold no guard gives back).
-- Answers one integer (`layout::Answer`): granted, the fencing token (>= 0); held by
-- another, -3 - its PTTL (always < 0). Not a {granted, value} table: a table reply
-- costs the server more, as does a number argument to redis.call (converted with
-- "%.17g"), so leases and hold counts go as strings.
local lock, counter = KEYS[1], KEYS[2]
local owner, grant = ARGV[2], ARGV[4]
if ARGV[5] ~= '0' then
  -- Recovering ('2'): an in-process hand-off to this acquisition whose reply was lost,
  -- never picked up since: claim its hold (a retry's own nonce, '1', never marks one).
  -- The marker goes, so a leaving waiter cannot undo it later; the hand-off wrote the
  -- hold's own field.
  local marker = redis.call('hget', lock, 'dlock:handoff')
  if marker and 'dlock:g:' .. marker == grant then
    redis.call('hdel', lock, 'dlock:handoff')
    return tonumber(redis.call('hget', lock, 'dlock:fence') or '0')
  end
end
if redis.call('exists', lock) == 0 then
  local token = redis.call('incr', counter)
  redis.call('hset', lock, owner, '1', 'dlock:fence', token, grant, ARGV[3])
  redis.call('pexpire', lock, ARGV[1])
  return token
end
if redis.call('hexists', lock, owner) == 1 then
  if redis.call('hexists', lock, grant) == 1 then
    -- This attempt's grant is there already: a retry after a lost reply, or the same
    -- command sent again by the client library after a dropped connection (without
    -- the recovery flag). Report it; not a second hold.
    return tonumber(redis.call('hget', lock, 'dlock:fence') or '0')
  end
  redis.call('hincrby', lock, owner, '1')
  redis.call('hset', lock, grant, ARGV[3])
  if redis.call('pttl', lock) < tonumber(ARGV[1]) then
    redis.call('pexpire', lock, ARGV[1])
  end
  local token = redis.call('hget', lock, 'dlock:fence') or redis.call('get', counter) or '0'
  return tonumber(token)
end
if ARGV[5] == '2' then
  -- The hand-off has not run, and the lock is another's: the waiter stops counting on
  -- it. Void it, so that if it still runs (sent again, or late) it releases to
  -- everyone instead of leaving this owner a hold that no guard owns.
  redis.call('hset', lock, 'dlock:void:' .. string.sub(grant, 9), '1')
end
return -3 - redis.call('pttl', lock)
