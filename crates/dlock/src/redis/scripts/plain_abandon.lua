-- Give back the grant of an attempt that failed after a lost reply (no guard owns it),
-- plain-string layouts.
-- KEYS[1] the lock key, KEYS[2] where to signal waiters, KEYS[3] dlock's metadata key.
-- ARGV[1] owner token, ARGV[2] the attempt's nonce, ARGV[3] signal kind (see
-- plain_release.lua).
-- The grant is the attempt's while the key holds the owner and the metadata the grant
-- wrote names the nonce (as plain_acquire.lua recovers it); a later grant, to another
-- task sharing the owner, wrote its own nonce there and stays.
-- Returns 1 if the grant was given back, else 0.
if redis.call('get', KEYS[1]) ~= ARGV[1] then
  return 0
end
local meta = redis.call('get', KEYS[3])
if not meta or not string.find(meta, ARGV[2], 1, true) then
  return 0
end
redis.call('del', KEYS[1], KEYS[3])
signal_waiters(KEYS[2], ARGV[3])
return 1
