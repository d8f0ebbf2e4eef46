//! [`Locker`]: the handle users hold, and the one acquisition loop every backend shares.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{
    AcquireRequest, AcquisitionId, Attempt, Backend, Capabilities, LockInfo, Primitive, Waiter,
};
use crate::error::{Error, Result};
use crate::finish::Finish;
use crate::guard::LockGuard;
use crate::keeper::{Hold, KeeperPlan, Keepers};
use crate::lease::{drift_margin, lease_start};
use crate::name::LockName;
use crate::options::{LockOptions, Metadata, Owner, Wait};
use crate::owner_waits::{OwnerWait, OwnerWaiters};
use crate::telemetry::Ended;
use crate::telemetry::in_span;

/// Longest single wait between attempts when the backend gives no hint.
const MAX_WAIT_STEP: Duration = Duration::from_secs(1);

/// A handle to one lock service. Cheap to clone; clones share connections.
///
/// ```no_run
/// # async fn demo() -> dlock::Result<()> {
/// let locker = dlock::Locker::connect("sqlite:///tmp/locks.db").await?;
/// let guard = locker.lock("orders:42").await?;
/// println!("fencing token {}", guard.fencing_token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Locker {
    backend: Arc<dyn Backend>,
    /// Renewal and loss timers of every lock taken through this locker (and its clones).
    keepers: Arc<Keepers>,
    /// Acquisitions of this locker waiting, by lock and owner: when one of them is
    /// granted, the others of its owner may re-enter at once.
    waiting: Arc<OwnerWaiters>,
    defaults: LockOptions,
    url: String,
}

impl Locker {
    /// The timers of the locks taken through this locker.
    pub(crate) fn keepers(&self) -> &Arc<Keepers> {
        &self.keepers
    }

    /// Check, without connecting, that `name` is a lock name the backend of `url`
    /// accepts: a tool can refuse a bad name before any I/O. (A name some URL options
    /// refuse: `postgres://…?mode=advisory&advisory_key=number` maps only the canonical
    /// decimal spelling of an int8.)
    ///
    /// ```
    /// let url = "postgres://u@db/app?mode=advisory&advisory_key=number";
    /// # #[cfg(feature = "postgres")] {
    /// assert!(dlock::Locker::check_name(url, "42").is_ok());
    /// assert!(dlock::Locker::check_name(url, "abc").is_err());
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a name that is not a lock name or that the URL's
    /// options refuse; [`Error::InvalidUrl`] for a URL that does not parse.
    pub fn check_name(url: &str, name: &str) -> Result<()> {
        crate::schemes::check_name(url, name)
    }

    /// Connect to the lock service named by `url` (see the crate docs for the grammar).
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for a malformed URL or unknown query parameter,
    /// [`Error::BackendNotEnabled`] when the backend was not compiled in, connection
    /// errors when the service cannot be reached.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is held until the future completes.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::open(crate::url::ConnectUrl::parse(url)?).await
    }

    /// Connect with a backend's typed options ([`crate::connect`]): the same as
    /// [`Locker::connect`] with the URL they stand for.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo() -> dlock::Result<()> {
    /// let opts = dlock::connect::PostgresOptions::new("db.internal", 5432, "app")
    ///     .credentials("app", "s3cret")
    ///     .mode(dlock::sql::Mode::Advisory);
    /// let locker = dlock::Locker::with_options(opts).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Locker::connect`]; [`Error::InvalidUrl`] for a combination no URL can
    /// express (e.g. TLS on a Redis cluster).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is held until the future completes.
    pub async fn with_options(options: impl crate::connect::IntoConnectUrl) -> Result<Self> {
        Self::open(options.into_connect_url()?).await
    }

    #[tracing::instrument(level = "debug", name = "connect", skip_all, fields(scheme = parsed.scheme()))]
    async fn open(mut parsed: crate::url::ConnectUrl) -> Result<Self> {
        let mut defaults = LockOptions::default();
        if let Some(ttl) = parsed.take_param("ttl") {
            defaults.ttl = crate::options::parse_duration("ttl", &ttl)?;
            crate::options::validate_ttl(defaults.ttl)?;
        }
        let shown = parsed.to_string();
        let backend = crate::schemes::open(parsed).await?;
        Ok(Locker {
            keepers: Arc::new(Keepers::new(backend.scheme())),
            backend,
            waiting: Arc::default(),
            defaults,
            url: shown,
        })
    }

    /// Wrap a backend (e.g. one implemented outside this crate). Called on a Tokio
    /// runtime, that runtime releases the guards dropped where there is none (see
    /// [`LockGuard`]).
    #[must_use]
    pub fn from_backend(backend: Arc<dyn Backend>) -> Self {
        Locker {
            url: format!("{}://", backend.scheme()),
            keepers: Arc::new(Keepers::new(backend.scheme())),
            backend,
            waiting: Arc::default(),
            defaults: LockOptions::default(),
        }
    }

    /// The backend (for the conformance suite's SPI-level behaviours).
    #[cfg(feature = "conformance")]
    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The URL this locker was opened with, password redacted.
    #[must_use]
    pub fn url(&self) -> &str {
        &self.url
    }

    /// What the backend guarantees.
    #[must_use]
    pub fn capabilities(&self) -> Capabilities {
        self.backend.capabilities()
    }

    /// Every held lock whose name begins with `prefix` (`""`: all), as
    /// [`Locker::inspect`] shows each, in the names' byte order. At most 10,000 names
    /// are looked at.
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the backend cannot enumerate its locks (Redis and
    /// Redlock: the default layout keeps a lock at its bare name, which a scan cannot
    /// tell from other keys; ask for a name with `inspect`); connection or server
    /// errors.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    #[tracing::instrument(level = "debug", name = "list", skip_all, fields(prefix, scheme = self.backend.scheme()))]
    pub async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        let mut held = Vec::new();
        for name in self.backend.names(prefix, 10_000).await? {
            // A row written by something else under a name dlock would refuse.
            let Ok(name) = LockName::new(&name) else {
                continue;
            };
            if let Some(info) = self.backend.inspect(&name).await? {
                held.push(info);
            }
        }
        Ok(held)
    }

    /// An operator's forced release (`dlock break`) of the hold of `name` granted with
    /// `fencing_token` — the token [`Locker::inspect`] showed, so that only the hold
    /// looked at is ended, never one granted since. Its owner loses every hold of it
    /// (its next renewal fails and its `lost()` fires), and the next grant gets a
    /// higher token, so a fenced resource rejects the old holder if it comes back.
    /// `false` when that hold is no longer the one held (released, expired, or taken
    /// over): nothing was broken. Logged at WARN.
    ///
    /// # Errors
    /// [`Error::Unsupported`] where a hold cannot be ended from outside (the SQL
    /// session modes) and for token 0 (a holder outside dlock); [`Error::InvalidName`];
    /// connection or server errors.
    ///
    /// # Cancel safety
    /// Cancel safe: the break ends the hold or not (on Redlock, a break cut off after
    /// some nodes leaves the holder its majority, and its renewal puts the lock back
    /// where it went); look again to know.
    #[tracing::instrument(level = "debug", name = "break", skip_all, fields(lock = name, scheme = self.backend.scheme()))]
    pub async fn break_lock(&self, name: &str, fencing_token: u64) -> Result<bool> {
        let lock = LockName::new(name)?;
        if fencing_token == 0 {
            return Err(Error::Unsupported(format!(
                "{name:?} is held outside dlock (no token): dlock cannot end that hold"
            )));
        }
        let broke = self.backend.break_lock(&lock, fencing_token).await?;
        if broke {
            tracing::warn!(
                lock = name,
                token = fencing_token,
                "lock broken by an operator"
            );
        }
        Ok(broke)
    }

    /// The backend's scheme (for spans and metrics).
    pub(crate) fn scheme(&self) -> &'static str {
        self.backend.scheme()
    }

    /// The options `lock` uses (TTL from the URL's `ttl=` parameter, if given).
    #[must_use]
    pub fn default_options(&self) -> LockOptions {
        self.defaults.clone()
    }

    /// A fresh random owner, for reentrant use: pass it in [`LockOptions::owner`], clone
    /// it into other tasks, or hand its string to another process.
    #[must_use]
    pub fn owner(&self) -> Owner {
        Owner::random()
    }

    /// Acquire `name`, waiting as long as it takes, with the default options.
    ///
    /// # Errors
    /// [`Error::InvalidName`], backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing held and no queue entry behind.
    pub async fn lock(&self, name: &str) -> Result<LockGuard> {
        let opts = LockOptions {
            wait: Wait::Forever,
            ..self.defaults.clone()
        };
        self.lock_with(name, &opts).await
    }

    /// Acquire `name`, waiting at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the lock stayed busy, [`Error::InvalidName`], backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing held and no queue entry behind.
    pub async fn lock_timeout(&self, name: &str, timeout: Duration) -> Result<LockGuard> {
        let opts = LockOptions {
            wait: Wait::Timeout(timeout),
            ..self.defaults.clone()
        };
        self.lock_with(name, &opts).await
    }

    /// One attempt: `Ok(None)` when the lock is busy (busy is not an error).
    ///
    /// # Errors
    /// [`Error::InvalidName`], backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing held.
    pub async fn try_lock(&self, name: &str) -> Result<Option<LockGuard>> {
        self.try_lock_with(name, &self.defaults).await
    }

    /// One attempt with explicit options (`opts.wait` is ignored).
    ///
    /// # Errors
    /// As [`Locker::try_lock`], plus [`Error::InvalidOption`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing held.
    pub async fn try_lock_with(&self, name: &str, opts: &LockOptions) -> Result<Option<LockGuard>> {
        let span = tracing::debug_span!("try_lock", lock = name, scheme = self.backend.scheme());
        in_span!(span, self.try_hold(name, opts, Primitive::Lock))
    }

    /// One attempt at a hold of `primitive` (the lock, a permit, a read or a write).
    pub(crate) async fn try_hold(
        &self,
        name: &str,
        opts: &LockOptions,
        primitive: Primitive,
    ) -> Result<Option<LockGuard>> {
        let call = self.keepers.meters.start();
        let result = self.try_once(name, opts, primitive).await;
        let outcome = match &result {
            Ok(Some(_)) => Ended::Granted,
            Ok(None) => Ended::Busy,
            Err(_) => Ended::Error,
        };
        call.end(outcome);
        result
    }

    async fn try_once(
        &self,
        name: &str,
        opts: &LockOptions,
        primitive: Primitive,
    ) -> Result<Option<LockGuard>> {
        let (name, req) = self.prepare(name, opts, primitive)?;
        let mut cleanup = Cleanup::new(&self.backend, &req);
        let sent_at = Instant::now();
        cleanup.in_flight = true;
        let outcome = self.attempt(req.clone(), None, sent_at).await;
        cleanup.in_flight = false;
        match outcome {
            Ok(held) => {
                cleanup.armed = false;
                // A grant that arrived after its lease could have ended is no grant.
                Ok(self.finish(held, (&name, req.primitive), &req.owner, opts, sent_at))
            }
            // A single attempt that will not wait leaves nothing queued.
            Err(AttemptError::Busy(_) | AttemptError::Abandoned) => {
                self.keepers.meters.busy();
                cleanup.armed = false;
                Ok(None)
            }
            Err(AttemptError::Failed(e)) => {
                cleanup.leave().await;
                Err(e)
            }
        }
    }

    /// Acquire `name` with explicit options.
    ///
    /// # Errors
    /// [`Error::Timeout`] when `opts.wait` runs out (immediately for [`Wait::NoWait`]),
    /// [`Error::InvalidName`], [`Error::InvalidOption`], [`Error::Unsupported`] for
    /// `fair` on a backend without FIFO order, backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing held and no queue entry behind.
    pub async fn lock_with(&self, name: &str, opts: &LockOptions) -> Result<LockGuard> {
        let span = tracing::debug_span!("lock", lock = name, scheme = self.backend.scheme());
        in_span!(span, self.hold_with(name, opts, Primitive::Lock))
    }

    /// Acquire a hold of `primitive` (the lock, a permit, a read or a write) through
    /// the one acquisition loop.
    pub(crate) async fn hold_with(
        &self,
        name: &str,
        opts: &LockOptions,
        primitive: Primitive,
    ) -> Result<LockGuard> {
        let meters = &self.keepers.meters;
        let call = meters.start();
        let mut first_busy = None;
        let result = self.acquire(name, opts, primitive, &mut first_busy).await;
        let outcome = match &result {
            Ok(_) => {
                if let Some(busy) = first_busy {
                    meters.waited(busy.elapsed());
                }
                Ended::Granted
            }
            Err(Error::Timeout { .. }) => Ended::Timeout,
            Err(_) => Ended::Error,
        };
        call.end(outcome);
        result
    }

    /// The acquisition loop behind [`Locker::lock_with`]; notes when the first busy
    /// answer came (for the wait-time metric).
    async fn acquire(
        &self,
        name: &str,
        opts: &LockOptions,
        primitive: Primitive,
        first_busy: &mut Option<Instant>,
    ) -> Result<LockGuard> {
        let (name, mut req) = self.prepare(name, opts, primitive)?;
        let started = Instant::now();
        let deadline = match opts.wait {
            Wait::Forever => None,
            // A wait too long to represent is a wait forever.
            Wait::Timeout(d) => started.checked_add(d),
            Wait::NoWait => Some(started),
        };
        req.will_wait = !matches!(opts.wait, Wait::NoWait);
        // A fair waiter queues; so does a writer that will wait (its entry keeps new
        // readers out until it is granted or leaves).
        if req.fair || (primitive == Primitive::Write && req.will_wait) {
            req.enqueue = Some(opts.queue_entry_ttl);
        }
        // Whatever happens from here on, nothing this acquisition queued may outlive
        // it — and nothing may be cleaned up while one of its attempts still runs.
        let mut cleanup = Cleanup::new(&self.backend, &req);
        let mut waiter: Option<(Box<dyn Waiter>, OwnerWait)> = None;
        let mut spin = SpinGuard::default();
        loop {
            let sent_at = Instant::now();
            let this_attempt = req.clone();
            req.attempt = req.attempt.saturating_add(1);
            cleanup.in_flight = true;
            let outcome = self.attempt(this_attempt, deadline, sent_at).await;
            cleanup.in_flight = false;
            let retry_after = match outcome {
                Ok(held) => {
                    match self.finish(held, (&name, req.primitive), &req.owner, opts, sent_at) {
                        Some(guard) => {
                            cleanup.armed = false;
                            return Ok(guard);
                        }
                        // Its answer came too late to be of use: ask again, as if busy.
                        None => None,
                    }
                }
                Err(AttemptError::Busy(hint)) => {
                    self.keepers.meters.busy();
                    first_busy.get_or_insert_with(Instant::now);
                    hint
                }
                Err(AttemptError::Abandoned) => {
                    // The attempt outlived the wait: it finishes in a task of its own,
                    // which gives back a grant and leaves the queue after it.
                    cleanup.armed = false;
                    return Err(Error::Timeout {
                        name: name.as_str().to_owned(),
                        waited: started.elapsed(),
                    });
                }
                Err(AttemptError::Failed(e)) => {
                    // Stop waiting (local queues included) before leaving the queue.
                    drop(waiter.take());
                    cleanup.leave().await;
                    return Err(e);
                }
            };
            let now = Instant::now();
            let remaining = match deadline {
                Some(d) if now >= d => {
                    drop(waiter.take());
                    cleanup.leave().await;
                    return Err(Error::Timeout {
                        name: name.as_str().to_owned(),
                        waited: now - started,
                    });
                }
                Some(d) => d - now,
                None => Duration::MAX,
            };
            match waiter.as_mut() {
                None => {
                    // Subscribe, then try again at once: a release that happened between
                    // the attempt and the subscription is seen by that attempt.
                    let owner_wait = self.waiting.register(&name, &req.owner);
                    // A backend may have to ask the server to subscribe (etcd opens a
                    // watch): that too is bounded by the caller's wait.
                    match tokio::time::timeout(remaining, self.backend.subscribe(&req)).await {
                        Ok(w) => waiter = Some((w?, owner_wait)),
                        Err(_) => {
                            cleanup.leave().await;
                            return Err(Error::Timeout {
                                name: name.as_str().to_owned(),
                                waited: started.elapsed(),
                            });
                        }
                    }
                }
                Some((w, owner_wait)) => {
                    let mut step = retry_after.unwrap_or(MAX_WAIT_STEP).min(remaining);
                    if req.enqueue.is_some() {
                        // Come back in time to refresh the queue entry.
                        step = step.min(opts.queue_entry_ttl / 3);
                    }
                    let waited_from = Instant::now();
                    tokio::select! {
                        r = w.changed(step.max(Duration::from_micros(100))) => r?,
                        // Another task of this owner got the lock: re-enter now.
                        () = owner_wait.granted() => {}
                    }
                    spin.after_wait(waited_from.elapsed(), remaining).await;
                }
            }
        }
    }

    /// The semaphore `name` with `permits` permits (no I/O until a permit is asked for).
    #[must_use]
    pub fn semaphore(&self, name: &str, permits: u32) -> crate::Semaphore {
        crate::Semaphore::new(self.clone(), name, permits)
    }

    /// The leader election `name` (no I/O until a campaign or a look at the leader).
    #[must_use]
    pub fn election(&self, name: &str) -> crate::Election {
        crate::Election::new(self.clone(), name)
    }

    /// The read-write lock `name` (no I/O until a hold is asked for).
    #[must_use]
    pub fn rwlock(&self, name: &str) -> crate::RwLock {
        crate::RwLock::new(self.clone(), name)
    }

    /// Run `f` while holding `name` (default options). `f`'s future is dropped —
    /// cancelled — if the lock is lost, and the result is then [`Error::LockLost`].
    ///
    /// ```no_run
    /// # async fn demo(locker: dlock::Locker) -> dlock::Result<()> {
    /// let sold = locker
    ///     .with_lock("stock:42", |ctx| async move {
    ///         // pass ctx.fencing_token to the store
    ///         ctx.fencing_token
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// Acquisition errors, [`Error::LockLost`], release errors. A lock lost while `f`
    /// ran cancels it; one found lost by the release after `f` finished (broken: see
    /// [`LockGuard::release`]) drops `f`'s value and reports the loss, so `f` records
    /// itself whatever must be undone if it ran without the lock.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops `f`'s future and releases the lock.
    pub async fn with_lock<F, Fut, T>(&self, name: &str, f: F) -> Result<T>
    where
        F: FnOnce(crate::guard::LockContext) -> Fut,
        Fut: Future<Output = T>,
    {
        let opts = LockOptions {
            wait: Wait::Forever,
            ..self.defaults.clone()
        };
        self.with_lock_opts(name, &opts, f).await
    }

    /// [`Locker::with_lock`] with explicit options.
    ///
    /// # Errors
    /// As [`Locker::with_lock`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops `f`'s future and releases the lock.
    pub async fn with_lock_opts<F, Fut, T>(&self, name: &str, opts: &LockOptions, f: F) -> Result<T>
    where
        F: FnOnce(crate::guard::LockContext) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = self.lock_with(name, opts).await?;
        let work = f(guard.context());
        let lost = guard.lost();
        tokio::select! {
            biased;
            err = lost => Err(err),
            value = work => {
                guard.release().await?;
                Ok(value)
            }
        }
    }

    /// Who holds `name`, if anyone.
    ///
    /// # Errors
    /// [`Error::InvalidName`], backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    #[tracing::instrument(level = "debug", name = "inspect", skip_all, fields(lock = name, scheme = self.backend.scheme()))]
    pub async fn inspect(&self, name: &str) -> Result<Option<LockInfo>> {
        let name = LockName::new(name)?;
        self.backend.inspect(&name).await
    }

    /// Every live holder of the semaphore or read-write lock `name`.
    pub(crate) async fn holders(&self, name: &str, primitive: Primitive) -> Result<Vec<LockInfo>> {
        let name = LockName::new(name)?;
        self.backend.holders(&name, primitive).await
    }

    fn prepare(
        &self,
        name: &str,
        opts: &LockOptions,
        primitive: Primitive,
    ) -> Result<(LockName, AcquireRequest)> {
        let name = LockName::new(name)?;
        opts.validate()?;
        let caps = self.backend.capabilities();
        if !caps.primitives.offers(primitive) {
            return Err(Error::Unsupported(format!(
                "{} is not offered by {}:// (its capabilities list what it offers)",
                match primitive {
                    Primitive::Permit { .. } => "a semaphore",
                    _ => "a read-write lock",
                },
                self.backend.scheme()
            )));
        }
        if primitive != Primitive::Lock && opts.fair && !caps.primitives.fifo {
            return Err(Error::Unsupported(format!(
                "fair (FIFO) mode is not offered for semaphores or read-write locks on {}:// (etcd and ZooKeeper serve them in arrival order)",
                self.backend.scheme()
            )));
        }
        if let Primitive::Permit { permits: 0 } = primitive {
            return Err(Error::option(
                "permits",
                "a semaphore needs at least 1 permit",
            ));
        }
        if opts.fair && primitive == Primitive::Lock && !caps.fifo {
            return Err(Error::Unsupported(format!(
                "fair (FIFO) locking is not available on {}://",
                self.backend.scheme()
            )));
        }
        if let Some(max) = caps.max_ttl
            && opts.ttl > max
        {
            return Err(Error::option(
                "ttl",
                format!("{:?} exceeds this backend's maximum of {max:?}", opts.ttl),
            ));
        }
        let req = AcquireRequest {
            name: name.clone(),
            owner: opts.owner.clone().unwrap_or_else(Owner::random),
            acquisition: AcquisitionId::new(),
            ttl: opts.ttl,
            // A semaphore's or read-write lock's order is the backend's own (see
            // `Primitives::fifo`): nothing more to ask of it.
            fair: opts.fair && primitive == Primitive::Lock,
            enqueue: None,
            attempt: 0,
            will_wait: false,
            metadata: opts
                .metadata
                .clone()
                .map_or_else(Metadata::this_process_shared, Arc::new),
            primitive,
            campaign: opts.campaign.clone(),
        };
        Ok((name, req))
    }

    /// One attempt, run to completion even if the caller goes away mid-attempt: it is
    /// polled in place (no task in the common case), and if its future is dropped
    /// unfinished — the caller was cancelled, or `deadline` (plus a little) passed —
    /// the rest runs in a task that releases any grant and, where attempts may queue,
    /// leaves the queue after it ([`AttemptError::Abandoned`]). `sent_at`: read by
    /// the caller before this call, so never later than the request's sending (a
    /// lease judged from it can only end early).
    async fn attempt(
        &self,
        req: AcquireRequest,
        deadline: Option<Instant>,
        sent_at: Instant,
    ) -> Result<Box<dyn crate::backend::HeldLock>, AttemptError> {
        let backend = Arc::clone(&self.backend);
        let abandon =
            may_queue(backend.as_ref(), &req).then(|| (Arc::clone(&backend), req.clone()));
        let ttl = req.ttl;
        let job = async move {
            match backend.try_acquire(&req).await {
                // An acquisition slower than the lease is worthless: someone else may
                // already be entitled to the lock. Never report it as a success.
                Ok(Attempt::Acquired(held))
                    if lease_start(held.granted_at(), sent_at).elapsed()
                        >= ttl.saturating_sub(held.clock_drift(ttl).max(drift_margin(ttl))) =>
                {
                    tracing::warn!(lock = %req.name, "acquisition took longer than the TTL; giving it back");
                    let _ = held.release().await;
                    Ok(Outcome::Busy(None))
                }
                Ok(Attempt::Acquired(held)) => Ok(Outcome::Granted(Unclaimed(Some(held)))),
                Ok(Attempt::Busy { retry_after }) => Ok(Outcome::Busy(retry_after)),
                Err(e) => Err(e),
            }
        };
        // Dropped unfinished: the job completes in a task; a grant is given back as its
        // `Unclaimed` drops, and anything queued is left after the attempt, never
        // before (it could not be left before it was taken). Where attempts do not
        // queue, dropping the outcome is all there is to do.
        let mut flight = match abandon {
            None => Finish::new(job),
            Some((backend, req)) => {
                Finish::with_epilogue(job, move |outcome: Result<Outcome>| async move {
                    let granted = matches!(outcome, Ok(Outcome::Granted(_)));
                    drop(outcome);
                    if !granted {
                        let _ = backend.leave_queue(&req).await;
                    }
                })
            }
        };
        let received = match deadline {
            None => (&mut flight).await,
            Some(d) => {
                // Let an attempt that started before the deadline finish a little past it.
                // (An instant too far to add to is no limit.)
                let limit = d.max(Instant::now());
                let limit = limit
                    .checked_add(Duration::from_millis(250))
                    .unwrap_or(limit);
                match tokio::time::timeout_at(limit, &mut flight).await {
                    Ok(r) => r,
                    Err(_) => return Err(AttemptError::Abandoned),
                }
            }
        };
        match received {
            Some(Ok(Outcome::Granted(grant))) => Ok(grant.claim()),
            Some(Ok(Outcome::Busy(retry_after))) => Err(AttemptError::Busy(retry_after)),
            Some(Err(e)) => Err(AttemptError::Failed(e)),
            None => Err(AttemptError::Failed(Error::backend(
                "core",
                "attempt polled twice",
            ))),
        }
    }

    /// The guard of a grant — or `None` when the answer arrived after the lease it
    /// granted could have ended (a reply held up by the network past the TTL): the
    /// lock may already be someone else's, so it is given back in the background and
    /// never handed to the caller as held.
    fn finish(
        &self,
        held: Box<dyn crate::backend::HeldLock>,
        (name, primitive): (&LockName, Primitive),
        owner: &Owner,
        opts: &LockOptions,
        sent_at: Instant,
    ) -> Option<LockGuard> {
        let sent_at = lease_start(held.granted_at(), sent_at);
        let margin = held.clock_drift(opts.ttl).max(drift_margin(opts.ttl));
        if Instant::now() >= sent_at + opts.ttl.saturating_sub(margin) {
            tracing::debug!(lock = %name, "a grant arrived after its lease could have ended; given back");
            tokio::spawn(async move {
                let _ = held.release().await;
            });
            return None;
        }
        self.waiting.granted(name, owner);
        Some(LockGuard::new(Hold::start(
            &self.keepers,
            held,
            name.clone(),
            owner.clone(),
            KeeperPlan {
                ttl: opts.ttl,
                renew_every: opts.renew_interval(),
                renew_auto: opts.renewal == crate::Renewal::Auto,
                max_hold: opts.max_hold,
                sent_at,
                primitive,
            },
        )))
    }
}

/// What an attempt task hands back to the waiting caller.
enum Outcome {
    Granted(Unclaimed),
    Busy(Option<Duration>),
}

/// A grant on its way to the caller: released in the background if it is dropped
/// before the caller claims it (the caller was cancelled while the answer was in flight).
struct Unclaimed(Option<Box<dyn crate::backend::HeldLock>>);

impl Unclaimed {
    fn claim(mut self) -> Box<dyn crate::backend::HeldLock> {
        #[allow(clippy::expect_used)]
        self.0
            .take()
            .expect("an unclaimed grant holds its lock until claimed")
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if let Some(held) = self.0.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move {
                let _ = held.release().await;
            });
        }
    }
}

enum AttemptError {
    Busy(Option<Duration>),
    Failed(Error),
    /// The attempt outlived the caller's wait; it finishes (and cleans up after
    /// itself) in a task of its own.
    Abandoned,
}

/// Whether an attempt of `req` may leave something queued on the server (a fair-mode
/// queue entry, a contender key or node) that must be removed if it does not end
/// with the lock.
fn may_queue(backend: &dyn Backend, req: &AcquireRequest) -> bool {
    req.enqueue.is_some() || backend.capabilities().queued_waiting
}

/// Removes what an acquisition left queued when it ends without the lock: at once on
/// timeout and error, in a background task when the acquisition's future is dropped —
/// unless an attempt is in flight then, whose own continuation leaves the queue once it
/// has finished ([`Locker::attempt`]).
struct Cleanup {
    /// What to leave the queue with: only where an attempt may queue (most
    /// acquisitions queue nothing, and need no copy of their request).
    queued: Option<(Arc<dyn Backend>, AcquireRequest)>,
    armed: bool,
    in_flight: bool,
}

impl Cleanup {
    fn new(backend: &Arc<dyn Backend>, req: &AcquireRequest) -> Self {
        Cleanup {
            queued: may_queue(backend.as_ref(), req).then(|| (Arc::clone(backend), req.clone())),
            armed: true,
            in_flight: false,
        }
    }

    /// Leave now (finished in a task of its own if the caller goes away meanwhile).
    async fn leave(&mut self) {
        if !std::mem::take(&mut self.armed) {
            return;
        }
        // Disarmed: nothing else reads it.
        let Some((backend, req)) = self.queued.take() else {
            return;
        };
        let name = req.name.clone();
        let left = Finish::new(async move { backend.leave_queue(&req).await }).await;
        if let Some(Err(e)) = left {
            tracing::debug!(lock = %name, error = %e, "could not leave the queue; the entry will expire");
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed || self.in_flight {
            return;
        }
        let Some((backend, req)) = self.queued.take() else {
            return;
        };
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = backend.leave_queue(&req).await;
            });
        }
    }
}

/// Keeps a waiting loop from spinning when a backend's waiter returns at once again
/// and again (a bug, or a state it cannot wait on): after a few instant returns in a
/// row the loop sleeps a jittered millisecond or two, so other tasks — the holder's
/// release among them — get to run, even on a single-threaded runtime.
#[derive(Default)]
struct SpinGuard {
    instant_returns: u32,
}

impl SpinGuard {
    async fn after_wait(&mut self, waited: Duration, remaining: Duration) {
        if waited >= Duration::from_micros(50) {
            self.instant_returns = 0;
            return;
        }
        self.instant_returns += 1;
        if self.instant_returns >= 3 {
            let pause = Duration::from_micros(fastrand::u64(1000..2000)).min(remaining);
            tokio::time::sleep(pause).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits and hold times too long to represent mean "no limit", not a panic
    /// (`Instant + Duration::MAX` overflows).
    #[tokio::test]
    async fn unrepresentable_durations_are_no_limit() {
        let locker = Locker::from_backend(crate::memory::MemoryBackend::new());
        let opts = LockOptions::new()
            .wait(Wait::Timeout(Duration::MAX))
            .max_hold(Duration::MAX);
        let g = locker.lock_with("x", &opts).await.expect("lock");
        let waiting =
            tokio::time::timeout(Duration::from_millis(100), locker.lock_with("x", &opts));
        assert!(waiting.await.is_err(), "granted a held lock");
        assert!(g.is_held());
        g.release().await.expect("release");
    }

    /// A grant dropped on its way to a cancelled caller is given back.
    #[tokio::test]
    async fn unclaimed_grant_is_released_on_drop() {
        let backend = crate::memory::MemoryBackend::new();
        let locker = Locker::from_backend(backend.clone());
        let (name, req) = locker
            .prepare("x", &LockOptions::default(), Primitive::Lock)
            .expect("prepare");
        let Ok(Attempt::Acquired(held)) = backend.try_acquire(&req).await else {
            panic!("not granted");
        };
        assert!(locker.inspect("x").await.expect("inspect").is_some());
        drop(Unclaimed(Some(held)));
        let mut freed = false;
        for _ in 0..100 {
            if backend.inspect(&name).await.expect("inspect").is_none() {
                freed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(freed, "the dropped grant still holds the lock");
    }
}
