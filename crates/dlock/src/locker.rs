//! [`Locker`]: the handle users hold, and the one acquisition loop every backend shares.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{AcquireRequest, Attempt, Backend, Capabilities, LockInfo, Waiter};
use crate::error::{Error, Result};
use crate::guard::{LockGuard, drift_margin};
use crate::keeper::{Hold, KeeperPlan, Keepers};
use crate::name::LockName;
use crate::options::{LockOptions, Metadata, Owner, Wait};

/// How long a fair-mode queue entry lives without being refreshed by its waiter.
const QUEUE_ENTRY_TTL: Duration = Duration::from_secs(5);
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
    defaults: LockOptions,
    url: String,
}

impl Locker {
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
        let mut parsed = crate::url::ConnectUrl::parse(url)?;
        let mut defaults = LockOptions::default();
        if let Some(ttl) = parsed.take_param("ttl") {
            defaults.ttl = crate::options::parse_duration("ttl", &ttl)?;
            crate::options::validate_ttl(defaults.ttl)?;
        }
        let shown = parsed.to_string();
        let backend = crate::schemes::open(parsed).await?;
        Ok(Locker {
            backend,
            keepers: Arc::default(),
            defaults,
            url: shown,
        })
    }

    /// Wrap a backend (e.g. one implemented outside this crate).
    #[must_use]
    pub fn from_backend(backend: Arc<dyn Backend>) -> Self {
        Locker {
            url: format!("{}://", backend.scheme()),
            backend,
            keepers: Arc::default(),
            defaults: LockOptions::default(),
        }
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
        let (name, req) = self.prepare(name, opts)?;
        let sent_at = Instant::now();
        match self.attempt(req.clone(), None).await {
            Ok(held) => Ok(Some(self.finish(held, name, req.owner, opts, sent_at))),
            Err(AttemptError::Busy(_)) => Ok(None),
            Err(AttemptError::Failed(e)) => Err(e),
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
        let (name, mut req) = self.prepare(name, opts)?;
        let started = Instant::now();
        let deadline = match opts.wait {
            Wait::Forever => None,
            Wait::Timeout(d) => Some(started + d),
            Wait::NoWait => Some(started),
        };
        if opts.fair {
            req.enqueue = Some(QUEUE_ENTRY_TTL);
        }
        req.will_wait = !matches!(opts.wait, Wait::NoWait);
        // Whatever happens from here on, a queue entry must not outlive this call.
        let mut queue_guard = QueueGuard {
            backend: Arc::clone(&self.backend),
            name: name.clone(),
            owner: req.owner.clone(),
            armed: opts.fair || self.backend.capabilities().queued_waiting,
        };
        let mut waiter: Option<Box<dyn Waiter>> = None;
        loop {
            let sent_at = Instant::now();
            let this_attempt = req.clone();
            req.attempt = req.attempt.saturating_add(1);
            let retry_after = match self.attempt(this_attempt, deadline).await {
                Ok(held) => {
                    queue_guard.armed = false;
                    return Ok(self.finish(held, name, req.owner, opts, sent_at));
                }
                Err(AttemptError::Busy(hint)) => hint,
                Err(AttemptError::Failed(e)) => return Err(e),
            };
            let now = Instant::now();
            let remaining = match deadline {
                Some(d) if now >= d => {
                    queue_guard.leave().await;
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
                    waiter = Some(self.backend.subscribe(&name, &req.owner).await?);
                }
                Some(w) => {
                    let mut step = retry_after.unwrap_or(MAX_WAIT_STEP).min(remaining);
                    if opts.fair {
                        step = step.min(QUEUE_ENTRY_TTL / 3);
                    }
                    w.changed(step.max(Duration::from_micros(100))).await?;
                }
            }
        }
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
    /// Acquisition errors, [`Error::LockLost`], release errors.
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
    pub async fn inspect(&self, name: &str) -> Result<Option<LockInfo>> {
        let name = LockName::new(name)?;
        self.backend.inspect(&name).await
    }

    fn prepare(&self, name: &str, opts: &LockOptions) -> Result<(LockName, AcquireRequest)> {
        let name = LockName::new(name)?;
        opts.validate()?;
        let caps = self.backend.capabilities();
        if opts.fair && !caps.fifo {
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
            ttl: opts.ttl,
            fair: opts.fair,
            enqueue: None,
            attempt: 0,
            will_wait: false,
            metadata: opts.metadata.clone().unwrap_or_else(Metadata::this_process),
        };
        Ok((name, req))
    }

    /// One attempt, run to completion even if the caller goes away mid-attempt: it is
    /// polled in place (no task in the common case), and if its future is dropped
    /// unfinished the rest runs in a task that releases any grant and leaves any queue.
    async fn attempt(
        &self,
        req: AcquireRequest,
        deadline: Option<Instant>,
    ) -> Result<Box<dyn crate::backend::HeldLock>, AttemptError> {
        let backend = Arc::clone(&self.backend);
        let queued = req.fair || backend.capabilities().queued_waiting;
        let (name, owner) = (req.name.clone(), req.owner.clone());
        let ttl = req.ttl;
        let sent_at = Instant::now();
        let job = async move {
            match backend.try_acquire(&req).await {
                // An acquisition slower than the lease is worthless: someone else may
                // already be entitled to the lock. Never report it as a success.
                Ok(Attempt::Acquired(held))
                    if lease_start(held.as_ref(), sent_at).elapsed()
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
        let mut flight = InFlight {
            job: Some(Box::pin(job)),
            abandon: queued.then(|| (Arc::clone(&self.backend), name, owner)),
        };
        let received = match deadline {
            None => (&mut flight).await,
            Some(d) => {
                // Let an attempt that started before the deadline finish a little past it.
                let limit = d.max(Instant::now()) + Duration::from_millis(250);
                match tokio::time::timeout_at(limit, &mut flight).await {
                    Ok(r) => r,
                    Err(_) => return Err(AttemptError::Busy(None)),
                }
            }
        };
        match received {
            Ok(Outcome::Granted(grant)) => Ok(grant.claim()),
            Ok(Outcome::Busy(retry_after)) => Err(AttemptError::Busy(retry_after)),
            Err(e) => Err(AttemptError::Failed(e)),
        }
    }

    fn finish(
        &self,
        held: Box<dyn crate::backend::HeldLock>,
        name: LockName,
        owner: Owner,
        opts: &LockOptions,
        sent_at: Instant,
    ) -> LockGuard {
        let sent_at = lease_start(held.as_ref(), sent_at);
        LockGuard::new(Hold::start(
            &self.keepers,
            held,
            name,
            owner,
            KeeperPlan {
                ttl: opts.ttl,
                renew_every: opts.renew_interval(),
                max_hold: opts.max_hold,
                sent_at,
            },
        ))
    }
}

/// When the lease of `held` began, at the latest: `sent_at` (the instant before the
/// attempt that returned it was sent), or earlier if the grant was made before that.
fn lease_start(held: &dyn crate::backend::HeldLock, sent_at: Instant) -> Instant {
    held.granted_at()
        .map_or(sent_at, |g| Instant::from_std(g).min(sent_at))
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

type AttemptFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Outcome>> + Send>>;

/// An attempt being polled by its caller. Dropped unfinished (the caller was cancelled
/// or timed out), it finishes in a task of its own: a grant is released (by
/// [`Unclaimed`]'s drop) and, where attempts queue, the queue place is left — after
/// the attempt, so it cannot be left before it was taken.
struct InFlight {
    job: Option<AttemptFuture>,
    abandon: Option<(Arc<dyn Backend>, LockName, Owner)>,
}

impl std::future::Future for InFlight {
    type Output = Result<Outcome>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let Some(job) = self.job.as_mut() else {
            return std::task::Poll::Ready(Err(Error::backend("core", "attempt polled twice")));
        };
        let out = job.as_mut().poll(cx);
        if out.is_ready() {
            self.job = None;
        }
        out
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(job) = self.job.take() else {
            return;
        };
        let abandon = self.abandon.take();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let outcome = job.await;
                if !matches!(outcome, Ok(Outcome::Granted(_)))
                    && let Some((backend, name, owner)) = abandon
                {
                    let _ = backend.leave_queue(&name, &owner).await;
                }
                // A grant is released as `outcome` (its `Unclaimed`) drops here.
            });
        }
    }
}

enum AttemptError {
    Busy(Option<Duration>),
    Failed(Error),
}

/// Removes a fair-mode queue entry when the acquisition ends without the lock: at
/// once on timeout, in a background task when the future is dropped.
struct QueueGuard {
    backend: Arc<dyn Backend>,
    name: LockName,
    owner: Owner,
    armed: bool,
}

impl QueueGuard {
    async fn leave(&mut self) {
        if self.armed {
            self.armed = false;
            if let Err(e) = self.backend.leave_queue(&self.name, &self.owner).await {
                tracing::debug!(lock = %self.name, error = %e, "could not leave the queue; the entry will expire");
            }
        }
    }
}

impl Drop for QueueGuard {
    fn drop(&mut self) {
        if self.armed {
            let backend = Arc::clone(&self.backend);
            let name = self.name.clone();
            let owner = self.owner.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let _ = backend.leave_queue(&name, &owner).await;
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grant dropped on its way to a cancelled caller is given back.
    #[tokio::test]
    async fn unclaimed_grant_is_released_on_drop() {
        let backend = crate::memory::MemoryBackend::new();
        let locker = Locker::from_backend(backend.clone());
        let (name, req) = locker
            .prepare("x", &LockOptions::default())
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
