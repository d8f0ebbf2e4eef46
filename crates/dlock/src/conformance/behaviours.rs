//! One function per behaviour; see the module docs of [`crate::conformance`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{Harness, eventually, opts, short_lease, unique};
use crate::{Error, LockGuard, LockOptions, LossReason, Metadata, Owner, Renewal, Wait};

/// Many tasks on several clients run a deliberately racy read–yield–write on a shared
/// counter under the lock: no update is lost and no two are inside at once.
pub async fn mutual_exclusion(h: &Harness) {
    let name = unique("mutex");
    let clients = [h.locker().await, h.locker().await, h.locker().await];
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let (tasks, rounds) = (6u64, 15u64);
    let mut joins = Vec::new();
    for t in 0..tasks {
        let locker = clients[(t as usize) % clients.len()].clone();
        let (name, counter, inside, overlaps) = (
            name.clone(),
            Arc::clone(&counter),
            Arc::clone(&inside),
            Arc::clone(&overlaps),
        );
        joins.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let guard = locker.lock(&name).await.expect("lock");
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let read = counter.load(Ordering::SeqCst);
                tokio::time::sleep(Duration::from_micros(300)).await;
                counter.store(read + 1, Ordering::SeqCst);
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        }));
    }
    for j in joins {
        j.await.expect("task");
    }
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "critical sections overlapped"
    );
    assert_eq!(
        counter.load(Ordering::SeqCst),
        tasks * rounds,
        "updates were lost"
    );
}

/// `try_lock` on a held lock is `Ok(None)`; after release it succeeds.
pub async fn try_lock_busy_is_none(h: &Harness) {
    let name = unique("try");
    let (a, b) = (h.locker().await, h.locker().await);
    let held = a.lock(&name).await.expect("lock");
    assert!(b.try_lock(&name).await.expect("try_lock").is_none());
    held.release().await.expect("release");
    let again = b.try_lock(&name).await.expect("try_lock");
    assert!(again.is_some(), "free lock not granted by try_lock");
}

/// `lock_timeout` on a held lock fails with `Timeout` after the timeout, not before and
/// not much later; `Wait::NoWait` fails at once.
pub async fn timeout_bounds(h: &Harness) {
    let name = unique("timeout");
    let (a, b) = (h.locker().await, h.locker().await);
    let _held = a.lock(&name).await.expect("lock");
    let wait = Duration::from_millis(300);
    let start = Instant::now();
    let err = b
        .lock_timeout(&name, wait)
        .await
        .expect_err("must time out");
    let took = start.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.is_retryable());
    assert!(took >= wait, "gave up early after {took:?}");
    assert!(took < wait + Duration::from_secs(2), "took {took:?}");
    let start = Instant::now();
    let err = b
        .lock_with(&name, &opts().wait(Wait::NoWait))
        .await
        .expect_err("NoWait on a busy lock");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

/// A released lock can be taken again at once, repeatedly.
pub async fn release_then_reacquire(h: &Harness) {
    let name = unique("cycle");
    let (a, b) = (h.locker().await, h.locker().await);
    for i in 0..5 {
        let who = if i % 2 == 0 { &a } else { &b };
        let g = who.try_lock(&name).await.expect("try_lock");
        let g = g.unwrap_or_else(|| panic!("round {i}: released lock not free"));
        assert!(g.is_held());
        g.release().await.expect("release");
    }
}

/// Dropping a guard releases in the background, well before the lease would end.
pub async fn drop_releases_promptly(h: &Harness) {
    dropped_guard_frees(h, "drop", drop).await;
}

/// A guard dropped on a thread with no runtime (moved into synchronous code) is
/// released on its locker's runtime, well before the lease would end: a
/// session-bound backend would otherwise keep the lock for as long as its session
/// lives, with nobody holding it.
pub async fn drop_off_the_runtime_releases_promptly(h: &Harness) {
    dropped_guard_frees(h, "drop-off", |g| {
        std::thread::spawn(move || drop(g))
            .join()
            .expect("the dropping thread");
    })
    .await;
}

/// A lock whose guard `dropper` drops is free for another locker within 2 s.
async fn dropped_guard_frees(h: &Harness, label: &str, dropper: impl FnOnce(LockGuard)) {
    let name = unique(label);
    let (a, b) = (h.locker().await, h.locker().await);
    let g = a.lock(&name).await.expect("lock");
    let start = Instant::now();
    dropper(g);
    let g2 = b
        .lock_timeout(&name, Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("{label}: the dropped guard's lock must free: {e}"));
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{label}: took {:?} to free the lock (the lease is 30 s)",
        start.elapsed()
    );
    g2.release().await.expect("release");
}

/// A holder whose lease ran out cannot release or extend the next holder's lock.
pub async fn stale_owner_cannot_release_or_extend(h: &Harness) {
    let name = unique("stale");
    let (a, b) = (h.locker().await, h.locker().await);
    let stale = a.lock_with(&name, &short_lease(200)).await.expect("lock");
    let _ = tokio::time::timeout(Duration::from_secs(3), stale.lost()).await;
    let fresh = b
        .lock_timeout(&name, Duration::from_secs(3))
        .await
        .expect("expired lock must be free");
    assert!(stale.extend(Duration::from_secs(5)).await.is_err());
    assert!(
        stale.release().await.is_err(),
        "a lost lock cannot be released"
    );
    let info = b
        .inspect(&name)
        .await
        .expect("inspect")
        .expect("still held");
    assert_eq!(
        info.owner,
        fresh.owner().as_str(),
        "stale owner disturbed the holder"
    );
    assert_eq!(info.fencing_token, fresh.fencing_token());
    assert!(fresh.is_held());
    fresh.release().await.expect("release");
}

/// A holder whose lock an operator broke, and another client then took, hears of it
/// at its release, where the backend says it can tell
/// ([`crate::Capabilities::release_reports_loss`]): `LockLost` with `NotOwner`, not
/// `Ok`, since the work done under the guard may not have been exclusive. Each
/// reentrant hold of the owner hears of it; the new holder is untouched, and a waiter
/// in the broken holder's process (offered an in-process hand-off by its release)
/// gets the lock only after the new holder's release. Where locks cannot be broken
/// (the SQL session modes), `break_lock` says so.
pub async fn release_after_a_break_reports_the_loss(h: &Harness) {
    let name = unique("broken");
    let (a, b) = (h.locker().await, h.locker().await);
    let caps = a.capabilities();
    let o = opts().owner(a.owner());
    let mut holds = vec![a.lock_with(&name, &o).await.expect("lock")];
    if caps.reentrant {
        holds.push(a.lock_with(&name, &o).await.expect("reentrant lock"));
    }
    let token = holds[0].fencing_token();
    match b.break_lock(&name, token).await {
        Err(Error::Unsupported(_)) => {
            assert!(
                !caps.release_reports_loss,
                "claims to report a broken lock's release, but cannot break one"
            );
            for g in holds {
                g.release().await.expect("release");
            }
            return;
        }
        broke => assert!(broke.expect("break"), "the holder's token broke nothing"),
    }
    let fresh = b
        .lock_timeout(&name, Duration::from_secs(5))
        .await
        .expect("a broken lock must be free");
    let waiter = {
        let (a, name) = (a.clone(), name.clone());
        tokio::spawn(async move { a.lock_timeout(&name, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    for (i, g) in holds.into_iter().enumerate() {
        let released = g.release().await;
        let told = matches!(
            released,
            Err(Error::LockLost {
                reason: LossReason::NotOwner,
                ..
            })
        );
        if caps.release_reports_loss {
            assert!(
                told,
                "hold {i}: the release of a broken lock said {released:?}"
            );
        } else {
            assert!(told || released.is_ok(), "hold {i}: {released:?}");
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    if waiter.is_finished() {
        let ended = waiter
            .await
            .expect("waiter task")
            .map(|g| g.fencing_token());
        panic!("the waiter's wait ended while the new holder held the lock: {ended:?}");
    }
    let info = b.inspect(&name).await.expect("inspect").expect("held");
    assert_eq!(
        info.owner,
        fresh.owner().as_str(),
        "the new holder was disturbed"
    );
    assert_eq!(info.fencing_token, fresh.fencing_token());
    assert!(fresh.is_held());
    let fresh_token = fresh.fencing_token();
    fresh.release().await.expect("release");
    let next = waiter
        .await
        .expect("waiter task")
        .expect("the waiter gets the lock after the new holder's release");
    assert!(
        next.fencing_token() > fresh_token,
        "the waiter's token is not above the new holder's"
    );
    next.release().await.expect("release");
}

/// 10,000 attempts with forged owner tokens on a held lock: none gets it, the holder
/// keeps it unchanged.
pub async fn forged_owners_never_succeed(h: &Harness) {
    let name = unique("forged");
    let (a, b) = (h.locker().await, h.locker().await);
    let g = a.lock(&name).await.expect("lock");
    let mut granted = 0;
    let start = Instant::now();
    let attempts = 10_000;
    for _ in 0..attempts {
        let forged = opts().owner(Owner::random());
        if b.try_lock_with(&name, &forged)
            .await
            .expect("try_lock")
            .is_some()
        {
            granted += 1;
        }
        if start.elapsed() > Duration::from_secs(60) {
            panic!("10k forged attempts took over 60 s");
        }
    }
    assert_eq!(
        granted, 0,
        "{granted} of {attempts} forged owners got the lock"
    );
    let info = a.inspect(&name).await.expect("inspect").expect("held");
    assert_eq!(info.owner, g.owner().as_str());
    assert_eq!(info.fencing_token, g.fencing_token());
    g.release().await.expect("release");
}

/// With renewal off, a lease frees the lock by itself (the holder is still "alive").
pub async fn ttl_expiry_frees(h: &Harness) {
    let name = unique("ttl");
    let (a, b) = (h.locker().await, h.locker().await);
    let ttl = Duration::from_millis(400);
    let start = Instant::now();
    let _held = a.lock_with(&name, &short_lease(400)).await.expect("lock");
    let g = b
        .lock_timeout(&name, ttl + Duration::from_secs(3))
        .await
        .expect("lease must free the lock");
    let took = start.elapsed();
    // The holder stops trusting its lease a drift margin early and then releases it
    // (owner-checked), so the earliest grant is at TTL minus that margin.
    let earliest = ttl - crate::lease::drift_margin(ttl);
    assert!(
        took >= earliest,
        "granted before the holder's lease ended ({earliest:?}): {took:?}"
    );
    assert!(took < ttl + Duration::from_millis(1500), "took {took:?}");
    g.release().await.expect("release");
}

/// Automatic renewal keeps the lock for several TTLs.
pub async fn renewal_outlives_ttl(h: &Harness) {
    let name = unique("renew");
    let (a, b) = (h.locker().await, h.locker().await);
    let g = a
        .lock_with(&name, &opts().ttl(Duration::from_millis(300)))
        .await
        .expect("lock");
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert!(g.is_held(), "renewal failed: {:?}", g.loss_reason());
    assert!(
        b.try_lock(&name).await.expect("try_lock").is_none(),
        "renewed lock was free"
    );
    g.release().await.expect("release");
}

/// Fencing tokens strictly increase across owners, clients, releases and expiries.
pub async fn fencing_strictly_increases(h: &Harness) {
    let name = unique("fence");
    let clients = [h.locker().await, h.locker().await, h.locker().await];
    let mut last = 0u64;
    for i in 0..12 {
        let c = &clients[i % clients.len()];
        let g = if i % 4 == 3 {
            // Let this one expire instead of releasing it.
            let g = c.lock_with(&name, &short_lease(100)).await.expect("lock");
            let t = g.fencing_token();
            let _ = tokio::time::timeout(Duration::from_secs(3), g.lost()).await;
            assert!(t > last, "token {t} after {last}");
            last = t;
            continue;
        } else {
            c.lock_timeout(&name, Duration::from_secs(3))
                .await
                .expect("lock")
        };
        let t = g.fencing_token();
        assert!(t > last, "token {t} after {last}");
        last = t;
        g.release().await.expect("release");
    }
}

/// A waiter cancelled (future dropped) while waiting leaves nothing behind: no hold,
/// no queue entry.
pub async fn cancel_while_waiting_leaves_nothing(h: &Harness) {
    let name = unique("cancel-wait");
    let (a, b, c) = (h.locker().await, h.locker().await, h.locker().await);
    let caps = a.capabilities();
    let g = a.lock(&name).await.expect("lock");
    let waiting = opts().fair(caps.fifo);
    let r = tokio::time::timeout(Duration::from_millis(300), b.lock_with(&name, &waiting)).await;
    assert!(r.is_err(), "waiter got a held lock");
    if caps.fifo {
        let clean = eventually(Duration::from_secs(3), || async {
            c.inspect(&name)
                .await
                .expect("inspect")
                .is_some_and(|i| i.waiters == Some(0))
        })
        .await;
        assert!(clean, "cancelled waiter left a queue entry");
    }
    g.release().await.expect("release");
    let start = Instant::now();
    let g = c
        .lock_with(
            &name,
            &opts()
                .fair(caps.fifo)
                .wait(Wait::Timeout(Duration::from_secs(5))),
        )
        .await
        .expect("lock after cancelled waiter");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "a ghost waiter delayed the next holder"
    );
    g.release().await.expect("release");
}

/// Acquisitions cancelled at random points mid-flight never leave a hold behind.
pub async fn cancel_mid_acquire_leaves_nothing(h: &Harness) {
    let name = unique("cancel-mid");
    let (a, b) = (h.locker().await, h.locker().await);
    for i in 0..40u64 {
        let delay = Duration::from_micros(fastrand::u64(0..3000));
        if let Ok(Ok(g)) = tokio::time::timeout(delay, a.lock(&name)).await {
            drop(g);
        }
        let g = match b.lock_timeout(&name, Duration::from_secs(5)).await {
            Ok(g) => g,
            Err(e) => {
                let holder = b.inspect(&name).await;
                panic!("round {i}: lock stuck after a cancelled acquire: {e}; holder: {holder:?}");
            }
        };
        g.release().await.expect("release");
    }
}

/// `lost()` fires when the lease runs out without renewal, before another can hold.
pub async fn loss_signal_fires(h: &Harness) {
    let name = unique("lost");
    let a = h.locker().await;
    let ttl = Duration::from_millis(300);
    let start = Instant::now();
    let g = a.lock_with(&name, &short_lease(300)).await.expect("lock");
    let granted = Instant::now();
    let token = g.lost_token();
    let err = tokio::time::timeout(ttl + Duration::from_millis(500), g.lost())
        .await
        .expect("lost() did not fire within TTL + 0.5 s");
    assert!(matches!(err, Error::LockLost { .. }), "{err}");
    // The keeper's deadline is TTL − 1 % − 2 ms after the send: lost() fires before
    // the lease ends unless this process is starved of CPU for those few ms, which a
    // loaded test machine does; the bound says "at the lease, not long after". The
    // send lies between `start` and `granted` (a slow grant on a busy machine).
    let (at, after_grant) = (start.elapsed(), granted.elapsed());
    assert!(
        at >= ttl * 9 / 10 && after_grant < ttl + Duration::from_millis(250),
        "lost() fired at {at:?} ({after_grant:?} after the grant) for a {ttl:?} lease"
    );
    assert!(token.is_cancelled());
    assert!(!g.is_held());
    assert!(g.loss_reason().is_some());
}

/// `with_lock` drops the closure's future when the lock is lost.
pub async fn with_lock_cancels_on_loss(h: &Harness) {
    let name = unique("with-lock");
    let a = h.locker().await;
    let finished = Arc::new(AtomicUsize::new(0));
    let f2 = Arc::clone(&finished);
    let start = Instant::now();
    let r = a
        .with_lock_opts(&name, &short_lease(300), |ctx| async move {
            assert!(ctx.fencing_token > 0);
            tokio::time::sleep(Duration::from_secs(5)).await;
            f2.fetch_add(1, Ordering::SeqCst);
        })
        .await;
    assert!(matches!(r, Err(Error::LockLost { .. })), "{r:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "closure ran on after the loss"
    );
    let v = a
        .with_lock(&name, |ctx| async move { ctx.fencing_token })
        .await;
    assert!(v.expect("with_lock") > 0);
}

/// The same owner re-enters at once with the same token; the lock frees on the last
/// release. A backend that does not claim reentrancy must refuse the second hold.
pub async fn reentrancy(h: &Harness) {
    let name = unique("reentrant");
    let (a, b) = (h.locker().await, h.locker().await);
    let owner = a.owner();
    let o = opts().owner(owner.clone());
    let g1 = a.lock_with(&name, &o).await.expect("lock");
    let g2 = a.try_lock_with(&name, &o).await.expect("try_lock");
    if !a.capabilities().reentrant {
        assert!(g2.is_none(), "reentered without claiming reentrancy");
        return;
    }
    let g2 = g2.expect("same owner must re-enter");
    assert_eq!(g1.fencing_token(), g2.fencing_token());
    assert_eq!(g2.owner(), &owner);
    let info = b.inspect(&name).await.expect("inspect").expect("held");
    assert_eq!(info.holds, 2);
    g1.release().await.expect("release");
    assert!(
        b.try_lock(&name).await.expect("try").is_none(),
        "freed before the last release"
    );
    g2.release().await.expect("release");
    assert!(
        b.try_lock(&name).await.expect("try").is_some(),
        "not freed by the last release"
    );
}

/// Fair waiters are granted in arrival order (where the backend claims FIFO); fair
/// mode is refused where it does not.
pub async fn fifo_order(h: &Harness) {
    let name = unique("fifo");
    let a = h.locker().await;
    if !a.capabilities().fifo {
        let err = a
            .lock_with(&name, &opts().fair(true))
            .await
            .expect_err("fair refused");
        assert!(matches!(err, Error::Unsupported(_)), "{err}");
        return;
    }
    let fair = opts()
        .fair(true)
        .wait(Wait::Timeout(Duration::from_secs(20)));
    let g = a.lock_with(&name, &fair).await.expect("lock");
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut joins = Vec::new();
    let n = 5;
    for i in 0..n {
        let locker = h.locker().await;
        let (task_name, fair, order) = (name.clone(), fair.clone(), Arc::clone(&order));
        joins.push(tokio::spawn(async move {
            let g = locker
                .lock_with(&task_name, &fair)
                .await
                .expect("fair lock");
            order.lock().expect("order").push(i);
            tokio::time::sleep(Duration::from_millis(20)).await;
            g.release().await.expect("release");
        }));
        // Wait until this waiter is queued before starting the next.
        let queued = eventually(Duration::from_secs(5), || async {
            a.inspect(&name)
                .await
                .expect("inspect")
                .is_some_and(|info| info.waiters == Some(i + 1))
        })
        .await;
        assert!(queued, "waiter {i} never showed up in the queue");
    }
    g.release().await.expect("release");
    for j in joins {
        j.await.expect("waiter");
    }
    let order = order.lock().expect("order").clone();
    assert_eq!(
        order,
        (0..n).collect::<Vec<_>>(),
        "not first come, first served"
    );
}

/// A waiter gets a released lock promptly: within 0.5 s of the release, far below the
/// 30 s lease (so it was woken or polled, not left to expiry).
pub async fn waiter_wakes_promptly(h: &Harness) {
    let name = unique("wake");
    let (a, b) = (h.locker().await, h.locker().await);
    let g = a.lock(&name).await.expect("lock");
    let waiter = tokio::spawn({
        let name = name.clone();
        async move {
            let g = b.lock(&name).await.expect("lock");
            let at = Instant::now();
            g.release().await.expect("release");
            at
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released_at = Instant::now();
    g.release().await.expect("release");
    let acquired_at = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("waiter never woke")
        .expect("waiter task");
    let latency = acquired_at.saturating_duration_since(released_at);
    assert!(
        latency < Duration::from_millis(500),
        "woken {latency:?} after the release"
    );
}

/// Different names are different locks, including names that differ only in case,
/// in a trailing slash, or as a path prefix.
pub async fn independent_names(h: &Harness) {
    let base = unique("indep");
    let (a, b) = (h.locker().await, h.locker().await);
    let names = [
        format!("{base}/jobs/a"),
        format!("{base}/jobs/a/x"),
        format!("{base}/jobs/A"),
        format!("{base}/jobs/a/"),
    ];
    let mut guards = Vec::new();
    for n in &names {
        guards.push(
            a.try_lock(n)
                .await
                .expect("try")
                .unwrap_or_else(|| panic!("{n} busy")),
        );
    }
    for n in &names {
        assert!(b.try_lock(n).await.expect("try").is_none(), "{n} not held");
    }
    for g in guards {
        g.release().await.expect("release");
    }
}

/// `inspect` shows the holder, its token, metadata and remaining lease; nothing after
/// release.
pub async fn inspect_shows_holder(h: &Harness) {
    let name = unique("inspect");
    let (a, b) = (h.locker().await, h.locker().await);
    assert!(b.inspect(&name).await.expect("inspect").is_none());
    let meta = Metadata::this_process().with_note("conformance");
    let ttl = Duration::from_secs(20);
    let g = a
        .lock_with(&name, &opts().ttl(ttl).metadata(meta.clone()))
        .await
        .expect("lock");
    let info = b.inspect(&name).await.expect("inspect").expect("held");
    assert_eq!(info.name, name);
    assert_eq!(info.owner, g.owner().as_str());
    assert_eq!(info.fencing_token, g.fencing_token());
    assert_eq!(info.holds, 1);
    assert_eq!(info.metadata, meta);
    if let Some(rem) = info.remaining {
        assert!(rem <= ttl && rem > ttl / 2, "remaining {rem:?}");
    }
    g.release().await.expect("release");
    assert!(
        b.inspect(&name).await.expect("inspect").is_none(),
        "still listed after release"
    );
}

/// Bad names and options are typed errors, never panics, and nothing is held after.
pub async fn bad_input_errors(h: &Harness) {
    let a = h.locker().await;
    for bad in ["", "nul\0byte", "line\nbreak"] {
        let err = a.try_lock(bad).await.expect_err("bad name");
        assert!(matches!(err, Error::InvalidName { .. }), "{bad:?}: {err}");
    }
    let long = "n".repeat(crate::name::MAX_NAME_LEN + 1);
    assert!(matches!(
        a.lock(&long).await,
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        a.inspect("").await,
        Err(Error::InvalidName { .. })
    ));
    let name = unique("bad-input");
    for (label, o) in [
        ("zero ttl", opts().ttl(Duration::ZERO)),
        ("huge ttl", opts().ttl(crate::MAX_TTL * 2)),
        (
            "renewal slower than ttl",
            opts()
                .ttl(Duration::from_secs(1))
                .renewal(Renewal::Every(Duration::from_secs(2))),
        ),
        ("zero max hold", opts().max_hold(Duration::ZERO)),
    ] {
        let err = a.lock_with(&name, &o).await.expect_err(label);
        assert!(matches!(err, Error::InvalidOption { .. }), "{label}: {err}");
    }
    assert!(
        a.try_lock(&name).await.expect("try").is_some(),
        "bad input left a hold"
    );
}

/// Names that a careless encoding would merge are all distinct locks.
pub async fn distinct_names_never_collide(h: &Harness) {
    let base = unique("collide");
    let a = h.locker().await;
    let tails = [
        "a/b", "a%2Fb", "a%2fb", "a_b", "a:b", "a.b", "a b", "a+b", ".", "..", "%2E", "é",
        "e\u{301}", "{a}", "[a]", "a\\b",
    ];
    let mut guards = Vec::new();
    for t in tails {
        let n = format!("{base}/{t}");
        let g = a
            .try_lock(&n)
            .await
            .expect("try")
            .unwrap_or_else(|| panic!("{n:?} collided"));
        guards.push((n, g));
    }
    // Each name still shows its own holder (each try_lock had a fresh owner).
    for (n, g) in &guards {
        let info = a.inspect(n).await.expect("inspect").expect("held");
        assert_eq!(
            info.owner,
            g.owner().as_str(),
            "{n:?} shows another name's holder"
        );
    }
    for (_, g) in guards {
        g.release().await.expect("release");
    }
}

/// With a maximum hold time, renewal stops and `lost()` reports it.
pub async fn max_hold_stops_renewal(h: &Harness) {
    let name = unique("max-hold");
    let a = h.locker().await;
    let o = LockOptions::new()
        .ttl(Duration::from_millis(300))
        .max_hold(Duration::from_millis(500));
    let start = Instant::now();
    let g = a.lock_with(&name, &o).await.expect("lock");
    let err = tokio::time::timeout(Duration::from_secs(3), g.lost())
        .await
        .expect("lost() must fire after the max hold time");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(450),
        "lost after {took:?}, before max hold"
    );
    assert!(
        matches!(&err, Error::LockLost { reason, .. } if *reason == crate::LossReason::MaxHoldTime),
        "{err}"
    );
}
