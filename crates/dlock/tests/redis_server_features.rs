//! Redis server features around the lock: replica acknowledgement (`min_replicas`),
//! a least-privilege ACL user, passwords kept out of every message, and fencing
//! durability reported from the server's persistence settings.
#![cfg(feature = "redis")]

use std::time::Duration;

use dlock::{Error, Fencing, Locker};
use dlock_testkit::{RedisOptions, RedisServer, redis_command};

const T: Duration = Duration::from_secs(2);

/// The commands dlock needs, as an ACL rule (also in the README).
const DLOCK_ACL: &str = "+evalsha +eval +script|load +publish +subscribe +unsubscribe +ping \
     +hgetall +pttl +get +wait +exists +incr +hset +hexists +hincrby +hget +hmget +hdel +pexpire \
     +del +set +lpush +zcard +lindex +lpop +lrem +rpush +zscore +zrem +zadd +time +pubsub|numsub \
     +zrange +zrangebyscore +zremrangebyscore";

#[tokio::test]
async fn min_replicas_waits_for_a_replica_and_refuses_without_enough() {
    let Some(master) = RedisServer::start() else {
        return;
    };
    let Some(replica) = RedisServer::start_with(RedisOptions {
        extra_args: vec![
            "--replicaof".into(),
            "127.0.0.1".into(),
            master.addr().port().to_string(),
        ],
        ..RedisOptions::default()
    }) else {
        return;
    };
    // Wait until the replica is in sync.
    let end = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let info = redis_command(replica.addr(), &["INFO", "replication"], T).unwrap_or_default();
        if String::from_utf8_lossy(&info).contains("master_link_status:up") {
            break;
        }
        assert!(std::time::Instant::now() < end, "replica never synced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let one = Locker::connect(&format!("{}?min_replicas=1", master.url()))
        .await
        .expect("connect");
    let g = one
        .lock("replicated")
        .await
        .expect("acknowledged by one replica");
    g.release().await.expect("release");

    let two = Locker::connect(&format!(
        "{}?min_replicas=2&wait_timeout=200ms",
        master.url()
    ))
    .await
    .expect("connect");
    let err = two
        .lock_timeout("replicated", Duration::from_secs(3))
        .await
        .expect_err("only one replica");
    assert!(
        matches!(
            err,
            Error::NoQuorum {
                granted: 1,
                needed: 2,
                ..
            }
        ),
        "{err}"
    );
    // The refused grant was given back.
    assert!(one.inspect("replicated").await.expect("inspect").is_none());
    // Permits and writes wait for replicas too, and a refused one is given back.
    let permit = one
        .semaphore("replicated", 1)
        .acquire()
        .await
        .expect("permit");
    permit.release().await.expect("release");
    for refused in [
        two.semaphore("replicated", 1)
            .acquire_timeout(Duration::from_secs(3))
            .await,
        two.rwlock("replicated")
            .write_timeout(Duration::from_secs(3))
            .await,
    ] {
        let err = refused.expect_err("only one replica");
        assert!(matches!(err, Error::NoQuorum { needed: 2, .. }), "{err}");
    }
    let again = one
        .semaphore("replicated", 1)
        .try_acquire()
        .await
        .expect("try");
    assert!(again.is_some(), "a refused permit was left held");
    let again = one.rwlock("replicated").try_write().await.expect("try");
    assert!(again.is_some(), "a refused write was left held");
    drop(replica);
}

#[tokio::test]
async fn least_privilege_acl_user_is_enough() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut args = vec![
        "ACL",
        "SETUSER",
        "locker",
        "on",
        ">s3cretMARKER",
        "~*",
        "&*",
        "resetchannels",
        "&*",
        "-@all",
    ];
    let rules: Vec<&str> = DLOCK_ACL.split_whitespace().collect();
    args.extend(rules);
    let ok = redis_command(server.addr(), &args, T).expect("ACL SETUSER");
    assert_eq!(ok, b"+OK\r\n", "{}", String::from_utf8_lossy(&ok));
    let url = format!("redis://locker:s3cretMARKER@{}", server.addr());
    let a = Locker::connect(&url)
        .await
        .expect("connect as the ACL user");
    let b = Locker::connect(&url)
        .await
        .expect("connect as the ACL user");
    // CONFIG is not allowed: fencing is reported as best effort, not assumed durable.
    assert_eq!(a.capabilities().fencing, Fencing::BestEffort);
    let g = a.lock("acl").await.expect("lock");
    assert!(b.try_lock("acl").await.expect("try").is_none());
    let info = b.inspect("acl").await.expect("inspect").expect("held");
    assert_eq!(info.fencing_token, g.fencing_token());
    g.extend(Duration::from_secs(20)).await.expect("renew");
    // A waiter (pub/sub) is woken by the release.
    let waiter = tokio::spawn(async move { b.lock("acl").await.map(|g| g.fencing_token()) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    g.release().await.expect("release");
    let t = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect("waiter not woken")
        .expect("join")
        .expect("lock");
    assert!(t > info.fencing_token);
    // So do semaphores and read-write locks.
    let permit = a.semaphore("acl-sem", 1).acquire().await.expect("permit");
    permit.extend(Duration::from_secs(20)).await.expect("renew");
    permit.release().await.expect("release");
    let read = a.rwlock("acl-rw").read().await.expect("read");
    read.release().await.expect("release");
    let write = a.rwlock("acl-rw").write().await.expect("write");
    write.release().await.expect("release");
    // Fair mode works with the same rule.
    let fair = dlock::LockOptions::new().fair(true);
    let g = a.lock_with("acl-fair", &fair).await.expect("fair lock");
    a.inspect("acl-fair").await.expect("inspect").expect("held");
    g.release().await.expect("release");
    // Nothing shows the password.
    assert!(!format!("{a:?}").contains("s3cretMARKER"));
    let bad = Locker::connect(&format!("redis://locker:wrongMARKER@{}", server.addr()))
        .await
        .expect_err("wrong password");
    assert!(!bad.to_string().contains("wrongMARKER"), "{bad}");
    assert!(!format!("{bad:?}").contains("wrongMARKER"));
}

#[tokio::test]
async fn fencing_is_durable_only_with_appendfsync_always() {
    let Some(plain) = RedisServer::start() else {
        return;
    };
    let l = Locker::connect(&plain.url()).await.expect("connect");
    assert_eq!(l.capabilities().fencing, Fencing::BestEffort);
    let Some(persistent) = RedisServer::start_with(RedisOptions {
        persistent: true,
        ..RedisOptions::default()
    }) else {
        return;
    };
    let l = Locker::connect(&persistent.url()).await.expect("connect");
    assert_eq!(l.capabilities().fencing, Fencing::Durable);
}

#[tokio::test]
async fn fencing_survives_a_restart_with_persistence() {
    let Some(mut server) = RedisServer::start_with(RedisOptions {
        persistent: true,
        ..RedisOptions::default()
    }) else {
        return;
    };
    let l = Locker::connect(&server.url()).await.expect("connect");
    let g = l.lock("durable").await.expect("lock");
    let before = g.fencing_token();
    g.release().await.expect("release");
    drop(l);
    server.restart();
    let l = Locker::connect(&server.url()).await.expect("reconnect");
    let g = l.lock("durable").await.expect("lock after restart");
    assert!(
        g.fencing_token() > before,
        "token {} after {before}",
        g.fencing_token()
    );
}

/// A Sentinel failover under a held lock. Redis replication is asynchronous, so what
/// happens to the lock is reported rather than promised; the test asserts only that
/// the deployment recovers (a new holder within lease + failover time) and prints what
/// it observed: whether the lock survived on the promoted replica, whether the old
/// holder kept it, and the token order.
#[tokio::test]
async fn sentinel_failover_reports_what_happens_to_a_held_lock() {
    use dlock::{LockOptions, Wait};
    use dlock_testkit::RedisSentinel;
    let Some(mut setup) = RedisSentinel::start() else {
        return;
    };
    let url = setup.url();
    let holder = Locker::connect(&url).await.expect("connect");
    let ttl = Duration::from_secs(3);
    let guard = holder
        .lock_with("failover", &LockOptions::new().ttl(ttl))
        .await
        .expect("lock");
    let token = guard.fencing_token();
    // Give replication a moment, as an application would not.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let old_master = setup.servers()[0].addr();
    setup.servers()[0].process().kill();
    let killed = std::time::Instant::now();
    let promoted = loop {
        match setup.master_addr() {
            Some(a) if a != old_master => break a,
            _ => {}
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "no failover within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let failover = killed.elapsed();
    // Right after the switch, Sentinel may not yet confirm the promoted node as master:
    // that is a retryable error; keep trying for a while.
    let other = loop {
        match Locker::connect(&url).await {
            Ok(l) => break l,
            Err(e) if e.is_retryable() && killed.elapsed() < Duration::from_secs(40) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("connect after failover: {e}"),
        }
    };
    let survived = other.inspect("failover").await.ok().flatten();
    let start = std::time::Instant::now();
    let next = other
        .lock_with(
            "failover",
            &LockOptions::new().wait(Wait::Timeout(ttl + Duration::from_secs(10))),
        )
        .await
        .expect("the lock must be obtainable again after the failover");
    let waited = start.elapsed();
    let old_still_held = guard.is_held();
    eprintln!(
        "sentinel failover report: promoted {promoted} after {failover:?}; lock on the new \
         master before the new grant: {}; new holder after a further {waited:?}; old holder \
         believes it holds: {old_still_held} (loss: {:?}); token {token} -> {} ({})",
        survived.as_ref().map_or("gone".to_owned(), |i| format!(
            "held by the old owner, token {}",
            i.fencing_token
        )),
        guard.loss_reason(),
        next.fencing_token(),
        if next.fencing_token() > token {
            "increasing"
        } else {
            "NOT increasing: best-effort fencing"
        },
    );
    // Whatever replication lost, the two holders did not both keep their leases: if the
    // lock survived, the new grant waited for the old lease (and the old holder's loss).
    if survived.is_some() && next.fencing_token() > token {
        assert!(!old_still_held || waited < ttl, "both hold");
    }
    next.release().await.expect("release");
}

fn script_calls(server: &RedisServer) -> u64 {
    calls(server, &["evalsha", "eval"])
}

/// Calls of `commands` the server counted (`INFO commandstats`).
fn calls(server: &RedisServer, commands: &[&str]) -> u64 {
    let info = redis_command(server.addr(), &["INFO", "commandstats"], T).expect("INFO");
    String::from_utf8_lossy(&info)
        .lines()
        .filter(|l| {
            commands.iter().any(|c| {
                l.strip_prefix("cmdstat_")
                    .and_then(|r| r.strip_prefix(c))
                    .is_some_and(|r| r.starts_with(':'))
            })
        })
        .filter_map(|l| {
            l.split(',')
                .find_map(|kv| kv.split(':').next_back()?.strip_prefix("calls="))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum()
}

/// Renewals of many held locks are batched: far fewer renew commands than renewals,
/// and every lock survives several leases.
#[tokio::test]
async fn renewals_of_many_locks_are_batched() {
    use dlock::LockOptions;
    let Some(server) = RedisServer::start() else {
        return;
    };
    let locker = Locker::connect(&server.url()).await.expect("connect");
    let opts = LockOptions::new().ttl(Duration::from_millis(600));
    let n = 2000;
    let mut guards = Vec::new();
    for i in 0..n {
        guards.push(
            locker
                .lock_with(&format!("many:{i}"), &opts)
                .await
                .expect("lock"),
        );
    }
    let before = script_calls(&server);
    let hold = Duration::from_millis(1800);
    tokio::time::sleep(hold).await;
    let calls = script_calls(&server) - before;
    let lost = guards.iter().filter(|g| !g.is_held()).count();
    assert_eq!(lost, 0, "{lost} of {n} locks lost while renewing");
    // Each lock renews every 200 ms: about 9 renewals each in 1.8 s.
    let renewals = n * 8;
    assert!(
        calls * 4 < renewals,
        "{calls} renew commands for about {renewals} renewals: not batched"
    );
    eprintln!("{n} locks held {hold:?}: {calls} renew commands for ~{renewals} renewals");
}

/// A held lock whose key another client made another type — a Redisson hash where a
/// plain-layout lock was, a string where a Redisson-layout one was (the layouts keep
/// out of each other's way only by the key's existence) — is told it lost the lock at
/// its next renewal, and the locks renewed in the same batched call are not disturbed.
#[tokio::test]
async fn a_lock_whose_key_changed_type_is_told_without_disturbing_its_batch() {
    use dlock::{LockOptions, LossReason};
    let Some(server) = RedisServer::start() else {
        return;
    };
    for (layout, retype) in [
        ("redis-py", ["HSET", "f", "1"]),
        ("redisson", ["SET", "x", ""]),
    ] {
        let locker = Locker::connect(&format!("{}?layout={layout}", server.url()))
            .await
            .expect("connect");
        let opts = LockOptions::new().ttl(Duration::from_millis(900));
        let name = format!("retyped:{layout}");
        let victim = locker.lock_with(&name, &opts).await.expect("lock");
        let mut others = Vec::new();
        for i in 0..20 {
            let other = locker
                .lock_with(&format!("batched:{layout}:{i}"), &opts)
                .await
                .expect("lock");
            others.push(other);
        }
        redis_command(server.addr(), &["DEL", &name], Duration::from_secs(2)).expect("DEL");
        let args: Vec<&str> = match retype {
            ["HSET", field, value] => vec!["HSET", &name, field, value],
            [cmd, value, _] => vec![cmd, &name, value],
        };
        redis_command(server.addr(), &args, Duration::from_secs(2)).expect("retype");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            victim.loss_reason(),
            Some(LossReason::NotOwner),
            "{layout}: the lock whose key changed type"
        );
        let lost = others.iter().filter(|g| !g.is_held()).count();
        assert_eq!(
            lost, 0,
            "{layout}: {lost} of 20 locks renewed beside it were lost"
        );
        for other in others {
            other.release().await.expect("release");
        }
    }
}

/// A Redis server, a fault proxy in front of it, a locker through the proxy and one
/// straight to the server (both with the URL options `query`). The scripts are loaded
/// through the proxy first: an EVALSHA answered NOSCRIPT while replies are dropped
/// would never run.
struct Proxied {
    server: RedisServer,
    proxy: dlock_testkit::FaultProxy,
    locker: Locker,
    direct: Locker,
}

impl Proxied {
    async fn start(query: &str) -> Option<Proxied> {
        let server = RedisServer::start()?;
        let proxy = dlock_testkit::FaultProxy::start(server.addr())
            .await
            .expect("proxy");
        let locker = Locker::connect(&format!("redis://{}?{query}", proxy.addr()))
            .await
            .expect("connect through the proxy");
        let direct = Locker::connect(&format!("{}?{query}", server.url()))
            .await
            .expect("connect");
        locker
            .lock("warm-up")
            .await
            .expect("lock")
            .release()
            .await
            .expect("release");
        Some(Proxied {
            server,
            proxy,
            locker,
            direct,
        })
    }
}

/// Subscribers on `channel`, as the server counts them.
fn subscribers(server: &RedisServer, channel: &str) -> u64 {
    dlock_testkit::redis_subscribers(server.addr(), channel).expect("PUBSUB NUMSUB")
}

/// Wait until `name` is held, as `direct` sees it (at most 5 s).
async fn until_held(direct: &Locker, name: &str, layout: &str) {
    let end = std::time::Instant::now() + Duration::from_secs(5);
    while direct.inspect(name).await.expect("inspect").is_none() {
        assert!(
            std::time::Instant::now() < end,
            "{layout}: the acquisition never reached the server"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The connection dies after the server ran the acquire script but before its reply
/// arrived: the retry finds that grant (same nonce) instead of orphaning it or taking
/// a second hold, so one release frees the lock.
#[tokio::test]
async fn reply_lost_mid_acquire_leaves_no_orphan() {
    use dlock_testkit::Fault;
    for layout in ["redisson", "redis-py"] {
        let Some(t) = Proxied::start(&format!("layout={layout}")).await else {
            return;
        };
        let (proxy, locker, direct) = (&t.proxy, &t.locker, &t.direct);
        proxy.set(Fault::DropReplies);
        let acquiring = tokio::spawn({
            let locker = locker.clone();
            async move {
                locker
                    .lock_timeout("lost-reply", Duration::from_secs(10))
                    .await
            }
        });
        // Wait until the server has granted (the reply is being dropped).
        until_held(direct, "lost-reply", layout).await;
        proxy.set(Fault::None);
        proxy.reset_all();
        let guard = tokio::time::timeout(Duration::from_secs(10), acquiring)
            .await
            .expect("acquire hung")
            .expect("join")
            .expect("the grant must be recovered");
        let info = direct
            .inspect("lost-reply")
            .await
            .expect("inspect")
            .expect("held");
        assert_eq!(info.owner, guard.owner().as_str(), "{layout}");
        assert_eq!(info.holds, 1, "{layout}: the retry took a second hold");
        assert_eq!(info.fencing_token, guard.fencing_token(), "{layout}");
        guard.release().await.expect("release");
        let again = direct
            .try_lock("lost-reply")
            .await
            .expect("try")
            .unwrap_or_else(|| panic!("{layout}: orphaned after one release"));
        again.release().await.expect("release");
    }
}

/// The connection dies while a lock is held: the release's first copy fails on it.
/// On the Redisson layout the release is sent again (it is keyed by the hold's own
/// field, so a second copy can give back nothing else), and the lock is free at once
/// rather than at the end of its 30 s lease; the same when the release's reply is lost
/// after it ran (the copy after it answers "not held") and the same owner holds the
/// lock again meanwhile (that hold stays).
#[tokio::test]
async fn a_release_cut_off_by_a_dropped_connection_is_sent_again() {
    use dlock::LockOptions;
    use dlock_testkit::Fault;
    let Some(t) = Proxied::start("layout=redisson").await else {
        return;
    };
    let (proxy, locker, direct) = (&t.proxy, &t.locker, &t.direct);
    let ttl = LockOptions::new().ttl(Duration::from_secs(30));
    for round in 0..3 {
        let guard = locker.lock_with("cut-release", &ttl).await.expect("lock");
        proxy.reset_all();
        guard
            .release()
            .await
            .unwrap_or_else(|e| panic!("round {round}: the release was not sent again: {e}"));
        let again = direct
            .try_lock("cut-release")
            .await
            .expect("try")
            .unwrap_or_else(|| panic!("round {round}: still held after its release"));
        again.release().await.expect("release");
    }
    // The reply of a release that ran is lost; meanwhile a second hold of the same
    // owner (re-entered) stays: the copy sent again must not give it back.
    let owner = LockOptions::new()
        .ttl(Duration::from_secs(30))
        .owner("cut-release-owner".parse().expect("owner"));
    let first = locker.lock_with("cut-twice", &owner).await.expect("lock");
    let second = locker
        .lock_with("cut-twice", &owner)
        .await
        .expect("re-enter");
    proxy.set(Fault::DropReplies);
    let releasing = tokio::spawn(async move { first.release().await });
    let end = std::time::Instant::now() + Duration::from_secs(5);
    while direct
        .inspect("cut-twice")
        .await
        .expect("inspect")
        .map(|i| i.holds)
        != Some(1)
    {
        assert!(std::time::Instant::now() < end, "the release never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.set(Fault::None);
    proxy.reset_all();
    tokio::time::timeout(Duration::from_secs(10), releasing)
        .await
        .expect("the release hung")
        .expect("join")
        .expect("the release whose reply was lost was not sent again");
    let info = direct
        .inspect("cut-twice")
        .await
        .expect("inspect")
        .expect("the second hold was given back by a copy of the first's release");
    assert_eq!(info.holds, 1);
    assert!(second.is_held());
    second.release().await.expect("release");
    assert!(
        direct
            .inspect("cut-twice")
            .await
            .expect("inspect")
            .is_none()
    );
}

/// A release whose reply never comes (the connection open, nothing answered) times out
/// and is not sent again: its caller waits one timeout (1 s here), not three.
#[tokio::test]
async fn a_release_that_timed_out_is_not_sent_again() {
    use dlock::LockOptions;
    use dlock_testkit::Fault;
    let Some(t) = Proxied::start("timeout=1s&layout=redisson").await else {
        return;
    };
    let ttl = LockOptions::new().ttl(Duration::from_secs(30));
    let guard = t
        .locker
        .lock_with("timed-out-release", &ttl)
        .await
        .expect("lock");
    t.proxy.set(Fault::Blackhole);
    let started = std::time::Instant::now();
    let e = guard
        .release()
        .await
        .expect_err("nothing answers: the release cannot succeed");
    let took = started.elapsed();
    t.proxy.set(Fault::None);
    assert!(e.is_retryable(), "{e}");
    assert!(
        took < Duration::from_millis(2500),
        "the release took {took:?}: sent again after it timed out"
    );
}

/// The same with a task of this process waiting: the release is an in-process hand-off,
/// cut off by the dropped connection — before it reached the server, or after it ran
/// (its reply lost). The releasing hold's own release follows it and answers, so the
/// release succeeds and the waiter gets the lock soon — at once, or once the lost
/// reply has timed out (5 s), handed over (recovered by the hand-off's nonce) or
/// released to everyone — rather than when the 60 s lease ends.
#[tokio::test]
async fn a_hand_off_cut_off_by_a_dropped_connection_still_frees_the_lock() {
    use dlock::LockOptions;
    use dlock_testkit::Fault;
    let Some(t) = Proxied::start("layout=redisson").await else {
        return;
    };
    let (proxy, locker, direct) = (&t.proxy, &t.locker, &t.direct);
    let ttl = LockOptions::new().ttl(Duration::from_secs(60));
    for round in 0..4 {
        let ran = round % 2 == 1;
        // A name per round: its unlock channel has no subscriber left from before.
        let name = format!("cut-hand-off-{round}");
        let held = locker.lock_with(&name, &ttl).await.expect("lock");
        let holder = held.owner().as_str().to_owned();
        let waiter = tokio::spawn({
            let (locker, ttl, name) = (locker.clone(), ttl.clone(), name.clone());
            async move {
                let opts = ttl.wait(dlock::Wait::Timeout(Duration::from_secs(30)));
                let started = std::time::Instant::now();
                let got = locker.lock_with(&name, &opts).await;
                (got, started.elapsed())
            }
        });
        // The waiter has subscribed, tried again (stating what it wants: in line for a
        // hand-off) and waits for the release.
        let channel = format!("redisson_lock__channel:{{{name}}}");
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while subscribers(&t.server, &channel) == 0 {
            assert!(
                std::time::Instant::now() < end,
                "the waiter never subscribed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let released = if ran {
            // The hand-off runs; its reply is lost.
            proxy.set(Fault::DropReplies);
            let releasing = tokio::spawn(held.release());
            let end = std::time::Instant::now() + Duration::from_secs(10);
            while direct
                .inspect(&name)
                .await
                .expect("inspect")
                .is_none_or(|i| i.owner == holder)
            {
                assert!(
                    std::time::Instant::now() < end,
                    "round {round}: the hand-off never ran"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            proxy.set(Fault::None);
            proxy.reset_all();
            tokio::time::timeout(Duration::from_secs(10), releasing)
                .await
                .expect("the release hung")
                .expect("join")
        } else {
            proxy.reset_all();
            held.release().await
        };
        released.unwrap_or_else(|e| panic!("round {round}: the release failed: {e}"));
        let (got, waited) = tokio::time::timeout(Duration::from_secs(35), waiter)
            .await
            .expect("the waiter hung")
            .expect("join");
        let got = got.unwrap_or_else(|e| panic!("round {round}: the waiter failed: {e}"));
        assert!(
            waited < Duration::from_secs(20),
            "round {round}: the waiter got the lock only after {waited:?} (at the lease's end)"
        );
        let info = direct
            .inspect(&name)
            .await
            .expect("inspect")
            .expect("held by the waiter");
        assert_eq!(info.holds, 1, "round {round}");
        assert_eq!(info.owner, got.owner().as_str(), "round {round}");
        assert_eq!(info.fencing_token, got.fencing_token(), "round {round}");
        got.release().await.expect("release");
        assert!(
            direct.inspect(&name).await.expect("inspect").is_none(),
            "round {round}: an orphan is left"
        );
    }
}

/// Every reply of an attempt is lost, its first try was granted, and the attempt gives
/// up with an error: no guard owns that grant, so once the server answers again it is
/// given back, long before its 30 s lease would have freed the lock.
#[tokio::test]
async fn an_attempt_that_fails_after_lost_replies_leaves_no_orphan() {
    use dlock::LockOptions;
    use dlock_testkit::Fault;
    for layout in ["redisson", "redis-py"] {
        let Some(t) = Proxied::start(&format!("timeout=1s&layout={layout}")).await else {
            return;
        };
        let (proxy, locker, direct) = (&t.proxy, &t.locker, &t.direct);
        proxy.set(Fault::DropReplies);
        let attempt = tokio::spawn({
            let locker = locker.clone();
            let ttl = LockOptions::new().ttl(Duration::from_secs(30));
            async move { locker.try_lock_with("lost-replies", &ttl).await }
        });
        // The first try is granted (its reply is dropped).
        until_held(direct, "lost-replies", layout).await;
        let failed = tokio::time::timeout(Duration::from_secs(20), attempt)
            .await
            .expect("the attempt hung")
            .expect("join");
        assert!(
            failed.is_err(),
            "{layout}: every reply was lost: {failed:?}"
        );
        proxy.set(Fault::None);
        proxy.reset_all();
        let end = std::time::Instant::now() + Duration::from_secs(10);
        let guard = loop {
            if let Some(g) = direct.try_lock("lost-replies").await.expect("try") {
                break g;
            }
            assert!(
                std::time::Instant::now() < end,
                "{layout}: the failed attempt's grant was never given back"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        guard.release().await.expect("release");
    }
}

/// Fair mode: a waiter that died in the queue (its entry never refreshed) holds up the
/// queue only until its deadline.
#[tokio::test]
async fn a_dead_fair_waiter_blocks_only_until_its_deadline() {
    use dlock::{LockOptions, Wait};
    let Some(server) = RedisServer::start() else {
        return;
    };
    let locker = Locker::connect(&server.url()).await.expect("connect");
    let fair = LockOptions::new().fair(true);
    let holder = locker.lock_with("fair-dead", &fair).await.expect("lock");
    // A crashed waiter: at the head of the queue, deadline 800 ms from now.
    let time = redis_command(server.addr(), &["TIME"], T).expect("TIME");
    let text = String::from_utf8_lossy(&time).into_owned();
    let nums: Vec<u64> = text
        .split("\r\n")
        .filter_map(|l| l.parse::<u64>().ok())
        .collect();
    let now_ms = nums[0] * 1000 + nums[1] / 1000;
    let queue = "dlock_lock_queue:{fair-dead}";
    let deadlines = "dlock_lock_timeout:{fair-dead}";
    redis_command(server.addr(), &["RPUSH", queue, "dead-waiter"], T).expect("rpush");
    let deadline = (now_ms + 800).to_string();
    redis_command(
        server.addr(),
        &["ZADD", deadlines, &deadline, "dead-waiter"],
        T,
    )
    .expect("zadd");
    let waiter = tokio::spawn({
        let locker = locker.clone();
        let opts = fair.clone().wait(Wait::Timeout(Duration::from_secs(10)));
        async move {
            let start = std::time::Instant::now();
            let g = locker.lock_with("fair-dead", &opts).await?;
            Ok::<_, Error>((g, start.elapsed()))
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    holder.release().await.expect("release");
    let (g, took) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("waiter stuck behind a dead entry")
        .expect("join")
        .expect("lock");
    // The dead entry expires 800 ms after it was written; the live waiter re-checks
    // at least every ~1.7 s.
    assert!(
        took < Duration::from_millis(3000),
        "waited {took:?} behind a dead waiter"
    );
    let info = locker
        .inspect("fair-dead")
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.waiters, Some(0), "the dead entry is still queued");
    g.release().await.expect("release");
}

/// `rediss://`: the server is verified against `ca_file` (an unrelated CA is refused),
/// and a server that requires client certificates admits only a client that has one.
#[tokio::test]
async fn tls_verifies_the_server_and_presents_a_client_certificate() {
    let Some(server) = RedisServer::start_with(RedisOptions {
        tls: true,
        extra_args: vec!["--tls-auth-clients".into(), "yes".into()],
        ..RedisOptions::default()
    }) else {
        return;
    };
    let (port, certs) = server.tls().expect("TLS port");
    let p = |p: &std::path::Path| p.display().to_string();
    let base = format!("rediss://127.0.0.1:{port}?timeout=2s");
    let with_cert = format!(
        "{base}&ca_file={}&cert_file={}&key_file={}",
        p(&certs.ca),
        p(&certs.client_cert),
        p(&certs.client_key)
    );
    let locker = Locker::connect(&with_cert).await.expect("TLS connect");
    let guard = locker.lock("over-tls").await.expect("lock over TLS");
    assert!(guard.fencing_token() > 0);
    // The plain port sees the same lock: it is the same server.
    let held = redis_command(server.addr(), &["EXISTS", "over-tls"], T).expect("plain");
    assert_eq!(String::from_utf8_lossy(&held).trim(), ":1");
    guard.release().await.expect("release over TLS");

    // Without a client certificate the server refuses the handshake.
    let no_cert = format!("{base}&ca_file={}", p(&certs.ca));
    let e = Locker::connect(&no_cert).await.expect_err("no client cert");
    assert!(matches!(e, Error::Connection { .. }), "{e:?}");
    // A CA that did not sign the server's certificate: the client refuses the server.
    let wrong_ca = format!(
        "{base}&ca_file={}&cert_file={}&key_file={}",
        p(&certs.other_ca),
        p(&certs.client_cert),
        p(&certs.client_key)
    );
    let e = Locker::connect(&wrong_ca).await.expect_err("unknown CA");
    assert!(matches!(e, Error::Connection { .. }), "{e:?}");
    // Plain text to the TLS port is not silently accepted either.
    let e = Locker::connect(&format!("redis://127.0.0.1:{port}?timeout=1s"))
        .await
        .expect_err("plain text to a TLS port");
    assert!(
        e.is_retryable() || matches!(e, Error::Backend { .. }),
        "{e:?}"
    );
}

/// A user without rights on the unlock channel (no `&` channel pattern) cannot
/// subscribe: a contended `lock()` falls back to polling and gets the lock once it is
/// released, instead of failing with the pub/sub error.
#[tokio::test]
async fn without_channel_rights_waiting_falls_back_to_polling() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut args = vec![
        "ACL",
        "SETUSER",
        "nochannels",
        "on",
        ">pw",
        "~*",
        "resetchannels",
        "-@all",
    ];
    args.extend(DLOCK_ACL.split_whitespace());
    let ok = redis_command(server.addr(), &args, T).expect("ACL SETUSER");
    assert_eq!(ok, b"+OK\r\n", "{}", String::from_utf8_lossy(&ok));
    let url = format!("redis://nochannels:pw@{}?poll=20ms", server.addr());
    let holder = Locker::connect(&server.url()).await.expect("connect");
    let waiter = Locker::connect(&url).await.expect("connect as the user");
    let held = holder.lock("no-pubsub").await.expect("lock");
    let waiting = tokio::spawn(async move {
        waiter
            .lock_timeout("no-pubsub", Duration::from_secs(10))
            .await
            .map(|g| g.fencing_token())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let token = held.fencing_token();
    held.release().await.expect("release");
    let got = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiter never got the lock")
        .expect("join");
    assert!(
        matches!(got, Ok(t) if t > token),
        "a waiter without pub/sub rights: {got:?}"
    );
}

/// `Locker::break_lock` on every Redis layout: the hold seen by `inspect` ends (all its
/// re-entries with it), a stale token breaks nothing, its holder hears of the break at
/// its next renewal, and the next grant's token is higher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn break_lock_ends_the_hold_it_was_shown_on_every_layout() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    for layout in ["redisson", "redis-py", "python-redis-lock"] {
        let url = format!("{}?layout={layout}", server.url());
        let (a, b) = (
            Locker::connect(&url).await.expect("connect"),
            Locker::connect(&url).await.expect("connect"),
        );
        let name = format!("break-{layout}");
        let mut opts = dlock::LockOptions::new().ttl(Duration::from_secs(2));
        if layout == "redisson" {
            opts = opts.owner(a.owner());
        }
        let held = a.lock_with(&name, &opts).await.expect("lock");
        // A re-entry (reentrant layout only) ends with the break too.
        let again = if layout == "redisson" {
            Some(a.lock_with(&name, &opts).await.expect("re-enter"))
        } else {
            None
        };
        let seen = b.inspect(&name).await.expect("inspect").expect("held");
        assert_eq!(seen.fencing_token, held.fencing_token(), "{layout}");
        assert!(
            !b.break_lock(&name, seen.fencing_token + 1)
                .await
                .expect("break"),
            "{layout}: a token that was never granted broke the hold"
        );
        assert!(
            b.inspect(&name).await.expect("inspect").is_some(),
            "{layout}"
        );
        assert!(
            b.break_lock(&name, seen.fencing_token)
                .await
                .expect("break"),
            "{layout}"
        );
        tokio::time::timeout(Duration::from_secs(5), held.lost())
            .await
            .unwrap_or_else(|_| panic!("{layout}: the holder never heard of the break"));
        let next = b
            .try_lock(&name)
            .await
            .expect("try")
            .unwrap_or_else(|| panic!("{layout}: not free after the break"));
        assert!(next.fencing_token() > seen.fencing_token, "{layout}");
        assert!(
            !b.break_lock(&name, seen.fencing_token)
                .await
                .expect("break"),
            "{layout}: the old token broke the next hold"
        );
        let last = next.fencing_token();
        next.release().await.expect("release");
        drop(again);
        if layout == "redisson" {
            continue;
        }
        // A foreign client (redis-py's SET NX PX) holds the plain key now: it has no
        // token, and the counter a past dlock grant left must not let a break delete
        // its key.
        let key = if layout == "redis-py" {
            name.clone()
        } else {
            format!("lock:{name}")
        };
        let set = ["SET", key.as_str(), "foreign", "NX", "PX", "10000"];
        redis_command(server.addr(), &set, T).expect("SET");
        let seen = b.inspect(&name).await.expect("inspect").expect("held");
        assert_eq!(
            seen.fencing_token, 0,
            "{layout}: a foreign holder has no token"
        );
        assert!(
            !b.break_lock(&name, last).await.expect("break"),
            "{layout}: a break with a past token ended a foreign hold"
        );
        assert!(
            b.inspect(&name).await.expect("inspect").is_some(),
            "{layout}"
        );
    }
}

/// Each hold keeps its acquisition's metadata in a field of its own (no field per lock
/// beside it): `inspect` shows a hold that is still there — after the first of two
/// re-entrant holds is given back (plain and fair acquisitions), and after an
/// in-process hand-off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_metadata_of_a_hold_still_there() {
    use dlock::{LockOptions, Metadata, Owner};
    let Some(server) = RedisServer::start() else {
        return;
    };
    let locker = Locker::connect(&server.url()).await.expect("connect");
    let meta = |note: &str| Metadata::this_process().with_note(note);
    let with = |owner: &Owner, note: &str, fair: bool| {
        LockOptions::new()
            .owner(owner.clone())
            .metadata(meta(note))
            .fair(fair)
    };
    let shared: Owner = "shared".parse().expect("owner");
    for fair in [false, true] {
        let first = locker
            .lock_with("m", &with(&shared, "first", fair))
            .await
            .expect("first");
        let info = locker.inspect("m").await.expect("inspect").expect("held");
        assert_eq!(
            (info.holds, &info.metadata),
            (1, &meta("first")),
            "fair: {fair}"
        );
        let second = locker
            .lock_with("m", &with(&shared, "second", fair))
            .await
            .expect("re-entry");
        let info = locker.inspect("m").await.expect("inspect").expect("held");
        assert_eq!(info.holds, 2, "fair: {fair}");
        assert!(
            [meta("first"), meta("second")].contains(&info.metadata),
            "fair: {fair}: {:?}",
            info.metadata
        );
        first.release().await.expect("release");
        let info = locker.inspect("m").await.expect("inspect").expect("held");
        assert_eq!(
            (info.holds, info.metadata),
            (1, meta("second")),
            "fair: {fair}"
        );
        second.release().await.expect("release");
    }

    let second = locker
        .lock_with("m", &with(&shared, "second", false))
        .await
        .expect("lock");
    let other: Owner = "other".parse().expect("owner");
    let waiter = {
        let locker = locker.clone();
        let opts = with(&other, "third", false);
        tokio::spawn(async move { locker.lock_with("m", &opts).await })
    };
    let publishes = || calls(&server, &["publish"]);
    // The waiter has subscribed, asked again, and waits for the release.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while subscribers(&server, "redisson_lock__channel:{m}") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the waiter never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let published = publishes();
    second.release().await.expect("release");
    let third = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("handed over in time")
        .expect("task")
        .expect("lock");
    assert_eq!(
        publishes(),
        published,
        "handed over in process, not published"
    );
    let info = locker.inspect("m").await.expect("inspect").expect("held");
    assert_eq!(
        (info.owner.as_str(), info.fencing_token, info.metadata),
        ("other", third.fencing_token(), meta("third"))
    );
    third.release().await.expect("release");

    // A hold an earlier build of dlock took (rolling upgrade): '1' in its own field,
    // its metadata in a field of its own.
    let written = [
        "HSET",
        "old",
        "someone",
        "1",
        "dlock:fence",
        "7",
        "dlock:meta",
        r#"{"note":"old"}"#,
        "dlock:g:0123",
        "1",
    ];
    redis_command(server.addr(), &written, T).expect("HSET");
    redis_command(server.addr(), &["PEXPIRE", "old", "30000"], T).expect("PEXPIRE");
    let info = locker.inspect("old").await.expect("inspect").expect("held");
    assert_eq!(
        (info.owner.as_str(), info.fencing_token, info.metadata),
        ("someone", 7, Metadata::default().with_note("old"))
    );
}
