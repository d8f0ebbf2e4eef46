-- dlock Redlock: after a majority granted, write the grant's fencing token back.
-- KEYS[1] the token counter, KEYS[2] the lock key, KEYS[3] where the holder's token is
-- kept (for inspect), KEYS[4] the metadata key. ARGV[1] the token T (max of the
-- granting nodes' counters), ARGV[2] owner token, ARGV[3] the grant's nonce.
-- The counter is raised to T if lower (never lowered). Returns 1 only while this node
-- still holds this grant: only such a node makes every later grant here come after the
-- raise (a later grant must wait until this one's key is gone), so only such answers
-- count towards the majority that must have seen T. Else 0.
local t = tonumber(ARGV[1])
if (tonumber(redis.call('get', KEYS[1]) or '0') or 0) < t then
  redis.call('set', KEYS[1], ARGV[1])
end
if redis.call('get', KEYS[2]) == ARGV[2] then
  local meta = redis.call('get', KEYS[4])
  local pttl = redis.call('pttl', KEYS[2])
  if meta and string.find(meta, ARGV[3], 1, true) and pttl > 0 then
    redis.call('set', KEYS[3], ARGV[1], 'PX', pttl)
    return 1
  end
end
return 0
