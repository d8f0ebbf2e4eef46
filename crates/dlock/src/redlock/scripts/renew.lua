-- dlock Redlock renew on one node. Never shortens a lease.
-- KEYS[1] the lock key, KEYS[2] metadata key, KEYS[3] token key.
-- ARGV[1] owner token, ARGV[2] lease in ms, ARGV[3] the grant's nonce.
-- Returns 1 held (extended to at least the lease), 0 the key is gone (expired, or the
-- node restarted empty), -1 another grant (of another owner, or a later one of the
-- same owner) holds it here.
local v = redis.call('get', KEYS[1])
if v == ARGV[1] then
  local meta = redis.call('get', KEYS[2])
  if meta and string.find(meta, ARGV[3], 1, true) then
    local lease = tonumber(ARGV[2])
    if redis.call('pttl', KEYS[1]) < lease then
      redis.call('pexpire', KEYS[1], lease)
      redis.call('pexpire', KEYS[2], lease)
      redis.call('pexpire', KEYS[3], lease)
    end
    return 1
  end
  return -1
end
if v then
  return -1
end
return 0
