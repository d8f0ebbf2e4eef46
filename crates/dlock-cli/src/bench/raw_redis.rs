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
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .map_err(err)?;
    Ok(info
        .lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            commands.contains(&name).then_some(stats)
        })
        .filter_map(|stats| {
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum())
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
}
