-- dlock: a fair waiter gives up its place.
-- KEYS[1] queue list, KEYS[2] waiter deadlines, KEYS[3] the unlock channel.
-- ARGV[1] the acquisition's queue entry. Wakes the waiters when the head left (the
-- next one may go now).
local head = redis.call('lindex', KEYS[1], 0)
redis.call('lrem', KEYS[1], 0, ARGV[1])
redis.call('zrem', KEYS[2], ARGV[1])
if head == ARGV[1] then
  redis.call('publish', KEYS[3], '0')
end
return 0
