-- dlock renew, plain-string layouts, many locks per call.
-- KEYS[2i-1] a lock key, KEYS[2i] its metadata key; ARGV[2i-1] owner token, ARGV[2i] lease ms.
local out = {}
for i = 1, #KEYS / 2 do
  local lock, meta = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('get', lock) == ARGV[2 * i - 1] then
    local lease = tonumber(ARGV[2 * i])
    if redis.call('pttl', lock) < lease then
      redis.call('pexpire', lock, lease)
      redis.call('pexpire', meta, lease)
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
