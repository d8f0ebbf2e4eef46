//! [`LockGuard`], the held lock handed to users.
//!
//! The guard is a handle on a [`Hold`] kept by its locker's [`crate::keeper::Keepers`]:
//! renewed, watched against a local monotonic deadline (`sent_at + ttl − drift`, where
//! `sent_at` is taken *before* the acquire request left), marked lost when that deadline
//! passes without a successful renewal or when the backend reports the lock gone, and
//! released — never renewed after that.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::error::{Error, LossReason, Result};
use crate::finish::Finish;
use crate::keeper::Hold;
use crate::options::Owner;
use crate::telemetry::in_span;

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
/// The guard is owned and `Send + 'static`: move it into tasks, threads and
/// synchronous code freely. Dropped where there is no Tokio runtime, it is released
/// on the runtime its [`crate::Locker`] was opened on; if that one is gone too, the
/// lease frees the lock when it runs out (on a session-bound backend: when the
/// session ends).
#[must_use = "the lock is released as soon as the guard is dropped"]
#[derive(Debug)]
pub struct LockGuard {
    hold: Arc<Hold>,
    released: bool,
}

impl LockGuard {
    /// The guard of a hold just started.
    pub(crate) fn new(hold: Arc<Hold>) -> Self {
        LockGuard {
            hold,
            released: false,
        }
    }

    /// The lock's name.
    #[must_use]
    pub fn name(&self) -> &str {
        self.hold.name.as_str()
    }

    /// The fencing token of this grant. Pass it with every operation on the protected
    /// resource, and have the resource reject tokens lower than the highest it has seen.
    #[must_use]
    pub fn fencing_token(&self) -> u64 {
        self.hold.token
    }

    /// The hold behind this guard.
    pub(crate) fn hold(&self) -> &Arc<Hold> {
        &self.hold
    }

    /// Who holds the lock.
    #[must_use]
    pub fn owner(&self) -> &Owner {
        &self.hold.owner
    }

    /// Whether the lock is still believed held: not released, not lost, its local
    /// deadline not passed and its session (if it has one) still trusted — also when
    /// the keeper has not yet got round to marking it lost.
    #[must_use]
    pub fn is_held(&self) -> bool {
        !self.released && !self.hold.is_lost() && !self.hold.past_deadline()
    }

    /// The local deadline: from this instant on the hold counts as lost unless a
    /// renewal succeeds before it. It is the send time of the request that last set
    /// the lease (acquire or renewal) plus the TTL minus the drift margin, on the
    /// monotonic clock — so it passes before the lease can end on the server. Each
    /// successful renewal moves it later; while renewals fail, it stays put, and a
    /// caller can stop its work in time (`dlock run` sends its command SIGTERM ahead
    /// of it). A hold that lives as long as a session (etcd, ZooKeeper, an SQL session
    /// mode) may count as lost sooner, once its session is not proven alive in time:
    /// [`LockGuard::is_held`] and [`LockGuard::lost`] watch that too
    /// ([`crate::backend::HeldLock::session_trust`]).
    #[must_use]
    pub fn deadline(&self) -> std::time::Instant {
        self.hold.deadline().into_std()
    }

    /// Whether the lock is held but in doubt: the backend's session is disconnected
    /// (ZooKeeper) and may still recover — or end, and then [`LockGuard::lost`] fires.
    /// Always `false` on backends without such a state.
    #[must_use]
    pub fn is_suspect(&self) -> bool {
        self.is_held()
            && self
                .hold
                .suspect()
                .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// Why the lock was lost, if it was.
    #[must_use]
    pub fn loss_reason(&self) -> Option<LossReason> {
        if self.hold.is_lost() {
            self.hold.reason()
        } else {
            None
        }
    }

    /// Resolves with [`Error::LockLost`] when the lock is lost; pending forever otherwise.
    ///
    /// It fires before the lease can have run out on the server, when a renewal fails
    /// definitively, or when the backend reports its session gone — at the latest at
    /// the local [`LockGuard::deadline`] as it stands then, which this future watches
    /// itself: it does not depend on the locker's timer task (which runs on the runtime
    /// that started it, and stops if that runtime shuts down; polling this future on
    /// a multi-thread runtime starts it again there, and renewals go on). Poll it on
    /// a Tokio runtime with its timer, as every dlock future.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future changes nothing.
    pub fn lost(&self) -> impl Future<Output = Error> + Send + 'static {
        Arc::clone(&self.hold).watch_loss()
    }

    /// A token cancelled when the lock is lost (a child token: cancelling it yourself
    /// does not affect the guard).
    #[must_use]
    pub fn lost_token(&self) -> CancellationToken {
        self.hold.lost_token().child_token()
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

    /// Renew the lease now, for `ttl`; later automatic renewals use `ttl` too (with
    /// [`crate::Renewal::Auto`] they come every third of it; an interval given with
    /// [`crate::Renewal::Every`] stays, at most a third of `ttl`).
    ///
    /// This guard's deadline (and [`LockGuard::lost`]) follows `ttl`, shorter or
    /// longer. The lease on the server is never shortened: another hold of the same
    /// owner may rely on it. A shorter `ttl` ends this hold sooner; the lock itself is
    /// freed by its release. With a maximum hold time the lease ends with it at the
    /// latest: the extension is cut to what is left of it, and when less than
    /// [`crate::MIN_TTL`] is left, nothing is sent and this returns `Ok` — the hold
    /// ends at its maximum, as [`LockGuard::lost`] then tells
    /// ([`crate::LossReason::MaxHoldTime`]).
    ///
    /// # Errors
    /// [`Error::LockLost`] when the lock is gone; [`Error::InvalidOption`] for a TTL
    /// out of range; connection errors (the lock may still be held).
    ///
    /// # Cancel safety
    /// Cancel safe in that dropping the future leaves the guard usable; the extension
    /// may or may not have happened. Not so in an SQL session mode, where an extension
    /// is a ping of the lock's connection: dropped before its answer came, it leaves
    /// the connection out of step, and the lock is lost at the next ping (a renewal,
    /// the heartbeat, or an extension), this guard told before the connection closes.
    #[tracing::instrument(level = "debug", name = "extend", skip_all, fields(lock = %self.hold.name, scheme = self.hold.scheme()))]
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        crate::options::validate_ttl(ttl)?;
        self.hold.extend(ttl).await
    }

    /// Release the lock and report how that went.
    ///
    /// # Errors
    /// [`Error::LockLost`] when the lock had already been lost (what may be left of it
    /// on the server is still given back, unless the backend keeps a lock-delay), or
    /// when the release found it gone on the server (reason
    /// [`crate::LossReason::NotOwner`]: broken, or its lease ended and it was taken or
    /// dropped; on backends with [`crate::Capabilities::release_reports_loss`]): the
    /// work done under this guard may not have been exclusive; connection errors (the
    /// lease then frees the lock when it runs out).
    ///
    /// # Cancel safety
    /// Cancel safe: the release runs in the caller's task and, if this future is
    /// dropped halfway, finishes in a task of its own.
    pub async fn release(mut self) -> Result<()> {
        self.released = true;
        let span = tracing::debug_span!(
            "release",
            lock = %self.hold.name,
            scheme = self.hold.scheme()
        );
        // Run here (no hop through another task), finished in a task of its own if
        // this future is dropped halfway.
        in_span!(span, Finish::new(Arc::clone(&self.hold).release()))
            .unwrap_or_else(|| Err(self.hold.lost_error()))
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if !self.released {
            // Never blocks: released in a task (see the type's docs).
            self.hold.mark_released();
            if let Some(rt) = self.hold.release_runtime() {
                let hold = Arc::clone(&self.hold);
                rt.spawn(async move {
                    if let Err(e) = hold.release().await
                        && !matches!(e, Error::LockLost { .. })
                    {
                        tracing::warn!(error = %e, "background release failed; the lease will free the lock");
                    }
                });
            }
        }
    }
}
