-- dlock fair acquire, Redisson layout plus a FIFO queue of waiters.
-- KEYS[1] lock hash, KEYS[2] token counter, KEYS[3] queue list, KEYS[4] waiter
-- deadlines (sorted set, ms on the server's clock).
-- ARGV[1] lease ms, ARGV[2] owner, ARGV[3] metadata (the grant field's value),
-- ARGV[4] this attempt's grant field ('dlock:g:' .. its nonce, as
-- redisson_acquire.lua takes it), ARGV[5] '1' when
-- retrying after a lost reply, ARGV[6] queue entry lifetime in ms ('0': do not queue),
-- ARGV[7] this acquisition's queue entry (owner and acquisition: two waiters of one
-- owner each have a place of their own).
-- Answers as redisson_acquire.lua does: the fencing token (>= 0) when granted, else
-- -3 - the lock's PTTL (always < 0).
local lock, counter, queue, deadlines = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease, owner, grant, entry = tonumber(ARGV[1]), ARGV[2], ARGV[4], ARGV[7]
-- Each hold's own field, as in redisson_acquire.lua: a retry finds its grant in the
-- re-entry branch below.
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Drop waiters whose deadline passed (they died or gave up without leaving).
while true do
  local head = redis.call('lindex', queue, 0)
  if not head then break end
  local deadline = redis.call('zscore', deadlines, head)
  if deadline and tonumber(deadline) > now then break end
  redis.call('lpop', queue)
  redis.call('zrem', deadlines, head)
end
if redis.call('hexists', lock, owner) == 1 then
  if redis.call('hexists', lock, grant) == 1 then
    -- This attempt's grant is there already (see redisson_acquire.lua).
    return tonumber(redis.call('hget', lock, 'dlock:fence') or '0')
  end
  -- Re-entry by the holding owner: granted at once, and its queue place goes.
  redis.call('hincrby', lock, owner, '1')
  redis.call('hset', lock, grant, ARGV[3])
  if redis.call('pttl', lock) < lease then
    redis.call('pexpire', lock, ARGV[1])
  end
  if redis.call('zscore', deadlines, entry) then
    redis.call('lrem', queue, 0, entry)
    redis.call('zrem', deadlines, entry)
  end
  return tonumber(redis.call('hget', lock, 'dlock:fence') or '0')
end
local head = redis.call('lindex', queue, 0)
if redis.call('exists', lock) == 0 and (not head or head == entry) then
  if head == entry then
    redis.call('lpop', queue)
    redis.call('zrem', deadlines, entry)
  end
  local token = redis.call('incr', counter)
  redis.call('hset', lock, owner, '1', 'dlock:fence', token, grant, ARGV[3])
  redis.call('pexpire', lock, ARGV[1])
  return token
end
local life = tonumber(ARGV[6])
if life > 0 then
  if not redis.call('zscore', deadlines, entry) then
    redis.call('rpush', queue, entry)
  end
  redis.call('zadd', deadlines, now + life, entry)
  -- If every waiter dies, the queue keys expire on their own.
  redis.call('pexpire', queue, life * 2)
  redis.call('pexpire', deadlines, life * 2)
end
return -3 - redis.call('pttl', lock)
