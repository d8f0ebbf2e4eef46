-- Extend a held permit, read or write, never shortening it.
-- KEYS: 1 entries hash, 2 expiry zset. ARGV: 1 acquisition, 2 token, 3 ttl ms.
-- Returns 1 renewed, 0 no longer held.
if redis.replicate_commands then redis.replicate_commands() end
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local kind, token = string.match(v, '^(%S+) (%d+) ')
if kind == 'want-write' or token ~= ARGV[2] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ends = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or 0)
if ends <= now then return 0 end
local new_end = math.max(ends, now + tonumber(ARGV[3]))
redis.call('ZADD', KEYS[2], new_end, ARGV[1])
local ms = math.floor(new_end - now) + 1000
if redis.call('PTTL', KEYS[1]) < ms then
  redis.call('PEXPIRE', KEYS[1], ms)
  redis.call('PEXPIRE', KEYS[2], ms)
end
return 1
