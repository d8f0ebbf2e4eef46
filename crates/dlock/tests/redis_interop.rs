//! Layout interoperability on a real redis-server: raw commands play the foreign
//! client's side (Redisson, redis-py, python-redis-lock) and show exclusion in both
//! directions, and that each side's release wakes the other's waiters. Where the real
//! Python peers are installed (pip: redis, python-redis-lock), they run against dlock.
#![cfg(feature = "redis")]

use std::process::Command;
use std::time::{Duration, Instant};

use dlock::Locker;
use dlock_testkit::RedisServer;
use redis::AsyncCommands;

async fn setup(query: &str) -> Option<(RedisServer, Locker, redis::aio::MultiplexedConnection)> {
    let server = RedisServer::start()?;
    let locker = Locker::connect(&format!("{}{query}", server.url()))
        .await
        .expect("connect");
    let client = redis::Client::open(server.url()).expect("client");
    let raw = client
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection");
    Some((server, locker, raw))
}

/// A foreign client's `SET key value NX <unit> ttl`; `Some("OK")` when it got the lock.
async fn set_nx(
    raw: &mut redis::aio::MultiplexedConnection,
    key: &str,
    value: &str,
    unit: &str,
    ttl: u64,
) -> Option<String> {
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg(unit)
        .arg(ttl)
        .query_async(raw)
        .await
        .expect("set")
}

/// Wait for `fut` at most `limit`, returning how long it took.
async fn within<T>(limit: Duration, fut: impl std::future::Future<Output = T>) -> (T, Duration) {
    let start = Instant::now();
    let v = tokio::time::timeout(limit, fut)
        .await
        .expect("took too long");
    (v, start.elapsed())
}

#[tokio::test]
async fn redisson_holder_excludes_dlock_and_its_unlock_message_wakes_dlock() {
    let Some((_server, locker, mut raw)) = setup("").await else {
        return;
    };
    // A Redisson RLock holder: hash at the name, field "<uuid>:<threadId>" -> count.
    let field = "6f1c8a52-0000-4000-8000-000000000001:1";
    let _: () = raw.hset("stock:1", field, 1).await.expect("hset");
    let _: () = raw.pexpire("stock:1", 30_000).await.expect("pexpire");
    assert!(
        locker.try_lock("stock:1").await.expect("try").is_none(),
        "dlock ignored Redisson's hold"
    );
    let info = locker
        .inspect("stock:1")
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.owner, field);

    // A dlock waiter, then Redisson's unlock: delete + publish 0 on its channel.
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock("stock:1").await.expect("lock") }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _: () = raw.del("stock:1").await.expect("del");
    let _: () = raw
        .publish("redisson_lock__channel:{stock:1}", 0)
        .await
        .expect("publish");
    // Woken by the message, far sooner than the 30 s lease.
    let (guard, took) = within(Duration::from_secs(5), waiter).await;
    let guard = guard.expect("join");
    assert!(took < Duration::from_secs(3), "woken after {took:?}");
    guard.release().await.expect("release");
}

#[tokio::test]
async fn dlock_holder_excludes_redisson_and_publishes_redissons_unlock_message() {
    let Some((server, locker, mut raw)) = setup("").await else {
        return;
    };
    let guard = locker.lock("stock:2").await.expect("lock");
    // Redisson's acquire test: the key exists and our field is not in it -> busy.
    let exists: bool = raw.exists("stock:2").await.expect("exists");
    let mine: bool = raw
        .hexists("stock:2", "6f1c8a52-0000-4000-8000-000000000002:7")
        .await
        .expect("hexists");
    assert!(
        exists && !mine,
        "a Redisson client would have taken a dlock-held lock"
    );
    let kind: String = redis::cmd("TYPE")
        .arg("stock:2")
        .query_async(&mut raw)
        .await
        .expect("type");
    assert_eq!(kind, "hash");
    let pttl: i64 = raw.pttl("stock:2").await.expect("pttl");
    assert!(pttl > 0, "no lease on the lock key");
    // The token counter is RFencedLock's.
    let token: u64 = raw
        .get("redisson_lock_token:{stock:2}")
        .await
        .expect("token");
    assert_eq!(token, guard.fencing_token());

    // A Redisson waiter listens on the channel; dlock's release must publish there.
    let client = redis::Client::open(server.url()).expect("client");
    let mut pubsub = client.get_async_pubsub().await.expect("pubsub");
    pubsub
        .subscribe("redisson_lock__channel:{stock:2}")
        .await
        .expect("subscribe");
    guard.release().await.expect("release");
    use futures_util::StreamExt;
    let msg = tokio::time::timeout(Duration::from_secs(5), pubsub.on_message().next())
        .await
        .expect("no unlock message")
        .expect("stream");
    let payload: String = msg.get_payload().expect("payload");
    assert_eq!(payload, "0");
    let exists: bool = raw.exists("stock:2").await.expect("exists");
    assert!(!exists, "release left the hash behind");
}

#[tokio::test]
async fn redis_py_layout_excludes_both_ways() {
    let Some((_server, locker, mut raw)) = setup("?layout=redis-py").await else {
        return;
    };
    // Foreign holder: SET NX PX with a random value.
    let set = set_nx(&mut raw, "job", "foreign-token", "PX", 30_000).await;
    assert_eq!(set.as_deref(), Some("OK"));
    assert!(locker.try_lock("job").await.expect("try").is_none());
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock("job").await.expect("lock") }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Foreign compare-and-delete release (no message): dlock notices by polling.
    let _: () = raw.del("job").await.expect("del");
    let (guard, took) = within(Duration::from_secs(5), waiter).await;
    let guard = guard.expect("join");
    assert!(took < Duration::from_secs(3), "noticed after {took:?}");
    // dlock holds: the foreign SET NX fails; the value is dlock's owner token.
    let set = set_nx(&mut raw, "job", "foreign-token", "PX", 30_000).await;
    assert!(set.is_none(), "foreign client took a dlock-held lock");
    let value: String = raw.get("job").await.expect("get");
    assert_eq!(value, guard.owner().as_str());
    guard.release().await.expect("release");
    let exists: bool = raw.exists("job").await.expect("exists");
    assert!(!exists);
}

#[tokio::test]
async fn python_redis_lock_layout_excludes_both_ways_and_signals() {
    let Some((_server, locker, mut raw)) = setup("?layout=python-redis-lock").await else {
        return;
    };
    let set = set_nx(
        &mut raw,
        "lock:report",
        "Zm9yZWlnbi1pZC0xMjM0NTY3",
        "EX",
        30,
    )
    .await;
    assert_eq!(set.as_deref(), Some("OK"));
    assert!(locker.try_lock("report").await.expect("try").is_none());
    let _: () = raw.del("lock:report").await.expect("del");
    let guard = locker
        .lock_timeout("report", Duration::from_secs(2))
        .await
        .expect("lock after foreign release");
    let set = set_nx(&mut raw, "lock:report", "x", "EX", 30).await;
    assert!(set.is_none(), "foreign client took a dlock-held lock");
    // A python-redis-lock waiter blocks on the signal list; dlock's release pushes to it.
    let blpop = tokio::spawn({
        let mut raw = raw.clone();
        async move {
            let got: Option<(String, String)> =
                raw.blpop("lock-signal:report", 5.0).await.expect("blpop");
            got
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    guard.release().await.expect("release");
    let (got, _) = within(Duration::from_secs(6), blpop).await;
    assert!(
        got.expect("join").is_some(),
        "no signal pushed for python-redis-lock waiters"
    );
}

/// Run a Python snippet; `None` when Python or the module is missing (a skip).
fn python(script: &str, module: &str) -> Option<std::process::Output> {
    let probe = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output();
    if !matches!(probe, Ok(ref o) if o.status.success()) {
        return dlock_testkit::skip(&format!("python3 module {module} not found (pip install)"));
    }
    Some(
        Command::new("python3")
            .args(["-c", script])
            .output()
            .expect("python3"),
    )
}

#[tokio::test]
async fn real_redis_py_lock_against_dlock() {
    let Some((server, locker, _raw)) = setup("?layout=redis-py").await else {
        return;
    };
    let port = server.addr().port();
    // dlock holds: redis-py's Lock cannot acquire.
    let guard = locker.lock("peer").await.expect("lock");
    let script = format!(
        "import redis,sys\nr=redis.Redis(port={port})\nl=r.lock('peer',timeout=30)\n\
         sys.exit(3 if l.acquire(blocking=False) else 0)"
    );
    let Some(out) = tokio::task::spawn_blocking(move || python(&script, "redis"))
        .await
        .expect("join")
    else {
        return;
    };
    assert_eq!(
        out.status.code(),
        Some(0),
        "redis-py acquired a dlock-held lock: {out:?}"
    );
    guard.release().await.expect("release");
    // redis-py holds (for 1.5 s, then releases): dlock waits, then gets it.
    let script = format!(
        "import redis,time\nr=redis.Redis(port={port})\nl=r.lock('peer',timeout=30)\n\
         assert l.acquire(blocking=False)\nprint('held',flush=True)\ntime.sleep(1.5)\nl.release()"
    );
    let mut child = Command::new("python3")
        .args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    assert_eq!(line.trim(), "held");
    assert!(
        locker.try_lock("peer").await.expect("try").is_none(),
        "dlock took redis-py's lock"
    );
    let g = locker
        .lock_timeout("peer", Duration::from_secs(10))
        .await
        .expect("lock after redis-py released");
    g.release().await.expect("release");
    assert!(child.wait().expect("wait").success());
}

#[tokio::test]
async fn real_python_redis_lock_against_dlock() {
    let Some((server, locker, _raw)) = setup("?layout=python-redis-lock").await else {
        return;
    };
    let port = server.addr().port();
    let guard = locker.lock("nightly").await.expect("lock");
    let script = format!(
        "import redis,redis_lock,sys\nr=redis.Redis(port={port})\n\
         l=redis_lock.Lock(r,'nightly',expire=30)\nsys.exit(3 if l.acquire(blocking=False) else 0)"
    );
    let Some(out) = tokio::task::spawn_blocking({
        let script = script.clone();
        move || python(&script, "redis_lock")
    })
    .await
    .expect("join") else {
        return;
    };
    assert_eq!(
        out.status.code(),
        Some(0),
        "python-redis-lock acquired a dlock-held lock: {out:?}"
    );
    // A blocking python-redis-lock waiter is woken by dlock's release (signal list).
    let script = format!(
        "import redis,redis_lock,time\nr=redis.Redis(port={port})\n\
         l=redis_lock.Lock(r,'nightly',expire=30)\nt=time.time()\nassert l.acquire(timeout=10)\n\
         print(round(time.time()-t,3),flush=True)\nl.release()"
    );
    let child = Command::new("python3")
        .args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    tokio::time::sleep(Duration::from_millis(700)).await;
    guard.release().await.expect("release");
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .expect("join")
        .expect("python");
    assert!(out.status.success(), "{out:?}");
    let waited: f64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("seconds");
    assert!(waited < 5.0, "python-redis-lock waiter waited {waited} s");
    assert!(locker.try_lock("nightly").await.expect("try").is_some());
}
