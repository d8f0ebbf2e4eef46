-- dlock Redlock release on one node (checked against the grant, not only the owner).
-- KEYS[1] the lock key, KEYS[2] metadata key, KEYS[3] token key.
-- ARGV[1] owner token, ARGV[2] the grant's nonce (written into its metadata).
-- Another task sharing the owner may hold a later grant here: only this grant's keys
-- are deleted. Returns 1 released, 0 not held by this grant here.
if redis.call('get', KEYS[1]) == ARGV[1] then
  local meta = redis.call('get', KEYS[2])
  if meta and string.find(meta, ARGV[2], 1, true) then
    redis.call('del', KEYS[1], KEYS[2], KEYS[3])
    return 1
  end
end
return 0
