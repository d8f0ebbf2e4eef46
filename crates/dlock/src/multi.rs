//! Several locks held together ([`Locker::lock_all`]): all of them or none, taken one
//! after another in one canonical order — the names' byte order — so two callers whose
//! sets overlap never wait for each other in a circle. Each lock keeps its own lease,
//! renewal and fencing token; the [`MultiGuard`] hears of the loss of any of them.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use crate::error::{Error, LossReason, Result};
use crate::guard::LockGuard;
use crate::locker::Locker;
use crate::name::LockName;
use crate::options::{LockOptions, Owner, Wait};

/// Every lock of a [`Locker::lock_all`] call, or the permits of one
/// [`crate::Semaphore::acquire_many`] call, held together.
///
/// Dropping it releases every lock in the background, as dropping each
/// [`LockGuard`] would; [`MultiGuard::release`] does it in the caller's task and says
/// how it went.
#[derive(Debug)]
#[must_use = "dropping the guard releases the locks"]
pub struct MultiGuard {
    /// In the canonical order (by name).
    pub(crate) guards: Vec<LockGuard>,
}

/// A set of one: code that handles a set (a tool's `--also`) handles one lock, permit,
/// read or write the same way.
impl From<LockGuard> for MultiGuard {
    fn from(guard: LockGuard) -> Self {
        MultiGuard {
            guards: vec![guard],
        }
    }
}

impl MultiGuard {
    /// The set just taken, if every guard of it is still held; else each is given
    /// back and the first loss is the error (the last guard came after the others).
    pub(crate) async fn whole(self) -> Result<Self> {
        let Some(lost) = self.guards.iter().find(|g| !g.is_held()) else {
            return Ok(self);
        };
        let e = Error::LockLost {
            name: lost.name().to_owned(),
            reason: lost.loss_reason().unwrap_or(LossReason::LeaseExpired),
        };
        let _ = self.release().await;
        Err(e)
    }

    /// The guards in the order they were taken: for [`Locker::lock_all`] one per
    /// distinct name, in the names' byte order; for
    /// [`crate::Semaphore::acquire_many`] one per permit, each with its own token.
    pub fn guards(&self) -> &[LockGuard] {
        &self.guards
    }

    /// The guard of `name`, if it is one of the set (for a set of permits, which
    /// share one name: the first; see [`MultiGuard::guards`]).
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&LockGuard> {
        self.guards.iter().find(|g| g.name() == name)
    }

    /// `name`'s fencing token, if it is one of the set: each lock has its own, and a
    /// resource protected by one lock checks that lock's token.
    #[must_use]
    pub fn fencing_token(&self, name: &str) -> Option<u64> {
        self.get(name).map(LockGuard::fencing_token)
    }

    /// Whether every lock of the set is still held.
    #[must_use]
    pub fn is_held(&self) -> bool {
        self.guards.iter().all(LockGuard::is_held)
    }

    /// The earliest local deadline of the set: past it, one lock may have ended on the
    /// server.
    #[must_use]
    pub fn deadline(&self) -> Instant {
        self.guards
            .iter()
            .map(LockGuard::deadline)
            .min()
            .unwrap_or_else(Instant::now)
    }

    /// Why a lock of the set was lost (the first lost one, in the set's order), if one
    /// was.
    #[must_use]
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.guards.iter().find_map(LockGuard::loss_reason)
    }

    /// Resolves with [`Error::LockLost`] as soon as any lock of the set is lost;
    /// pending forever otherwise.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future changes nothing.
    pub fn lost(&self) -> impl Future<Output = Error> + Send + 'static {
        let mut each: Vec<Boxed<Error>> = self
            .guards
            .iter()
            .map(|g| Box::pin(g.lost()) as Boxed<Error>)
            .collect();
        let mut told = slots(each.len());
        std::future::poll_fn(move |cx| {
            poll_each(&mut each, &mut told, cx);
            match told.iter_mut().find_map(Option::take) {
                Some(e) => Poll::Ready(e),
                None => Poll::Pending,
            }
        })
    }

    /// Release every lock, all at once, and report a lock found lost if any, else the
    /// first error in the order the locks were taken, the last first (every lock is
    /// given back whatever happens to the others). The releases run together in the
    /// caller's task, so a set goes back in about the time of its slowest release, not
    /// the sum of them all.
    ///
    /// # Errors
    /// As [`LockGuard::release`]: a lock found lost if any, else the first lock whose
    /// release failed.
    ///
    /// # Cancel safety
    /// Cancel safe: each release under way finishes in a task of its own; dropped
    /// before it was first polled, the future's guards release in the background as
    /// they drop.
    pub async fn release(self) -> Result<()> {
        let mut releases: Vec<Boxed<Result<()>>> = self
            .guards
            .into_iter()
            .rev()
            .map(|g| Box::pin(g.release()) as Boxed<Result<()>>)
            .collect();
        let mut results = slots(releases.len());
        std::future::poll_fn(|cx| {
            if poll_each(&mut releases, &mut results, cx) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        // A lock found lost says more than another lock's failed release (which its
        // lease undoes): it is the error told, when there is one.
        let lost = |r: &Result<()>| matches!(r, Err(Error::LockLost { .. }));
        results
            .into_iter()
            .flatten()
            .filter(Result::is_err)
            .reduce(|told, next| {
                if !lost(&told) && lost(&next) {
                    next
                } else {
                    told
                }
            })
            .unwrap_or(Ok(()))
    }

    /// The guards themselves, to release or keep each one on its own.
    #[must_use]
    pub fn into_guards(self) -> Vec<LockGuard> {
        self.guards
    }
}

/// One guard's future, boxed so a set's futures can sit in one `Vec`.
type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// An empty slot for each of `n` futures' outputs.
fn slots<T>(n: usize) -> Vec<Option<T>> {
    std::iter::repeat_with(|| None).take(n).collect()
}

/// Polls each future of `each` whose slot in `out` is still empty, and puts its output
/// there when it finishes: a future that finished is never polled again, and all of
/// them wake the same task. True once every slot is full.
fn poll_each<T>(each: &mut [Boxed<T>], out: &mut [Option<T>], cx: &mut Context<'_>) -> bool {
    let mut done = true;
    for (f, slot) in each.iter_mut().zip(out.iter_mut()) {
        if slot.is_none() {
            match f.as_mut().poll(cx) {
                Poll::Ready(v) => *slot = Some(v),
                Poll::Pending => done = false,
            }
        }
    }
    done
}

impl Locker {
    /// Acquire every lock of `names` — all of them or none — with `opts` for each.
    ///
    /// The locks are taken one by one in the names' byte order, whatever order they
    /// are given in, so callers with overlapping sets never deadlock; a name given
    /// twice is one lock. Every lock is taken by one owner (`opts.owner`, or a fresh
    /// one for the set). `opts.wait` bounds the whole call: a `Timeout` is shared by
    /// all the locks. When one cannot be had — or one already taken is lost while the
    /// call waits for the next — the ones taken are given back before the error is
    /// returned (a release that fails leaves that lock to its lease, as dropping a
    /// guard does). Names that differ are different locks: on a backend that maps
    /// several names to one lock (PostgreSQL `advisory_key=number` takes only the
    /// canonical spelling of a number for that reason) the order stays canonical.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming the lock that stayed busy (`waited`: the whole call),
    /// [`Error::LockLost`] when a lock taken was lost before the set was complete,
    /// [`Error::InvalidName`] for
    /// any name (checked before anything is taken), [`Error::InvalidOption`] for an
    /// empty set or bad options, backend errors — in every case nothing stays held.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future releases (in the background) the locks it had
    /// taken and leaves nothing queued.
    #[tracing::instrument(level = "debug", name = "lock_all", skip_all, fields(scheme = self.scheme()))]
    pub async fn lock_all<I>(&self, names: I, opts: &LockOptions) -> Result<MultiGuard>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut sorted = names
            .into_iter()
            .map(|n| LockName::new(n.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        if sorted.is_empty() {
            return Err(Error::option("names", "lock_all needs at least one name"));
        }
        opts.validate()?;
        sorted.sort_unstable();
        sorted.dedup();
        let started = tokio::time::Instant::now();
        // A wait too long to represent is a wait without end.
        let deadline = match opts.wait {
            Wait::Timeout(t) => started.checked_add(t),
            _ => None,
        };
        let owner = opts.owner.clone().unwrap_or_else(Owner::random);
        let mut held = MultiGuard {
            guards: Vec::with_capacity(sorted.len()),
        };
        for name in &sorted {
            let mut each = opts.clone().owner(owner.clone());
            if let Some(d) = deadline {
                each.wait = Wait::Timeout(d.saturating_duration_since(tokio::time::Instant::now()));
            }
            // While it waits for the next lock, one already taken may be lost (its
            // session ended): then the set cannot be had whole — stop at once.
            let lost = held.lost();
            let next = tokio::select! {
                r = self.lock_with(name.as_str(), &each) => r,
                e = lost, if !held.guards.is_empty() => Err(e),
            };
            match next {
                Ok(g) => held.guards.push(g),
                Err(e) => {
                    // All or nothing: what this call took is given back before it
                    // says why it failed.
                    let _ = held.release().await;
                    return Err(match e {
                        Error::Timeout { name, .. } => Error::Timeout {
                            name,
                            waited: started.elapsed(),
                        },
                        other => other,
                    });
                }
            }
        }
        // The last lock came after the others: make sure none was lost meanwhile.
        held.whole().await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;
    use crate::backend::{HeldLock, Primitive};
    use crate::keeper::{Hold, KeeperPlan, Keepers};

    /// A held lock whose release takes 3 s, then notes its token and succeeds or fails.
    #[derive(Debug)]
    struct SlowRelease {
        token: u64,
        fails: bool,
        released: Arc<Mutex<Vec<u64>>>,
    }

    #[async_trait::async_trait]
    impl HeldLock for SlowRelease {
        fn fencing_token(&self) -> u64 {
            self.token
        }
        async fn renew(&self, _ttl: Duration) -> Result<()> {
            Ok(())
        }
        async fn release(&self) -> Result<()> {
            tokio::time::sleep(Duration::from_secs(3)).await;
            self.released.lock().expect("log").push(self.token);
            if self.fails {
                Err(Error::connection(
                    "test",
                    format!("release {} failed", self.token),
                ))
            } else {
                Ok(())
            }
        }
    }

    /// A set taken in the order of `fails` (token 1 first), and the tokens its
    /// releases noted.
    fn set(fails: &[bool]) -> (MultiGuard, Arc<Mutex<Vec<u64>>>) {
        let keepers = Arc::new(Keepers::default());
        let released = Arc::new(Mutex::new(Vec::new()));
        let guards = (1..)
            .zip(fails)
            .map(|(token, &fails)| {
                let plan = KeeperPlan {
                    ttl: Duration::from_secs(60),
                    renew_every: None,
                    renew_auto: false,
                    max_hold: None,
                    sent_at: Instant::now(),
                    primitive: Primitive::Lock,
                };
                let held = SlowRelease {
                    token,
                    fails,
                    released: Arc::clone(&released),
                };
                let name = LockName::new(&format!("n{token}")).expect("name");
                LockGuard::new(Hold::start(
                    &keepers,
                    Box::new(held),
                    name,
                    Owner::random(),
                    plan,
                ))
            })
            .collect();
        (MultiGuard { guards }, released)
    }

    fn sorted(released: &Mutex<Vec<u64>>) -> Vec<u64> {
        let mut tokens = released.lock().expect("log").clone();
        tokens.sort_unstable();
        tokens
    }

    /// Four releases of 3 s each take 3 s together, not 12 s.
    #[tokio::test(start_paused = true)]
    async fn a_set_goes_back_in_the_time_of_one_release() {
        let (guard, released) = set(&[false; 4]);
        let started = Instant::now();
        guard.release().await.expect("release");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(3) && took < Duration::from_secs(4),
            "a set of four releases of 3 s each took {took:?}"
        );
        assert_eq!(sorted(&released), [1, 2, 3, 4]);
    }

    /// Every lock is given back whatever happens to the others, and the error told is
    /// the first in the order taken, the last first.
    #[tokio::test(start_paused = true)]
    async fn the_error_told_is_the_last_taken_lock_that_failed() {
        let (guard, released) = set(&[false, true, true, false]);
        let e = guard.release().await.expect_err("two releases failed");
        assert!(e.to_string().contains("release 3 failed"), "{e}");
        assert_eq!(sorted(&released), [1, 2, 3, 4]);
    }

    /// A release dropped halfway still gives every lock back, each in a task of its
    /// own.
    #[tokio::test(start_paused = true)]
    async fn a_release_dropped_halfway_still_gives_every_lock_back() {
        let (guard, released) = set(&[false; 4]);
        let cut = tokio::time::timeout(Duration::from_secs(1), guard.release()).await;
        assert!(cut.is_err(), "the release finished within 1 s");
        assert!(sorted(&released).is_empty());
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(sorted(&released), [1, 2, 3, 4]);
    }
}
