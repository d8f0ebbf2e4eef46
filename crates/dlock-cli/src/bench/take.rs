//! What one bench cycle takes and gives back: the lock, a permit, a read, a write or
//! leadership, through the same `Locker`.

use dlock::{LockGuard, LockOptions, Locker};

use crate::args::BenchPrimitive;
use crate::bench::skips::Skips;
use crate::exit::Failure;

/// The primitive a cycle takes and, for a semaphore, its permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Take {
    pub primitive: BenchPrimitive,
    pub permits: u32,
}

/// How a [`Take::cycle`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cycled {
    /// Taken and given back.
    Done,
    /// Not taken: the acquisition failed on an error stepped over (no sample).
    NotTaken,
    /// Taken, but its release failed on an error stepped over: a cycle all the same,
    /// and the name stays taken until the lease ends (a loop that takes it again waits
    /// that long).
    StillHeld,
}

/// The shape of a floor's bare cycle: one holder at most (a lock, leadership), or a
/// grant counted against a limit (a permit, a read, a write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Exclusive,
    Counted(u32),
    /// The least a *fenced* lock must do on this backend, where [`Shape::Exclusive`]'s
    /// bare requests are not one (`floor::Floor::limit`).
    Fenced,
}

impl Take {
    /// Take it on `name`, waiting as `opts` says.
    pub async fn take(
        self,
        locker: &Locker,
        name: &str,
        opts: &LockOptions,
    ) -> Result<LockGuard, dlock::Error> {
        Ok(match self.primitive {
            BenchPrimitive::Lock => locker.lock_with(name, opts).await?,
            BenchPrimitive::Semaphore => {
                locker
                    .semaphore(name, self.permits)
                    .acquire_with(opts)
                    .await?
            }
            BenchPrimitive::Read => locker.rwlock(name).read_with(opts).await?,
            BenchPrimitive::Write => locker.rwlock(name).write_with(opts).await?,
            BenchPrimitive::Election => locker
                .election(name)
                .campaign_with("bench", opts)
                .await?
                .into_guard(),
        })
    }

    /// One cycle: take it, give it back; an error trying again may mend is stepped
    /// over into `skips` and said in the answer. The benchmarks generator's callgrind
    /// count toggles on this function by name.
    ///
    /// # Errors
    /// What [`Skips::step_over`] does not step over.
    pub async fn cycle(
        self,
        locker: &Locker,
        name: &str,
        opts: &LockOptions,
        skips: &Skips,
    ) -> Result<Cycled, Failure> {
        Ok(match self.take(locker, name, opts).await {
            Ok(guard) => {
                if skips.release(guard).await? {
                    Cycled::Done
                } else {
                    Cycled::StillHeld
                }
            }
            Err(e) => {
                skips.step_over(e)?;
                Cycled::NotTaken
            }
        })
    }

    /// The floor's shape for this primitive: a lock's and leadership's floor is the
    /// lock's; a permit, a read and a write need a grant counted against a limit.
    pub fn shape(self) -> Shape {
        match self.primitive {
            BenchPrimitive::Lock | BenchPrimitive::Election => Shape::Exclusive,
            BenchPrimitive::Semaphore => Shape::Counted(self.permits),
            BenchPrimitive::Read | BenchPrimitive::Write => Shape::Counted(1),
        }
    }
}
