-- dlock renew, Redisson layout, many locks per call.
-- KEYS[i] a lock hash; ARGV[3i-2] owner field, ARGV[3i-1] fencing token, ARGV[3i] lease ms.
-- Returns one 1 (extended) or 0 (no longer held by that grant) per key. A key another
-- client made another type (a plain string lock) is not held by the grant: read with
-- pcall, whose error is no match, so it cannot fail the other locks' renewals batched
-- in the same call.
local out = {}
for i = 1, #KEYS do
  local owner, token, lease = ARGV[3 * i - 2], ARGV[3 * i - 1], tonumber(ARGV[3 * i])
  if redis.pcall('hexists', KEYS[i], owner) == 1
      and redis.call('hget', KEYS[i], 'dlock:fence') == token then
    if redis.call('pttl', KEYS[i]) < lease then
      redis.call('pexpire', KEYS[i], ARGV[3 * i])
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
