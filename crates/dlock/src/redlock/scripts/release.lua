-- dlock Redlock release on one node (owner-checked).
-- KEYS[1] the lock key, KEYS[2] metadata key, KEYS[3] token key. ARGV[1] owner token.
-- Returns 1 released, 0 not held by this owner here.
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('del', KEYS[1], KEYS[2], KEYS[3])
  return 1
end
return 0
