//! What keeps held locks alive: one timer task per [`crate::Locker`] for all of them.
//!
//! Each held lock is a [`Hold`]: the backend's [`HeldLock`] and its timing (lease
//! deadline, next renewal) behind one async mutex, so a renewal, an extension and the
//! release never overlap and no renewal can follow the release. The [`Keepers`] of a
//! locker keep ordered maps of the next instant each hold needs attention (the earlier
//! of its renewal and its local deadline) and one driver task that sleeps until the
//! first of them and hands what is due to a short task of its own (so one slow renewal
//! delays no other). An idle held lock therefore costs a map entry, not a task. Holds
//! whose backend renews them in batches ([`HeldLock::renews_in_batches`]) have a map of
//! their own and run in at most [`MAX_SERVING`] of those tasks at once: holds taken
//! together come due together, and 100,000 renewals started at once would each hold a
//! task and a request until their batch answered (tens of megabytes at the peak)
//! without renewing one lock sooner than the batches allow.
//!
//! The guard's release and extension run in the caller's task (no hop through a keeper
//! task); a release whose caller goes away finishes in a task of its own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{HeldLock, Primitive, SessionTrust};
use crate::error::{Error, LossReason, Result};
use crate::lease::{drift_margin, nanos_of};
use crate::name::LockName;
use crate::options::{MIN_TTL, Owner};
use crate::telemetry::Meters;

/// How long the keeper waits for a best-effort release after a loss.
const LOST_RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a [`Hold::watch_loss`] that saw the deadline pass waits for whoever works
/// on the hold (a renewal answering right at it) before it marks the loss without them.
const EXPIRE_WAIT: Duration = Duration::from_millis(250);

/// How often a [`Hold::watch_loss`] looks again while the expiry it started runs.
const EXPIRE_POLL: Duration = Duration::from_millis(10);

/// How long the driver task stays after the last held lock is gone (so a locker that
/// takes and releases locks in a loop does not start one per lock).
const DRIVER_LINGER: Duration = Duration::from_secs(5);

/// A place in the timer map: when, and a sequence number that makes it unique.
type Slot = (Instant, u64);

/// Most timer tasks of one locker serving holds renewed in batches at once; what comes
/// due while they all run waits in the map, earliest first, until one ends. Twice what
/// the busiest batched renewer carries at once (Redlock: up to 4 batches of 512; the
/// SQL lease renewers up to 4 of 256; SQLite, and Redis on one server or through
/// Sentinel, one of 256 or 512): while every batch runs, the next ones gather whole.
/// Holds renewed one request each (etcd, ZooKeeper, a Redis cluster, the SQL session
/// modes, semaphores and read-write locks on Redis and SQL, memory) are not counted,
/// and wait for no place (they have a map of their own): their renewals may each wait
/// long for an answer, so they all run at once. A task keeps its place while it waits
/// for its hold behind a release or an extension under way, and for its renewal,
/// which the keeper bounds.
const MAX_SERVING: usize = 4096;

/// The places of the timer tasks ([`MAX_SERVING`]).
#[derive(Debug)]
struct Serving(Arc<tokio::sync::Semaphore>);

impl Default for Serving {
    fn default() -> Self {
        Serving(Arc::new(tokio::sync::Semaphore::new(MAX_SERVING)))
    }
}

/// How a held lock is kept.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeeperPlan {
    pub ttl: Duration,
    pub renew_every: Option<Duration>,
    /// `renew_every` is [`crate::Renewal::Auto`]'s (a third of the TTL): an extension
    /// to another TTL renews at a third of that one. Any other interval stays.
    pub renew_auto: bool,
    pub max_hold: Option<Duration>,
    /// When the acquire request was sent (before the server could start the lease).
    pub sent_at: Instant,
    /// What was granted (a lock, a permit, a read, a write).
    pub primitive: Primitive,
}

/// The timers of every lock one locker holds, and the task that serves them.
#[derive(Debug, Default)]
pub(crate) struct Keepers {
    state: Mutex<Timers>,
    /// Set when the driver went with its runtime (or a hold was put back where there
    /// was no runtime) while holds were left in the map: until a driver starts again,
    /// nothing renews them. Read without the lock by [`Keepers::revive`].
    stranded: AtomicBool,
    /// Wakes every [`Hold::watch_loss`] when holds are stranded, so that one polled on
    /// a live runtime starts a driver there at once, not at the deadline it sleeps to.
    gone: Notify,
    /// Wakes the driver when a slot earlier than its sleep is added.
    wake: Notify,
    /// A place for each timer task running for a hold renewed in batches.
    serving: Serving,
    /// The locker's metric handles (renewals, losses; acquisitions in the locker).
    pub(crate) meters: Meters,
    /// The runtime the locker was opened on, if it was opened on one: a guard dropped
    /// where there is no runtime is released there ([`Hold::release_runtime`]).
    home: Option<tokio::runtime::Handle>,
}

#[derive(Debug, Default)]
struct Timers {
    /// The holds renewed one request each: whatever is due is served at once.
    due: BTreeMap<Slot, Arc<Hold>>,
    /// The holds renewed in batches ([`Hold::batched`]): what is due is served while
    /// places last ([`MAX_SERVING`]). Apart, so that none of them, waiting for a place,
    /// holds up a hold of the other kind (a semaphore's permit beside Redis locks).
    batched: BTreeMap<Slot, Arc<Hold>>,
    seq: u64,
    /// `None`: no driver task. `Some(t)`: the driver sleeps until `t` at the latest
    /// (and, while every place is taken, until a timer task ends).
    driver: Option<Instant>,
}

impl Timers {
    /// The map `hold` is kept in.
    fn map(&mut self, hold: &Hold) -> &mut BTreeMap<Slot, Arc<Hold>> {
        if hold.batched {
            &mut self.batched
        } else {
            &mut self.due
        }
    }

    /// The first instant in either map.
    fn first(&self) -> Option<Instant> {
        first_instant(&self.due)
            .into_iter()
            .chain(first_instant(&self.batched))
            .min()
    }
}

/// The first instant in `map`.
fn first_instant(map: &BTreeMap<Slot, Arc<Hold>>) -> Option<Instant> {
    map.first_key_value().map(|(slot, _)| slot.0)
}

impl Keepers {
    /// The keepers of a locker on the backend `scheme`.
    pub(crate) fn new(scheme: &'static str) -> Self {
        Keepers {
            state: Mutex::default(),
            stranded: AtomicBool::new(false),
            gone: Notify::new(),
            wake: Notify::new(),
            serving: Serving::default(),
            meters: Meters::new(scheme),
            home: tokio::runtime::Handle::try_current().ok(),
        }
    }

    fn timers(&self) -> std::sync::MutexGuard<'_, Timers> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Put `hold` in the map at `at` (taking `old` out); starts the driver if there is
    /// none, wakes it if `at` comes before its sleep ends.
    fn schedule(self: &Arc<Self>, old: Option<Slot>, at: Instant, hold: &Arc<Hold>) -> Slot {
        let mut timers = self.timers();
        timers.seq += 1;
        let slot = (at, timers.seq);
        let map = timers.map(hold);
        if let Some(old) = old {
            map.remove(&old);
        }
        map.insert(slot, Arc::clone(hold));
        match timers.driver {
            None => {
                // Without a runtime (a timer put back while one shuts down, see
                // `Rearm`), the next hold scheduled on one starts the driver.
                let runtime = tokio::runtime::Handle::try_current();
                match runtime {
                    Ok(_) => {
                        timers.driver = Some(at);
                        self.stranded.store(false, Ordering::SeqCst);
                    }
                    Err(_) => self.stranded.store(true, Ordering::SeqCst),
                }
                drop(timers);
                if runtime.is_err() {
                    self.gone.notify_waiters();
                }
                if let Ok(runtime) = runtime {
                    runtime.spawn(self.driver());
                }
            }
            Some(until) if at < until => {
                timers.driver = Some(at);
                drop(timers);
                self.wake.notify_one();
            }
            Some(_) => {}
        }
        slot
    }

    /// Start a driver on the current runtime if the last one went with its runtime
    /// and left holds in the map (see [`Keepers::stranded`]): called by a hold's
    /// [`Hold::watch_loss`], so that a hold whose timers stopped with another runtime
    /// is renewed again, not only told of its loss at its deadline. Only on a
    /// multi-thread runtime, whose workers run the driver whatever its caller does
    /// next: a driver left parked on a current-thread runtime nobody drives would
    /// count as running and keep every hold of the locker from being renewed. One
    /// atomic load when nothing is stranded.
    pub(crate) fn revive(self: &Arc<Self>) {
        if !self.stranded.load(Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
            return;
        }
        let mut timers = self.timers();
        if timers.driver.is_some() {
            self.stranded.store(false, Ordering::SeqCst);
            return;
        }
        let Some(first) = timers.first() else {
            self.stranded.store(false, Ordering::SeqCst);
            return;
        };
        timers.driver = Some(first);
        self.stranded.store(false, Ordering::SeqCst);
        drop(timers);
        runtime.spawn(self.driver());
    }

    fn unschedule(&self, slot: Slot, hold: &Hold) {
        self.timers().map(hold).remove(&slot);
    }

    /// The driver task's future. Its [`DriverGone`] is made before the first poll: a
    /// task dropped unpolled (spawned while its runtime shuts down) still marks the
    /// driver gone.
    fn driver(self: &Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        let gone = DriverGone {
            keepers: Arc::clone(self),
            armed: true,
        };
        Arc::clone(self).drive(gone)
    }

    /// The driver: sleeps until the first slot, hands every due hold to a task of its
    /// own (one renewed in batches while places last: [`MAX_SERVING`]), and ends after
    /// [`DRIVER_LINGER`] with nothing to keep.
    async fn drive(self: Arc<Self>, mut gone: DriverGone) {
        let mut idle_since: Option<Instant> = None;
        loop {
            let mut due = Vec::new();
            let mut full = false;
            let until = {
                let mut timers = self.timers();
                let now = Instant::now();
                while let Some(first) = timers.due.first_entry() {
                    if first.key().0 > now {
                        break;
                    }
                    due.push((first.remove_entry(), None));
                }
                while let Some(first) = timers.batched.first_entry() {
                    if first.key().0 > now {
                        break;
                    }
                    let Ok(place) = Arc::clone(&self.serving.0).try_acquire_owned() else {
                        full = true;
                        break;
                    };
                    due.push((first.remove_entry(), Some(place)));
                }
                // Every place taken: the batched holds due wait for one to free (the
                // select below), not for an instant.
                let next = first_instant(&timers.due)
                    .into_iter()
                    .chain(first_instant(&timers.batched).filter(|_| !full))
                    .min();
                let until = match next {
                    Some(at) => {
                        idle_since = None;
                        at
                    }
                    None if full => {
                        idle_since = None;
                        now + DRIVER_LINGER
                    }
                    None if due.is_empty() => {
                        let since = *idle_since.get_or_insert(now);
                        if now >= since + DRIVER_LINGER {
                            timers.driver = None;
                            gone.armed = false;
                            return;
                        }
                        since + DRIVER_LINGER
                    }
                    None => now + DRIVER_LINGER,
                };
                timers.driver = Some(until);
                until
            };
            for ((slot, hold), place) in due {
                tokio::spawn(hold.on_timer(slot, place));
            }
            tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                () = self.wake.notified() => {}
                // A place is given back as a task ends (the semaphore is never
                // closed); taken here only to wait for it: the loop takes it again.
                place = self.serving.0.acquire(), if full => drop(place),
            }
        }
    }
}

/// Puts a hold back in the timer map when the task serving its timer is dropped
/// before it rescheduled the hold: its runtime shut down (a [`crate::Locker`] used
/// from several runtimes runs its timers on the one that started the driver). The
/// driver took the hold's slot out of the map; without this, nothing would renew the
/// hold again, nor mark it lost at its deadline. A hold whose `keep` someone else
/// holds now is rescheduled by them (every holder of `keep` reschedules before it
/// lets go); one moved to another slot meanwhile is already back.
struct Rearm {
    hold: Arc<Hold>,
    slot: Slot,
    armed: bool,
    /// The task's place among the [`MAX_SERVING`] (a hold renewed in batches), given
    /// back as it ends.
    _place: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for Rearm {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(mut keep) = self.hold.keep.try_lock()
            && (keep.slot_seq == 0 || keep.slot_seq == self.slot.1)
        {
            // A renewal cut off here is tried again as a failed one is, not at once
            // (a task dropped because its renewal panicked must not spin).
            if keep.next_renew != NEVER {
                let soonest = self
                    .hold
                    .nanos(Instant::now())
                    .saturating_add(nanos_of(keep.retry_after()));
                keep.next_renew = keep.next_renew.max(soonest);
            }
            self.hold.reschedule(&mut keep);
        }
    }
}

/// Marks the driver gone if its task is dropped unfinished (its runtime shut down), so
/// the next lock taken starts a new one.
struct DriverGone {
    keepers: Arc<Keepers>,
    armed: bool,
}

impl Drop for DriverGone {
    fn drop(&mut self) {
        if self.armed {
            let mut timers = self.keepers.timers();
            timers.driver = None;
            let stranded = timers.first().is_some();
            if stranded {
                self.keepers.stranded.store(true, Ordering::SeqCst);
            }
            drop(timers);
            if stranded {
                self.keepers.gone.notify_waiters();
            }
        }
    }
}

/// One held lock, shared by its guard, the timer map and whatever task is keeping it.
///
/// A process may keep 100,000 of these, so its instants are nanoseconds after `base`
/// (the grant's send time) rather than 16-byte instants, and what only some backends
/// need sits behind one box.
#[derive(Debug)]
pub(crate) struct Hold {
    pub name: LockName,
    pub owner: Owner,
    pub token: u64,
    /// The grant is a read-write lock's write (what [`crate::RwLock::downgrade`] takes).
    pub is_write: bool,
    /// The backend renews it in batches ([`HeldLock::renews_in_batches`]): its timer
    /// tasks count against [`MAX_SERVING`].
    batched: bool,
    lost: AtomicBool,
    /// Set when the guard is released or dropped: timers due after that do nothing.
    released: AtomicBool,
    /// Made on the loss, or when someone first waits for one ([`Hold::lost_token`]):
    /// a hold that is never lost nor waited on pays 16 bytes here.
    loss: OnceLock<Box<Loss>>,
    /// When the acquire request was sent: every instant of this hold is kept as
    /// nanoseconds after it (see [`Hold::nanos`]).
    base: Instant,
    /// The local lease deadline: the lock counts as lost from here on. Written only
    /// with `keep` locked; read without it, so `is_held` can tell a passed deadline
    /// before the keeper's timer has run.
    deadline_ns: AtomicU64,
    /// The backend's loss signal and suspect flag, if it has either.
    signals: Option<Box<Signals>>,
    keepers: Arc<Keepers>,
    keep: tokio::sync::Mutex<Keep>,
}

/// What a backend with a session of its own (ZooKeeper, etcd) adds to a hold.
#[derive(Debug)]
struct Signals {
    /// Set while the session is in doubt (see [`crate::LockGuard::is_suspect`]).
    suspect: Option<Arc<AtomicBool>>,
    /// The backend's loss signal, read by [`Hold::is_lost`] itself, so a loss the
    /// backend reported counts at once — before the watcher task runs, and so before
    /// the backend may let the lock go on the server (etcd revokes a lost session
    /// 50 ms later) — and the token that ends the watcher task.
    loss: Option<(CancellationToken, CancellationToken)>,
    /// Until when the hold's session is known to live ([`HeldLock::session_trust`]),
    /// read by [`Hold::is_lost`] itself: once it passes the hold counts as lost, with
    /// no renewal, timer or watcher needing to run first.
    session: Option<SessionTrust>,
}

/// A hold's loss: why, and the token that tells those waiting for it.
#[derive(Debug, Default)]
struct Loss {
    /// The first reason recorded.
    reason: OnceLock<LossReason>,
    /// Cancelled when the hold is lost.
    token: CancellationToken,
    /// The deadline (nanoseconds after the hold's base) a [`Hold::watch_loss`] last
    /// started an expiry for: one per deadline, however many watchers poll.
    expiring: AtomicU64,
}

/// "No such instant" (no renewal due, no maximum hold time) in a hold's nanoseconds;
/// also what [`nanos_of`] saturates to, so a duration too long to represent is none.
const NEVER: u64 = u64::MAX;

/// The part of a hold only one task touches at a time. Instants are nanoseconds after
/// the hold's `base`, [`NEVER`] for none.
#[derive(Debug)]
struct Keep {
    /// `None` once released (or given back after a loss).
    held: Option<Box<dyn HeldLock>>,
    ttl_ns: u64,
    /// [`NEVER`]: renewal off.
    renew_every_ns: u64,
    hold_until: u64,
    next_renew: u64,
    /// Where this hold sits in the timer map: the instant and the sequence number
    /// (0: not in the map; the map's numbers start at 1).
    slot_at: u64,
    slot_seq: u64,
    /// The current lease was shortened (or renewal stopped) by the max hold time.
    capped_by_hold: bool,
    /// See [`KeeperPlan::renew_auto`].
    renew_auto: bool,
}

impl Keep {
    fn ttl(&self) -> Duration {
        Duration::from_nanos(self.ttl_ns)
    }

    /// How soon a renewal that failed (or was cut off) is tried again.
    fn retry_after(&self) -> Duration {
        (self.ttl() / 10).clamp(Duration::from_millis(5), Duration::from_secs(1))
    }

    fn renew_every(&self) -> Option<Duration> {
        (self.renew_every_ns != NEVER).then(|| Duration::from_nanos(self.renew_every_ns))
    }
}

impl Hold {
    /// Start keeping `held`: its first timer is set before this returns.
    pub(crate) fn start(
        keepers: &Arc<Keepers>,
        held: Box<dyn HeldLock>,
        name: LockName,
        owner: Owner,
        plan: KeeperPlan,
    ) -> Arc<Hold> {
        let margin = held.clock_drift(plan.ttl).max(drift_margin(plan.ttl));
        // A hold whose renewal proves its session alive is renewed at least as often as
        // it asks; one that is not renewed at all proves it by itself (before its loss
        // signal is read: it has one only then).
        let renew_every = match (plan.renew_every, held.prove_alive_every()) {
            (Some(every), Some(proof)) => Some(every.min(proof)),
            (None, Some(_)) => {
                held.watch_alone();
                None
            }
            (every, None) => every,
        };
        let loss = held.loss_signal();
        let suspect = held.suspect_flag();
        let session = held.session_trust();
        // A maximum hold time too long to represent is no maximum.
        let hold_until = plan.max_hold.map_or(NEVER, nanos_of);
        let lease_deadline = nanos_of(plan.ttl.saturating_sub(margin));
        // A maximum hold time shorter than the lease (or than the first renewal, or
        // with renewal off) ends the hold by itself.
        let (deadline, capped_by_hold) = if hold_until < lease_deadline {
            (hold_until, true)
        } else {
            (lease_deadline, false)
        };
        let renew_every_ns = renew_every.map_or(NEVER, nanos_of);
        // The first renewal as every later one: at most a third of the lease in, so
        // that it has the rest to get its answer (an interval just under the TTL
        // would leave it milliseconds, or none).
        let first_renew = renew_every.map_or(NEVER, |every| nanos_of(every.min(plan.ttl / 3)));
        let next_renew = if first_renew < deadline {
            first_renew
        } else {
            NEVER
        };
        let signals = (loss.is_some() || suspect.is_some() || session.is_some()).then(|| {
            Box::new(Signals {
                suspect,
                loss: loss.map(|signal| (signal, CancellationToken::new())),
                session,
            })
        });
        let hold = Arc::new(Hold {
            name,
            owner,
            token: held.fencing_token(),
            is_write: plan.primitive == Primitive::Write,
            batched: held.renews_in_batches(),
            lost: AtomicBool::new(false),
            released: AtomicBool::new(false),
            loss: OnceLock::new(),
            base: plan.sent_at,
            deadline_ns: AtomicU64::new(deadline),
            signals,
            keepers: Arc::clone(keepers),
            keep: tokio::sync::Mutex::new(Keep {
                held: Some(held),
                ttl_ns: nanos_of(plan.ttl),
                renew_every_ns,
                hold_until,
                next_renew,
                slot_at: NEVER,
                slot_seq: 0,
                capped_by_hold,
                renew_auto: plan.renew_auto,
            }),
        });
        if let Ok(mut keep) = hold.keep.try_lock() {
            hold.reschedule(&mut keep);
        } else {
            // Nobody else can have the lock of a hold just made; if that ever changes,
            // set the timer as soon as it is free.
            let later = Arc::clone(&hold);
            tokio::spawn(async move {
                let mut keep = later.keep.lock().await;
                later.reschedule(&mut keep);
            });
        }
        if let Some((signal, end)) = hold.signals.as_ref().and_then(|s| s.loss.clone()) {
            tokio::spawn(Arc::clone(&hold).watch_backend(signal, end));
        }
        hold
    }

    /// `at` as nanoseconds after this hold's base (0 before it, [`NEVER`] at most).
    fn nanos(&self, at: Instant) -> u64 {
        nanos_of(at.saturating_duration_since(self.base))
    }

    /// The instant `ns` nanoseconds after this hold's base (`ns` not [`NEVER`]: TTLs
    /// are at most 7 days, so a deadline or renewal never is; even so, 584 years
    /// after the base is an instant, not a panic).
    fn instant(&self, ns: u64) -> Instant {
        debug_assert_ne!(ns, NEVER, "an instant that is none");
        self.base + Duration::from_nanos(ns)
    }

    /// The backend's loss signal, if it has one.
    fn loss_signal(&self) -> Option<&CancellationToken> {
        self.signals
            .as_ref()
            .and_then(|s| s.loss.as_ref())
            .map(|(signal, _)| signal)
    }

    /// The backend's suspect flag (see [`crate::LockGuard::is_suspect`]), if it has one.
    pub(crate) fn suspect(&self) -> Option<&AtomicBool> {
        self.signals.as_ref().and_then(|s| s.suspect.as_deref())
    }

    /// Whether the lock is lost: marked so, or the backend's loss signal fired, or its
    /// session is trusted no more (the task that marks it and gives the lock back may
    /// not have run yet: [`Hold::watch_backend`], the timer's [`Hold::serve_timer`],
    /// a [`Hold::watch_loss`]'s expiry).
    pub(crate) fn is_lost(&self) -> bool {
        if self.lost.load(Ordering::SeqCst) {
            return true;
        }
        let reason = if self
            .loss_signal()
            .is_some_and(CancellationToken::is_cancelled)
        {
            session_gone
        } else if self.session_untrusted() {
            session_unproven
        } else {
            return false;
        };
        let loss = self.loss();
        loss.reason.get_or_init(reason);
        loss.token.cancel();
        true
    }

    /// The hold's session is trusted no more ([`Signals::session`]); for good once
    /// seen so (ended): an answer to a proof sent before that cannot bring back a hold
    /// already told it was lost.
    fn session_untrusted(&self) -> bool {
        self.session_trust().is_some_and(|trust| {
            let passed = trust.passed();
            if passed {
                trust.end();
            }
            passed
        })
    }

    fn session_trust(&self) -> Option<&SessionTrust> {
        self.signals.as_ref().and_then(|s| s.session.as_ref())
    }

    /// Lost (by [`Hold::is_lost`]'s account) but not marked yet: whoever sees it marks
    /// the loss and gives the lock back.
    fn unmarked_loss(&self) -> bool {
        !self.lost.load(Ordering::SeqCst) && self.is_lost()
    }

    /// Where a release in the background runs: on the current runtime, else on the
    /// one the locker was opened on (a guard dropped on a thread with no runtime,
    /// e.g. moved into synchronous code). A session-bound backend (etcd, ZooKeeper,
    /// an SQL session mode) keeps a lock nobody releases for as long as its session
    /// lives, which is as long as that runtime keeps it alive.
    pub(crate) fn release_runtime(&self) -> Option<tokio::runtime::Handle> {
        tokio::runtime::Handle::try_current()
            .ok()
            .or_else(|| self.keepers.home.clone())
    }

    /// Whether the local deadline has passed, whether or not the keeper's timer has
    /// run yet (it may be late on a busy runtime).
    pub(crate) fn past_deadline(&self) -> bool {
        self.nanos(Instant::now()) >= self.deadline_ns.load(Ordering::SeqCst)
    }

    /// The local deadline as it stands.
    pub(crate) fn deadline(&self) -> Instant {
        self.instant(self.deadline_ns.load(Ordering::SeqCst))
    }

    /// Move the local deadline (only with `keep` locked, which the `&mut` proves).
    fn set_deadline(&self, _keep: &mut Keep, deadline: u64) {
        self.deadline_ns.store(deadline, Ordering::SeqCst);
    }

    pub(crate) fn reason(&self) -> Option<LossReason> {
        self.loss.get().and_then(|l| l.reason.get()).cloned()
    }

    pub(crate) fn lost_error(&self) -> Error {
        Error::LockLost {
            name: self.name.as_str().to_owned(),
            reason: self.reason().unwrap_or(LossReason::LeaseExpired),
        }
    }

    /// The scheme of the backend that holds this lock (for spans and metrics).
    pub(crate) fn scheme(&self) -> &'static str {
        self.keepers.meters.scheme()
    }

    /// The token cancelled on loss (made now if nobody asked before).
    pub(crate) fn lost_token(&self) -> &CancellationToken {
        let token = &self.loss().token;
        // A loss by the backend's signal the watcher has not marked yet: `is_lost`
        // cancels the token itself.
        let _ = self.is_lost();
        token
    }

    /// Resolves when the hold is lost (what [`crate::LockGuard::lost`] awaits): its
    /// loss marked, by whoever sees it first. A deadline that passes is normally marked
    /// by the timer as it comes; in case the timer's task cannot run (its runtime shut
    /// down: see [`Rearm`]), it is expired from here too, in a task on this runtime,
    /// after whoever works on the hold now (a renewal answering right at the deadline
    /// moves it instead) — waited for at most [`EXPIRE_WAIT`]. A released hold is not
    /// lost: only a loss marked (by its release) ends the wait then.
    pub(crate) async fn watch_loss(self: Arc<Self>) -> Error {
        let token = self.lost_token().clone();
        let expiring = &self.loss().expiring;
        loop {
            // Made before `revive` looks: a driver that goes after it looked wakes this.
            let gone = self.keepers.gone.notified();
            tokio::pin!(gone);
            gone.as_mut().enable();
            self.keepers.revive();
            let deadline = self.deadline_ns.load(Ordering::SeqCst);
            let wake = if expiring.load(Ordering::SeqCst) == deadline {
                Instant::now() + EXPIRE_POLL
            } else {
                let wake = self.instant(deadline);
                // The session's trust as it stands; looked at again when it comes (a
                // proof of life may have moved it meanwhile). Not sooner than a poll
                // from now: on a paused test clock the trust's (real) instant may lie
                // behind the runtime's while it has not passed.
                match self.session_trust() {
                    Some(t) => {
                        wake.min(Instant::from_std(t.until()).max(Instant::now() + EXPIRE_POLL))
                    }
                    None => wake,
                }
            };
            tokio::select! {
                () = token.cancelled() => return self.lost_error(),
                () = tokio::time::sleep_until(wake) => {}
                () = &mut gone => continue,
            }
            if self.released.load(Ordering::SeqCst) {
                token.cancelled().await;
                return self.lost_error();
            }
            let deadline = self.deadline_ns.load(Ordering::SeqCst);
            let last = expiring.load(Ordering::SeqCst);
            if (self.past_deadline() || self.unmarked_loss())
                && last != deadline
                && expiring
                    .compare_exchange(last, deadline, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                tokio::spawn(Arc::clone(&self).expire_if_due());
            }
        }
    }

    /// Expire the hold if its deadline passed and nobody did ([`Hold::watch_loss`]).
    async fn expire_if_due(self: Arc<Self>) {
        let due = |hold: &Self| {
            !hold.released.load(Ordering::SeqCst)
                && ((!hold.is_lost() && hold.past_deadline()) || hold.unmarked_loss())
        };
        match tokio::time::timeout(EXPIRE_WAIT, self.keep.lock()).await {
            Ok(mut keep) => {
                if due(&self) {
                    self.expire(&mut keep).await;
                }
                // Out of the timer map if expired (its driver may be gone); back in it
                // if a timer's task dropped meanwhile could not put it back ([`Rearm`]).
                self.reschedule(&mut keep);
            }
            // Whoever works on the hold is not done (its task does not run): the loss
            // is told without them, then given back once they are.
            Err(_) => {
                if due(&self) && self.mark_lost(LossReason::LeaseExpired) {
                    let mut keep = self.keep.lock().await;
                    Self::release_after_loss(&mut keep).await;
                    self.reschedule(&mut keep);
                }
            }
        }
    }

    /// The loss's state, made on first demand.
    fn loss(&self) -> &Loss {
        self.loss.get_or_init(Box::default)
    }

    /// Record the loss; `true` if this call was the first to.
    fn mark_lost(&self, reason: LossReason) -> bool {
        // The first reason stands ([`Hold::is_lost`] may have recorded one already).
        let loss = self.loss();
        let reason = loss.reason.get_or_init(|| reason);
        let first = !self.lost.swap(true, Ordering::SeqCst);
        if first {
            tracing::warn!(lock = %self.name, %reason, "lock lost");
            self.keepers.meters.lost(reason);
        }
        loss.token.cancel();
        first
    }

    /// The guard is gone or releasing: no timer may renew the lock any more.
    pub(crate) fn mark_released(&self) {
        self.released.store(true, Ordering::SeqCst);
    }

    /// Take the hold out of the timer map or put it back at its next instant.
    fn reschedule(self: &Arc<Self>, keep: &mut Keep) {
        let old = (keep.slot_seq != 0).then(|| (self.instant(keep.slot_at), keep.slot_seq));
        keep.slot_seq = 0;
        if keep.held.is_none() || self.is_lost() || self.released.load(Ordering::SeqCst) {
            if let Some(old) = old {
                self.keepers.unschedule(old, self);
            }
            return;
        }
        let at = keep.next_renew.min(self.deadline_ns.load(Ordering::SeqCst));
        let (_, seq) = self.keepers.schedule(old, self.instant(at), self);
        keep.slot_at = at;
        keep.slot_seq = seq;
    }

    /// A timer of this hold came due: the future of a task of its own, which puts the
    /// hold back in the timer map if it is dropped before it is done (see [`Rearm`]).
    fn on_timer(
        self: Arc<Self>,
        slot: Slot,
        place: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> impl Future<Output = ()> + Send + 'static {
        let rearm = Rearm {
            hold: Arc::clone(&self),
            slot,
            armed: true,
            _place: place,
        };
        self.serve_timer(slot, rearm)
    }

    async fn serve_timer(self: Arc<Self>, slot: Slot, mut rearm: Rearm) {
        let mut keep = self.keep.lock().await;
        // Not moved meanwhile (an extension sets a new timer), and still to keep.
        if keep.slot_seq == slot.1 {
            keep.slot_seq = 0;
            if keep.held.is_some() && !self.is_lost() && !self.released.load(Ordering::SeqCst) {
                // The deadline before a renewal due at the same moment.
                let now = self.nanos(Instant::now());
                if now >= self.deadline_ns.load(Ordering::SeqCst) {
                    self.expire(&mut keep).await;
                } else if now >= keep.next_renew {
                    let _ = self.renew_once(&mut keep).await;
                }
            } else if keep.held.is_some()
                && !self.released.load(Ordering::SeqCst)
                && self.unmarked_loss()
            {
                // Its session is trusted no more (or the backend's signal fired and its
                // watcher has not run): marked, and the lock given back.
                self.expire(&mut keep).await;
            }
        }
        // Whatever was found, the hold leaves with the slot it needs, if any: every
        // holder of `keep` reschedules before it lets go (see [`Rearm`]).
        rearm.armed = false;
        self.reschedule(&mut keep);
    }

    /// The backend reported its session gone.
    async fn watch_backend(self: Arc<Self>, signal: CancellationToken, end: CancellationToken) {
        tokio::select! {
            () = signal.cancelled() => {}
            () = end.cancelled() => return,
        }
        if self.mark_lost(session_gone()) {
            let mut keep = self.keep.lock().await;
            self.reschedule(&mut keep);
            Self::release_after_loss(&mut keep).await;
        }
    }

    /// One renewal. Updates the deadline on success, marks the lock lost when the server
    /// disowns it, and sets a quicker retry on a transient error.
    async fn renew_once(&self, keep: &mut Keep) -> Result<()> {
        let now = self.nanos(Instant::now());
        let mut ttl = keep.ttl();
        // Whether this renewal's lease ends with the maximum hold time: the deadline it
        // sets is then that end (only once it is applied: a failed renewal leaves the
        // deadline a lease's, and its passing a `LeaseExpired`).
        let mut capped = false;
        if keep.hold_until != NEVER {
            let left = Duration::from_nanos(keep.hold_until.saturating_sub(now));
            if left < MIN_TTL {
                // Max hold reached: stop renewing; the deadline fires MaxHoldTime.
                keep.next_renew = NEVER;
                keep.capped_by_hold = true;
                return Ok(());
            }
            if left < ttl {
                ttl = left;
                capped = true;
            }
        }
        let deadline = self.deadline_ns.load(Ordering::SeqCst);
        let budget = Duration::from_nanos(deadline.saturating_sub(now));
        let outcome = match keep.held.as_ref() {
            None => Err(self.lost_error()),
            Some(_) if budget.is_zero() => Err(Error::connection("core", "no time left to renew")),
            Some(held) => match tokio::time::timeout(budget, held.renew(ttl)).await {
                Ok(r) => r,
                Err(_) => Err(Error::connection("core", "renewal timed out")),
            },
        };
        let drift = keep
            .held
            .as_ref()
            .map_or(Duration::ZERO, |h| h.clock_drift(ttl));
        // Where the lease ends if this renewal was applied (sent at `now`), capped by
        // the maximum hold time (NEVER when there is none).
        let asked = now
            .saturating_add(nanos_of(ttl.saturating_sub(drift.max(drift_margin(ttl)))))
            .min(keep.hold_until);
        self.keepers.meters.renewed(outcome.is_ok());
        match outcome.map_err(lost_by) {
            Ok(()) => {
                self.set_deadline(keep, asked);
                keep.capped_by_hold = capped;
                keep.next_renew = keep.renew_every().map_or(NEVER, |every| {
                    now.saturating_add(nanos_of(every.min(ttl / 3)))
                });
                Ok(())
            }
            Err(Ok(reason)) => {
                // The owner-checked release still runs: a backend that disowned the
                // hold locally (a ZooKeeper session given up while the server may
                // keep it) deletes what may be left of it, as after any other loss.
                // A backend that knows why (a session that did not prove itself
                // alive) says so.
                if self.mark_lost(reason) {
                    Self::release_after_loss(keep).await;
                }
                keep.next_renew = NEVER;
                Err(self.lost_error())
            }
            Err(Err(e)) => {
                // The renewal may have been applied with its answer lost. If it asked for
                // less than the lease had left, the lease may now end sooner: trust the
                // shorter of the two.
                if asked < self.deadline_ns.load(Ordering::SeqCst) {
                    self.set_deadline(keep, asked);
                }
                tracing::debug!(lock = %self.name, error = %e, "renewal failed; retrying");
                keep.next_renew = self
                    .nanos(Instant::now())
                    .saturating_add(nanos_of(keep.retry_after()));
                Err(e)
            }
        }
    }

    /// The local deadline passed: the lock is lost (max hold time or lease expiry).
    async fn expire(&self, keep: &mut Keep) {
        let reason = if keep.capped_by_hold {
            LossReason::MaxHoldTime
        } else {
            LossReason::LeaseExpired
        };
        if self.mark_lost(reason) {
            Self::release_after_loss(keep).await;
        }
    }

    /// A deadline that passed while nothing could run (the process was paused) counts
    /// before a command: a release or extension after it must report the loss, not
    /// succeed against a lease that is gone.
    async fn check_deadline(&self, keep: &mut Keep) -> Result<()> {
        if (!self.is_lost() && self.past_deadline()) || self.unmarked_loss() {
            self.expire(keep).await;
        }
        if self.is_lost() {
            return Err(self.lost_error());
        }
        Ok(())
    }

    /// After a loss the lease may still be ours on the server (e.g. renewals could not
    /// get through); an owner-checked release frees it for others sooner and cannot
    /// harm a new holder. The held lock goes with that release: a lost hold renews,
    /// extends and releases nothing more (each reports the loss first).
    ///
    /// Not with a lock-delay: the lease must run out unreleased for the delay to hold
    /// the next owner back while this holder hears of the loss and stops.
    async fn release_after_loss(keep: &mut Keep) {
        keep.next_renew = NEVER;
        if let Some(held) = keep.held.as_ref() {
            held.lost();
        }
        if keep.held.as_ref().is_some_and(|h| !h.keeps_lock_delay())
            && let Some(held) = keep.held.take()
        {
            // Not waited for longer than LOST_RELEASE_TIMEOUT, but never cut off: a
            // release stopped halfway may leave its key or node under a live session.
            let release = crate::finish::Finish::new(async move { held.release().await });
            let _ = tokio::time::timeout(LOST_RELEASE_TIMEOUT, release).await;
        }
    }

    /// How a successor of this hold should be kept: the lease asked for at the last
    /// grant or extension, the renewal (automatic, or the interval it runs at: for a
    /// hold whose renewals prove its session alive, at most
    /// [`HeldLock::prove_alive_every`]), and the end of the maximum hold time, if any.
    pub(crate) async fn keeping(self: &Arc<Self>) -> (Duration, crate::Renewal, Option<Instant>) {
        let mut keep = self.keep.lock().await;
        // A timer's task dropped while this held the hold could not put it back
        // ([`Rearm`] found it taken): whoever holds it does.
        self.reschedule(&mut keep);
        let hold_until = (keep.hold_until != NEVER).then(|| self.instant(keep.hold_until));
        let renewal = match keep.renew_every() {
            None => crate::Renewal::Off,
            Some(_) if keep.renew_auto => crate::Renewal::Auto,
            Some(every) => crate::Renewal::Every(every),
        };
        (keep.ttl(), renewal, hold_until)
    }

    /// Whether `keepers` keeps this hold (it belongs to their locker).
    pub(crate) fn kept_by(&self, keepers: &Arc<Keepers>) -> bool {
        Arc::ptr_eq(&self.keepers, keepers)
    }

    /// Set the lease to `ttl` from now; later renewals use it too.
    pub(crate) async fn extend(self: &Arc<Self>, ttl: Duration) -> Result<()> {
        let mut keep = self.keep.lock().await;
        if keep.held.is_none() {
            return Err(self.lost_error());
        }
        self.check_deadline(&mut keep).await?;
        keep.ttl_ns = nanos_of(ttl);
        // Renewals come at a third of the new TTL at the latest (every renewal's
        // interval is capped so); an interval the caller chose stays as it is.
        if keep.renew_auto && keep.renew_every_ns != NEVER {
            let proof = keep.held.as_ref().and_then(|h| h.prove_alive_every());
            keep.renew_every_ns = nanos_of(proof.map_or(ttl / 3, |p| p.min(ttl / 3)));
        }
        let result = self.renew_once(&mut keep).await;
        self.reschedule(&mut keep);
        result
    }

    /// Release the lock (once; a second call reports the loss).
    pub(crate) async fn release(self: Arc<Self>) -> Result<()> {
        self.mark_released();
        let mut keep = self.keep.lock().await;
        self.reschedule(&mut keep);
        let result = match self.check_deadline(&mut keep).await {
            Err(e) => {
                // Lost, and perhaps nobody marked it or gave the lock back yet: the
                // backend's signal fired and its watcher has not run (and may now
                // end without doing either: the release ends it). Mark it (a no-op
                // for every other loss, already marked) and give the lock back, as
                // any loss does, or the server keeps it until its session ends.
                self.mark_lost(session_gone());
                Self::release_after_loss(&mut keep).await;
                Err(e)
            }
            Ok(()) => match keep.held.as_ref() {
                Some(held) => match held.release().await.map_err(lost_by) {
                    Ok(()) => Ok(()),
                    // The server said this hold was gone (broken, or its lease ended
                    // and the lock was taken) while it looked held here: lost, and
                    // told so, as a renewal would have.
                    Err(Ok(reason)) => {
                        self.mark_lost(reason);
                        Err(self.lost_error())
                    }
                    Err(Err(e)) => Err(e),
                },
                None => Err(self.lost_error()),
            },
        };
        keep.held = None;
        keep.next_renew = NEVER;
        if let Some((_, end)) = self.signals.as_ref().and_then(|s| s.loss.as_ref()) {
            end.cancel();
        }
        result
    }
}

/// Why a hold was lost, if a renewal's or a release's error says it was (the server
/// no longer lists it: `NotOwner`; or the backend knows why: `LockLost`); else the
/// error itself.
fn lost_by(e: Error) -> std::result::Result<LossReason, Error> {
    match e {
        Error::NotOwner { .. } => Ok(LossReason::NotOwner),
        Error::LockLost { reason, .. } => Ok(reason),
        e => Err(e),
    }
}

/// Why a hold whose backend reported its session gone was lost.
fn session_gone() -> LossReason {
    LossReason::SessionLost("the backend reported the session gone".into())
}

/// Why a hold whose session was not proven alive in time was lost.
fn session_unproven() -> LossReason {
    LossReason::SessionLost(
        "its session was not proven alive in time: the server may have ended it".into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Renewals that take `delay` to answer (none by default), counted.
    #[derive(Debug, Default)]
    struct Slow {
        delay: Duration,
        renewals: Arc<std::sync::atomic::AtomicU32>,
    }

    #[async_trait::async_trait]
    impl HeldLock for Slow {
        fn fencing_token(&self) -> u64 {
            1
        }
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            tokio::time::sleep(self.delay).await;
            self.renewals.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        async fn release(&self) -> Result<()> {
            Ok(())
        }
    }

    /// A held lock costs its `Hold` (plus the backend's state and a timer map entry):
    /// no task and no task-sized future any more (one was 744, then 648 bytes; the
    /// hold itself was 304 bytes with 16-byte instants and its loss state inline).
    #[test]
    fn a_hold_stays_small() {
        let size = std::mem::size_of::<Hold>();
        assert!(size <= 216, "a Hold grew to {size} bytes");
    }

    /// Renewals that wait for `gate` to open, counting how many run at once (and the
    /// most that ever did) and which holds were renewed.
    #[derive(Debug)]
    struct Gated {
        id: usize,
        batched: bool,
        gate: Arc<tokio::sync::Semaphore>,
        running: Arc<std::sync::atomic::AtomicUsize>,
        most: Arc<std::sync::atomic::AtomicUsize>,
        renewed: Arc<Mutex<std::collections::HashSet<usize>>>,
    }

    #[async_trait::async_trait]
    impl HeldLock for Gated {
        fn fencing_token(&self) -> u64 {
            1
        }
        fn renews_in_batches(&self) -> bool {
            self.batched
        }
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            let open = self.gate.acquire().await;
            drop(open);
            self.renewed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(self.id);
            self.running.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
        async fn release(&self) -> Result<()> {
            Ok(())
        }
    }

    /// A hold of `keepers` named `name`, renewed every 50 ms, its lease 120 s.
    fn every_50_ms(keepers: &Arc<Keepers>, held: Box<dyn HeldLock>, name: &str) -> Arc<Hold> {
        let name = LockName::new(name).expect("name");
        let plan = plan(
            Duration::from_secs(120),
            Some(Duration::from_millis(50)),
            None,
        );
        Hold::start(keepers, held, name, Owner::random(), plan)
    }

    /// `count` holds of `keepers` renewed every 50 ms through [`Gated`], sharing one
    /// shut gate and its counters.
    struct GatedHolds {
        holds: Vec<Arc<Hold>>,
        gate: Arc<tokio::sync::Semaphore>,
        running: Arc<std::sync::atomic::AtomicUsize>,
        most: Arc<std::sync::atomic::AtomicUsize>,
        renewed: Arc<Mutex<std::collections::HashSet<usize>>>,
    }

    fn gated_holds(keepers: &Arc<Keepers>, count: usize, batched: bool) -> GatedHolds {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let renewed = Arc::new(Mutex::new(std::collections::HashSet::new()));
        let holds = (0..count)
            .map(|id| {
                let held = Gated {
                    id,
                    batched,
                    gate: Arc::clone(&gate),
                    running: Arc::clone(&running),
                    most: Arc::clone(&most),
                    renewed: Arc::clone(&renewed),
                };
                every_50_ms(keepers, Box::new(held), &format!("k{id}"))
            })
            .collect();
        GatedHolds {
            holds,
            gate,
            running,
            most,
            renewed,
        }
    }

    /// `holds_count` holds of one locker, renewed every 50 ms through [`Gated`] (in
    /// batches or not), all come due at once while the gate is shut, and after them
    /// `alone` holds renewed one request each through [`Slow`], at once. Answers how
    /// many gated renewals ran at once while shut and ever, whether every gated hold
    /// was renewed once it opened, and how many renewals of the others answered in
    /// 500 ms while it was shut.
    async fn due_together(
        holds_count: usize,
        batched: bool,
        alone: usize,
    ) -> (usize, usize, bool, u32) {
        let keepers = Arc::new(Keepers::default());
        let GatedHolds {
            holds,
            gate,
            running,
            most,
            renewed,
        } = gated_holds(&keepers, holds_count, batched);
        let alone_renewals = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let others: Vec<Arc<Hold>> = (0..alone)
            .map(|id| {
                let held = Slow {
                    delay: Duration::ZERO,
                    renewals: Arc::clone(&alone_renewals),
                };
                every_50_ms(&keepers, Box::new(held), &format!("alone{id}"))
            })
            .collect();
        // Every hold came due 50 ms in; the driver starts what it may, and nothing
        // gated renews while the gate is shut.
        let expect = if batched { MAX_SERVING } else { holds_count };
        let waited = Instant::now();
        while running.load(Ordering::SeqCst) < expect && waited.elapsed() < Duration::from_secs(20)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let before = alone_renewals.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let alone_while_shut = alone_renewals.load(Ordering::SeqCst) - before;
        let most_shut = most.load(Ordering::SeqCst);
        assert!(renewed.lock().expect("set").is_empty());
        // Opened: the waiting renewals answer, the rest are served as places free.
        gate.add_permits(tokio::sync::Semaphore::MAX_PERMITS / 2);
        let waited = Instant::now();
        while renewed.lock().expect("set").len() < holds_count
            && waited.elapsed() < Duration::from_secs(30)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let all =
            renewed.lock().expect("set").len() == holds_count && holds.iter().all(|h| !h.is_lost());
        let most_ever = most.load(Ordering::SeqCst);
        for h in holds.iter().chain(&others) {
            h.mark_released();
        }
        (most_shut, most_ever, all, alone_while_shut)
    }

    /// More holds renewed in batches come due at once than timer tasks may serve them:
    /// the driver starts [`MAX_SERVING`] and no more while they all wait, and the rest
    /// once places free — every hold is renewed, none lost.
    #[tokio::test]
    async fn holds_renewed_in_batches_are_served_by_at_most_max_serving_tasks() {
        let (shut, ever, all, _) = due_together(MAX_SERVING + 300, true, 0).await;
        assert_eq!(shut, MAX_SERVING);
        assert_eq!(ever, MAX_SERVING);
        assert!(all, "not every hold was renewed");
    }

    /// Holds renewed one request each are not held back: as many renewals run at once
    /// as came due (each may wait long for its answer).
    #[tokio::test]
    async fn holds_renewed_one_by_one_all_run_at_once() {
        let count = MAX_SERVING + 300;
        let (shut, _, all, _) = due_together(count, false, 0).await;
        assert_eq!(shut, count);
        assert!(all, "not every hold was renewed");
    }

    /// Holds renewed one request each, due behind a backlog of batched holds waiting
    /// for places, are not held up by it: they go on being renewed (every 50 ms: 50
    /// holds for 500 ms: about 500; at least 200 asked).
    #[tokio::test]
    async fn holds_renewed_one_by_one_are_not_held_up_by_a_batched_backlog() {
        let (shut, _, all, alone) = due_together(MAX_SERVING + 300, true, 50).await;
        assert_eq!(shut, MAX_SERVING);
        assert!(all, "not every batched hold was renewed");
        assert!(alone >= 200, "{alone} renewals of 50 holds in 500 ms");
    }

    /// Places given back by tasks whose holds were released meanwhile (they schedule
    /// nothing, so nothing else wakes the driver) serve the batched holds still due
    /// at once, not when the driver's sleep ends ([`DRIVER_LINGER`] away).
    #[tokio::test]
    async fn a_place_given_back_wakes_the_driver() {
        let keepers = Arc::new(Keepers::default());
        let count = MAX_SERVING + 300;
        let gated = gated_holds(&keepers, count, true);
        let (holds, gate, running, renewed) =
            (gated.holds, gated.gate, gated.running, gated.renewed);
        let waited = Instant::now();
        while running.load(Ordering::SeqCst) < MAX_SERVING
            && waited.elapsed() < Duration::from_secs(20)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(running.load(Ordering::SeqCst), MAX_SERVING);
        // The holds being served (the earliest due) are released; their renewals end
        // once the gate opens, and their tasks give their places back.
        for h in &holds[..MAX_SERVING] {
            h.mark_released();
        }
        gate.add_permits(tokio::sync::Semaphore::MAX_PERMITS / 2);
        let waited = Instant::now();
        while renewed.lock().expect("set").len() < count
            && waited.elapsed() < DRIVER_LINGER + Duration::from_secs(5)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = waited.elapsed();
        assert_eq!(renewed.lock().expect("set").len(), count);
        assert!(
            took < DRIVER_LINGER / 2,
            "the holds left waiting were served {took:?} after places freed"
        );
        for h in &holds {
            h.mark_released();
        }
    }

    /// Renewals never get an answer.
    #[derive(Debug)]
    struct Unanswered;

    #[async_trait::async_trait]
    impl HeldLock for Unanswered {
        fn fencing_token(&self) -> u64 {
            1
        }
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            Err(Error::connection("test", "no answer"))
        }
        async fn release(&self) -> Result<()> {
            Ok(())
        }
    }

    fn plan(
        ttl: Duration,
        renew_every: Option<Duration>,
        max_hold: Option<Duration>,
    ) -> KeeperPlan {
        KeeperPlan {
            ttl,
            renew_every,
            renew_auto: false,
            max_hold,
            sent_at: Instant::now(),
            primitive: Primitive::Lock,
        }
    }

    fn start(held: Box<dyn HeldLock>, plan: KeeperPlan) -> Arc<Hold> {
        let keepers = Arc::new(Keepers::default());
        let name = LockName::new("k").expect("name");
        Hold::start(&keepers, held, name, Owner::random(), plan)
    }

    /// A hold on a session that is not proven alive in time counts as lost at once —
    /// `is_held` false, `lost()` answering, the reason the session's — although its
    /// lease (30 s) and renewals are fine, and the lock is given back; one whose
    /// session is proven alive meanwhile stays held.
    #[tokio::test]
    async fn a_hold_whose_session_is_not_proven_alive_in_time_is_lost() {
        let window = Duration::from_millis(300);
        let stale = SessionTrust::new(std::time::Instant::now() + window);
        let releases = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let held = trusted(&stale, &releases);
        let hold = start(
            Box::new(held),
            plan(
                Duration::from_secs(30),
                Some(Duration::from_millis(100)),
                None,
            ),
        );
        let guard = crate::guard::LockGuard::new(hold);

        let fresh = SessionTrust::new(std::time::Instant::now() + window);
        let proven = trusted(&fresh, &Arc::default());
        let kept = crate::guard::LockGuard::new(start(
            Box::new(proven),
            plan(
                Duration::from_secs(30),
                Some(Duration::from_millis(100)),
                None,
            ),
        ));
        let prover = tokio::spawn(async move {
            loop {
                fresh.extend_to(std::time::Instant::now() + window);
                tokio::time::sleep(window / 4).await;
            }
        });

        assert!(guard.is_held());
        let told = tokio::time::timeout(window * 3, guard.lost())
            .await
            .expect("lost() fires once the session is not trusted");
        assert!(
            !stale.until().elapsed().is_zero(),
            "told before the trust passed"
        );
        assert!(!guard.is_held());
        assert!(guard.lost_token().is_cancelled());
        match told {
            Error::LockLost {
                reason: LossReason::SessionLost(_),
                ..
            } => {}
            other => panic!("told {other:?}"),
        }
        // Given back by whoever marked the loss.
        for _ in 0..100 {
            if releases.load(Ordering::SeqCst) > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            releases.load(Ordering::SeqCst),
            1,
            "the lost lock was given back once"
        );
        assert!(kept.is_held(), "a session proven alive keeps its hold");
        prover.abort();
        // A session ended for good stays lost whatever comes later.
        stale.extend_to(std::time::Instant::now() + Duration::from_secs(60));
        stale.end();
        stale.extend_to(std::time::Instant::now() + Duration::from_secs(60));
        assert!(stale.passed());
    }

    /// Once a hold has been seen lost for its session's trust, an answer to a proof
    /// sent before (a ping answering late) does not make it held again.
    #[tokio::test]
    async fn a_hold_seen_lost_for_its_session_stays_lost() {
        let trust = SessionTrust::new(std::time::Instant::now() + Duration::from_millis(50));
        let held = trusted(&trust, &Arc::default());
        // No renewal and a long lease: nothing marks the loss before the checks below.
        let guard = crate::guard::LockGuard::new(start(
            Box::new(held),
            plan(Duration::from_secs(30), None, None),
        ));
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(!guard.is_held());
        trust.extend_to(std::time::Instant::now() + Duration::from_secs(60));
        assert!(
            !guard.is_held(),
            "a late proof brought back a hold seen lost"
        );
        assert!(matches!(
            guard.loss_reason(),
            Some(LossReason::SessionLost(_))
        ));
    }

    /// A lock on a session: its backend reports the session gone through a signal, or
    /// the test proves it alive (or not) by moving its trust; renewals always succeed,
    /// releases are counted.
    #[derive(Debug)]
    struct Signalled {
        gone: CancellationToken,
        trust: Option<SessionTrust>,
        releases: Arc<std::sync::atomic::AtomicU32>,
    }

    #[async_trait::async_trait]
    impl HeldLock for Signalled {
        fn fencing_token(&self) -> u64 {
            1
        }
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            Ok(())
        }
        async fn release(&self) -> Result<()> {
            self.releases.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn loss_signal(&self) -> Option<CancellationToken> {
            Some(self.gone.clone())
        }
        fn session_trust(&self) -> Option<SessionTrust> {
            self.trust.clone()
        }
    }

    /// A lock on a session trusted as `trust` says, its releases counted by `releases`.
    fn trusted(trust: &SessionTrust, releases: &Arc<std::sync::atomic::AtomicU32>) -> Signalled {
        Signalled {
            gone: CancellationToken::new(),
            trust: Some(trust.clone()),
            releases: Arc::clone(releases),
        }
    }

    /// A renewed hold on a [`Signalled`] backend: the hold, its loss signal, and the
    /// count of its releases.
    fn signalled_hold() -> (
        Arc<Hold>,
        CancellationToken,
        Arc<std::sync::atomic::AtomicU32>,
    ) {
        let (gone, releases) = (CancellationToken::new(), Arc::default());
        let hold = start(
            Box::new(Signalled {
                gone: gone.clone(),
                trust: None,
                releases: Arc::clone(&releases),
            }),
            plan(Duration::from_secs(30), Some(Duration::from_secs(10)), None),
        );
        (hold, gone, releases)
    }

    /// A hold whose renewals prove its session alive (SQL session modes), every 1 s:
    /// counts its renewals and whether it was told to watch itself, and has a loss
    /// signal only once told (as a session hold's heartbeat gives it one).
    #[derive(Debug, Default, Clone)]
    struct Proving {
        renewals: Arc<std::sync::atomic::AtomicU32>,
        alone: Arc<std::sync::atomic::AtomicU32>,
        signal: Arc<OnceLock<CancellationToken>>,
        /// The next renewal answers that the session is gone.
        fail: Arc<AtomicBool>,
    }

    #[async_trait::async_trait]
    impl HeldLock for Proving {
        fn fencing_token(&self) -> u64 {
            1
        }
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            self.renewals.fetch_add(1, Ordering::SeqCst);
            if self.fail.load(Ordering::SeqCst) {
                return Err(Error::LockLost {
                    name: String::new(),
                    reason: LossReason::SessionLost("no answer to a ping".into()),
                });
            }
            Ok(())
        }
        async fn release(&self) -> Result<()> {
            Ok(())
        }
        fn prove_alive_every(&self) -> Option<Duration> {
            Some(Duration::from_secs(1))
        }
        fn watch_alone(&self) {
            self.alone.fetch_add(1, Ordering::SeqCst);
            self.signal.get_or_init(CancellationToken::new);
        }
        fn loss_signal(&self) -> Option<CancellationToken> {
            self.signal.get().cloned()
        }
    }

    /// Renewed at least as often as the session must be proven alive, whatever the
    /// renewal interval asked for and after an extension; never told to watch itself;
    /// a failed proof is a loss, with the backend's reason.
    #[tokio::test(start_paused = true)]
    async fn a_session_hold_is_renewed_as_often_as_it_must_prove_itself() {
        let held = Proving::default();
        let Proving {
            renewals,
            alone,
            fail,
            ..
        } = held.clone();
        let hold = start(
            Box::new(held),
            plan(Duration::from_secs(30), Some(Duration::from_secs(10)), None),
        );
        tokio::time::sleep(Duration::from_millis(5_500)).await;
        assert_eq!(renewals.load(Ordering::SeqCst), 5, "one proof a second");
        hold.extend(Duration::from_secs(60)).await.expect("extend");
        let after = renewals.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(3_500)).await;
        assert_eq!(
            renewals.load(Ordering::SeqCst) - after,
            3,
            "an extension kept the proofs a second apart"
        );
        assert_eq!(alone.load(Ordering::SeqCst), 0);
        fail.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        assert!(hold.is_lost(), "a failed proof is a loss");
        assert!(
            matches!(hold.reason(), Some(LossReason::SessionLost(_))),
            "{:?}",
            hold.reason()
        );
    }

    /// With renewal off, the keeper never renews such a hold: it is told, once, to
    /// prove itself alive on its own, before its loss signal is read, so a loss its
    /// heartbeat reports counts.
    #[tokio::test(start_paused = true)]
    async fn a_session_hold_without_renewal_watches_itself() {
        let held = Proving::default();
        let Proving {
            renewals,
            alone,
            signal,
            ..
        } = held.clone();
        let hold = start(Box::new(held), plan(Duration::from_secs(30), None, None));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(alone.load(Ordering::SeqCst), 1);
        assert_eq!(renewals.load(Ordering::SeqCst), 0);
        assert!(!hold.is_lost());
        signal.get().expect("told to watch itself").cancel();
        assert!(hold.is_lost(), "the heartbeat's loss went unheard");
    }

    /// The backend's loss signal counts the moment it fires — before the watcher task
    /// has run (a backend may let the lock go on the server soon after: etcd revokes a
    /// lost session 50 ms later) — and the watcher still gives the lock back once.
    #[tokio::test]
    async fn a_reported_loss_counts_before_the_watcher_runs() {
        let (hold, gone, releases) = signalled_hold();
        tokio::task::yield_now().await;
        assert!(!hold.is_lost());
        gone.cancel();
        // No await since: on this single-threaded runtime the watcher has not run.
        assert!(
            hold.is_lost(),
            "a reported loss waited for the watcher task"
        );
        assert!(matches!(hold.reason(), Some(LossReason::SessionLost(_))));
        assert!(hold.lost_token().is_cancelled());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            releases.load(Ordering::SeqCst),
            1,
            "released after the loss"
        );
    }

    /// A guard released after the backend reported the loss, before the watcher task
    /// ran, still gives the lock back, once: the release used to drop the held lock
    /// unreleased, and the watcher then found nothing to give back (a ZooKeeper node
    /// stayed until the server ended its session).
    #[tokio::test]
    async fn a_release_right_after_a_reported_loss_still_gives_the_lock_back() {
        let (hold, gone, releases) = signalled_hold();
        tokio::task::yield_now().await;
        gone.cancel();
        // No await since: on this single-threaded runtime the watcher has not run.
        let released = Arc::clone(&hold).release().await;
        assert!(
            matches!(released, Err(Error::LockLost { .. })),
            "{released:?}"
        );
        // Marked (so logged and counted) by the release: the watcher, ended by it,
        // may never get to.
        assert!(
            hold.lost.load(Ordering::SeqCst),
            "the loss was never marked"
        );
        assert!(matches!(hold.reason(), Some(LossReason::SessionLost(_))));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(releases.load(Ordering::SeqCst), 1, "given back once");
    }

    /// A renewal that asked for a shorter lease and got no answer may have been applied:
    /// the hold trusts the shorter lease from then on (it kept the old, longer deadline).
    #[tokio::test(start_paused = true)]
    async fn a_failed_renewal_that_asked_for_less_moves_the_deadline() {
        let hold = start(
            Box::new(Unanswered),
            plan(Duration::from_secs(10), None, None),
        );
        assert!(hold.extend(Duration::from_secs(1)).await.is_err());
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert!(hold.past_deadline(), "still trusting the 10 s lease");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(hold.is_lost());
        // One that asked for more changes nothing.
        let hold = start(
            Box::new(Unanswered),
            plan(Duration::from_secs(2), None, None),
        );
        assert!(hold.extend(Duration::from_secs(60)).await.is_err());
        tokio::time::sleep(Duration::from_millis(2100)).await;
        assert!(hold.is_lost(), "trusted a longer lease nobody confirmed");
    }

    /// A maximum hold time shorter than the renewal interval, or with renewal off,
    /// still ends the hold (it used to wait for a renewal that never came, or for the
    /// whole lease); one too long to represent is no maximum, not a panic.
    #[tokio::test(start_paused = true)]
    async fn max_hold_ends_a_hold_whatever_the_renewal() {
        let ttl = Duration::from_secs(30);
        let max = Some(Duration::from_millis(300));
        for every in [None, Some(Duration::from_secs(10))] {
            let hold = start(Box::new(Slow::default()), plan(ttl, every, max));
            tokio::time::sleep(Duration::from_millis(250)).await;
            assert!(!hold.is_lost(), "lost before the max hold time");
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(
                hold.is_lost(),
                "renewal {every:?}: held past the max hold time"
            );
            assert_eq!(hold.reason(), Some(LossReason::MaxHoldTime));
        }
        let hold = start(
            Box::new(Slow::default()),
            plan(
                Duration::from_secs(3),
                Some(Duration::from_secs(1)),
                Some(Duration::MAX),
            ),
        );
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!hold.is_lost(), "{:?}", hold.reason());
    }

    /// Releases slowly and says when it has finished.
    #[derive(Debug)]
    struct SlowRelease(Arc<AtomicBool>);

    #[async_trait::async_trait]
    impl HeldLock for SlowRelease {
        fn fencing_token(&self) -> u64 {
            1
        }
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            Ok(())
        }
        async fn release(&self) -> Result<()> {
            tokio::time::sleep(Duration::from_secs(3)).await;
            self.0.store(true, Ordering::SeqCst);
            Ok(())
        }
    }

    /// The release after a loss is waited for at most 2 s but never cut off halfway
    /// (a release stopped mid-way may leave an etcd key or a ZooKeeper node behind
    /// under a live session).
    #[tokio::test(start_paused = true)]
    async fn a_release_after_a_loss_is_never_cut_off() {
        let done = Arc::new(AtomicBool::new(false));
        let hold = start(
            Box::new(SlowRelease(Arc::clone(&done))),
            plan(
                Duration::from_secs(10),
                None,
                Some(Duration::from_millis(100)),
            ),
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(hold.is_lost());
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            done.load(Ordering::SeqCst),
            "the release was dropped halfway"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn one_driver_serves_every_hold_and_leaves_when_idle() {
        let keepers = Arc::new(Keepers::default());
        let plan = KeeperPlan {
            ttl: Duration::from_secs(3),
            renew_every: Some(Duration::from_secs(1)),
            renew_auto: false,
            max_hold: None,
            sent_at: Instant::now(),
            primitive: Primitive::Lock,
        };
        let holds: Vec<_> = (0..3)
            .map(|i| {
                let name = LockName::new(&format!("k{i}")).expect("name");
                Hold::start(
                    &keepers,
                    Box::new(Slow::default()),
                    name,
                    Owner::random(),
                    plan,
                )
            })
            .collect();
        assert_eq!(keepers.timers().due.len(), 3);
        // Renewed past several TTLs: still held.
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(holds.iter().all(|h| !h.is_lost()));
        for h in holds {
            h.release().await.expect("release");
        }
        assert!(keepers.timers().due.is_empty());
        tokio::time::sleep(DRIVER_LINGER * 2).await;
        assert!(
            keepers.timers().driver.is_none(),
            "the driver should have left"
        );
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// Keepers whose timer task runs on a runtime of its own (the first hold is taken
    /// there), returned with that runtime.
    fn keepers_on_a_runtime_of_their_own() -> (Arc<Keepers>, tokio::runtime::Runtime) {
        let first = runtime();
        let keepers = keepers_started_on(&first);
        (keepers, first)
    }

    /// Keepers whose driver was started on `first` by a hold taken there (and left in
    /// the timer map).
    fn keepers_started_on(first: &tokio::runtime::Runtime) -> Arc<Keepers> {
        let keepers = Arc::new(Keepers::default());
        let plan = plan(Duration::from_secs(30), None, None);
        let name = LockName::new("first").expect("name");
        let hold = first.block_on(async {
            Hold::start(
                &keepers,
                Box::new(Slow::default()),
                name,
                Owner::random(),
                plan,
            )
        });
        // Kept in the map by its slot; the guard is not needed.
        drop(hold);
        assert!(
            keepers.timers().driver.is_some(),
            "the driver started there"
        );
        keepers
    }

    /// A hold with a 400 ms lease renewed every 100 ms, taken on `second` from
    /// `keepers` (whose driver runs elsewhere), with its renewals counted.
    fn renewed_hold_on(
        second: &tokio::runtime::Runtime,
        keepers: &Arc<Keepers>,
    ) -> (
        crate::guard::LockGuard,
        Arc<std::sync::atomic::AtomicU32>,
        Duration,
    ) {
        let renewals = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let held = Slow {
            delay: Duration::ZERO,
            renewals: Arc::clone(&renewals),
        };
        let ttl = Duration::from_millis(400);
        let guard = second.block_on(async {
            let name = LockName::new("second").expect("name");
            let plan = plan(ttl, Some(Duration::from_millis(100)), None);
            crate::guard::LockGuard::new(Hold::start(
                keepers,
                Box::new(held),
                name,
                Owner::random(),
                plan,
            ))
        });
        (guard, renewals, ttl)
    }

    /// A locker used from two runtimes: its timer task runs on the first one that
    /// started it. When that runtime shuts down, a hold taken on the other is renewed
    /// again as soon as it is watched there (`lost()` starts a driver on its own
    /// runtime), instead of only being told of its loss at its deadline.
    #[test]
    fn a_hold_whose_timer_runtime_is_gone_is_renewed_once_watched() {
        renewed_after_its_timer_runtime_goes(false);
    }

    /// The same when `lost()` is already being watched as the timer runtime goes: the
    /// driver's end wakes the watcher, which starts a new one at once (not at the
    /// deadline it sleeps to).
    #[test]
    fn a_hold_watched_as_its_timer_runtime_goes_is_renewed() {
        renewed_after_its_timer_runtime_goes(true);
    }

    /// A hold renewed through a driver on a runtime that goes (before the first
    /// renewal is due), `lost()` watched on the other from before that (`watching`)
    /// or from after: never lost, renewed again.
    fn renewed_after_its_timer_runtime_goes(watching: bool) {
        let (keepers, first) = keepers_on_a_runtime_of_their_own();
        let second = runtime();
        let (guard, renewals, ttl) = renewed_hold_on(&second, &keepers);
        let watch = watching.then(|| second.spawn(guard.lost()));
        std::thread::sleep(Duration::from_millis(20));
        drop(first);
        let told = second.block_on(async {
            match watch {
                Some(watch) => tokio::time::timeout(ttl * 4, watch)
                    .await
                    .map(|r| format!("{r:?}")),
                None => tokio::time::timeout(ttl * 4, guard.lost())
                    .await
                    .map(|e| format!("{e:?}")),
            }
        });
        if let Ok(e) = told {
            panic!(
                "lost ({e}) after {} renewals: nothing renewed it once its timer runtime went",
                renewals.load(Ordering::SeqCst)
            );
        }
        assert!(
            renewals.load(Ordering::SeqCst) >= 3,
            "renewed {} times in four leases",
            renewals.load(Ordering::SeqCst)
        );
        assert!(guard.is_held());
        assert_eq!(guard.loss_reason(), None);
    }

    /// When the timer task cannot run at all (its runtime lives but is not driven: a
    /// current-thread runtime outside `block_on`), a hold is still told of its loss
    /// at its deadline: its `lost()` watches the deadline itself and marks the loss,
    /// instead of the hold reading as not held while `lost()` never fires.
    #[test]
    fn a_hold_is_told_of_its_loss_when_its_timer_task_cannot_run() {
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let keepers = keepers_started_on(&first);
        let second = runtime();
        let (guard, renewals, ttl) = renewed_hold_on(&second, &keepers);
        let told = second.block_on(async { tokio::time::timeout(ttl * 3, guard.lost()).await });
        assert_eq!(renewals.load(Ordering::SeqCst), 0, "the timer task ran");
        assert!(!guard.is_held());
        // Marked, not only answered: the tokens handed out fire too.
        assert!(guard.lost_token().is_cancelled());
        assert_eq!(guard.loss_reason(), Some(LossReason::LeaseExpired));
        match told {
            Ok(Error::LockLost { reason, .. }) => assert_eq!(reason, LossReason::LeaseExpired),
            Ok(other) => panic!("told {other:?}"),
            Err(_) => panic!("not held after its deadline, yet lost() never fired"),
        }
        drop(first);
    }

    /// A renewal in flight on a runtime that shuts down is not the hold's last: its
    /// task puts the hold back in the timer map as it is dropped, and the next
    /// driver (started by the next hold taken anywhere) renews it again.
    #[test]
    fn a_renewal_dropped_with_its_runtime_is_put_back() {
        let (keepers, first) = keepers_on_a_runtime_of_their_own();
        let second = runtime();
        let renewals = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let held = Slow {
            delay: Duration::from_millis(150),
            renewals: Arc::clone(&renewals),
        };
        let guard = second.block_on(async {
            let name = LockName::new("second").expect("name");
            let plan = plan(
                Duration::from_secs(3),
                Some(Duration::from_millis(100)),
                None,
            );
            crate::guard::LockGuard::new(Hold::start(
                &keepers,
                Box::new(held),
                name,
                Owner::random(),
                plan,
            ))
        });
        // The first renewal is due at 100 ms and answers at 250 ms: in flight on the
        // first runtime when it goes.
        std::thread::sleep(Duration::from_millis(180));
        drop(first);
        assert_eq!(
            renewals.load(Ordering::SeqCst),
            0,
            "the renewal was cut off"
        );
        let before = renewals.load(Ordering::SeqCst);
        second.block_on(async {
            // Any hold taken now starts a driver here.
            let name = LockName::new("third").expect("name");
            let plan = plan(Duration::from_secs(30), None, None);
            let _third = Hold::start(
                &keepers,
                Box::new(Slow::default()),
                name,
                Owner::random(),
                plan,
            );
            tokio::time::sleep(Duration::from_millis(1200)).await;
        });
        let after = renewals.load(Ordering::SeqCst);
        assert!(
            after >= before + 2,
            "renewed {after} times after the first runtime went (before: {before})"
        );
        assert!(guard.is_held());
    }

    /// An extension keeps a renewal interval the caller chose (renewals still come
    /// at a third of the new TTL at the latest), while the automatic one follows the
    /// new TTL.
    #[tokio::test(start_paused = true)]
    async fn an_extension_keeps_a_chosen_renewal_interval() {
        let chosen = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let held = Slow {
            delay: Duration::ZERO,
            renewals: Arc::clone(&chosen),
        };
        let hold = start(
            Box::new(held),
            plan(
                Duration::from_secs(3),
                Some(Duration::from_millis(100)),
                None,
            ),
        );
        hold.extend(Duration::from_secs(9)).await.expect("extend");
        let before = chosen.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(1050)).await;
        let renewed = chosen.load(Ordering::SeqCst) - before;
        assert!(
            renewed >= 9,
            "renewed {renewed} times in a second at a chosen 100 ms"
        );

        let auto = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let held = Slow {
            delay: Duration::ZERO,
            renewals: Arc::clone(&auto),
        };
        let mut auto_plan = plan(Duration::from_secs(3), Some(Duration::from_secs(1)), None);
        auto_plan.renew_auto = true;
        let hold = start(Box::new(held), auto_plan);
        hold.extend(Duration::from_secs(30)).await.expect("extend");
        let before = auto.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(
            auto.load(Ordering::SeqCst),
            before,
            "renewed before a third of the new 30 s lease"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(auto.load(Ordering::SeqCst), before + 1);
    }

    /// An interval just under the TTL is no later first renewal than a third of the
    /// lease, as for every later one: a renewal that takes 100 ms to answer keeps a
    /// 1 s lease asked to renew every 950 ms.
    #[tokio::test]
    async fn the_first_renewal_comes_a_third_of_the_lease_in_at_the_latest() {
        let renewals = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let held = Slow {
            delay: Duration::from_millis(100),
            renewals: Arc::clone(&renewals),
        };
        let ttl = Duration::from_secs(1);
        let hold = start(
            Box::new(held),
            plan(ttl, Some(Duration::from_millis(950)), None),
        );
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            !hold.is_lost() && !hold.past_deadline(),
            "lost after {} renewals: {:?}",
            renewals.load(Ordering::SeqCst),
            hold.reason()
        );
        assert!(renewals.load(Ordering::SeqCst) >= 2);
    }

    /// A lease that runs out because its renewals failed is lost as `LeaseExpired`,
    /// even when the renewals that failed would have been cut to the maximum hold
    /// time: only an applied renewal makes the deadline the maximum hold's.
    #[tokio::test]
    async fn a_lease_whose_renewals_failed_expires_as_a_lease() {
        let ttl = Duration::from_millis(600);
        let hold = start(
            Box::new(Unanswered),
            plan(
                ttl,
                Some(Duration::from_millis(200)),
                Some(Duration::from_secs(1)),
            ),
        );
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert!(hold.is_lost());
        assert_eq!(hold.reason(), Some(LossReason::LeaseExpired));
    }

    /// A released guard's `lost()` stays pending past the deadline its hold had: a
    /// release is no loss (a leader that stepped down is not told it lost).
    #[tokio::test]
    async fn a_released_holds_lost_stays_pending() {
        let ttl = Duration::from_millis(300);
        let hold = start(Box::new(Slow::default()), plan(ttl, Some(ttl / 3), None));
        let guard = crate::guard::LockGuard::new(hold);
        let lost = guard.lost();
        guard.release().await.expect("release");
        let told = tokio::time::timeout(ttl * 2, lost).await;
        assert!(told.is_err(), "told {told:?}");
    }
}
