//! The bench's own bare Redis client: the floors (what the same client crate does with
//! the bare commands of a lock cycle) and the server's command counters.

use std::sync::LazyLock;

use redis::Script;
use redis::aio::ConnectionManager;

use crate::exit::Failure;

/// A `redis://` URL without dlock's query options; `None` for other backends.
pub fn bare_url(url: &str) -> Option<String> {
    url.starts_with("redis://")
        .then(|| url.split('?').next().unwrap_or(url).to_owned())
}

pub fn err(e: redis::RedisError) -> Failure {
    Failure::internal(format!("bench's bare redis client: {e}"))
}

/// A multiplexed, reconnecting connection to `url` (a bare URL), waiting for replies
/// as long as dlock does by default (5 s): the crate's own default, 500 ms, fails a
/// floor on a server that syncs every write where dlock would only wait.
pub async fn connect(url: &str) -> Result<ConnectionManager, Failure> {
    let client = redis::Client::open(url).map_err(err)?;
    let wait = Some(std::time::Duration::from_secs(5));
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_response_timeout(wait)
        .set_connection_timeout(wait);
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(err)
}

static COMPARE_AND_DELETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0",
    )
});

/// One bare lock cycle: `SET key owner NX PX 30000`, then `EVALSHA` compare-and-delete.
pub async fn floor_cycle(
    conn: &mut ConnectionManager,
    key: &str,
    owner: &str,
) -> redis::RedisResult<()> {
    let _: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(owner)
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(conn)
        .await?;
    let _: i64 = COMPARE_AND_DELETE
        .key(key)
        .arg(owner)
        .invoke_async(conn)
        .await?;
    Ok(())
}

/// The least a fenced lock does on Redis: one script grants a free key and draws the
/// next token from a counter in the same step (stored with the owner, so a release or
/// a renewal can tell this grant from a later one); the release is the floor's
/// compare-and-delete. A bare `SET NX PX` cannot draw a token: this is what fencing
/// costs the server beyond the floor.
static FENCED_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('exists', KEYS[1]) == 1 then return 0 end \
         local token = redis.call('incr', KEYS[2]) \
         redis.call('set', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2]) \
         return token",
    )
});

/// One cycle of the least fenced lock (above): grant with a token, compare-and-delete.
pub async fn fenced_cycle(
    conn: &mut ConnectionManager,
    key: &str,
    counter: &str,
    owner: &str,
) -> redis::RedisResult<()> {
    let token: i64 = FENCED_ACQUIRE
        .key(key)
        .key(counter)
        .arg(owner)
        .arg(30_000)
        .invoke_async(conn)
        .await?;
    if token == 0 {
        // A cycle that was not granted must not count as one.
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "the limit's key was taken",
        )));
    }
    let _: i64 = COMPARE_AND_DELETE
        .key(key)
        .arg(format!("{owner}:{token}"))
        .invoke_async(conn)
        .await?;
    Ok(())
}

/// The least fenced lock in Redisson's layout, dlock's default (for interop): the same
/// grant as [`fenced_cycle`]'s, but the hold count under the owner and the token in a
/// hash with a lease, and the hold known by its acquisition, not by its owner alone:
/// where tasks share an owner, a retry after a lost reply must find its own grant (the
/// branch for a taken key, never run by an uncontended cycle) and a release sent twice
/// must not give back another task's hold. The least that takes is the acquisition's
/// nonce beside the token in one field (dlock gives each hold a field of its own, which
/// re-entry by a shared owner needs, and keeps the holder's metadata in it). The
/// release checks both fields, deletes the hash and publishes Redisson's unlock
/// message, which Redisson's waiters need.
static HASH_FENCED_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('exists', KEYS[1]) == 1 then \
           local f = redis.call('hget', KEYS[1], 'dlock:fence') \
           if f and string.sub(f, -#ARGV[3]) == ARGV[3] then \
             return tonumber(string.match(f, '^%d+')) end \
           return 0 end \
         local token = redis.call('incr', KEYS[2]) \
         redis.call('hset', KEYS[1], ARGV[1], '1', 'dlock:fence', token .. ':' .. ARGV[3]) \
         redis.call('pexpire', KEYS[1], ARGV[2]) \
         return token",
    )
});

static HASH_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "local held = redis.call('hmget', KEYS[1], ARGV[1], 'dlock:fence') \
         if not held[1] or held[2] ~= ARGV[2] then return 0 end \
         redis.call('del', KEYS[1]) \
         redis.call('publish', KEYS[2], '0') \
         return 1",
    )
});

/// One cycle of the least fenced lock in Redisson's layout (above); `channel` is where
/// its release publishes, `nonce` this acquisition's (as long as dlock's: 32 hex
/// digits).
pub async fn hash_fenced_cycle(
    conn: &mut ConnectionManager,
    key: &str,
    counter: &str,
    channel: &str,
    owner: &str,
    nonce: &str,
) -> redis::RedisResult<()> {
    let token: i64 = HASH_FENCED_ACQUIRE
        .key(key)
        .key(counter)
        .arg(owner)
        .arg("30000")
        .arg(nonce)
        .invoke_async(conn)
        .await?;
    if token == 0 {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "the layout limit's key was taken",
        )));
    }
    let released: i64 = HASH_RELEASE
        .key(key)
        .key(channel)
        .arg(owner)
        .arg(format!("{token}:{nonce}"))
        .invoke_async(conn)
        .await?;
    if released != 1 {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "the layout limit's release found another hold",
        )));
    }
    Ok(())
}

/// A counted grant in one script, the shape of the npm `redis-semaphore` package's
/// acquire: drop members whose lease ran out, add this one while fewer than the limit
/// are there.
static COUNTED_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "redis.call('zremrangebyscore', KEYS[1], '-inf', ARGV[2] - ARGV[3]) \
         if redis.call('zcard', KEYS[1]) < tonumber(ARGV[4]) then \
         redis.call('zadd', KEYS[1], ARGV[2], ARGV[1]) \
         redis.call('pexpire', KEYS[1], ARGV[3]) return 1 end return 0",
    )
});

/// One bare counted grant (a permit, a read, a write): `EVALSHA` of the script above,
/// then `ZREM`.
pub async fn counted_cycle(
    conn: &mut ConnectionManager,
    key: &str,
    owner: &str,
    now_ms: i64,
    limit: u32,
) -> redis::RedisResult<()> {
    let _: i64 = COUNTED_ACQUIRE
        .key(key)
        .arg(owner)
        .arg(now_ms)
        .arg(30_000)
        .arg(limit)
        .invoke_async(conn)
        .await?;
    let _: i64 = redis::cmd("ZREM")
        .arg(key)
        .arg(owner)
        .query_async(conn)
        .await?;
    Ok(())
}

/// Commands clients sent the server while `work` ran, read from a MONITOR connection:
/// the calls scripts make (`[db lua]` lines) are left out. Counting stops at a marker
/// `ECHO` sent, once `work` is done, on a connection opened before MONITOR started.
pub async fn client_commands_during<T>(
    url: &str,
    work: impl Future<Output = Result<T, Failure>>,
) -> Result<(T, u64), Failure> {
    use futures_util::StreamExt as _;
    let mut marker_conn = connect(url).await?;
    let marker = format!("dlock-bench-count-end-{}", dlock::Owner::random());
    let client = redis::Client::open(url).map_err(err)?;
    let monitor = client.get_async_monitor().await.map_err(err)?;
    let mut counting = tokio::spawn({
        let marker = marker.clone();
        async move {
            let mut lines = monitor.into_on_message::<String>();
            let mut sent = 0u64;
            while let Some(line) = lines.next().await {
                if line.contains(&marker) {
                    return Some(sent);
                }
                if !line.contains(" lua] ") {
                    sent += 1;
                }
            }
            None
        }
    });
    let out = work.await;
    let echoed: redis::RedisResult<String> = redis::cmd("ECHO")
        .arg(&marker)
        .query_async(&mut marker_conn)
        .await;
    let counted = tokio::time::timeout(std::time::Duration::from_secs(10), &mut counting).await;
    // Without the marker the task would read the MONITOR stream for good.
    counting.abort();
    let out = out?;
    echoed.map_err(err)?;
    match counted {
        Ok(Ok(Some(sent))) => Ok((out, sent)),
        _ => Err(Failure::internal(
            "bench's MONITOR connection ended before the count's marker",
        )),
    }
}

/// Calls of the given commands (`INFO commandstats` names without the `cmdstat_`
/// prefix, e.g. `evalsha`) since the server started.
pub async fn command_calls(url: &str, commands: &[&str]) -> Result<u64, Failure> {
    let mut conn = connect(url).await?;
    Ok(command_stats(&mut conn, commands).await?.calls)
}

/// What the server counted for some commands (`INFO commandstats`), summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counted {
    pub calls: u64,
    /// Microseconds the server spent running them (a script's: with the calls it makes).
    pub usec: u64,
}

impl std::ops::Add for Counted {
    type Output = Counted;

    fn add(self, more: Counted) -> Counted {
        Counted {
            calls: self.calls + more.calls,
            usec: self.usec + more.usec,
        }
    }
}

impl std::ops::Sub for Counted {
    type Output = Counted;

    fn sub(self, earlier: Counted) -> Counted {
        Counted {
            calls: self.calls.saturating_sub(earlier.calls),
            usec: self.usec.saturating_sub(earlier.usec),
        }
    }
}

/// [`Counted`] for the given commands (`INFO commandstats` names without the
/// `cmdstat_` prefix, e.g. `evalsha`) since the server started.
pub async fn command_stats(
    conn: &mut ConnectionManager,
    commands: &[&str],
) -> Result<Counted, Failure> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .map_err(err)?;
    Ok(counted_in(&info, commands))
}

fn counted_in(info: &str, commands: &[&str]) -> Counted {
    let field = |stats: &str, key: &str| {
        stats
            .split(',')
            .find_map(|kv| kv.strip_prefix(key))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            commands.contains(&name).then_some(stats)
        })
        .fold(Counted::default(), |sum, stats| Counted {
            calls: sum.calls + field(stats, "calls="),
            usec: sum.usec + field(stats, "usec="),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_urls() {
        assert_eq!(
            bare_url("redis://h:1/0?layout=redis-py").as_deref(),
            Some("redis://h:1/0")
        );
        assert_eq!(bare_url("sqlite:///x.db"), None);
    }

    #[test]
    fn command_stats_are_read_and_summed() {
        let info = "# Commandstats\r\n\
            cmdstat_set:calls=4,usec=10,usec_per_call=2.50,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_evalsha:calls=6,usec=90,usec_per_call=15.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_hset:calls=6,usec=12,usec_per_call=2.00\r\n";
        let both = counted_in(info, &["set", "evalsha", "eval"]);
        assert_eq!(
            both,
            Counted {
                calls: 10,
                usec: 100
            }
        );
        assert_eq!(counted_in(info, &["evalsha"]).usec, 90);
        assert_eq!(counted_in(info, &["info"]), Counted::default());
        let later = Counted {
            calls: 12,
            usec: 130,
        };
        assert_eq!(later - both, Counted { calls: 2, usec: 30 });
    }
}
