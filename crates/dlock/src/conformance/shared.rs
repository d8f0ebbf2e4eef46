//! Behaviours with many tasks per [`Locker`]: owners shared by several tasks (and by
//! two lockers), acquisitions that time out or are cancelled while an attempt is in
//! flight, reentrant holds with different TTLs, the same owner asking again while it
//! holds. These are the paths where a backend's in-process shared state (slots, queue
//! maps, hand-off registries, session keys, a lease row several holds renew) can give
//! two holders, an orphan or a stale token. Every run is judged by a
//! [`FencedBook`](super::FencedBook), never by the lock itself.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

use super::fenced::FencedBook;
use super::{Harness, NetFault, unique};
use crate::{Error, LockGuard, LockOptions, Locker, Owner, Renewal, Wait};

/// TTLs the crowd picks from: the longest bounds how long an orphan may live.
const TTLS_MS: [u64; 4] = [300, 600, 1000, 2000];

/// How a crowd run went, for its assertions.
#[derive(Debug, Default)]
struct Tally {
    granted: u64,
    busy: u64,
    cancelled: u64,
    errors: Vec<String>,
    nested_reentered: u64,
    nested_refused: u64,
    nested_wrong: Vec<String>,
    released_err: Vec<String>,
}

impl Tally {
    fn merge(&mut self, o: Tally) {
        self.granted += o.granted;
        self.busy += o.busy;
        self.cancelled += o.cancelled;
        self.errors.extend(o.errors);
        self.nested_reentered += o.nested_reentered;
        self.nested_refused += o.nested_refused;
        self.nested_wrong.extend(o.nested_wrong);
        self.released_err.extend(o.released_err);
    }
}

/// One task of the crowd.
struct Worker {
    locker: Locker,
    name: String,
    label: String,
    shared: [Owner; 2],
    book: Arc<FencedBook>,
    reentrant: bool,
    fifo: bool,
    /// Faults are on: errors and losses are allowed (and counted), not failures.
    faulty: bool,
    /// How long after a newer grant a holder may still be unaware of its loss: zero,
    /// except where a broken connection frees a session lock on the server before its
    /// holder can know ([`Capabilities::connection_loss_notice`](crate::Capabilities::connection_loss_notice)).
    window: Duration,
    until: Instant,
    rounds: u32,
    /// Leftover nested holds, kept by their own tasks.
    detached: JoinSet<Tally>,
}

impl Worker {
    async fn run(mut self) -> Tally {
        let mut tally = Tally::default();
        let mut rng = fastrand::Rng::new();
        for round in 0..self.rounds {
            if Instant::now() >= self.until {
                break;
            }
            let shared = rng.bool();
            let owner = if shared {
                self.shared[rng.usize(..2)].clone()
            } else {
                Owner::random()
            };
            let opts = random_opts(&mut rng, self.fifo).owner(owner.clone());
            // The lease's terms in the label: a loss reported at release names them.
            let label = format!(
                "{} round {round} (ttl {:?}, renewal {:?})",
                self.label, opts.ttl, opts.renewal
            );
            let lapses = opts.renewal == Renewal::Off;
            let got = match rng.u8(..4) {
                0 => {
                    let wait = Duration::from_millis(rng.u64(0..400));
                    self.locker
                        .lock_with(&self.name, &opts.wait(Wait::Timeout(wait)))
                        .await
                        .map(Some)
                }
                1 => self.locker.try_lock_with(&self.name, &opts).await,
                2 => {
                    let cancel_after = Duration::from_millis(rng.u64(0..300));
                    match tokio::time::timeout(
                        cancel_after,
                        self.locker.lock_with(&self.name, &opts.wait(Wait::Forever)),
                    )
                    .await
                    {
                        Ok(r) => r.map(Some),
                        Err(_) => {
                            tally.cancelled += 1;
                            continue;
                        }
                    }
                }
                _ => self
                    .locker
                    .lock_with(&self.name, &opts.wait(Wait::NoWait))
                    .await
                    .map(Some),
            };
            let guard = match got {
                Ok(Some(g)) => g,
                Ok(None) | Err(Error::Timeout { .. }) => {
                    tally.busy += 1;
                    continue;
                }
                Err(e) => {
                    tally.errors.push(format!("{label}: {e}"));
                    if self.faulty {
                        continue;
                    }
                    break;
                }
            };
            tally.granted += 1;
            self.hold(guard, &owner, shared, lapses, &label, &mut rng, &mut tally)
                .await;
        }
        while let Some(t) = self.detached.join_next().await {
            if let Ok(t) = t {
                tally.merge(t);
            }
        }
        tally
    }

    /// The critical section of one grant, with a nested hold of the same owner now
    /// and then. `lapses`: renewal is off, so a long section may outlive the lease.
    #[allow(clippy::too_many_arguments)]
    async fn hold(
        &mut self,
        guard: LockGuard,
        owner: &Owner,
        shared: bool,
        lapses: bool,
        label: &str,
        rng: &mut fastrand::Rng,
        tally: &mut Tally,
    ) {
        let token = guard.fencing_token();
        if !guard.is_held() {
            return;
        }
        let entered = Instant::now();
        let id = self.book.enter(token, owner.as_str(), label);
        tokio::time::sleep(Duration::from_millis(rng.u64(0..15))).await;
        if shared && rng.u8(..10) < 4 {
            self.nested(owner, token, label, rng, tally).await;
        }
        if guard.is_held() {
            self.book.write(token);
        }
        end_section(&self.book, id, &guard, self.window, label, token).await;
        if rng.bool() {
            match guard.release().await {
                Ok(()) => {}
                // The lease ran out (renewal off) while the section went on.
                Err(Error::LockLost { .. }) if lapses => {}
                Err(_) if self.faulty => {}
                Err(e) => tally.released_err.push(format!(
                    "{label}: release {:?} after the section began: {e}",
                    entered.elapsed()
                )),
            }
        } else {
            drop(guard);
        }
    }

    /// The same owner asks again while it holds: a reentrant backend grants it at once
    /// with the same token (held here, or handed to a task that keeps it a while after
    /// this hold ends); any other backend must refuse it in time, never hang or grant.
    async fn nested(
        &mut self,
        owner: &Owner,
        token: u64,
        label: &str,
        rng: &mut fastrand::Rng,
        tally: &mut Tally,
    ) {
        let opts = random_opts(rng, false).owner(owner.clone());
        let label = format!("{label} nested");
        if !self.reentrant {
            let asked = Instant::now();
            let wait = Duration::from_millis(100);
            match self
                .locker
                .lock_with(&self.name, &opts.wait(Wait::Timeout(wait)))
                .await
            {
                Err(Error::Timeout { .. }) => tally.nested_refused += 1,
                Ok(g) if self.faulty => {
                    // The outer hold may have been lost meanwhile (its session reset):
                    // then this is a new grant like any other, and the book judges
                    // whether the outer holder heard of its loss in time.
                    let id = self.book.enter(g.fencing_token(), owner.as_str(), &label);
                    end_section(&self.book, id, &g, self.window, &label, g.fencing_token()).await;
                    drop(g);
                }
                Ok(g) => {
                    tally
                        .nested_wrong
                        .push(format!("{label}: a non-reentrant backend granted it again"));
                    drop(g);
                }
                Err(e) if !self.faulty => tally.nested_wrong.push(format!("{label}: {e}")),
                Err(_) => {}
            }
            if asked.elapsed() > Duration::from_secs(3) {
                tally
                    .nested_wrong
                    .push(format!("{label}: a 100 ms wait took {:?}", asked.elapsed()));
            }
            return;
        }
        let nested = match self.locker.try_lock_with(&self.name, &opts).await {
            Ok(Some(g)) => g,
            Ok(None) => {
                if !self.faulty {
                    tally
                        .nested_wrong
                        .push(format!("{label}: the holding owner could not re-enter"));
                }
                return;
            }
            Err(e) => {
                if !self.faulty {
                    tally.nested_wrong.push(format!("{label}: {e}"));
                }
                return;
            }
        };
        tally.nested_reentered += 1;
        if nested.fencing_token() != token && !self.faulty {
            tally.nested_wrong.push(format!(
                "{label}: re-entered with token {} instead of {token}",
                nested.fencing_token()
            ));
        }
        let book = Arc::clone(&self.book);
        let owner = owner.as_str().to_owned();
        let keep_for = Duration::from_millis(rng.u64(0..400));
        let release = rng.bool();
        let faulty = self.faulty;
        let window = self.window;
        let section = async move {
            let mut t = Tally::default();
            let token = nested.fencing_token();
            if nested.is_held() {
                let id = book.enter(token, &owner, &label);
                tokio::time::sleep(keep_for).await;
                if nested.is_held() {
                    book.write(token);
                }
                end_section(&book, id, &nested, window, &label, token).await;
            }
            if release {
                if let Err(e) = nested.release().await
                    && !faulty
                    && !matches!(e, Error::LockLost { .. })
                {
                    t.released_err.push(format!("{label}: release: {e}"));
                }
            } else {
                drop(nested);
            }
            t
        };
        if rng.bool() {
            // Outlives the outer hold.
            self.detached.spawn(section);
        } else {
            tally.merge(section.await);
        }
    }
}

/// End a critical section in the book. A section that still believes it holds
/// although a newer grant came must be told of its loss by `window` after that grant
/// (at once, for a zero window).
async fn end_section(
    book: &FencedBook,
    id: super::SectionId,
    guard: &LockGuard,
    window: Duration,
    label: &str,
    token: u64,
) {
    let Some(newer_at) = book.exit(id, guard.is_held()) else {
        return;
    };
    let told = !window.is_zero()
        && (tokio::time::timeout_at(newer_at + window, guard.lost())
            .await
            .is_ok()
            || !guard.is_held());
    if !told {
        book.violation(format!(
            "{label} held token {token} and was not told of its loss within {window:?} of a newer grant"
        ));
    }
}

fn random_opts(rng: &mut fastrand::Rng, fifo: bool) -> LockOptions {
    let ttl = Duration::from_millis(TTLS_MS[rng.usize(..TTLS_MS.len())]);
    let renewal = if rng.u8(..10) < 7 {
        Renewal::Auto
    } else {
        Renewal::Off
    };
    LockOptions::new()
        .ttl(ttl)
        .renewal(renewal)
        .fair(fifo && rng.u8(..10) < 3)
}

/// Run the crowd on `name`: `near` tasks on `a`, `far` on `b`, for about `run_for`.
async fn crowd(
    a: &Locker,
    b: &Locker,
    name: &str,
    faulty: bool,
    run_for: Duration,
) -> (Tally, Arc<FencedBook>) {
    let caps = a.capabilities();
    let book = Arc::new(FencedBook::default());
    let shared = [Owner::random(), Owner::random()];
    let until = Instant::now() + run_for;
    let mut tasks = JoinSet::new();
    let (near, far) = (8, 4);
    for i in 0..near + far {
        let locker = if i < near { a.clone() } else { b.clone() };
        tasks.spawn(
            Worker {
                locker,
                name: name.to_owned(),
                label: format!("task {i}"),
                shared: shared.clone(),
                book: Arc::clone(&book),
                reentrant: caps.reentrant,
                fifo: caps.fifo,
                faulty,
                window: if faulty {
                    caps.connection_loss_notice
                        .map_or(Duration::ZERO, |d| d + Duration::from_millis(500))
                } else {
                    Duration::ZERO
                },
                until,
                // Under faults the clock ends the crowd, so that the fault driver has
                // the whole time to work; the count only bounds it.
                rounds: if faulty { 2_000 } else { 40 },
                detached: JoinSet::new(),
            }
            .run(),
        );
    }
    let mut tally = Tally::default();
    let limit = run_for + Duration::from_secs(60);
    let joined = tokio::time::timeout(limit, async {
        while let Some(t) = tasks.join_next().await {
            tally.merge(t.expect("crowd task panicked"));
        }
    })
    .await;
    assert!(
        joined.is_ok(),
        "the crowd on {name} did not finish within {limit:?}: a task hangs"
    );
    (tally, book)
}

/// After the crowd: nothing is left held or queued. A fresh client gets the lock
/// within the longest TTL used plus `slack`, with a token above every token seen.
async fn nothing_left(h: &Harness, name: &str, highest: u64, slack: Duration) {
    let fresh = h.locker().await;
    let within = Duration::from_millis(TTLS_MS[TTLS_MS.len() - 1]) + slack;
    let started = Instant::now();
    let g = match fresh.lock_timeout(name, within).await {
        Ok(g) => g,
        Err(e) => {
            let holder = fresh.inspect(name).await;
            panic!("{name} still held {within:?} after the crowd: {e}; holder: {holder:?}");
        }
    };
    assert!(
        g.fencing_token() > highest || fresh.capabilities().fencing == crate::Fencing::None,
        "a grant after the crowd has token {} although {highest} was seen",
        g.fencing_token()
    );
    g.release().await.expect("release");
    let waiters = fresh
        .inspect(name)
        .await
        .expect("inspect")
        .and_then(|i| i.waiters);
    assert!(
        matches!(waiters, None | Some(0)),
        "{name}: {waiters:?} waiters left behind after every task gave up ({:?} after)",
        started.elapsed()
    );
}

/// Twelve tasks on two lockers share two owners (and use fresh ones) on one lock:
/// `lock` with short waits, `try_lock`, no-wait, and waits cancelled at random points,
/// TTLs from 300 ms to 2 s with and without renewal, fair and unfair where offered, the
/// holding owner asking again (reentrant holds handed to tasks that outlive the first
/// hold). No two grants may work at once unaware, no token may serve two owners, no
/// fenced write may be stale, nothing may hang, and once everyone is done a fresh
/// client gets the lock within the longest TTL plus 0.5 s. A crowd with too little
/// granted or refused to judge (a busy machine) runs once more.
pub async fn shared_owners_crowd(h: &Harness) {
    let (a, b) = (h.locker().await, h.locker().await);
    // A crowd too thin to judge (a busy machine) runs once more, on a new name; every
    // run's guarantees are checked.
    for last in [false, true] {
        let name = unique("crowd");
        let (tally, book) = crowd(&a, &b, &name, false, Duration::from_secs(5)).await;
        let report = book.report();
        println!("figure: crowd {name}: {tally:?}");
        assert!(
            tally.errors.is_empty(),
            "errors without faults: {:?}",
            tally.errors
        );
        assert!(
            report.violations.is_empty(),
            "the fenced store saw: {:#?}",
            report.violations
        );
        assert_eq!(report.stale_rejected, 0, "stale writes without faults");
        assert!(tally.nested_wrong.is_empty(), "{:#?}", tally.nested_wrong);
        assert!(tally.released_err.is_empty(), "{:#?}", tally.released_err);
        assert_eq!(report.still_inside, 0);
        nothing_left(h, &name, report.highest, Duration::from_millis(500)).await;
        let judged = tally.granted >= 20
            && tally.busy >= 5
            && tally.nested_reentered + tally.nested_refused >= 3;
        if judged {
            return;
        }
        assert!(
            !last,
            "too little happened to judge, twice (at least 20 grants, 5 refusals and 3 \
             nested asks): {tally:?}"
        );
    }
}

/// The crowd with one of its lockers behind the harness's fault proxy, which in turn
/// delays traffic, drops replies (requests run, answers vanish) and resets every
/// connection. Errors and losses are allowed; what the fenced store sees is not: no
/// two grants at work unaware of each other, no token for two owners — and once the
/// faults stop, nothing is left held or queued. (Where a reset connection frees a
/// session lock on the server at once, the holder must hear of it within its
/// [`Capabilities::connection_loss_notice`](crate::Capabilities::connection_loss_notice) plus 0.5 s.)
///
/// # Panics
/// When the harness has no proxy (see [`Harness::with_proxy`]).
pub async fn shared_owners_crowd_under_faults(h: &Harness) {
    let name = unique("crowd-faults");
    let near = h
        .proxied_locker()
        .await
        .expect("this behaviour needs a harness with a fault proxy");
    let far = h.locker().await;
    let stop = tokio_util::sync::CancellationToken::new();
    let faults = tokio::spawn(drive_faults(h.fault_switch(), stop.clone()));
    let (tally, book) = crowd(&near, &far, &name, true, Duration::from_secs(6)).await;
    stop.cancel();
    let injected = faults.await.expect("fault driver");
    let report = book.report();
    assert!(
        report.violations.is_empty(),
        "the fenced store saw: {:#?}",
        report.violations
    );
    assert!(tally.nested_wrong.is_empty(), "{:#?}", tally.nested_wrong);
    assert_eq!(report.still_inside, 0);
    assert!(
        tally.granted >= 10 && injected >= 5,
        "too little happened to judge: {tally:?}, {injected} faults"
    );
    // Once the proxy forwards again, a release that could not get through is finished
    // in the background (backoff up to 1 s) or its lease runs out.
    nothing_left(h, &name, report.highest, Duration::from_millis(1500)).await;
}

/// Cycle the proxy through its faults until `stop`; returns how many were injected.
pub(super) async fn drive_faults(
    switch: Arc<dyn Fn(NetFault) + Send + Sync>,
    stop: tokio_util::sync::CancellationToken,
) -> u32 {
    let mut rng = fastrand::Rng::new();
    let mut injected = 0;
    while !stop.is_cancelled() {
        // Every cycle injects one fault; the pause after it is the quiet time.
        let fault = match rng.u8(..3) {
            0 => NetFault::Delay(Duration::from_millis(rng.u64(5..60))),
            1 => NetFault::DropReplies,
            _ => NetFault::ResetAll,
        };
        let lasts = match fault {
            NetFault::DropReplies => Duration::from_millis(rng.u64(0..10)),
            _ => Duration::from_millis(rng.u64(100..400)),
        };
        injected += 1;
        let dropping = fault == NetFault::DropReplies;
        switch(fault);
        tokio::select! {
            () = tokio::time::sleep(lasts) => {}
            () = stop.cancelled() => {}
        }
        if dropping {
            // Requests ran, their answers are gone: reset so the clients notice.
            switch(NetFault::ResetAll);
        }
        switch(NetFault::None);
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(rng.u64(50..300))) => {}
            () = stop.cancelled() => {}
        }
    }
    switch(NetFault::None);
    injected
}

/// One owner holds with a long lease and, in another task, re-enters with a short one
/// that renews a few times and is released: the long hold must still be held on the
/// server afterwards (a renewal of one hold never shortens another's lease). On a
/// backend without reentrancy, the second hold is refused and the first is untouched.
pub async fn shared_owner_renewal_never_shortens(h: &Harness) {
    let name = unique("renew-shared");
    let (a, b) = (h.locker().await, h.locker().await);
    let owner = a.owner();
    let long = a
        .lock_with(
            &name,
            &LockOptions::new()
                .ttl(Duration::from_secs(60))
                .owner(owner.clone()),
        )
        .await
        .expect("lock");
    let short_opts = LockOptions::new()
        .ttl(Duration::from_millis(600))
        .owner(owner.clone());
    let short = a.try_lock_with(&name, &short_opts).await.expect("try_lock");
    match short {
        Some(short) => {
            assert!(a.capabilities().reentrant, "re-entered without reentrancy");
            // Renewed every 200 ms to "600 ms from now", then released.
            tokio::time::sleep(Duration::from_millis(700)).await;
            assert!(short.is_held(), "{:?}", short.loss_reason());
            short.release().await.expect("release");
        }
        None => assert!(
            !a.capabilities().reentrant,
            "the holding owner could not re-enter"
        ),
    }
    // Past the short lease (and past any lease it could have set).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(long.is_held(), "{:?}", long.loss_reason());
    assert!(
        b.try_lock(&name).await.expect("try_lock").is_none(),
        "another client got the lock while its 60 s holder still held it"
    );
    let info = b.inspect(&name).await.expect("inspect");
    assert!(
        info.as_ref().is_some_and(|i| i.owner == owner.as_str()),
        "inspect says {info:?} while {owner} holds"
    );
    if let Some(rem) = info.and_then(|i| i.remaining) {
        assert!(
            rem > Duration::from_secs(30),
            "the 60 s lease was shortened to {rem:?}"
        );
    }
    long.release().await.expect("release");
}

/// The same owner asks for a lock it holds, on a single-threaded runtime: a reentrant
/// backend grants it, any other times out after its wait — neither may spin so that
/// the holder's own release never runs.
pub async fn same_owner_relock_while_holding(h: &Harness) {
    let url = h.url().to_owned();
    let name = unique("relock");
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let outcome = rt.block_on(async move {
            let locker = Locker::connect(&url).await.expect("connect");
            let owner = locker.owner();
            let opts = LockOptions::new().owner(owner);
            let first = locker.lock_with(&name, &opts).await.expect("lock");
            // A task of the same runtime that must get to run while we wait.
            let ticks = Arc::new(std::sync::atomic::AtomicU32::new(0));
            let ticker = tokio::spawn({
                let ticks = Arc::clone(&ticks);
                async move {
                    loop {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        ticks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                }
            });
            let asked = Instant::now();
            let again = locker
                .lock_with(
                    &name,
                    &opts.clone().wait(Wait::Timeout(Duration::from_millis(300))),
                )
                .await;
            let waited = asked.elapsed();
            ticker.abort();
            let reentrant = locker.capabilities().reentrant;
            let verdict = match again {
                Ok(g) if reentrant => {
                    assert_eq!(g.fencing_token(), first.fencing_token());
                    g.release().await.expect("release");
                    Ok(())
                }
                Ok(_) => Err("a non-reentrant backend granted the lock twice".to_owned()),
                Err(Error::Timeout { .. }) if !reentrant => Ok(()),
                Err(e) => Err(format!("second lock by the holding owner: {e}")),
            };
            let ticked = ticks.load(std::sync::atomic::Ordering::SeqCst);
            first.release().await.expect("release");
            let other = locker
                .lock_timeout(&name, Duration::from_secs(5))
                .await
                .map_err(|e| format!("after the holder released: {e}"));
            // A wait of 300 ms lets a 10 ms ticker run about 30 times.
            verdict.and(other.map(drop)).and(
                if waited < Duration::from_millis(200) || ticked >= 5 {
                    Ok(())
                } else {
                    Err(format!(
                        "other tasks ran {ticked} times in {waited:?} of waiting: a busy loop"
                    ))
                },
            )
        });
        let _ = done_tx.send(outcome);
    });
    match done_rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{e}"),
        Err(_) => panic!("the same owner asking again hung a single-threaded runtime"),
    }
}

/// Two waiters that share an owner queue on a held lock and both give up (one by its
/// timeout, one cancelled); once the holder releases, a client elsewhere gets the lock
/// at once: neither left a queue entry or a node behind.
pub async fn shared_owner_waiters_leave_nothing(h: &Harness) {
    let name = unique("shared-waiters");
    let (a, b, c) = (h.locker().await, h.locker().await, h.locker().await);
    let fair = b.capabilities().fifo;
    let held = a.lock(&name).await.expect("lock");
    let owner = b.owner();
    for round in 0..3 {
        let opts = LockOptions::new()
            .owner(owner.clone())
            .fair(fair && round == 1);
        let timed_opts = opts
            .clone()
            .wait(Wait::Timeout(Duration::from_millis(200 + 50 * round)));
        let forever = opts.clone().wait(Wait::Forever);
        let timed = b.lock_with(&name, &timed_opts);
        let cancelled =
            tokio::time::timeout(Duration::from_millis(150), b.lock_with(&name, &forever));
        let (timed, cancelled) = tokio::join!(timed, cancelled);
        assert!(
            matches!(timed, Err(Error::Timeout { .. })),
            "round {round}: {timed:?}"
        );
        assert!(
            cancelled.is_err(),
            "round {round}: a waiter got a held lock"
        );
    }
    held.release().await.expect("release");
    let start = Instant::now();
    let g = c
        .lock_timeout(&name, Duration::from_secs(5))
        .await
        .expect("a waiter that gave up still blocks the lock");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "a ghost waiter delayed the next holder by {:?}",
        start.elapsed()
    );
    g.release().await.expect("release");
}

/// One attempt through the backend SPI, as the core would make it.
fn request(name: &str, owner: &Owner, ttl: Duration) -> crate::backend::AcquireRequest {
    let name = crate::name::LockName::new(name).expect("name");
    crate::backend::AcquireRequest {
        metadata: crate::Metadata::this_process().into(),
        ..crate::backend::AcquireRequest::plain(name, owner.clone(), ttl)
    }
}

async fn grant(
    locker: &Locker,
    req: &crate::backend::AcquireRequest,
) -> Option<Box<dyn crate::backend::HeldLock>> {
    match locker
        .backend()
        .try_acquire(req)
        .await
        .expect("try_acquire")
    {
        crate::backend::Attempt::Acquired(held) => Some(held),
        _ => None,
    }
}

/// A renewal asking for less than the lease has left does not shorten the lease on the
/// server (checked through the backend SPI: a 10 s grant renewed "to 600 ms" still has
/// more than 5 s left, where the backend can tell).
pub async fn renewal_never_shortens_the_server_lease(h: &Harness) {
    let name = unique("renew-less");
    let a = h.locker().await;
    let owner = Owner::random();
    let held = grant(&a, &request(&name, &owner, Duration::from_secs(10)))
        .await
        .expect("a free lock");
    held.renew(Duration::from_millis(600)).await.expect("renew");
    tokio::time::sleep(Duration::from_millis(900)).await;
    let info = a.inspect(&name).await.expect("inspect");
    assert!(
        info.as_ref().is_some_and(|i| i.owner == owner.as_str()),
        "a 10 s lease renewed to 600 ms was gone after 900 ms: {info:?}"
    );
    if let Some(rem) = info.and_then(|i| i.remaining) {
        assert!(
            rem > Duration::from_secs(5),
            "the lease was shortened to {rem:?}"
        );
    }
    held.release().await.expect("release");
}

/// A grant whose lease ran out, and a newer grant to the same owner (another task, or a
/// process sharing the owner): the stale grant's release and renewal must not touch the
/// newer one (checked through the backend SPI, where a late release would arrive).
/// A session-bound lock does not lapse by its TTL: there the newer grant is refused.
pub async fn a_stale_grant_cannot_touch_its_owners_newer_grant(h: &Harness) {
    let name = unique("stale-shared");
    let (a, b) = (h.locker().await, h.locker().await);
    let owner = Owner::random();
    let stale = grant(&a, &request(&name, &owner, Duration::from_millis(200)))
        .await
        .expect("a free lock");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let Some(newer) = grant(&a, &request(&name, &owner, Duration::from_secs(30))).await else {
        assert!(
            a.capabilities().session_bound,
            "the lapsed lease still blocks its own owner"
        );
        stale.release().await.expect("release");
        return;
    };
    assert!(
        newer.fencing_token() > stale.fencing_token(),
        "a grant after a lapsed lease reused its token {}",
        stale.fencing_token()
    );
    let _ = stale.release().await;
    let renewed = stale.renew(Duration::from_secs(30)).await;
    assert!(renewed.is_err(), "the stale grant was renewed");
    let intruder = grant(
        &b,
        &request(&name, &Owner::random(), Duration::from_secs(5)),
    )
    .await;
    assert!(
        intruder.is_none(),
        "the stale grant's release freed its owner's newer grant"
    );
    let info = b.inspect(&name).await.expect("inspect").expect("held");
    assert_eq!(info.fencing_token, newer.fencing_token());
    newer.release().await.expect("release");
}

/// An acquisition that waited, gave up (its queue left, as the core does on timeout)
/// and only then stopped waiting: a release in between must not hand it the lock —
/// nobody would ever give it back. This locker gets the lock at once afterwards.
pub async fn a_waiter_that_left_is_never_handed_the_lock(h: &Harness) {
    let name = unique("left-waiter");
    let a = h.locker().await;
    let holder = grant(
        &a,
        &request(&name, &Owner::random(), Duration::from_secs(30)),
    )
    .await
    .expect("a free lock");
    let mut waiting = request(&name, &Owner::random(), Duration::from_secs(30));
    waiting.will_wait = true;
    let busy = a.backend().try_acquire(&waiting).await.expect("attempt");
    assert!(
        matches!(busy, crate::backend::Attempt::Busy { .. }),
        "a held lock granted"
    );
    let mut waiter = a.backend().subscribe(&waiting).await.expect("subscribe");
    waiter
        .changed(Duration::from_millis(20))
        .await
        .expect("changed");
    // Gives up: leaves the queue first, stops waiting only after the release below.
    a.backend().leave_queue(&waiting).await.expect("leave");
    holder.release().await.expect("release");
    drop(waiter);
    let again = a
        .lock_timeout(&name, Duration::from_secs(3))
        .await
        .expect("the lock was handed to a waiter that had left");
    again.release().await.expect("release");
}
