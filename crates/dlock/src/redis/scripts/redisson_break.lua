-- dlock break (an operator's forced release), Redisson layout.
-- KEYS[1] the lock hash, KEYS[2] the unlock channel.
-- ARGV[1] the fencing token of the hold to end (the one `inspect` showed).
-- Ends every hold of that grant (whatever its count) only while it is still the one
-- held: a grant since carries a higher token. Its owner's next renewal finds the hash
-- gone and reports the loss; the next grant increments the counter past the token.
-- Returns 1 when broken, 0 when that grant no longer holds the lock.
if redis.call('hget', KEYS[1], 'dlock:fence') ~= ARGV[1] then
  return 0
end
redis.call('del', KEYS[1])
redis.call('publish', KEYS[2], '0')
return 1
