-- dlock renew, plain-string layouts, many locks per call.
-- KEYS[3i-2] a lock key, KEYS[3i-1] its metadata key, KEYS[3i] its token counter;
-- ARGV[3i-2] owner token, ARGV[3i-1] the grant's fencing token, ARGV[3i] lease ms.
-- A grant is renewed only while it holds (owner matches, no grant since); the lease is
-- never shortened. Returns one 1 (held) or 0 (no longer held by that grant) per lock.
-- A key another client made another type (a Redisson hash) is not held by the grant:
-- read with pcall, whose error is no match, so it cannot fail the other locks' renewals
-- batched in the same call.
local out = {}
for i = 1, #KEYS / 3 do
  local lock, meta, counter = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if redis.pcall('get', lock) == ARGV[3 * i - 2]
      and redis.pcall('get', counter) == ARGV[3 * i - 1] then
    local lease = tonumber(ARGV[3 * i])
    if redis.call('pttl', lock) < lease then
      redis.call('pexpire', lock, ARGV[3 * i])
      redis.call('pexpire', meta, ARGV[3 * i])
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
