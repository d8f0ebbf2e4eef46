-- dlock Redlock renew on one node.
-- KEYS[1] the lock key, KEYS[2] metadata key, KEYS[3] token key.
-- ARGV[1] owner token, ARGV[2] lease in ms.
-- Returns 1 extended, 0 the key is gone (expired, or the node restarted empty),
-- -1 another owner holds it here.
local v = redis.call('get', KEYS[1])
if v == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  redis.call('pexpire', KEYS[2], ARGV[2])
  redis.call('pexpire', KEYS[3], ARGV[2])
  return 1
end
if v then
  return -1
end
return 0
