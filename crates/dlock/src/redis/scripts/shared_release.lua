-- Remove an acquisition's entry and wake one waiter per freed entry.
-- KEYS: 1 entries hash, 2 expiry zset, 3 channel.
-- ARGV: 1 acquisition, 2 what: a token (that hold only), 'want' (a waiting writer's
-- entry only) or 'any' (whatever the acquisition left: its reply was lost).
-- Returns 1 removed, 0 nothing there.
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local kind, token = string.match(v, '^(%S+) (%d+) ')
if ARGV[2] == 'want' then
  if kind ~= 'want-write' then return 0 end
elseif ARGV[2] ~= 'any' then
  if kind == 'want-write' or token ~= ARGV[2] then return 0 end
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('PUBLISH', KEYS[3], '0')
return 1
