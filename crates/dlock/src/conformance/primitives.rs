//! Semaphores and read-write locks ([`crate::Locker::semaphore`],
//! [`crate::Locker::rwlock`]): judged by a racy store of their own here — who is
//! inside, counted at entry — never by asking the primitive.
//!
//! A backend whose [`crate::Capabilities::primitives`] does not list a primitive must
//! refuse it with [`Error::Unsupported`]; the behaviours check that and stop there.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::{Harness, eventually, unique};
use crate::{Error, LockGuard, LockOptions, Locker, Owner, Renewal, Wait};

/// Whether `locker` offers semaphores; if not, check that it says so when asked.
async fn offers_semaphore(locker: &Locker) -> bool {
    if locker.capabilities().primitives.semaphore {
        return true;
    }
    match locker.semaphore(&unique("nosem"), 2).try_acquire().await {
        Err(Error::Unsupported(_)) => false,
        other => panic!("a backend without semaphores answered {other:?}, not Unsupported"),
    }
}

/// Whether `locker` offers read-write locks; if not, check that it says so when asked.
async fn offers_rwlock(locker: &Locker) -> bool {
    if locker.capabilities().primitives.rwlock {
        return true;
    }
    match locker.rwlock(&unique("norw")).try_read().await {
        Err(Error::Unsupported(_)) => false,
        other => panic!("a backend without read-write locks answered {other:?}, not Unsupported"),
    }
}

/// Who is inside, as the protected resource sees it.
#[derive(Debug, Default)]
struct Room {
    /// Inside now: section id → (owner, writer?).
    inside: HashMap<u64, (String, bool)>,
    next: u64,
    tokens: HashSet<u64>,
    violations: Vec<String>,
    sections: u64,
}

#[derive(Debug, Default, Clone)]
struct SharedRoom(Arc<Mutex<Room>>);

impl SharedRoom {
    fn room(&self) -> std::sync::MutexGuard<'_, Room> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// After a crowd: no violation, and enough sections for the test to prove
    /// something.
    fn assert_crowd_sound(&self) {
        let r = self.room();
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        assert!(
            r.sections > 20,
            "only {} sections: the test proves little",
            r.sections
        );
    }

    /// A holder enters with its grant's token; `limit`: at most this many inside (a
    /// semaphore), `writer`: a read-write lock's writer (`Some(false)`: a reader).
    fn enter(&self, token: u64, owner: &str, limit: Option<usize>, writer: Option<bool>) -> u64 {
        let mut r = self.room();
        if !r.tokens.insert(token) {
            r.violations.push(format!("token {token} granted twice"));
        }
        if let Some(limit) = limit
            && r.inside.len() >= limit
        {
            let n = r.inside.len() + 1;
            r.violations
                .push(format!("{n} permit holders inside a semaphore of {limit}"));
        }
        if let Some(writer) = writer {
            let clash = r.inside.values().any(|(o, w)| o != owner && (writer || *w));
            if clash {
                r.violations.push(format!(
                    "a {} entered while another owner's {} was inside",
                    if writer { "writer" } else { "reader" },
                    if writer { "holder" } else { "writer" }
                ));
            }
        }
        r.next += 1;
        r.sections += 1;
        let id = r.next;
        r.inside
            .insert(id, (owner.to_owned(), writer.unwrap_or(false)));
        id
    }

    fn exit(&self, id: u64, still_held: bool, what: &str) {
        let mut r = self.room();
        r.inside.remove(&id);
        if !still_held {
            r.violations.push(format!(
                "a {what} was lost while inside (its lease is long)"
            ));
        }
    }
}

/// One section: work a little inside, then leave and release.
async fn inside(room: &SharedRoom, g: LockGuard, limit: Option<usize>, writer: Option<bool>) {
    let id = room.enter(g.fencing_token(), g.owner().as_str(), limit, writer);
    tokio::time::sleep(Duration::from_millis(fastrand::u64(1..8))).await;
    room.exit(
        id,
        g.is_held(),
        if limit.is_some() { "permit" } else { "hold" },
    );
    g.release().await.expect("release");
}

/// Options for a crowd task: a long lease (no legitimate loss), a random way to wait.
fn crowd_opts(owner: Option<&Owner>) -> LockOptions {
    let wait = match fastrand::u8(0..3) {
        0 => Wait::Forever,
        1 => Wait::Timeout(Duration::from_millis(fastrand::u64(1..300))),
        _ => Wait::NoWait,
    };
    let opts = LockOptions::new().ttl(Duration::from_secs(15)).wait(wait);
    match owner {
        Some(o) => opts.owner(o.clone()),
        None => opts,
    }
}

/// A semaphore of 3: ten tasks on two lockers (four of them sharing one owner) take
/// permits with waits without end, random timeouts, no-wait attempts and
/// cancellations, for a bounded time. Never more than 3 inside, every token granted
/// once; then 3 permits can be taken at once and a 4th cannot — it is a semaphore of
/// 3, and nothing was left held.
///
/// # Panics
/// On more than 3 holders, a token granted twice, a permit left held, or a backend
/// without semaphores that does not refuse them.
pub async fn semaphore_admits_at_most_its_permits(h: &Harness) {
    let (a, b) = (h.locker().await, h.locker().await);
    if !offers_semaphore(&a).await {
        return;
    }
    let name = unique("sem");
    let room = SharedRoom::default();
    let shared = Owner::random();
    let stop = Instant::now() + Duration::from_secs(4);
    let mut tasks = Vec::new();
    for t in 0..10 {
        let sem = if t % 2 == 0 { &a } else { &b }.semaphore(&name, 3);
        let room = room.clone();
        let owner = (t < 4).then(|| shared.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..40 {
                if Instant::now() >= stop {
                    break;
                }
                let opts = crowd_opts(owner.as_ref());
                let attempt = sem.acquire_with(&opts);
                let got = if fastrand::u8(0..4) == 0 {
                    // Cancelled after a random while, whatever the attempt was doing.
                    let cut = Duration::from_millis(fastrand::u64(0..50));
                    match tokio::time::timeout(cut, attempt).await {
                        Ok(r) => r,
                        Err(_) => continue,
                    }
                } else {
                    attempt.await
                };
                match got {
                    Ok(g) => inside(&room, g, Some(3), None).await,
                    Err(Error::Timeout { .. }) => {}
                    Err(e) => panic!("permit: {e}"),
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("the crowd finished")
            .expect("task");
    }
    // Three at once, held together (a cancelled attempt may finish giving back its
    // grant in the background for a moment: wait for it, a lease is 15 s).
    let sem = a.semaphore(&name, 3);
    let mut held = Vec::new();
    let give_up = Instant::now() + Duration::from_secs(3);
    while held.len() < 3 && Instant::now() < give_up {
        match sem.try_acquire().await.expect("try_acquire") {
            Some(g) => held.push(g),
            None => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    assert!(
        held.len() == 3,
        "only {} of 3 permits free after the crowd: one was left held",
        held.len()
    );
    let fourth = b.semaphore(&name, 3).try_acquire().await.expect("try");
    assert!(fourth.is_none(), "a 4th permit of a semaphore of 3");
    // An observer sees exactly these three holders.
    let seen = b.semaphore(&name, 3).holders().await.expect("holders");
    let seen_tokens: Vec<u64> = seen.iter().map(|i| i.fencing_token).collect();
    let mut held_tokens: Vec<u64> = held.iter().map(LockGuard::fencing_token).collect();
    held_tokens.sort_unstable();
    assert_eq!(seen_tokens, held_tokens, "holders() shows other permits");
    // A lease's time left is shown; a session-bound permit lasts while its session does.
    let session_bound = a.capabilities().session_bound;
    assert!(
        seen.iter()
            .all(|i| i.hold == Some(crate::HoldKind::Permit)
                && (i.remaining.is_some() || session_bound)),
        "{seen:?}"
    );
    let mut tokens: Vec<u64> = held.iter().map(LockGuard::fencing_token).collect();
    let sorted = {
        let mut t = tokens.clone();
        t.sort_unstable();
        t
    };
    assert_eq!(
        tokens, sorted,
        "tokens of successive grants are not increasing"
    );
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "a token granted twice");
    for g in held {
        g.release().await.expect("release");
    }
    room.assert_crowd_sound();
    // How many were inside at once depends on the machine's load (under load a
    // ZooKeeper grant outlasts the 1–8 ms sections): 3 at once is proven above.
}

/// A permit whose holder vanished without releasing (a crash: its renewals stop) is
/// free once its lease ends — within TTL (or the session timeout) plus 0.5 s — and no
/// sooner than the lease allows while it lives.
///
/// # Panics
/// When the permit stays taken, or is given to another before its holder is gone.
pub async fn semaphore_permit_of_a_dead_holder_frees(h: &Harness) {
    let locker = h.locker().await;
    if !offers_semaphore(&locker).await {
        return;
    }
    let name = unique("semdead");
    let ttl = Duration::from_millis(800);
    let sem = locker.semaphore(&name, 1);
    // Connected first: a connection made on a busy machine could outlast the lease.
    let other = h.locker().await.semaphore(&name, 1);
    let asked = Instant::now();
    let dead = sem
        .acquire_with(&LockOptions::new().ttl(ttl).renewal(Renewal::Off))
        .await
        .expect("permit");
    let taken = Instant::now();
    // What a crash leaves: the hold is neither renewed nor released.
    std::mem::forget(dead);
    let second = other.try_acquire().await.expect("try");
    // The lease began after `asked`: an answer before `asked + ttl` came while it lived.
    // (A later one may rightly find it ended: the machine was too busy to tell.)
    assert!(
        second.is_none() || asked.elapsed() >= ttl,
        "the only permit given twice"
    );
    if let Some(g) = second {
        println!(
            "figure: semaphore try answered {:?} after the dead holder asked (past its \
             {ttl:?} lease): not judged",
            asked.elapsed()
        );
        g.release().await.expect("release");
        return;
    }
    let bound = locker.capabilities().session_timeout.unwrap_or(ttl) + Duration::from_millis(500);
    let g = other
        .acquire_timeout(bound + Duration::from_secs(2))
        .await
        .expect("the dead holder's permit was never freed");
    let freed = taken.elapsed();
    assert!(
        freed < bound + Duration::from_millis(300),
        "freed after {freed:?}"
    );
    g.release().await.expect("release");
}

/// Eight tasks on two lockers, readers and writers (a writer and a reader sharing an
/// owner among them), with random waits and cancellations: a writer is never inside
/// with another owner's reader or writer, and nothing is left held; then two owners read
/// at once while a write is refused.
///
/// # Panics
/// On a writer overlapping another owner, a hold left, a second reader refused or a
/// write granted beside readers.
pub async fn rwlock_readers_share_and_a_writer_excludes(h: &Harness) {
    let (a, b) = (h.locker().await, h.locker().await);
    if !offers_rwlock(&a).await {
        return;
    }
    let name = unique("rw");
    let room = SharedRoom::default();
    let shared = Owner::random();
    let stop = Instant::now() + Duration::from_secs(4);
    let mut tasks = Vec::new();
    for t in 0..8 {
        let rw = if t % 2 == 0 { &a } else { &b }.rwlock(&name);
        let room = room.clone();
        let writer = t % 4 == 0 || t == 5;
        let owner = (t == 0 || t == 1).then(|| shared.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..40 {
                if Instant::now() >= stop {
                    break;
                }
                let opts = crowd_opts(owner.as_ref());
                let attempt = async {
                    if writer {
                        rw.write_with(&opts).await
                    } else {
                        rw.read_with(&opts).await
                    }
                };
                let got = if fastrand::u8(0..4) == 0 {
                    let cut = Duration::from_millis(fastrand::u64(0..50));
                    match tokio::time::timeout(cut, attempt).await {
                        Ok(r) => r,
                        Err(_) => continue,
                    }
                } else {
                    attempt.await
                };
                match got {
                    Ok(g) => inside(&room, g, None, Some(writer)).await,
                    // The shared owner's writer while its reader holds.
                    Err(Error::Timeout { .. } | Error::UpgradeRefused { .. }) => {}
                    Err(e) => panic!("{}: {e}", if writer { "write" } else { "read" }),
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("the crowd finished")
            .expect("task");
    }
    let rw = a.rwlock(&name);
    let came = eventually(Duration::from_secs(3), || {
        let rw = rw.clone();
        async move {
            match rw.try_write().await.expect("try_write") {
                Some(g) => {
                    g.release().await.expect("release");
                    true
                }
                None => false,
            }
        }
    })
    .await;
    assert!(
        came,
        "the write is not free after the crowd: a hold was left"
    );
    room.assert_crowd_sound();
    // Readers share: two owners read at once while a writer is refused. (How often the
    // crowd's readers overlapped depends on the machine's load: proven here instead,
    // once a cancelled writer's queue entry is gone — it may leave in the background.)
    let (ra, rb) = (a.rwlock(&name), b.rwlock(&name));
    let shared = eventually(Duration::from_secs(3), || {
        let (ra, rb) = (ra.clone(), rb.clone());
        async move {
            let Some(first) = ra.try_read().await.expect("try_read") else {
                return false;
            };
            let second = rb.try_read().await.expect("try_read");
            let both = second.is_some();
            if both {
                assert!(
                    rb.try_write().await.expect("try_write").is_none(),
                    "a write while two read"
                );
            }
            first.release().await.expect("release");
            if let Some(g) = second {
                g.release().await.expect("release");
            }
            both
        }
    })
    .await;
    assert!(shared, "two readers never read at once after the crowd");
}

/// Two readers keep the lock read without a gap; a writer that comes is granted within
/// its wait all the same (new readers wait behind it), and a writer that gave up (timed
/// out, or cancelled) keeps no reader out afterwards.
///
/// # Panics
/// When the writer is starved, or a writer that left still blocks readers.
pub async fn rwlock_a_waiting_writer_is_not_starved(h: &Harness) {
    let (a, b) = (h.locker().await, h.locker().await);
    if !offers_rwlock(&a).await {
        return;
    }
    let name = unique("rwstarve");
    let stop = Instant::now() + Duration::from_secs(6);
    let mut readers = Vec::new();
    for r in 0..2u64 {
        let rw = a.rwlock(&name);
        readers.push(tokio::spawn(async move {
            // Staggered, each re-reading at once: the lock is never without a reader.
            tokio::time::sleep(Duration::from_millis(40 * r)).await;
            let mut reads = 0u32;
            while Instant::now() < stop {
                let g = rw.read().await.expect("read");
                tokio::time::sleep(Duration::from_millis(80)).await;
                g.release().await.expect("release");
                reads += 1;
            }
            reads
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let writer = b.rwlock(&name);
    let started = Instant::now();
    let g = writer
        .write_timeout(Duration::from_secs(4))
        .await
        .expect("a writer starved by a stream of readers");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the writer waited {:?}",
        started.elapsed()
    );
    g.release().await.expect("release");
    for r in readers {
        assert!(r.await.expect("reader") > 2, "the readers hardly read");
    }

    // A writer that times out, and one that is cancelled, leave no entry behind that
    // would keep readers out (their entries would live 10 s).
    let reader = a.rwlock(&name).read().await.expect("read");
    let left = LockOptions::new()
        .wait(Wait::Timeout(Duration::from_millis(200)))
        .queue_entry_ttl(Duration::from_secs(10));
    match b.rwlock(&name).write_with(&left).await {
        Err(Error::Timeout { .. }) => {}
        other => panic!("a write while a read is held: {other:?}"),
    }
    let in_again = b.rwlock(&name).try_read().await.expect("try_read");
    assert!(
        in_again.is_some(),
        "a writer that timed out keeps readers out"
    );
    if let Some(g) = in_again {
        g.release().await.expect("release");
    }
    let forever = LockOptions::new().queue_entry_ttl(Duration::from_secs(10));
    let rw = b.rwlock(&name);
    let cancelled = tokio::time::timeout(Duration::from_millis(200), rw.write_with(&forever));
    assert!(cancelled.await.is_err(), "a write while a read is held");
    let rw = b.rwlock(&name);
    let reads_again = eventually(Duration::from_secs(2), || {
        let rw = rw.clone();
        async move {
            match rw.try_read().await.expect("try_read") {
                Some(g) => {
                    g.release().await.expect("release");
                    true
                }
                None => false,
            }
        }
    })
    .await;
    assert!(reads_again, "a cancelled writer keeps readers out");
    reader.release().await.expect("release");
}

/// An owner holding a read that asks to write is refused with
/// [`Error::UpgradeRefused`] (at once, not after a wait); the writer may read; tokens
/// strictly increase over read and write grants.
///
/// # Panics
/// When an upgrade waits or is granted, or tokens do not increase.
pub async fn rwlock_upgrade_is_refused_and_tokens_increase(h: &Harness) {
    let locker = h.locker().await;
    if !offers_rwlock(&locker).await {
        return;
    }
    let rw = locker.rwlock(&unique("rwup"));
    let me = Owner::random();
    let mine = LockOptions::new().owner(me.clone());
    let r1 = rw.read_with(&mine).await.expect("read");
    let started = Instant::now();
    match rw
        .write_with(&mine.clone().wait(Wait::Timeout(Duration::from_secs(5))))
        .await
    {
        Err(Error::UpgradeRefused { .. }) => {}
        other => panic!("an upgrade answered {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the refusal waited"
    );
    let r2 = rw.read().await.expect("a second reader");
    assert!(r2.fencing_token() > r1.fencing_token());
    let seen = rw.holders().await.expect("holders");
    assert_eq!(
        seen.iter()
            .map(|i| (i.hold, i.fencing_token))
            .collect::<Vec<_>>(),
        [
            (Some(crate::HoldKind::Read), r1.fencing_token()),
            (Some(crate::HoldKind::Read), r2.fencing_token())
        ],
        "holders() while two read"
    );
    let read_token = r2.fencing_token();
    r1.release().await.expect("release");
    r2.release().await.expect("release");
    let w = rw.write_with(&mine).await.expect("write");
    assert!(
        w.fencing_token() > read_token,
        "a write's token below a read's"
    );
    let under = rw.read_with(&mine).await.expect("the writer reads");
    assert!(under.fencing_token() > w.fencing_token());
    assert!(
        rw.try_read().await.expect("try_read").is_none(),
        "another owner read under a write"
    );
    under.release().await.expect("release");
    w.release().await.expect("release");
}

/// Several permits at once ([`crate::Semaphore::acquire_many`]) on a semaphore of 3:
/// eight tasks on two lockers (three sharing one owner) take 1, 2 or 3 permits at a
/// time, waiting without end, with random timeouts, without waiting, or cancelled
/// after a random while, for a bounded time. The permits held never add up to more
/// than 3 (each permit is its own holder in the room), callers of several never wait
/// for each other in a circle (every task finishes), and afterwards the 3 permits and
/// the gate are free. `k` of 0 or above the permits is refused.
///
/// # Panics
/// On more than 3 permits held, a task that does not finish, a permit or the gate
/// left held, or a bad `k` accepted.
pub async fn semaphore_many_permits_all_or_none_without_deadlock(h: &Harness) {
    let (a, b) = (h.locker().await, h.locker().await);
    if !offers_semaphore(&a).await {
        return;
    }
    let name = unique("semk");
    for k in [0, 4] {
        match a.semaphore(&name, 3).try_acquire_many(k).await {
            Err(Error::InvalidOption { .. }) => {}
            other => panic!("{k} permits of 3 answered {other:?}"),
        }
    }
    let room = SharedRoom::default();
    let shared = Owner::random();
    let stop = Instant::now() + Duration::from_secs(4);
    let whole = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..8 {
        let sem = if t % 2 == 0 { &a } else { &b }.semaphore(&name, 3);
        let room = room.clone();
        let whole = Arc::clone(&whole);
        let owner = (t < 3).then(|| shared.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..30 {
                if Instant::now() >= stop {
                    break;
                }
                let k = fastrand::u32(1..=3);
                let opts = crowd_opts(owner.as_ref());
                let attempt = sem.acquire_many_with(k, &opts);
                let got = if fastrand::u8(0..4) == 0 {
                    let cut = Duration::from_millis(fastrand::u64(0..50));
                    match tokio::time::timeout(cut, attempt).await {
                        Ok(r) => r,
                        Err(_) => continue,
                    }
                } else {
                    attempt.await
                };
                let set = match got {
                    Ok(set) => set,
                    Err(Error::Timeout { .. }) => continue,
                    Err(e) => panic!("{k} permits: {e}"),
                };
                assert_eq!(set.guards().len(), k as usize, "asked for {k} permits");
                if k == 3 {
                    whole.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                let ids: Vec<u64> = set
                    .guards()
                    .iter()
                    .map(|g| room.enter(g.fencing_token(), g.owner().as_str(), Some(3), None))
                    .collect();
                tokio::time::sleep(Duration::from_millis(fastrand::u64(1..8))).await;
                let held = set.is_held();
                for id in ids {
                    room.exit(id, held, "permit");
                }
                set.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("callers of several permits waited for each other")
            .expect("task");
    }
    {
        let r = room.room();
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        assert!(r.sections > 0, "no permit was ever granted");
    }
    assert!(
        whole.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "all 3 permits were never taken at once"
    );
    // Everything given back (a cancelled call may finish releasing in the
    // background for a moment): 3 permits at once, and the gate.
    let sem = a.semaphore(&name, 3);
    let give_up = Instant::now() + Duration::from_secs(5);
    let all = loop {
        if let Some(all) = sem.try_acquire_many(3).await.expect("try_acquire_many") {
            break Some(all);
        }
        if Instant::now() >= give_up {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let all = all.expect("3 permits not free after the crowd: one (or the gate) was left held");
    assert!(
        b.semaphore(&name, 3)
            .try_acquire()
            .await
            .expect("try")
            .is_none(),
        "a 4th permit of a semaphore of 3"
    );
    all.release().await.expect("release");
}

/// `fair` for a semaphore and a read-write lock: accepted where the backend serves
/// them in arrival order ([`crate::Primitives::fifo`]) — waiters on a semaphore of 1
/// are then let in in the order they came — and refused with [`Error::Unsupported`]
/// elsewhere.
///
/// # Panics
/// When `fair` is accepted where the capabilities say it is not (or refused where
/// they say it is), or fair waiters are let in out of order.
pub async fn fair_primitives_are_served_in_arrival_order(h: &Harness) {
    let locker = h.locker().await;
    if !offers_semaphore(&locker).await {
        return;
    }
    let fair = LockOptions::new()
        .fair(true)
        .wait(Wait::Timeout(Duration::from_secs(20)));
    let sem = locker.semaphore(&unique("semfair"), 1);
    if !locker.capabilities().primitives.fifo {
        match sem.acquire_with(&fair).await {
            Err(Error::Unsupported(_)) => {}
            other => panic!("fair permit where primitives are not FIFO: {other:?}"),
        }
        match locker.rwlock(&unique("rwfair")).read_with(&fair).await {
            Err(Error::Unsupported(_)) => {}
            other => panic!("fair read where primitives are not FIFO: {other:?}"),
        }
        return;
    }
    let first = sem.acquire_with(&fair).await.expect("fair permit");
    let takes = (0..3).map(|_| Take::Permit(1));
    let order = order_of_waiters(h, sem.name(), first, &fair, takes).await;
    assert_eq!(order, [0, 1, 2], "fair waiters let in out of arrival order");
    // A read-write lock: a writer that came first goes first, before a later reader.
    let rw = locker.rwlock(&unique("rwfair"));
    let first = rw.write_with(&fair).await.expect("a fair write");
    let takes = [Take::Write, Take::Read];
    let order = order_of_waiters(h, rw.name(), first, &fair, takes).await;
    assert_eq!(
        order,
        [0, 1],
        "a reader went before the writer that came first"
    );
}

/// What a waiter of [`order_of_waiters`] takes.
#[derive(Debug, Clone, Copy)]
enum Take {
    Permit(u32),
    Read,
    Write,
}

/// Waiters on lockers of their own take `takes` of `name` (waiter `i` the `i`-th),
/// one second apart (each queued before the next comes, generously on a loaded
/// machine), while `first` holds; then `first` is released. The order they got in.
async fn order_of_waiters(
    h: &Harness,
    name: &str,
    first: LockGuard,
    opts: &LockOptions,
    takes: impl IntoIterator<Item = Take>,
) -> Vec<usize> {
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for (w, take) in takes.into_iter().enumerate() {
        let locker = h.locker().await;
        let (name, opts, order) = (name.to_owned(), opts.clone(), Arc::clone(&order));
        waiters.push(tokio::spawn(async move {
            let g = match take {
                Take::Permit(n) => locker.semaphore(&name, n).acquire_with(&opts).await,
                Take::Read => locker.rwlock(&name).read_with(&opts).await,
                Take::Write => locker.rwlock(&name).write_with(&opts).await,
            }
            .expect("fair waiter");
            order.lock().unwrap_or_else(|p| p.into_inner()).push(w);
            tokio::time::sleep(Duration::from_millis(20)).await;
            g.release().await.expect("release");
        }));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    first.release().await.expect("release");
    for w in waiters {
        tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("a fair waiter was never let in")
            .expect("waiter");
    }
    order.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// A write downgraded to a read ([`crate::RwLock::downgrade`]): the read is held with
/// a higher token, another owner's reader gets in beside it, a writer does not. With a
/// writer of another owner waiting, the downgrade keeps that writer out until the read
/// ends where the backend lets a read in under its owner's write at any time
/// ([`crate::Primitives::downgrade_while_a_writer_waits`]), and elsewhere is refused
/// with [`Error::DowngradeRefused`], the write handed back still held. A guard that is
/// not a write of the lock is refused and handed back.
///
/// # Panics
/// When a writer gets in beside the downgraded read, a downgrade happens where the
/// backend says it cannot, a refused write is not held, or tokens do not increase.
pub async fn rwlock_downgrade_keeps_writers_out(h: &Harness) {
    let locker = h.locker().await;
    if !offers_rwlock(&locker).await {
        return;
    }
    let rw = locker.rwlock(&unique("rwdown"));
    let theirs = h.locker().await.rwlock(rw.name());
    let held = |g: &LockGuard| (Some(crate::HoldKind::Read), g.fencing_token());

    // No writer waiting: always downgraded.
    let w = rw.write().await.expect("write");
    let write_token = w.fencing_token();
    let r = rw.downgrade(w).await.expect("downgrade");
    assert!(r.is_held(), "the downgraded read is not held");
    assert!(
        r.fencing_token() > write_token,
        "the read's token is not above the write's"
    );
    let seen = rw.holders().await.expect("holders");
    assert_eq!(
        seen.iter()
            .map(|i| (i.hold, i.fencing_token))
            .collect::<Vec<_>>(),
        [held(&r)],
        "holders() after a downgrade: the read alone"
    );
    let beside = theirs
        .try_read()
        .await
        .expect("try_read")
        .expect("another owner's read beside a downgraded read");
    assert!(
        theirs.try_write().await.expect("try_write").is_none(),
        "a writer got in beside a downgraded read"
    );
    beside.release().await.expect("release");
    r.release().await.expect("release");

    // A writer of another owner waits behind the write. Where the backend orders
    // contenders by arrival, the downgrade must be refused once that writer is
    // queued; when it came before the writer was (a loaded machine), the round is
    // played again with more time for the writer to queue.
    let always = locker
        .capabilities()
        .primitives
        .downgrade_while_a_writer_waits;
    let mut refused = false;
    for round in 0..4u32 {
        let w = rw.write().await.expect("write");
        let write_token = w.fencing_token();
        let writer = theirs.clone();
        let waiting = tokio::spawn(async move {
            let g = writer.write_timeout(Duration::from_secs(60)).await;
            (Instant::now(), g)
        });
        tokio::time::sleep(Duration::from_millis(500) * 2u32.pow(round)).await;
        assert!(!waiting.is_finished(), "a writer got in beside a write");
        let ended = match rw.downgrade(w).await {
            Ok(read) => {
                assert!(read.fencing_token() > write_token);
                tokio::time::sleep(Duration::from_millis(500)).await;
                assert!(
                    !waiting.is_finished(),
                    "the waiting writer got in beside the downgraded read"
                );
                let ended = Instant::now();
                read.release().await.expect("release");
                ended
            }
            Err(crate::NotDowngraded {
                error: Error::DowngradeRefused { .. },
                write,
            }) => {
                assert!(
                    !always,
                    "a downgrade refused on a backend that says it always downgrades"
                );
                refused = true;
                assert!(
                    write.is_held(),
                    "the refused write was not handed back held"
                );
                assert!(
                    !waiting.is_finished(),
                    "the writer got in beside the kept write"
                );
                let ended = Instant::now();
                write.release().await.expect("release");
                ended
            }
            Err(other) => panic!("a downgrade with a writer waiting answered {other:?}"),
        };
        let (got_in, g) = waiting.await.expect("writer task");
        let g = g.expect("the waiting writer gets in once the hold ends");
        assert!(got_in >= ended, "the writer got in before the hold ended");
        g.release().await.expect("release");
        if always || refused {
            break;
        }
    }
    assert!(
        always || refused,
        "a backend that orders contenders by arrival downgraded past a waiting writer in every round"
    );

    // Not a write of this lock: refused, handed back as it was.
    let r = rw.read().await.expect("read");
    match rw.downgrade(r).await {
        Err(crate::NotDowngraded {
            error: Error::InvalidOption { .. },
            write,
        }) => {
            assert!(write.is_held(), "a refused guard was not handed back held");
            write.release().await.expect("release");
        }
        other => panic!("downgrading a read answered {other:?}"),
    }
}

/// Three candidates on three lockers campaign at once: one leads, an observer sees its
/// value and term (and a watch reports it), the others wait; each resignation hands
/// leadership to a waiting candidate with a higher term, never to two at once. Each
/// leader leads until the observer has seen it (at most 10 s) and at least 200 ms, so a
/// slow observer on a busy machine is not mistaken for a wrong answer.
///
/// # Panics
/// On two leaders at once, a term that does not increase, or an observer that sees
/// another value than the leader's.
pub async fn election_one_leader_terms_increase(h: &Harness) {
    let name = unique("elect");
    // A shared owner would re-enter the leader's hold: refused.
    let owned = LockOptions::new().owner(crate::Owner::random());
    match h
        .locker()
        .await
        .election(&name)
        .campaign_with("o", &owned)
        .await
    {
        Err(Error::InvalidOption { .. }) => {}
        other => panic!("a campaign with an owner of its own choosing answered {other:?}"),
    }
    let leading = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut candidates = Vec::new();
    type Seen = tokio::sync::oneshot::Sender<()>;
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<(String, u64, Seen)>();
    for c in 0..3 {
        let election = h.locker().await.election(&name);
        let leading = Arc::clone(&leading);
        let done = done_tx.clone();
        candidates.push(tokio::spawn(async move {
            let value = format!("candidate-{c}");
            let me = election
                .campaign_with(
                    &value,
                    &LockOptions::new().wait(Wait::Timeout(Duration::from_secs(30))),
                )
                .await
                .expect("campaign");
            {
                let mut now = leading.lock().unwrap_or_else(|p| p.into_inner());
                now.push(value.clone());
                assert_eq!(now.len(), 1, "two leaders at once: {now:?}");
            }
            let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
            let led_since = Instant::now();
            let _ = done.send((value.clone(), me.term(), seen_tx));
            let _ = tokio::time::timeout(Duration::from_secs(10), seen_rx).await;
            // Long enough for the watch (every 20 ms) to see it too.
            tokio::time::sleep_until(led_since + Duration::from_millis(200)).await;
            assert!(me.is_leader(), "leadership lost while held");
            leading
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|v| v != &value);
            me.resign().await.expect("resign");
        }));
    }
    drop(done_tx);
    let observer = h.locker().await.election(&name);
    // Connected before the first leader is looked for.
    let _ = observer.leader().await.expect("leader");
    // A watch runs beside the observer from the start: the leaders it reports, until
    // the candidates are done and it reports none (bounded).
    let resigned = tokio_util::sync::CancellationToken::new();
    let watcher = tokio::spawn({
        let (mut watch, resigned) = (observer.watch(Duration::from_millis(20)), resigned.clone());
        async move {
            let mut reported = Vec::new();
            let end = Instant::now() + Duration::from_secs(60);
            while Instant::now() < end
                && !(resigned.is_cancelled() && reported.last() == Some(&None))
            {
                // Until the candidates are done, a change is waited for as long as it
                // takes (an answer may be slow on a busy machine); after, for 5 s.
                let change = if resigned.is_cancelled() {
                    tokio::time::timeout(Duration::from_secs(5), watch.changed())
                        .await
                        .ok()
                } else {
                    tokio::select! {
                        c = watch.changed() => Some(c),
                        () = resigned.cancelled() => None,
                    }
                };
                if let Some(c) = change {
                    reported.push(c.expect("watch").map(|l| (l.value, l.term)));
                }
            }
            reported
        }
    });
    let mut terms = Vec::new();
    let mut leaders = Vec::new();
    while let Some((value, term, seen_tx)) =
        tokio::time::timeout(Duration::from_secs(30), done_rx.recv())
            .await
            .expect("a leader within 30 s")
    {
        // While it leads, an observer sees its value and term.
        let seen = eventually(Duration::from_secs(8), || {
            let observer = observer.clone();
            let value = value.clone();
            async move {
                observer
                    .leader()
                    .await
                    .expect("leader")
                    .is_some_and(|l| l.value == value && l.term == term)
            }
        })
        .await;
        assert!(
            seen,
            "an observer never saw {value} (term {term}) lead; it sees {:?}",
            observer.leader().await
        );
        let _ = seen_tx.send(());
        terms.push(term);
        leaders.push((value, term));
    }
    for c in candidates {
        c.await.expect("candidate");
    }
    assert_eq!(terms.len(), 3, "every candidate led once");
    assert!(
        terms.windows(2).all(|w| w[0] < w[1]),
        "terms do not increase: {terms:?}"
    );
    // The watch reported leaders (it may miss a short one), and ends with none. Each
    // it reported is one of the leaders, at that leader's term or, on Redlock while the
    // grant's token is written back to a majority of nodes, at a term below it but
    // above the previous leader's: never a value that did not lead, never a term of an
    // earlier leader or above the leader's own. (Term 0: held, by whom not known yet —
    // MySQL row mode between a lock and its record. A term may be reported again after
    // a moment without one: a hand-off's record is written after the lock on SQL row
    // modes.)
    resigned.cancel();
    let reported = watcher.await.expect("watcher");
    let seen: Vec<&(String, u64)> = reported.iter().flatten().filter(|(_, t)| *t != 0).collect();
    assert!(
        !seen.is_empty(),
        "the watch reported no leader: {reported:?}"
    );
    for (value, term) in seen {
        let at = leaders.iter().position(|(v, _)| v == value);
        let fits = at.is_some_and(|i| {
            let before = if i == 0 { 0 } else { leaders[i - 1].1 };
            *term > before && *term <= leaders[i].1
        });
        assert!(
            fits,
            "the watch reported {value} at term {term} ({reported:?}); the leaders were {leaders:?}"
        );
    }
    assert_eq!(
        reported.last(),
        Some(&None),
        "a leader is left: {reported:?}"
    );
}

/// Five readers on one locker wait behind a write; once it is released they are all
/// let in within a second (not one at a time as each reader's lease runs out).
///
/// # Panics
/// When the readers do not all hold together within a second of the release.
pub async fn rwlock_readers_behind_a_writer_all_get_in(h: &Harness) {
    let locker = h.locker().await;
    if !offers_rwlock(&locker).await {
        return;
    }
    let rw = locker.rwlock(&unique("rwwake"));
    let writer = rw.write().await.expect("write");
    let inside = Arc::new(tokio::sync::Semaphore::new(0));
    let mut readers = Vec::new();
    for _ in 0..5 {
        let (rw, inside) = (rw.clone(), Arc::clone(&inside));
        readers.push(tokio::spawn(async move {
            let g = rw.read().await.expect("read");
            inside.add_permits(1);
            // Hold until all five are in (or give up after a while).
            let all = inside.acquire_many(5).await.expect("semaphore");
            drop(all);
            inside.add_permits(5);
            g.release().await.expect("release");
            Instant::now()
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    writer.release().await.expect("release");
    let all_in = tokio::time::timeout(Duration::from_secs(10), inside.acquire_many(5))
        .await
        .expect("the five readers never held together");
    drop(all_in);
    inside.add_permits(5);
    let took = released.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "the readers took {took:?} to get in after the write was released"
    );
    for r in readers {
        r.await.expect("reader");
    }
}

/// A semaphore of 2 and a read-write lock, each taken by six tasks on two lockers —
/// one behind the harness's fault proxy, which delays traffic, drops replies
/// (requests run, answers vanish) and resets every connection — with random
/// timeouts, no-wait attempts and cancellations (every attempt ends a second after
/// the 5 s run at the latest), leases of 15 s. Errors
/// are allowed; what the resource sees is not: never more than 2 permit holders
/// inside, never a writer beside anyone, no token granted twice. Once the faults
/// stop, nothing is left held: both permits and the write can be had within 5 s (a
/// third of a lease: what could not be given back is retried in the background).
///
/// # Panics
/// On more than 2 permit holders, a writer beside anyone, a token granted twice, or
/// a grant left held after the faults; when the harness has no proxy.
pub async fn primitives_under_faults(h: &Harness) {
    let near = h
        .proxied_locker()
        .await
        .expect("this behaviour needs a harness with a fault proxy");
    let far = h.locker().await;
    if !offers_semaphore(&far).await || !offers_rwlock(&far).await {
        return;
    }
    let (sem_name, rw_name) = (unique("semf"), unique("rwf"));
    let (permits, holds) = (SharedRoom::default(), SharedRoom::default());
    let stop_faults = tokio_util::sync::CancellationToken::new();
    let faults = tokio::spawn(super::shared::drive_faults(
        h.fault_switch(),
        stop_faults.clone(),
    ));
    let stop = Instant::now() + Duration::from_secs(5);
    let granted = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // Each attempt's own owner, and which locker made it: what a failure names.
    let attempts: Arc<Mutex<HashMap<String, &'static str>>> = Arc::default();
    let mut tasks = Vec::new();
    for t in 0..12 {
        let (locker, via) = if t % 2 == 0 {
            (near.clone(), "behind the proxy")
        } else {
            (far.clone(), "not behind the proxy")
        };
        let (sem_name, rw_name) = (sem_name.clone(), rw_name.clone());
        let (permits, holds) = (permits.clone(), holds.clone());
        let (granted, attempts) = (Arc::clone(&granted), Arc::clone(&attempts));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < stop {
                let owner = Owner::random();
                attempts
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(owner.as_str().to_owned(), via);
                let opts = crowd_opts(Some(&owner));
                let on_sem = t < 6;
                let writer = !on_sem && fastrand::u8(0..3) == 0;
                let attempt = async {
                    if on_sem {
                        locker.semaphore(&sem_name, 2).acquire_with(&opts).await
                    } else if writer {
                        locker.rwlock(&rw_name).write_with(&opts).await
                    } else {
                        locker.rwlock(&rw_name).read_with(&opts).await
                    }
                };
                // Cancelled after a random while, or else a second after the end: a
                // grant left held by mistake must not be outwaited by the crowd.
                let cut = if fastrand::u8(0..4) == 0 {
                    Instant::now() + Duration::from_millis(fastrand::u64(0..50))
                } else {
                    stop + Duration::from_secs(1)
                };
                let Ok(got) = tokio::time::timeout_at(cut, attempt).await else {
                    continue;
                };
                let Ok(g) = got else {
                    // Timeouts, and errors of requests the proxy cut: allowed.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                granted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let (room, limit, kind) = if on_sem {
                    (&permits, Some(2), None)
                } else {
                    (&holds, None, Some(writer))
                };
                if !g.is_held() {
                    continue;
                }
                let id = room.enter(g.fencing_token(), g.owner().as_str(), limit, kind);
                tokio::time::sleep(Duration::from_millis(fastrand::u64(1..8))).await;
                // A grant lost to the faults is allowed here (a lease of 15 s is not
                // lost otherwise): only who was inside together is judged.
                room.room().inside.remove(&id);
                let _ = g.release().await;
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("a task hung under faults")
            .expect("task");
    }
    stop_faults.cancel();
    let injected = faults.await.expect("fault driver");
    for (what, room) in [("semaphore", &permits), ("read-write lock", &holds)] {
        let r = room.room();
        assert!(r.violations.is_empty(), "{what}: {:?}", r.violations);
    }
    assert!(
        granted.load(std::sync::atomic::Ordering::Relaxed) >= 10 && injected >= 5,
        "too little happened to judge: {granted:?} grants, {injected} faults"
    );
    // Nothing left held: a release or an undo that could not get through is retried
    // in the background (backoff up to 1 s), so the permits and the write come free
    // within seconds of the faults' end — not when the 15 s leases run out.
    let within = Duration::from_secs(5);
    let fresh = h.locker().await;
    let sem = fresh.semaphore(&sem_name, 2);
    // Who is still inside, when something is, and which locker's attempt left it.
    let left = |what: &str, e: &Error, inside: crate::Result<Vec<crate::LockInfo>>| {
        let attempts = attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let whose: Vec<&str> = inside.as_ref().map_or_else(
            |_| Vec::new(),
            |holders| {
                holders
                    .iter()
                    .map(|h| attempts.get(&h.owner).copied().unwrap_or("of no attempt"))
                    .collect()
            },
        );
        format!(
            "{what} free after the faults: {e:?}; still inside: {inside:?}, left by attempts {whose:?}"
        )
    };
    let all = match sem
        .acquire_many_with(2, &LockOptions::new().wait(Wait::Timeout(within)))
        .await
    {
        Ok(all) => all,
        Err(e) => panic!("{}", left("both permits", &e, sem.holders().await)),
    };
    all.release().await.expect("release");
    let rw = fresh.rwlock(&rw_name);
    let w = match rw.write_timeout(within).await {
        Ok(w) => w,
        Err(e) => panic!("{}", left("the write", &e, rw.holders().await)),
    };
    w.release().await.expect("release");
}
