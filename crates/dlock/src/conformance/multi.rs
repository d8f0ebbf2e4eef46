//! [`Locker::lock_all`](crate::Locker::lock_all): all the locks of a set or none, and
//! never a deadlock between sets that overlap — judged per name by a
//! [`FencedBook`], never by the locks themselves.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::fenced::FencedBook;
use super::{Harness, unique};
use crate::{Error, LockOptions, Wait};

/// A set whose second lock is busy fails as a whole, naming that lock, and its first
/// lock is free the moment the call returns; a lock of the set lost while the call
/// waits for the next ends the call with that loss. Then eight tasks on two lockers take
/// random overlapping sets, in random order, with waits without end, short timeouts
/// and cancellations: no name ever has two holders, nothing deadlocks (the crowd is
/// bounded in time), and every name is free when they are done.
///
/// # Panics
/// When a set is taken in part, two holders of a name overlap, the crowd deadlocks, or
/// a lock stays held.
pub async fn lock_all_is_all_or_nothing_and_never_deadlocks(h: &Harness) {
    let names: Arc<Vec<String>> = Arc::new((0..3).map(|i| unique(&format!("all{i}"))).collect());
    let (a, b) = (h.locker().await, h.locker().await);

    let blocker = b.lock(&names[1]).await.expect("lock");
    // The set is taken in name order, and the wait bounds the whole call: long enough
    // that taking the free first lock does not use it up on a busy machine.
    let short = LockOptions::new().wait(Wait::Timeout(Duration::from_secs(1)));
    match a.lock_all(names.iter().rev(), &short).await {
        Err(Error::Timeout { name, .. }) => assert_eq!(name, names[1], "the busy lock"),
        Ok(_) => panic!("lock_all took a set whose lock {} was held", names[1]),
        Err(e) => panic!("lock_all: {e}"),
    }
    let first = b
        .try_lock(&names[0])
        .await
        .expect("try_lock")
        .unwrap_or_else(|| panic!("{} still held after lock_all failed", names[0]));
    first.release().await.expect("release");

    // A lock of the set lost while the call waits for the next one (its maximum hold
    // time ends its renewals): the call gives up at once with that loss instead of
    // waiting on, or handing back a set with a lost lock in it.
    let short_hold = LockOptions::new()
        .ttl(Duration::from_millis(300))
        .max_hold(Duration::from_millis(300))
        .wait(Wait::Timeout(Duration::from_secs(20)));
    let started = Instant::now();
    match a.lock_all(&names[..2], &short_hold).await {
        Err(Error::LockLost { name, .. }) => assert_eq!(name, names[0], "the lost lock"),
        Ok(_) => panic!("lock_all took a set whose lock {} was held", names[1]),
        Err(e) => panic!("lock_all with a lost lock: {e}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "lock_all waited {:?} on after a lock of the set was lost",
        started.elapsed()
    );
    blocker.release().await.expect("release");
    let again = b
        .lock_timeout(&names[0], Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("{} still held after lock_all gave up: {e}", names[0]));
    again.release().await.expect("release");

    let books: Arc<Vec<FencedBook>> = Arc::new((0..3).map(|_| FencedBook::default()).collect());
    let lockers = [Arc::new(a), Arc::new(b)];
    let stop_at = Instant::now() + Duration::from_secs(3);
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..8u64 {
        let locker = Arc::clone(&lockers[(t % 2) as usize]);
        let (names, books) = (Arc::clone(&names), Arc::clone(&books));
        tasks.spawn(async move {
            let mut rng = fastrand::Rng::with_seed(t);
            let mut taken = 0u32;
            for _ in 0..200 {
                if Instant::now() >= stop_at {
                    break;
                }
                let mut set: Vec<usize> = (0..3).collect();
                rng.shuffle(&mut set);
                set.truncate(rng.usize(2..=3));
                let wanted: Vec<&str> = set.iter().map(|&i| names[i].as_str()).collect();
                let wait = match rng.u8(..3) {
                    0 => Wait::Forever,
                    _ => Wait::Timeout(Duration::from_millis(rng.u64(0..200))),
                };
                let opts = LockOptions::new().wait(wait);
                let asking = locker.lock_all(&wanted, &opts);
                let cancel_after = Duration::from_millis(rng.u64(1..150));
                let guard = if rng.u8(..4) == 0 {
                    match tokio::time::timeout(cancel_after, asking).await {
                        Ok(r) => r,
                        Err(_) => continue,
                    }
                } else {
                    asking.await
                };
                let guard = match guard {
                    Ok(g) => g,
                    Err(Error::Timeout { .. }) => continue,
                    Err(e) => panic!("lock_all: {e}"),
                };
                let inside: Vec<_> = set
                    .iter()
                    .map(|&i| {
                        let token = guard.fencing_token(&names[i]).expect("a token per name");
                        let owner = guard.get(&names[i]).expect("guard").owner().as_str();
                        (i, books[i].enter(token, owner, &format!("task {t}")))
                    })
                    .collect();
                tokio::time::sleep(Duration::from_micros(rng.u64(0..2000))).await;
                for (i, id) in inside {
                    let held = guard.get(&names[i]).is_some_and(crate::LockGuard::is_held);
                    books[i].exit_strict(id, held);
                }
                taken += 1;
                if rng.u8(..4) == 0 {
                    drop(guard);
                } else {
                    guard.release().await.expect("release");
                }
            }
            taken
        });
    }
    let mut taken = 0;
    let all = async {
        while let Some(done) = tasks.join_next().await {
            taken += done.expect("task");
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .is_err()
    {
        panic!("lock_all deadlocked: tasks still waiting a minute after the crowd ended");
    }
    assert!(
        taken >= 8,
        "only {taken} sets were taken: too little to judge"
    );
    for (i, book) in books.iter().enumerate() {
        let report = book.report();
        assert!(
            report.violations.is_empty(),
            "{}: {:?}",
            names[i],
            report.violations
        );
        assert_eq!(report.still_inside, 0);
    }
    // Dropped guards release in the background: every name is free soon after.
    let ttl = lockers[0].default_options().ttl;
    for name in names.iter() {
        let g = lockers[1]
            .lock_timeout(name, ttl + Duration::from_secs(2))
            .await
            .unwrap_or_else(|e| panic!("{name} stayed held after the crowd: {e}"));
        g.release().await.expect("release");
    }
}

/// A set goes back all at once: with every packet held up on its way through the
/// proxy, giving back eight locks takes about as long as giving back one (one release
/// after another would take eight times as long), and each of them is free afterwards.
/// The harness's backend must answer through that delay (Redlock: a `node_timeout`
/// above it). Two sets, the quicker counted, as of two single locks: on a loaded
/// machine one release of a set may still have to open a connection through the
/// delay (the warm-up's releases can reuse each other's connections).
///
/// # Panics
/// When a release fails, the set takes four times as long as one lock or more, or a
/// lock of it stays held.
pub async fn a_set_goes_back_at_once(h: &Harness) {
    const DELAY: Duration = Duration::from_millis(60);
    const SET: usize = 8;
    let near = h
        .proxied_locker()
        .await
        .expect("this behaviour needs a harness with a fault proxy");
    let switch = h.fault_switch();
    let names: Vec<String> = (0..2 * SET + 2)
        .map(|i| unique(&format!("set-back{i}")))
        .collect();
    // Releases at once may each want a connection of their own (a pool): a set given
    // back now, before every round trip is slow, opens them.
    let warm: Vec<String> = names.iter().map(|n| format!("{n}:warm")).collect();
    near.lock_all(&warm, &LockOptions::new())
        .await
        .expect("lock_all to warm up")
        .release()
        .await
        .expect("release to warm up");
    let singles = [
        near.lock(&names[0]).await.expect("lock"),
        near.lock(&names[1]).await.expect("lock"),
    ];
    let mut sets = Vec::new();
    for set in names[2..].chunks(SET) {
        sets.push(
            near.lock_all(set, &LockOptions::new())
                .await
                .expect("lock_all"),
        );
    }

    switch(super::NetFault::Delay(DELAY));
    // One lock's release, the quicker of two (a stray packet ahead of one adds a delay).
    let mut single = Duration::MAX;
    for one in singles {
        let started = Instant::now();
        one.release().await.expect("release of one lock");
        single = single.min(started.elapsed());
    }
    let mut whole = Duration::MAX;
    for set in sets {
        let started = Instant::now();
        set.release().await.expect("release of the set");
        whole = whole.min(started.elapsed());
    }
    switch(super::NetFault::None);

    assert!(
        single >= DELAY && whole < single * 4,
        "one lock went back in {single:?}, a set of {SET} in {whole:?} (each packet held {DELAY:?})"
    );
    let other = h.locker().await;
    for name in &names {
        let g = other
            .try_lock(name)
            .await
            .expect("try_lock")
            .unwrap_or_else(|| panic!("{name} still held after its release"));
        g.release().await.expect("release");
    }
}
