-- Prepended to the plain layouts' release, break and abandon scripts: tell waiters the lock is
-- free. kind 'list' (python-redis-lock): one element pushed to the signal list, which
-- expires; otherwise dlock's unlock message on the channel.
local function signal_waiters(signal, kind)
  if kind == 'list' then
    redis.call('del', signal)
    redis.call('lpush', signal, 1)
    redis.call('pexpire', signal, 1000)
  else
    redis.call('publish', signal, '0')
  end
end
