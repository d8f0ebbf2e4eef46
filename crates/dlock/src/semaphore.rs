//! [`Semaphore`]: at most N holders at once, each with a leased permit of its own.

use std::time::Duration;

use crate::backend::Primitive;
use crate::error::{Error, Result};
use crate::guard::LockGuard;
use crate::locker::Locker;
use crate::multi::MultiGuard;
use crate::options::{LockOptions, Owner, Wait};

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
/// [`Semaphore::acquire_many`] takes k permits at once, all or none. Its callers pass
/// one at a time through a gate — the one permit of the semaphore named
/// `NAME%permits` (keep that name free for it) — and take their permits one by one
/// behind it: two callers each holding part of what they need could otherwise wait
/// for each other forever. Callers of one permit do not pass the gate, so a steady
/// stream of them can keep a caller of k waiting (within its timeout). A task that
/// already holds permits of the semaphore and asks for more can wait for itself: ask
/// for all it needs in one call. On ZooKeeper, do not mix it with Curator's
/// `acquire(qty)` on one name: each takes Curator's mutex for every permit.
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

    /// Take a permit with explicit options. `fair` is accepted where the backend
    /// serves semaphores in arrival order anyway ([`crate::Primitives::fifo`]: etcd,
    /// ZooKeeper) and refused elsewhere.
    ///
    /// # Errors
    /// As [`Semaphore::acquire_timeout`], plus [`crate::Error::Unsupported`] for `fair`
    /// where it is refused.
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

    /// Take `k` permits at once (all or none), waiting as long as it takes.
    ///
    /// # Errors
    /// As [`Semaphore::acquire_many_with`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future releases (in the background) the permits it
    /// had taken.
    pub async fn acquire_many(&self, k: u32) -> Result<MultiGuard> {
        let opts = LockOptions {
            wait: Wait::Forever,
            ..self.locker.default_options()
        };
        self.acquire_many_with(k, &opts).await
    }

    /// Take `k` permits at once, all or none (see the type's documentation for how),
    /// with `opts` for each: one owner (`opts.owner`, or a fresh one) holds them all,
    /// each keeps its own lease, renewal and fencing token, and the [`MultiGuard`]
    /// hears of the loss of any. `opts.wait` bounds the whole call (`NoWait`: one
    /// attempt at the gate and at each permit).
    ///
    /// # Errors
    /// [`Error::InvalidOption`] when `k` is 0 or above the semaphore's permits (it
    /// would wait forever), [`Error::Timeout`] (`waited`: the whole call),
    /// [`Error::LockLost`] when a permit taken was lost before the set was complete,
    /// as [`Semaphore::acquire_with`] otherwise — in every case nothing stays held.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future releases (in the background) the permits and
    /// the gate it had taken, and leaves nothing queued.
    pub async fn acquire_many_with(&self, k: u32, opts: &LockOptions) -> Result<MultiGuard> {
        if k == 0 || k > self.permits {
            return Err(Error::option(
                "k",
                format!(
                    "take between 1 and the semaphore's {} permits at once, not {k}",
                    self.permits
                ),
            ));
        }
        opts.validate()?;
        let gate_name = format!("{}%permits", self.name);
        crate::name::LockName::new(&gate_name)?;
        let started = tokio::time::Instant::now();
        let deadline = match opts.wait {
            Wait::Timeout(t) => started.checked_add(t),
            _ => None,
        };
        let left = |each: &mut LockOptions| {
            if let Some(d) = deadline {
                each.wait = Wait::Timeout(d.saturating_duration_since(tokio::time::Instant::now()));
            }
        };
        // A busy gate or permit is this semaphore's timeout, not the gate's.
        let timed_out = |e: Error| match e {
            Error::Timeout { .. } => Error::Timeout {
                name: self.name.clone(),
                waited: started.elapsed(),
            },
            other => other,
        };
        // The gate is a semaphore of one permit: offered wherever this semaphore is
        // (whatever the URL does to lock names), and never shared by callers that
        // share an owner.
        // It is renewed, and has no maximum hold, whatever the permits' options say:
        // it must outlast the wait for them.
        let gate_opts = LockOptions {
            renewal: crate::Renewal::Auto,
            max_hold: None,
            ..opts.clone()
        };
        let gate = Semaphore::new(self.locker.clone(), &gate_name, 1)
            .acquire_with(&gate_opts)
            .await
            .map_err(timed_out)?;
        let owner = opts.owner.clone().unwrap_or_else(Owner::random);
        let mut held = MultiGuard {
            guards: Vec::with_capacity(k.min(64) as usize),
        };
        for _ in 0..k {
            let mut each = opts.clone().owner(owner.clone());
            left(&mut each);
            // While it waits for the next permit, one already taken or the gate may be
            // lost: the set cannot be had whole, or another caller of several may pass
            // the gate — stop at once.
            let lost = held.lost();
            let next = tokio::select! {
                r = self.acquire_with(&each) => r,
                e = lost, if !held.guards.is_empty() => Err(e),
                e = gate.lost() => Err(match e {
                    Error::LockLost { reason, .. } => Error::LockLost {
                        name: self.name.clone(),
                        reason,
                    },
                    other => other,
                }),
            };
            match next {
                Ok(g) => held.guards.push(g),
                Err(e) => {
                    let _ = held.release().await;
                    let _ = gate.release().await;
                    return Err(timed_out(e));
                }
            }
        }
        let _ = gate.release().await;
        held.whole().await
    }

    /// One attempt at `k` permits at once: `Ok(None)` when they are not all free now
    /// (or another caller of several is taking its permits).
    ///
    /// # Errors
    /// As [`Semaphore::acquire_many_with`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future releases (in the background) what it had taken.
    pub async fn try_acquire_many(&self, k: u32) -> Result<Option<MultiGuard>> {
        let opts = LockOptions {
            wait: Wait::NoWait,
            ..self.locker.default_options()
        };
        match self.acquire_many_with(k, &opts).await {
            Ok(g) => Ok(Some(g)),
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
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
