//! [`LockGuard`], the held lock handed to users, and the keeper task behind it.
//!
//! Every guard has one keeper task that owns the backend's [`HeldLock`]. The keeper
//! renews the lease, watches a local monotonic deadline (`sent_at + ttl − drift`, where
//! `sent_at` is taken *before* the acquire request left), fires the loss token when that
//! deadline passes without a successful renewal or when the backend reports the lock
//! gone, and performs release. Because release goes through the same task, no renewal
//! can run after it.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::HeldLock;
use crate::error::{Error, LossReason, Result};
use crate::name::LockName;
use crate::options::{MIN_TTL, Owner};

/// Safety margin subtracted from a lease before the holder trusts it: 1 % of the TTL
/// plus 2 ms (the Redlock drift rule).
#[must_use]
pub fn drift_margin(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// How long the keeper waits for a best-effort release after a loss.
const LOST_RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug)]
enum Command {
    Extend(Duration, oneshot::Sender<Result<()>>),
    Release(Option<oneshot::Sender<Result<()>>>),
}

/// The guard's commands to its keeper. Lighter than an mpsc channel, which allocates a
/// block of 32 slots up front: with 100,000 held locks that block was most of the memory
/// each one cost.
#[derive(Debug, Default)]
struct Inbox {
    /// `None` once the keeper is gone: nothing will read commands any more.
    queue: Mutex<Option<VecDeque<Command>>>,
    wake: Notify,
}

impl Inbox {
    fn open() -> Self {
        Inbox {
            queue: Mutex::new(Some(VecDeque::new())),
            wake: Notify::new(),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Option<VecDeque<Command>>> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Hand `cmd` to the keeper; `Err` if the keeper is gone.
    fn send(&self, cmd: Command) -> std::result::Result<(), Command> {
        match self.queue().as_mut() {
            Some(q) => q.push_back(cmd),
            None => return Err(cmd),
        }
        // A permit is stored if the keeper is not waiting right now: no lost wake-up.
        self.wake.notify_one();
        Ok(())
    }

    /// The next command (cancel safe: a command stays queued until taken here).
    async fn recv(&self) -> Command {
        loop {
            if let Some(cmd) = self.queue().as_mut().and_then(VecDeque::pop_front) {
                return cmd;
            }
            self.wake.notified().await;
        }
    }

    /// The keeper is gone: drop what is queued (waiting callers see the loss) and refuse
    /// what comes.
    fn close(&self) {
        let left = self.queue().take();
        drop(left);
    }
}

#[derive(Debug)]
struct Shared {
    name: LockName,
    owner: Owner,
    token: u64,
    lost: CancellationToken,
    reason: Mutex<Option<LossReason>>,
    suspect: Option<Arc<std::sync::atomic::AtomicBool>>,
    inbox: Inbox,
}

impl Shared {
    fn lost_error(&self) -> Error {
        Error::LockLost {
            name: self.name.as_str().to_owned(),
            reason: self.reason().unwrap_or(LossReason::LeaseExpired),
        }
    }

    fn reason(&self) -> Option<LossReason> {
        self.reason.lock().map(|r| r.clone()).unwrap_or(None)
    }

    fn mark_lost(&self, reason: LossReason) {
        if let Ok(mut r) = self.reason.lock()
            && r.is_none()
        {
            tracing::warn!(lock = %self.name, %reason, "lock lost");
            *r = Some(reason);
        }
        self.lost.cancel();
    }
}

/// Context handed to the closure of [`crate::Locker::with_lock`].
#[derive(Debug, Clone)]
pub struct LockContext {
    /// The fencing token of this grant: pass it to the protected resource.
    pub fencing_token: u64,
    /// The holder's owner token.
    pub owner: Owner,
    /// Cancelled when the lock is lost.
    pub lost: CancellationToken,
}

/// A held lock. Release it with [`LockGuard::release`] to see errors; dropping it
/// releases in the background without blocking.
///
/// The guard is owned and `Send + 'static`: move it into tasks freely. If the tokio
/// runtime is gone when it drops, the lease frees the lock when it runs out.
#[must_use = "the lock is released as soon as the guard is dropped"]
#[derive(Debug)]
pub struct LockGuard {
    shared: Arc<Shared>,
    released: bool,
}

/// How the keeper renews.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeeperPlan {
    pub ttl: Duration,
    pub renew_every: Option<Duration>,
    pub max_hold: Option<Duration>,
    /// When the acquire request was sent (before the server could start the lease).
    pub sent_at: Instant,
}

impl LockGuard {
    pub(crate) fn start(
        held: Box<dyn HeldLock>,
        name: LockName,
        owner: Owner,
        plan: KeeperPlan,
    ) -> Self {
        let shared = Arc::new(Shared {
            name,
            owner,
            token: held.fencing_token(),
            lost: CancellationToken::new(),
            reason: Mutex::new(None),
            suspect: held.suspect_flag(),
            inbox: Inbox::open(),
        });
        let keeper = Keeper::new(held, Arc::clone(&shared), plan);
        tokio::spawn(keeper.run());
        LockGuard {
            shared,
            released: false,
        }
    }

    /// The lock's name.
    #[must_use]
    pub fn name(&self) -> &str {
        self.shared.name.as_str()
    }

    /// The fencing token of this grant. Pass it with every operation on the protected
    /// resource, and have the resource reject tokens lower than the highest it has seen.
    #[must_use]
    pub fn fencing_token(&self) -> u64 {
        self.shared.token
    }

    /// Who holds the lock.
    #[must_use]
    pub fn owner(&self) -> &Owner {
        &self.shared.owner
    }

    /// Whether the lock is still believed held (not lost, not released).
    #[must_use]
    pub fn is_held(&self) -> bool {
        !self.released && !self.shared.lost.is_cancelled()
    }

    /// Whether the lock is held but in doubt: the backend's session is disconnected
    /// (ZooKeeper) and may still recover — or end, and then [`LockGuard::lost`] fires.
    /// Always `false` on backends without such a state.
    #[must_use]
    pub fn is_suspect(&self) -> bool {
        self.is_held()
            && self
                .shared
                .suspect
                .as_ref()
                .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// Why the lock was lost, if it was.
    #[must_use]
    pub fn loss_reason(&self) -> Option<LossReason> {
        if self.shared.lost.is_cancelled() {
            self.shared.reason()
        } else {
            None
        }
    }

    /// Resolves with [`Error::LockLost`] when the lock is lost; pending forever otherwise.
    ///
    /// It fires before the lease can have run out on the server, when a renewal fails
    /// definitively, or when the backend reports its session gone.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future changes nothing.
    pub fn lost(&self) -> impl Future<Output = Error> + Send + 'static {
        let shared = Arc::clone(&self.shared);
        async move {
            shared.lost.cancelled().await;
            shared.lost_error()
        }
    }

    /// A token cancelled when the lock is lost (a child token: cancelling it yourself
    /// does not affect the guard).
    #[must_use]
    pub fn lost_token(&self) -> CancellationToken {
        self.shared.lost.child_token()
    }

    /// The context handed to `with_lock` closures.
    #[must_use]
    pub fn context(&self) -> LockContext {
        LockContext {
            fencing_token: self.fencing_token(),
            owner: self.owner().clone(),
            lost: self.lost_token(),
        }
    }

    /// Set the lease to `ttl` from now; later automatic renewals use `ttl` too.
    ///
    /// # Errors
    /// [`Error::LockLost`] when the lock is gone; [`Error::InvalidOption`] for a TTL
    /// out of range; connection errors (the lock may still be held).
    ///
    /// # Cancel safety
    /// Cancel safe in that dropping the future leaves the guard usable; the extension
    /// may or may not have happened.
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        crate::options::validate_ttl(ttl)?;
        let (tx, rx) = oneshot::channel();
        self.shared
            .inbox
            .send(Command::Extend(ttl, tx))
            .map_err(|_| self.shared.lost_error())?;
        rx.await.map_err(|_| self.shared.lost_error())?
    }

    /// Release the lock and report how that went.
    ///
    /// # Errors
    /// [`Error::LockLost`] when the lock had already been lost (nothing to release);
    /// connection errors (the lease then frees the lock when it runs out).
    ///
    /// # Cancel safety
    /// Cancel safe: the release is carried out by the keeper task even if this future
    /// is dropped.
    pub async fn release(mut self) -> Result<()> {
        self.released = true;
        let (tx, rx) = oneshot::channel();
        if self.shared.inbox.send(Command::Release(Some(tx))).is_err() {
            return Err(self.shared.lost_error());
        }
        rx.await.map_err(|_| self.shared.lost_error())?
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if !self.released {
            // Never blocks; if the keeper is gone (runtime shut down) the lease frees it.
            let _ = self.shared.inbox.send(Command::Release(None));
        }
    }
}

struct Keeper {
    held: Box<dyn HeldLock>,
    shared: Arc<Shared>,
    ttl: Duration,
    renew_every: Option<Duration>,
    hold_until: Option<Instant>,
    deadline: Instant,
    next_renew: Option<Instant>,
    /// The current lease was shortened (or renewal stopped) by the max hold time.
    capped_by_hold: bool,
}

impl Keeper {
    fn new(held: Box<dyn HeldLock>, shared: Arc<Shared>, plan: KeeperPlan) -> Self {
        let margin = held.clock_drift(plan.ttl).max(drift_margin(plan.ttl));
        Keeper {
            held,
            shared,
            ttl: plan.ttl,
            renew_every: plan.renew_every,
            hold_until: plan.max_hold.map(|m| plan.sent_at + m),
            deadline: plan.sent_at + plan.ttl.saturating_sub(margin),
            next_renew: plan.renew_every.map(|every| plan.sent_at + every),
            capped_by_hold: false,
        }
    }

    fn is_lost(&self) -> bool {
        self.shared.lost.is_cancelled()
    }

    /// The keeper's life: one task per held lock, idle almost always. Its future is
    /// kept small (it is most of a held lock's memory): one timer for whichever comes
    /// first, the lease deadline or the next renewal, and the rare paths (a command,
    /// a renewal, a loss) boxed instead of laid out inline.
    async fn run(mut self) {
        let shared = Arc::clone(&self.shared);
        let backend_loss = self.held.loss_signal();
        let backend_loss_fut = async {
            match &backend_loss {
                Some(t) => t.cancelled().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(backend_loss_fut);
        let timer = tokio::time::sleep_until(self.deadline);
        tokio::pin!(timer);
        loop {
            let lost = self.is_lost();
            // Lost: only commands matter (the guard asking to release or extend).
            let wake = (!lost).then(|| {
                self.next_renew
                    .map_or(self.deadline, |r| r.min(self.deadline))
            });
            if let Some(at) = wake
                && timer.deadline() != at
            {
                timer.as_mut().reset(at);
            }
            let event = tokio::select! {
                biased;
                cmd = shared.inbox.recv() => Event::Command(cmd),
                () = &mut backend_loss_fut, if !lost => Event::BackendLoss,
                () = &mut timer, if wake.is_some() => Event::Timer,
            };
            match event {
                Event::Command(cmd) => {
                    if Box::pin(self.on_command(cmd)).await {
                        return;
                    }
                }
                Event::BackendLoss => {
                    self.shared.mark_lost(LossReason::SessionLost(
                        "the backend reported the session gone".into(),
                    ));
                    Box::pin(self.release_after_loss()).await;
                }
                Event::Timer => {
                    // The deadline before a renewal due at the same moment.
                    let now = Instant::now();
                    if now >= self.deadline {
                        Box::pin(self.expire()).await;
                    } else if self.next_renew.is_some_and(|r| now >= r) {
                        let _ = Box::pin(self.renew_once()).await;
                    }
                }
            }
        }
    }

    /// One renewal. Updates the deadline on success, marks the lock lost when the server
    /// disowns it, and schedules a quicker retry on a transient error.
    async fn renew_once(&mut self) -> Result<()> {
        let now = Instant::now();
        let mut ttl = self.ttl;
        if let Some(h) = self.hold_until {
            let left = h.saturating_duration_since(now);
            if left < MIN_TTL {
                // Max hold reached: stop renewing; the deadline fires MaxHoldTime.
                self.next_renew = None;
                self.capped_by_hold = true;
                return Ok(());
            }
            if left < ttl {
                ttl = left;
                self.capped_by_hold = true;
            }
        }
        let budget = self.deadline.saturating_duration_since(now);
        let outcome = if budget.is_zero() {
            Err(Error::connection("core", "no time left to renew"))
        } else {
            match tokio::time::timeout(budget, self.held.renew(ttl)).await {
                Ok(r) => r,
                Err(_) => Err(Error::connection("core", "renewal timed out")),
            }
        };
        match outcome {
            Ok(()) => {
                let margin = self.held.clock_drift(ttl).max(drift_margin(ttl));
                self.deadline = now + ttl.saturating_sub(margin);
                self.next_renew = self.renew_every.map(|every| now + every.min(ttl / 3));
                Ok(())
            }
            Err(Error::NotOwner { .. } | Error::LockLost { .. }) => {
                self.shared.mark_lost(LossReason::NotOwner);
                self.next_renew = None;
                Err(self.shared.lost_error())
            }
            Err(e) => {
                tracing::debug!(lock = %self.shared.name, error = %e, "renewal failed; retrying");
                let retry = (self.ttl / 10).clamp(Duration::from_millis(5), Duration::from_secs(1));
                self.next_renew = Some(Instant::now() + retry);
                Err(e)
            }
        }
    }

    /// Handle one command from the guard; returns whether the keeper is done.
    async fn on_command(&mut self, cmd: Command) -> bool {
        // A deadline that passed while this task could not run (the process was paused)
        // counts before the command: a release or extend after it must report the
        // loss, not succeed against a lease that is gone.
        if !self.is_lost() && Instant::now() >= self.deadline {
            self.expire().await;
        }
        match cmd {
            Command::Release(reply) => {
                let result = self.release_now().await;
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                } else if let Err(e) = result
                    && !matches!(e, Error::LockLost { .. })
                {
                    tracing::warn!(lock = %self.shared.name, error = %e, "background release failed; the lease will free the lock");
                }
                true
            }
            Command::Extend(ttl, reply) => {
                let result = if self.is_lost() {
                    Err(self.shared.lost_error())
                } else {
                    self.ttl = ttl;
                    self.renew_every = self.renew_every.map(|_| ttl / 3);
                    self.renew_once().await
                };
                let _ = reply.send(result);
                false
            }
        }
    }

    /// The local deadline passed: the lock is lost (max hold time or lease expiry).
    async fn expire(&mut self) {
        let reason = if self.capped_by_hold {
            LossReason::MaxHoldTime
        } else {
            LossReason::LeaseExpired
        };
        self.shared.mark_lost(reason);
        self.release_after_loss().await;
    }

    async fn release_now(&mut self) -> Result<()> {
        if self.is_lost() {
            return Err(self.shared.lost_error());
        }
        self.next_renew = None;
        self.held.release().await
    }

    /// After a loss the lease may still be ours on the server (e.g. renewals could not
    /// get through); an owner-checked release frees it for others sooner and cannot
    /// harm a new holder.
    ///
    /// Not with a lock-delay: the lease must run out unreleased for the delay to hold
    /// the next owner back while this holder hears of the loss and stops.
    async fn release_after_loss(&mut self) {
        self.next_renew = None;
        if self.held.keeps_lock_delay() {
            return;
        }
        let _ = tokio::time::timeout(LOST_RELEASE_TIMEOUT, self.held.release()).await;
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        // Done, or dropped with the runtime: callers waiting on a reply see the loss.
        self.shared.inbox.close();
    }
}

/// What woke the keeper.
enum Event {
    Command(Command),
    BackendLoss,
    Timer,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Idle;

    #[async_trait::async_trait]
    impl HeldLock for Idle {
        fn fencing_token(&self) -> u64 {
            1
        }
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            Ok(())
        }
        async fn release(&self) -> Result<()> {
            Ok(())
        }
    }

    /// The keeper's future is most of what a held lock costs in memory (100,000 held
    /// locks: one each). It was 744 bytes with a timer per select branch and the rare
    /// paths inline; keep it from growing back.
    #[test]
    fn the_keeper_future_stays_small() {
        let shared = Arc::new(Shared {
            name: LockName::new("x").expect("name"),
            owner: Owner::random(),
            token: 1,
            lost: CancellationToken::new(),
            reason: Mutex::new(None),
            suspect: None,
            inbox: Inbox::open(),
        });
        let plan = KeeperPlan {
            ttl: Duration::from_secs(30),
            renew_every: Some(Duration::from_secs(10)),
            max_hold: None,
            sent_at: Instant::now(),
        };
        let run = Keeper::new(Box::new(Idle), shared, plan).run();
        let size = std::mem::size_of_val(&run);
        assert!(size <= 660, "the keeper future grew to {size} bytes");
    }
}
