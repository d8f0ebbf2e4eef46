//! In-process hand-off on Redis: a release passes the lock straight to the longest
//! waiting task of the same process (one script, no unlock message), at most
//! `handoff_burst` times in a row before the lock goes to everyone.
#![cfg(feature = "redis")]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::{Error, Locker};
use dlock_testkit::{RedisServer, redis_command};

const T: Duration = Duration::from_secs(2);

fn calls(server: &RedisServer, command: &str) -> u64 {
    let info = redis_command(server.addr(), &["INFO", "commandstats"], T).expect("INFO");
    let prefix = format!("cmdstat_{command}:");
    String::from_utf8_lossy(&info)
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| {
            l.split(',')
                .find_map(|kv| kv.split(':').next_back()?.strip_prefix("calls="))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum()
}

/// 20 tasks of one process on one lock: no lost update, tokens strictly increasing in
/// grant order, every task served, and most releases were hand-offs (no PUBLISH).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoffs_keep_exclusion_and_fencing_and_serve_everyone() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let locker = Locker::connect(&server.url()).await.expect("connect");
    let publishes_before = calls(&server, "publish");
    let scripts_before = calls(&server, "evalsha") + calls(&server, "eval");
    let tasks = 20u32;
    let per_task = 40u32;
    // The racy counter and the tokens, touched only under the lock.
    let counter = Arc::new(Mutex::new(0u64));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let per = Arc::new(Mutex::new(vec![0u32; tasks as usize]));
    let mut handles = Vec::new();
    for task in 0..tasks {
        let (locker, counter, tokens, per) = (
            locker.clone(),
            Arc::clone(&counter),
            Arc::clone(&tokens),
            Arc::clone(&per),
        );
        handles.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let g = locker
                    .lock_timeout("handoff", Duration::from_secs(20))
                    .await?;
                let read = *counter.lock().expect("counter");
                tokio::task::yield_now().await;
                *counter.lock().expect("counter") = read + 1;
                tokens.lock().expect("tokens").push(g.fencing_token());
                per.lock().expect("per")[task as usize] += 1;
                g.release().await?;
            }
            Ok::<(), Error>(())
        }));
    }
    for h in handles {
        tokio::time::timeout(Duration::from_secs(60), h)
            .await
            .expect("tasks finish")
            .expect("join")
            .expect("lock cycle");
    }
    let total = u64::from(tasks * per_task);
    assert_eq!(*counter.lock().expect("counter"), total, "lost updates");
    let tokens = tokens.lock().expect("tokens").clone();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens not strictly increasing in grant order"
    );
    assert!(per.lock().expect("per").iter().all(|&n| n == per_task));
    let publishes = calls(&server, "publish") - publishes_before;
    let scripts = calls(&server, "evalsha") + calls(&server, "eval") - scripts_before;
    eprintln!("{total} acquisitions, {publishes} unlock messages, {scripts} scripts run");
    // A hand-off is one script for a release and the next grant; while a task of this
    // process holds the lock the others send nothing (2 scripts per acquisition when
    // they each asked the server once).
    assert!(
        scripts * 2 < total * 3,
        "{scripts} scripts for {total} acquisitions: waiters ask the server while a local task holds the lock"
    );
    // Without hand-offs every release publishes; with them only the end of each streak
    // (at most one in 17) and the last releases do.
    assert!(
        publishes * 4 < total,
        "{publishes} unlock messages for {total} releases: no hand-offs happened"
    );
    assert!(locker.inspect("handoff").await.expect("inspect").is_none());
}

/// A waiter that timed out or was cancelled is not handed the lock: after the holder's
/// release the lock is free for anyone at once.
#[tokio::test]
async fn a_waiter_that_left_is_not_handed_the_lock() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let locker = Locker::connect(&server.url()).await.expect("connect");
    let other = Locker::connect(&server.url()).await.expect("connect");
    let holder = locker.lock("left").await.expect("lock");
    let timed_out = locker
        .lock_timeout("left", Duration::from_millis(300))
        .await;
    assert!(
        matches!(timed_out, Err(Error::Timeout { .. })),
        "{timed_out:?}"
    );
    let cancelled = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock("left").await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    cancelled.abort();
    let _ = cancelled.await;
    holder.release().await.expect("release");
    let start = Instant::now();
    let next = other
        .lock_timeout("left", Duration::from_secs(5))
        .await
        .expect("free after the release");
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "the lock went to a waiter that had left: free only after {:?}",
        start.elapsed()
    );
    next.release().await.expect("release");
}

/// A release that finds its hold already gone (its key expired or was broken under
/// it) hands nothing over and publishes nothing: the local waiter, which sent no
/// attempt while a local task held the lock, is woken to try again at once instead
/// of sleeping out its step (up to a second) while the lock is free.
#[tokio::test]
async fn a_waiter_tries_again_at_once_when_the_holders_hold_was_gone() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let locker = Locker::connect(&server.url()).await.expect("connect");
    let holder = locker.lock("gone").await.expect("lock");
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock_timeout("gone", Duration::from_secs(10)).await }
    });
    // Waiting by now, for a step of a second (the lease is 30 s).
    tokio::time::sleep(Duration::from_millis(150)).await;
    redis_command(server.addr(), &["DEL", "gone"], T).expect("DEL");
    let released = Instant::now();
    // The hold is gone: its release may report the loss.
    let _ = holder.release().await;
    let got = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter got the free lock")
        .expect("task")
        .expect("lock");
    let waited = released.elapsed();
    assert!(
        waited < Duration::from_millis(450),
        "the waiter took the free lock only {waited:?} after the release"
    );
    got.release().await.expect("release");
}

/// Hand-off streaks are capped: a waiter in another process (here another `Locker`,
/// its own connections) gets the lock while 8 local tasks keep cycling it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_processes_are_not_starved_by_local_handoffs() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let busy = Locker::connect(&server.url()).await.expect("connect");
    let outsider = Locker::connect(&server.url()).await.expect("connect");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut cyclers = Vec::new();
    for _ in 0..8 {
        let (busy, stop) = (busy.clone(), Arc::clone(&stop));
        cyclers.push(tokio::spawn(async move {
            let end = Instant::now() + Duration::from_secs(20);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < end {
                let g = busy
                    .lock_timeout("crowded", Duration::from_secs(20))
                    .await?;
                tokio::time::sleep(Duration::from_millis(1)).await;
                g.release().await?;
            }
            Ok::<(), Error>(())
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let start = Instant::now();
    let got = outsider
        .lock_timeout("crowded", Duration::from_secs(10))
        .await;
    let waited = start.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let guard = got.expect("the other process must get the lock");
    eprintln!("outsider waited {waited:?}");
    // Streaks end every 16 hand-offs (a few ms here); without the hold-back after a
    // streak this process's own next attempt won nearly every race (7.5 s measured).
    assert!(
        waited < Duration::from_secs(2),
        "the other process waited {waited:?} behind local hand-offs"
    );
    guard.release().await.expect("release");
    for c in cyclers {
        c.await.expect("join").expect("cycle");
    }
}

#[tokio::test]
async fn handoff_burst_is_validated() {
    for bad in ["x", "-1", "100001"] {
        let e = Locker::connect(&format!("redis://127.0.0.1:1?handoff_burst={bad}"))
            .await
            .expect_err(bad);
        assert!(matches!(e, Error::InvalidUrl { .. }), "{bad}: {e}");
    }
}

/// Subscribers on `channel`, as the server counts them.
fn subscribers(server: &RedisServer, channel: &str) -> u64 {
    dlock_testkit::redis_subscribers(server.addr(), channel).expect("PUBSUB NUMSUB")
}

/// Many waiters of one Locker share one subscription to the unlock channel, and the
/// Locker unsubscribes shortly after the last waiter has gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_share_one_subscription_and_it_ends_when_they_do() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let locker = Locker::connect(&server.url()).await.expect("connect");
    let channel = "redisson_lock__channel:{shared-sub}";
    let holder = locker.lock("shared-sub").await.expect("lock");
    let mut waiters = Vec::new();
    for _ in 0..12 {
        let locker = locker.clone();
        waiters.push(tokio::spawn(async move {
            let g = locker
                .lock_timeout("shared-sub", Duration::from_secs(20))
                .await?;
            g.release().await
        }));
    }
    // Wait (bounded) for the subscription to show, then let the rest settle.
    let deadline = Instant::now() + Duration::from_secs(5);
    while subscribers(&server, channel) == 0 {
        assert!(Instant::now() < deadline, "the waiters never subscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        subscribers(&server, channel),
        1,
        "12 waiters must share one subscription"
    );
    holder.release().await.expect("release");
    for w in waiters {
        tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("waiters finish")
            .expect("join")
            .expect("lock cycle");
    }
    // Unsubscribed once nobody waits (after a short linger): generous bound.
    let deadline = Instant::now() + Duration::from_millis(1_500);
    while subscribers(&server, channel) != 0 {
        assert!(
            Instant::now() < deadline,
            "still subscribed 1.5 s after the last waiter left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Two tasks of one owner wait with different leases (60 s and 500 ms without
/// renewal); the holder's release hands the lock over in-process. Each grant must carry
/// the lease its own acquisition asked for: the 60 s holder still holds the lock 1.5 s
/// later, and the server agrees (keyed by owner, the short waiter's lease was written
/// into the long waiter's hand-off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_sharing_an_owner_each_get_their_own_lease() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let locker = Locker::connect(&server.url()).await.expect("connect");
    let other = Locker::connect(&server.url()).await.expect("connect");
    let name = "shared-owner-handoff";
    let holder = locker.lock(name).await.expect("lock");
    let owner = locker.owner();
    let long = dlock::LockOptions::new()
        .ttl(Duration::from_secs(60))
        .owner(owner.clone());
    let short = dlock::LockOptions::new()
        .ttl(Duration::from_millis(500))
        .renewal(dlock::Renewal::Off)
        .owner(owner.clone());
    let (l1, n1) = (locker.clone(), name.to_owned());
    let long_waiter = tokio::spawn(async move { l1.lock_with(&n1, &long).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (l2, n2) = (locker.clone(), name.to_owned());
    let short_waiter = tokio::spawn(async move { l2.lock_with(&n2, &short).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    holder.release().await.expect("release");
    let long_guard = tokio::time::timeout(Duration::from_secs(5), long_waiter)
        .await
        .expect("long waiter")
        .expect("task")
        .expect("lock");
    let short_guard = tokio::time::timeout(Duration::from_secs(5), short_waiter)
        .await
        .expect("short waiter")
        .expect("task")
        .expect("lock");
    assert_eq!(long_guard.fencing_token(), short_guard.fencing_token());
    // Past the short lease (it lapses: no renewal), well within the long one.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(long_guard.is_held(), "{:?}", long_guard.loss_reason());
    assert!(
        other.try_lock(name).await.expect("try").is_none(),
        "another client took the lock from its 60 s holder"
    );
    let pttl = redis_command(server.addr(), &["PTTL", name], T).expect("PTTL");
    let ms: i64 = String::from_utf8_lossy(&pttl)
        .trim_start_matches(':')
        .trim()
        .parse()
        .expect("a PTTL");
    assert!(ms > 30_000, "the server lease is {ms} ms");
    drop(short_guard);
    long_guard.release().await.expect("release");
}

/// A holding owner re-entering with `try_lock` while other tasks of the process wait
/// for the lock: granted at once (it holds the lock), not queued behind the waiters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_reenters_with_try_lock_while_others_wait() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let locker = Locker::connect(&server.url()).await.expect("connect");
    let name = "reenter-with-waiters";
    let owner = locker.owner();
    let mine = dlock::LockOptions::new().owner(owner.clone());
    let held = locker.lock_with(name, &mine).await.expect("lock");
    let (l, n) = (locker.clone(), name.to_owned());
    let waiter = tokio::spawn(async move { l.lock(&n).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let again = locker
        .try_lock_with(name, &mine)
        .await
        .expect("try")
        .expect("the holding owner must re-enter while others wait");
    assert_eq!(again.fencing_token(), held.fencing_token());
    again.release().await.expect("release");
    held.release().await.expect("release");
    let w = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("waiter")
        .expect("task")
        .expect("lock");
    w.release().await.expect("release");
}
