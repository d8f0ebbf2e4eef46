-- dlock Redlock renew on one node, for one or many grants at once. Never shortens a
-- lease.
-- KEYS: three per grant: its lock key, metadata key, token key.
-- ARGV[1] lease in ms; then two per grant: its owner token and its nonce.
-- Returns one answer per grant, in order: 1 held (extended to at least the lease), 0
-- the key is gone (expired, or the node restarted empty), -1 another grant (of another
-- owner, or a later one of the same owner) holds it here; so does a key another client
-- made another type (read with pcall, whose error is no match: it cannot fail the other
-- grants batched in the same call).
local lease = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS / 3 do
  local lock, meta_key, token = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local owner, nonce = ARGV[2 * i], ARGV[2 * i + 1]
  local v = redis.pcall('get', lock)
  local answer = 0
  if v == owner then
    local meta = redis.pcall('get', meta_key)
    if type(meta) == 'string' and string.find(meta, nonce, 1, true) then
      if redis.call('pttl', lock) < lease then
        redis.call('pexpire', lock, lease)
        redis.call('pexpire', meta_key, lease)
        redis.call('pexpire', token, lease)
      end
      answer = 1
    else
      answer = -1
    end
  elseif v then
    answer = -1
  end
  out[i] = answer
end
return out
