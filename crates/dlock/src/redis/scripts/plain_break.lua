-- dlock break (an operator's forced release), plain-string layouts.
-- KEYS[1] the lock key, KEYS[2] where to signal waiters, KEYS[3] dlock's metadata key,
-- KEYS[4] dlock's token counter.
-- ARGV[1] the fencing token of the hold to end (the one `inspect` showed),
-- ARGV[2] signal kind: 'publish' or 'list' (python-redis-lock), as for a release.
-- Ends the hold only while it is a dlock grant (dlock's metadata key, written with
-- every grant and gone with it, is there: a foreign client such as redis-py never
-- writes it nor counts tokens) and no grant came since (the counter still shows its
-- token); its owner's next renewal finds the key gone. Returns 1 when broken, else 0.
if redis.call('exists', KEYS[1]) == 0 or redis.call('exists', KEYS[3]) == 0
    or redis.call('get', KEYS[4]) ~= ARGV[1] then
  return 0
end
redis.call('del', KEYS[1], KEYS[3])
signal_waiters(KEYS[2], ARGV[2])
return 1
