//! [`Semaphore`]: at most N holders at once, each with a leased permit of its own.

use std::time::Duration;

use crate::backend::Primitive;
use crate::error::Result;
use crate::guard::LockGuard;
use crate::locker::Locker;
use crate::options::{LockOptions, Wait};

/// A semaphore of a [`Locker`]'s backend: at most `permits` holders at once, across
/// every process using the name. Made by [`Locker::semaphore`]; cheap to clone.
///
/// A permit is a [`LockGuard`] with everything a lock's guard has: a fencing token
/// (strictly increasing per semaphore, over every grant — it orders grants, but up to
/// N holders are inside at once, so a store cannot reject "every token below the
/// highest seen" across permits), renewal while it lives,
/// `lost()`, `release`, and a lease that frees the permit when its holder dies — no
/// one's cleanup job. Every acquisition takes a permit of its own, whatever its owner
/// (two tasks sharing an owner hold two permits). Each caller gives the number of
/// permits; callers of one name are expected to agree (a caller counting fewer is
/// refused sooner, one counting more may be let in beside the others).
///
/// ```no_run
/// # async fn demo(locker: dlock::Locker) -> dlock::Result<()> {
/// let payments = locker.semaphore("payment-api", 3);
/// let permit = payments.acquire().await?;
/// // at most 3 callers are here at once; permit.fencing_token() orders them
/// permit.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Semaphore {
    locker: Locker,
    name: String,
    permits: u32,
}

impl Semaphore {
    pub(crate) fn new(locker: Locker, name: &str, permits: u32) -> Self {
        Semaphore {
            locker,
            name: name.to_owned(),
            permits,
        }
    }

    /// The semaphore's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many permits this handle counts.
    #[must_use]
    pub fn permits(&self) -> u32 {
        self.permits
    }

    fn primitive(&self) -> Primitive {
        Primitive::Permit {
            permits: self.permits,
        }
    }

    /// Take a permit, waiting as long as it takes (the locker's default options).
    ///
    /// # Errors
    /// [`crate::Error::Unsupported`] where the backend offers no semaphore
    /// ([`crate::Capabilities::primitives`]), [`crate::Error::InvalidOption`] for 0
    /// permits, [`crate::Error::InvalidName`], backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves no permit held.
    pub async fn acquire(&self) -> Result<LockGuard> {
        let opts = LockOptions {
            wait: Wait::Forever,
            ..self.locker.default_options()
        };
        self.acquire_with(&opts).await
    }

    /// Take a permit, waiting at most `timeout`.
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] when no permit came free in time; as
    /// [`Semaphore::acquire`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves no permit held.
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<LockGuard> {
        let opts = LockOptions {
            wait: Wait::Timeout(timeout),
            ..self.locker.default_options()
        };
        self.acquire_with(&opts).await
    }

    /// Take a permit with explicit options (`fair` is refused: not offered for
    /// semaphores yet).
    ///
    /// # Errors
    /// As [`Semaphore::acquire_timeout`], plus [`crate::Error::Unsupported`] for `fair`.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves no permit held.
    pub async fn acquire_with(&self, opts: &LockOptions) -> Result<LockGuard> {
        self.locker
            .hold_with(&self.name, opts, self.primitive())
            .await
    }

    /// One attempt: `Ok(None)` when every permit is taken.
    ///
    /// # Errors
    /// As [`Semaphore::acquire`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves no permit held.
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>> {
        self.locker
            .try_hold(&self.name, &self.locker.default_options(), self.primitive())
            .await
    }

    /// Who holds a permit now, in token order (each [`crate::LockInfo`] with
    /// `hold: Some(Permit)`, its owner, token, lease left and metadata).
    ///
    /// # Errors
    /// As [`Semaphore::acquire`].
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn holders(&self) -> Result<Vec<crate::LockInfo>> {
        self.locker.holders(&self.name, self.primitive()).await
    }
}
