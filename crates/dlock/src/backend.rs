//! The backend SPI: what a lock service must provide, and nothing more.
//!
//! A backend offers one non-blocking attempt ([`Backend::try_acquire`]), a way to wait
//! for a change ([`Backend::subscribe`] → [`Waiter`]), queue removal for fair mode, and
//! [`Backend::inspect`]. An acquired lock is a [`HeldLock`] with renew and release.
//! Waiting loops, timeouts, cancel safety, renewal, local loss deadlines and cleanup on
//! drop live once in the core ([`crate::Locker`], [`crate::LockGuard`]), not here.
//!
//! The trait is object safe: a [`crate::Locker`] holds an `Arc<dyn Backend>` chosen
//! from a URL at run time.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
/// The core's drift margin, for backends that add their own to it.
pub use crate::lease::drift_margin;
use crate::name::LockName;
use crate::options::{Metadata, Owner};

/// How far a backend's fencing tokens can be trusted.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fencing {
    /// Strictly increasing per lock across every grant, surviving server restarts and
    /// crashes of any client.
    Durable,
    /// Strictly increasing while the server keeps its data; a restart without
    /// persistence or a failover may repeat or lower tokens.
    BestEffort,
    /// No tokens (always 0).
    None,
}

impl fmt::Display for Fencing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fencing::Durable => "durable",
            Fencing::BestEffort => "best-effort",
            Fencing::None => "none",
        })
    }
}

/// What an acquisition asks for: the lock itself, or a hold of one of the primitives
/// built beside it (each has a namespace of its own: a semaphore `x`, a read-write
/// lock `x` and a lock `x` are three things).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Primitive {
    /// The lock (a mutex; reentrant for one owner where the backend says so).
    Lock,
    /// One permit of a semaphore that allows `permits` holders at once. Every
    /// acquisition takes a permit of its own, whoever its owner.
    Permit {
        /// How many permits the semaphore has (as this caller counts them).
        permits: u32,
    },
    /// A read hold of a read-write lock: shared with other readers.
    Read,
    /// A write hold of a read-write lock: excludes readers and other writers.
    Write,
}

/// Which primitives beside the lock a backend offers ([`Primitive`]).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub struct Primitives {
    /// Semaphores with leased permits ([`crate::Locker::semaphore`]).
    pub semaphore: bool,
    /// Read-write locks ([`crate::Locker::rwlock`]).
    pub rwlock: bool,
    /// A read-write lock's write can always be downgraded to a read
    /// ([`crate::RwLock::downgrade`]): the backend counts holds, and lets in a read
    /// whose owner holds the write. Where `false` (etcd, ZooKeeper: contenders are
    /// ordered by arrival), a downgrade is refused while a writer of another owner
    /// waits.
    pub downgrade_while_a_writer_waits: bool,
    /// Semaphores and read-write locks serve contenders in arrival order (each waits
    /// with an entry of its own in a queue the server orders: etcd's create
    /// revisions, ZooKeeper's sequential nodes), so `fair` is accepted for them and
    /// changes nothing. Where `false`, `fair` is refused for them with
    /// [`crate::Error::Unsupported`].
    pub fifo: bool,
}

impl Primitives {
    /// Every primitive beside the lock.
    pub const ALL: Primitives = Primitives {
        semaphore: true,
        rwlock: true,
        downgrade_while_a_writer_waits: true,
        fifo: false,
    };
    /// None beside the lock.
    pub const NONE: Primitives = Primitives {
        semaphore: false,
        rwlock: false,
        downgrade_while_a_writer_waits: false,
        fifo: false,
    };

    /// Whether `p` is offered (the lock always is).
    #[must_use]
    pub fn offers(&self, p: Primitive) -> bool {
        match p {
            Primitive::Lock => true,
            Primitive::Permit { .. } => self.semaphore,
            Primitive::Read | Primitive::Write => self.rwlock,
        }
    }
}

/// What a backend guarantees; tests and users can ask before relying on a property.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// Quality of fencing tokens.
    pub fencing: Fencing,
    /// Waiters are granted in arrival order when `fair` is asked for.
    pub fifo: bool,
    /// Waiters are woken by a notification from the server (not only by polling).
    pub native_wait: bool,
    /// The lock is tied to a session/connection and ends with it (not only a lease).
    pub session_bound: bool,
    /// The same owner may acquire again while holding.
    pub reentrant: bool,
    /// Separate processes (and machines, for networked backends) exclude each other.
    pub cross_process: bool,
    /// Longest lease the backend accepts, if it is shorter than dlock's own limit.
    pub max_ttl: Option<Duration>,
    /// Every busy attempt takes a place in a server-side queue (etcd, ZooKeeper), fair
    /// or not; the core removes it (`leave_queue`) when the acquisition ends without
    /// the lock.
    pub queued_waiting: bool,
    /// How long the server keeps a silent client's session — and every lock it holds —
    /// when locks end with a session that has its own timeout (etcd's session lease,
    /// ZooKeeper's session timeout as negotiated) rather than with each lock's TTL. A
    /// holder that dies is let go within this bound (plus the server's tick), whatever
    /// the TTL. `None`: the TTL (or the connection) bounds it.
    #[serde(serialize_with = "ser_opt_ms", rename = "session_timeout_ms")]
    pub session_timeout: Option<Duration>,
    /// Locks that end with their connection (SQL session modes): a connection that
    /// breaks (reset, closed by the server or a proxy) frees its lock on the server at
    /// once, and the holder hears of it by its next heartbeat — within this long. Only
    /// a fencing resource protects that window. `None`: the server never frees a lock
    /// before its holder's own deadline has passed.
    #[serde(serialize_with = "ser_opt_ms", rename = "connection_loss_notice_ms")]
    pub connection_loss_notice: Option<Duration>,
    /// A lock's release that finds its hold gone on the server — broken by an
    /// operator ([`crate::Locker::break_lock`]), or its lease ended without the holder
    /// seeing it and the lock was taken (or, where the server drops a lock whose lease
    /// ended — Redis, Redlock, etcd, ZooKeeper — just its lease ended) — fails with
    /// [`crate::Error::LockLost`] (reason [`crate::LossReason::NotOwner`]) rather than
    /// succeeding: the work done under the guard may not have been exclusive. It is
    /// told only when the server's "not held" answered the one send of that release.
    /// Off where a command may be sent again without dlock asking (Redis Cluster's
    /// client library, and dlock's Sentinel connection after a failover), so that
    /// "not held" could be the first send's own doing, and in the SQL session modes,
    /// where a lock cannot be broken and ends only with its connection (reported by
    /// the heartbeat). Permits (semaphores, read-write locks) report it on etcd and
    /// ZooKeeper only; elsewhere a permit's release finds nothing and reports `Ok`.
    pub release_reports_loss: bool,
    /// The primitives beside the lock this backend offers.
    pub primitives: Primitives,
}

impl Capabilities {
    /// Capabilities with the given fencing quality and every flag off.
    #[must_use]
    pub fn new(fencing: Fencing) -> Self {
        Capabilities {
            fencing,
            fifo: false,
            native_wait: false,
            session_bound: false,
            reentrant: false,
            cross_process: false,
            max_ttl: None,
            queued_waiting: false,
            session_timeout: None,
            connection_loss_notice: None,
            release_reports_loss: false,
            primitives: Primitives::NONE,
        }
    }
}

/// What a holder of a semaphore or read-write lock holds.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HoldKind {
    /// A semaphore's permit.
    Permit,
    /// A read of a read-write lock.
    Read,
    /// The write of a read-write lock.
    Write,
}

/// What `inspect` knows about a lock.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LockInfo {
    /// The lock name.
    pub name: String,
    /// The holder's owner token.
    pub owner: String,
    /// How many holds the owner has (reentrancy).
    pub holds: u32,
    /// The fencing token of the current grant.
    pub fencing_token: u64,
    /// Time left on the lease, when the backend knows it.
    #[serde(serialize_with = "ser_opt_ms", rename = "remaining_ms")]
    pub remaining: Option<Duration>,
    /// What the holder said about itself.
    pub metadata: Metadata,
    /// Number of queued waiters, when the backend keeps a queue.
    pub waiters: Option<usize>,
    /// A semaphore's or read-write lock's holder: what it holds (`None`: a lock).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldKind>,
}

impl LockInfo {
    /// Build a `LockInfo` (for backends outside this crate).
    #[must_use]
    pub fn new(name: &LockName, owner: String, holds: u32, fencing_token: u64) -> Self {
        LockInfo {
            name: name.as_str().to_owned(),
            owner,
            holds,
            fencing_token,
            remaining: None,
            metadata: Metadata::default(),
            waiters: None,
            hold: None,
        }
    }
}

fn ser_opt_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&(d.as_millis() as u64)),
        None => s.serialize_none(),
    }
}

/// One acquisition: every attempt of one `lock`/`try_lock` call carries the same id,
/// and no other acquisition (in any process) carries it.
///
/// Backends key whatever they keep for a waiting or attempting acquisition (a local
/// queue place, a hand-off slot, a server-side queue entry) by this id, never by the
/// owner alone: several tasks may share one owner, and one of them giving up must not
/// remove, take over or rewrite another's entry.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AcquisitionId(u64);

impl AcquisitionId {
    /// A fresh id: 64 random bits (never zero), the operating system's (an id is
    /// shared with other processes through a backend's entries, and one drawn twice —
    /// in a process and its forked child — would make two acquisitions one).
    #[must_use]
    pub fn new() -> Self {
        AcquisitionId(u64::from_le_bytes(crate::random::bytes::<8>()).max(1))
    }

    /// The id as a number.
    #[must_use]
    pub fn get(self) -> u64 {
        self.0
    }

    /// The id a stored number stands for (a backend reading back what it wrote).
    #[must_use]
    pub fn from_raw(raw: u64) -> Self {
        AcquisitionId(raw)
    }
}

impl Default for AcquisitionId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for AcquisitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AcquisitionId({:016x})", self.0)
    }
}

impl fmt::Display for AcquisitionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// One acquisition attempt, as the core hands it to a backend.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AcquireRequest {
    /// Lock name.
    pub name: LockName,
    /// Who acquires.
    pub owner: Owner,
    /// Which acquisition this attempt belongs to (the same for all its attempts).
    pub acquisition: AcquisitionId,
    /// Lease length.
    pub ttl: Duration,
    /// Fair (FIFO) mode.
    pub fair: bool,
    /// In fair mode: take (or refresh) a place in the queue when busy, valid for this long.
    /// `None`: do not queue (a `try_lock`).
    pub enqueue: Option<Duration>,
    /// Shown by inspect. Shared: every attempt of an acquisition, and every
    /// acquisition that keeps the default, point to one copy.
    pub metadata: std::sync::Arc<Metadata>,
    /// 0 for the first attempt of an acquisition, then 1, 2, … (a backend may skip a
    /// cheap pre-check on the first attempt, when the lock is most likely free).
    pub attempt: u32,
    /// Whether the caller waits when the lock is busy (`false` for `try_lock` and
    /// [`crate::Wait::NoWait`]): a queueing backend may then check before it writes.
    pub will_wait: bool,
    /// What is asked for: the lock, or a hold of another primitive. A backend refuses
    /// what its [`Capabilities::primitives`] does not list with [`Error::Unsupported`].
    /// A waiting writer of a read-write lock comes with `enqueue` set: its entry keeps
    /// new readers out until it is granted or leaves (`leave_queue`).
    pub primitive: Primitive,
    /// An election's campaign ([`crate::Locker::election`]): the value the candidate
    /// stands with (also the note of `metadata`). A backend whose peers keep the value
    /// alone in the contender's record stores it so (etcd: `concurrency.Election`,
    /// which `etcdctl elect` uses).
    pub campaign: Option<String>,
}

impl AcquireRequest {
    /// A plain lock attempt on `name` by `owner` with lease `ttl`: no wait, no queue,
    /// no metadata, a new acquisition (what tests and the conformance suite send
    /// through the backend SPI).
    #[cfg(any(test, feature = "conformance"))]
    pub(crate) fn plain(name: LockName, owner: Owner, ttl: Duration) -> Self {
        AcquireRequest {
            name,
            owner,
            acquisition: AcquisitionId::new(),
            ttl,
            fair: false,
            enqueue: None,
            metadata: Metadata::default().into(),
            attempt: 0,
            will_wait: false,
            primitive: Primitive::Lock,
            campaign: None,
        }
    }
}

/// The outcome of one attempt.
#[derive(Debug)]
#[non_exhaustive]
pub enum Attempt {
    /// The lock is now held.
    Acquired(Box<dyn HeldLock>),
    /// Someone else holds it (or, in fair mode, is ahead in the queue).
    Busy {
        /// When it is worth trying again at the latest (e.g. the holder's remaining lease).
        retry_after: Option<Duration>,
    },
}

/// Something that resolves when a lock may have changed hands.
#[async_trait]
pub trait Waiter: Send + fmt::Debug {
    /// Return when the lock may have been released, or after `max` at the latest.
    /// Spurious returns are fine: the core simply tries again.
    ///
    /// # Errors
    /// A backend error that makes waiting pointless (the core gives up).
    ///
    /// # Cancel safety
    /// Must be cancel safe: the core may drop this future at any await point.
    async fn changed(&mut self, max: Duration) -> Result<()>;
}

/// A waiter that sleeps a jittered interval: for backends without notifications.
#[derive(Debug)]
pub struct PollingWaiter {
    /// Upper bound of one sleep.
    pub interval: Duration,
}

#[async_trait]
impl Waiter for PollingWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        let cap = self.interval.min(max);
        // Jitter between 50 % and 100 % of the interval, so pollers spread out.
        let nanos = cap.as_nanos() as u64;
        let sleep = Duration::from_nanos(nanos / 2 + fastrand::u64(0..=nanos / 2));
        tokio::time::sleep(sleep).await;
        Ok(())
    }
}

/// A lock service.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// URL scheme, e.g. `sqlite`.
    fn scheme(&self) -> &'static str;

    /// What this backend guarantees: the same answer for the backend's whole life
    /// (`session_timeout` aside, which a backend may learn from its server). The
    /// locker asks again whenever it needs a flag, and an acquisition decides once, at
    /// its start, whether it may leave something queued to clean up
    /// (`queued_waiting`): a flag that changed under it would leave that behind.
    fn capabilities(&self) -> Capabilities;

    /// One attempt: acquire `req.name` for `req.owner` if free (or already held by the
    /// same owner, when reentrant), else report busy.
    ///
    /// # Errors
    /// Connection or server errors.
    ///
    /// # Cancel safety
    /// Need not be cancel safe: the core runs it to completion in a task of its own
    /// and releases the result if the caller has gone.
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt>;

    /// Arm a waiter for the acquisition `req` belongs to *before* its next attempt, so
    /// no release between the attempt and the wait is missed. The default polls every
    /// 20 ms (jittered).
    ///
    /// # Errors
    /// Connection errors while subscribing.
    ///
    /// # Cancel safety
    /// Must be cancel safe.
    async fn subscribe(&self, req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        let _ = req;
        Ok(Box::new(PollingWaiter {
            interval: Duration::from_millis(20),
        }))
    }

    /// Remove what the acquisition `req` belongs to left queued (its queue entry, its
    /// contender key or node), if anything. Idempotent. The core calls it once the
    /// acquisition ended without the lock, and only after its last attempt finished:
    /// never while an attempt of that acquisition is still running.
    ///
    /// # Errors
    /// Connection or server errors.
    ///
    /// # Cancel safety
    /// Need not be cancel safe (the core runs it in a task of its own).
    async fn leave_queue(&self, req: &AcquireRequest) -> Result<()> {
        let _ = req;
        Ok(())
    }

    /// Who holds `name`, if anyone.
    ///
    /// # Errors
    /// Connection or server errors.
    ///
    /// # Cancel safety
    /// Must be cancel safe (read only).
    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>>;
    /// An operator's forced release: end the hold of `name` whose grant carries
    /// `fence`, if that is still the one held (`false` otherwise). The next grant gets a
    /// higher token, so a fenced resource rejects the old holder, whose next renewal
    /// fails (its `lost()` fires).
    ///
    /// # Errors
    /// [`Error::Unsupported`] where a hold cannot be ended from outside (the default;
    /// session-bound modes); connection or server errors.
    ///
    /// # Cancel safety
    /// Must be cancel safe: one statement, done or not.
    async fn break_lock(&self, name: &LockName, fence: u64) -> Result<bool> {
        let _ = (name, fence);
        Err(Error::Unsupported(format!(
            "breaking a lock is not offered by {}:// yet",
            self.scheme()
        )))
    }

    /// Every live holder of the semaphore or read-write lock `name` (`primitive` says
    /// which; its permit count is not used), each with what it holds, in token order.
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the backend does not offer the primitive (the
    /// default); connection or server errors.
    ///
    /// # Cancel safety
    /// Must be cancel safe (read only).
    async fn holders(&self, name: &LockName, primitive: Primitive) -> Result<Vec<LockInfo>> {
        let _ = (name, primitive);
        Err(Error::Unsupported(format!(
            "semaphores and read-write locks are not offered by {}://",
            self.scheme()
        )))
    }

    /// The names beginning with `prefix` that this backend keeps a record of (held or
    /// not: the caller inspects each), at most `limit` of them, in byte order.
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the backend cannot enumerate its locks (the
    /// default); connection or server errors.
    ///
    /// # Cancel safety
    /// Must be cancel safe (read only).
    async fn names(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let _ = (prefix, limit);
        Err(Error::Unsupported(format!(
            "listing locks is not offered by {}:// yet (dlock status NAME asks for one)",
            self.scheme()
        )))
    }
}

/// One granted hold of a lock.
#[async_trait]
pub trait HeldLock: Send + Sync + fmt::Debug {
    /// The fencing token of this grant (same for every reentrant hold).
    fn fencing_token(&self) -> u64;

    /// Extend the lease to at least `ttl` from now, if this grant is still held.
    ///
    /// A renewal never shortens the lease on the server: other holds of the same owner
    /// (reentrancy) rely on it. A backend sets the expiry to the later of the current
    /// one and `now + ttl`.
    ///
    /// # Errors
    /// [`crate::Error::NotOwner`] when the server no longer lists this owner (the lock
    /// is lost), or [`crate::Error::LockLost`] with the reason, where the backend knows
    /// it; connection errors (the core retries until its local deadline).
    ///
    /// # Cancel safety
    /// The core stops waiting at the lease's local end, and a caller may drop an
    /// `extend`: what a renewal cut off halfway leaves behind must not make a later
    /// renewal or the release act on another answer than its own.
    async fn renew(&self, ttl: Duration) -> Result<()>;

    /// Give up this hold (owner-checked on the server). A second call succeeds without
    /// touching anyone else's lock: after a failed first it tries again where that
    /// cannot drop another hold, and otherwise (SQL lease holds, whose row counts an
    /// owner's holds) returns `Ok` without sending anything.
    ///
    /// # Errors
    /// [`crate::Error::NotOwner`] when the server answered that this hold was not there
    /// (broken, or its lease ended), where [`Capabilities::release_reports_loss`]; only
    /// when that answer came to the one send of this release, never when the release
    /// (or a hand-off before it) may have run already. Connection or server errors.
    ///
    /// # Cancel safety
    /// Need not be cancel safe.
    async fn release(&self) -> Result<()>;

    /// The margin the holder subtracts from each lease before trusting it (clock drift
    /// between client and servers). The core never uses less than
    /// [`drift_margin`]; a backend with a configurable drift may ask for more.
    fn clock_drift(&self, ttl: Duration) -> Duration {
        drift_margin(ttl)
    }

    /// When the request that made this grant left this process, if that was before the
    /// attempt that returned it (a lock handed over in-process while its waiter slept).
    /// The core measures the lease from the earlier of the two. `None` by default.
    fn granted_at(&self) -> Option<std::time::Instant> {
        None
    }

    /// A flag the backend raises while the lock is in doubt (its session disconnected
    /// but not yet expired); shown by `LockGuard::is_suspect`. `None` by default.
    fn suspect_flag(&self) -> Option<std::sync::Arc<std::sync::atomic::AtomicBool>> {
        None
    }

    /// For a hold that lives as long as a session (an etcd lease, a ZooKeeper session,
    /// an SQL session mode's connection): until when that session is known to live on
    /// the server, kept up to date by the backend as it proves the session alive. The
    /// hold counts as lost from that instant on — [`crate::LockGuard::is_held`] turns
    /// false and [`crate::LockGuard::lost`] fires — whether or not the backend has
    /// noticed yet (its watcher may not run: a paused process, a starved runtime).
    /// `None` by default: the lease's own deadline bounds the hold.
    fn session_trust(&self) -> Option<SessionTrust> {
        None
    }

    /// How often a hold whose lock lives as long as a connection's session must prove
    /// that session alive, where a renewal is such a proof (SQL session modes: a ping of
    /// the pinned connection, which on failure or after this long without an answer
    /// closes it and answers [`crate::Error::LockLost`], the session lost). The keeper then renews it at
    /// least this often; one it does not renew at all is told [`HeldLock::watch_alone`].
    /// `None` by default.
    fn prove_alive_every(&self) -> Option<Duration> {
        None
    }

    /// Whether this hold's renewals join batches that the backend sends together (one
    /// request renews many holds): the keeper then runs a bounded number of them at
    /// once, since more would only queue behind the batches. `false` by default: each
    /// renewal is a request of its own, and every one that comes due runs at once.
    fn renews_in_batches(&self) -> bool {
        false
    }

    /// The keeper will not renew this hold (renewal is off), though
    /// [`HeldLock::prove_alive_every`] asks for proofs: the hold proves its session
    /// alive on its own from now on and reports a failed proof through
    /// [`HeldLock::loss_signal`]. Called before `loss_signal`, at most once. Nothing by
    /// default.
    fn watch_alone(&self) {}

    /// A token the backend cancels when it learns, unprompted, that the lock is gone
    /// (session expired, connection died). `None` when it only learns on renewal.
    fn loss_signal(&self) -> Option<CancellationToken> {
        None
    }

    /// Whether the server keeps a lock-delay after a lease that was not released
    /// (`lock_delay=`): then the core does not release after a loss, which would end
    /// the delay at once while the holder may still be finishing its work.
    fn keeps_lock_delay(&self) -> bool {
        false
    }

    /// The core counts the hold lost (before its release after the loss, if any):
    /// whatever the backend kept as "held here" for its own waiters goes now. Nothing
    /// by default.
    fn lost(&self) {}
}

/// Until when a session is known to live on the server: its last proof of life (a
/// request the server answered, dated from when it was sent) plus how long the server
/// waits for the next, less a margin for clock drift. Clones share one value, which the
/// backend moves as it proves the session alive ([`SessionTrust::extend_to`]) and a hold
/// reads ([`HeldLock::session_trust`]).
#[derive(Clone)]
pub struct SessionTrust(std::sync::Arc<std::sync::atomic::AtomicU64>);

/// The instant [`SessionTrust`]'s nanoseconds count from.
fn trust_epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

impl SessionTrust {
    /// A session trusted until `until`.
    #[must_use]
    pub fn new(until: std::time::Instant) -> Self {
        SessionTrust(std::sync::Arc::new(std::sync::atomic::AtomicU64::new(
            Self::nanos(until),
        )))
    }

    /// `at` in nanoseconds after the epoch, at least 1 (0 marks an ended session).
    fn nanos(at: std::time::Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(trust_epoch()).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Trust the session until `until`, if that is later than it is trusted now (a
    /// late answer to an earlier proof never shortens the trust a later one gave) and
    /// the session was not ended.
    pub fn extend_to(&self, until: std::time::Instant) {
        let until = Self::nanos(until);
        let _ = self.0.fetch_update(
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
            |now| (now != 0 && now < until).then_some(until),
        );
    }

    /// Trust the session no more (it is lost), for good: every hold reading it counts
    /// as lost, and no later proof changes that.
    pub fn end(&self) {
        self.0.store(0, std::sync::atomic::Ordering::SeqCst);
    }

    /// Until when the session is trusted.
    #[must_use]
    pub fn until(&self) -> std::time::Instant {
        trust_epoch() + Duration::from_nanos(self.0.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// Whether the session is trusted no more.
    #[must_use]
    pub fn passed(&self) -> bool {
        Self::nanos(std::time::Instant::now()) >= self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl fmt::Debug for SessionTrust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SessionTrust").field(&self.until()).finish()
    }
}
