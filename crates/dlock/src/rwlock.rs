//! [`RwLock`]: many readers or one writer, every grant fenced.

use std::time::Duration;

use crate::backend::Primitive;
use crate::error::{Error, Result};
use crate::guard::LockGuard;
use crate::locker::Locker;
use crate::options::{LockOptions, Wait};

/// A read-write lock of a [`Locker`]'s backend: any number of readers together, or one
/// writer alone. Made by [`Locker::rwlock`]; cheap to clone.
///
/// A read or write hold is a [`LockGuard`] (fencing token, renewal, `lost()`,
/// `release`, a lease that frees it when its holder dies). A write's token is above
/// every token granted before it to another owner, read or write, so a fenced resource
/// can refuse a writer whose lock was taken over.
///
/// **A waiting writer goes first:** while a writer waits, new readers wait behind it,
/// so a stream of readers — each with its own owner, the default — cannot starve it.
/// Where the backend decides by counting holds (memory, SQLite, Redis, SQL), a reader
/// whose owner already holds the lock is let in all the same (it could otherwise wait
/// on itself): readers that share one owner and keep overlapping can keep a writer
/// waiting for as long as they overlap. Where it decides by order (etcd, ZooKeeper,
/// the backend's documentation says how), a reader waits for every earlier writer of
/// another owner, even one whose owner reads or writes already. With the default owners, a task
/// that takes a second read while it holds one waits behind a waiting writer — and
/// forever, if it waits for that read before releasing the first: do not nest reads
/// without sharing an owner. Writers among themselves are not ordered. An owner
/// holding a read that asks to write gets [`crate::Error::UpgradeRefused`] (two readers
/// upgrading at once would wait for each other forever); an owner holding the write may
/// also read (on etcd and ZooKeeper, only while no writer of another owner waits).
/// [`RwLock::downgrade`] trades a write for a read with no writer let in between.
///
/// Tokens order every grant; what a fenced store should check is a writer's: a read
/// taken under its owner's own write gets a token above the write's, and readers are
/// inside together, so a store that rejects tokens below the highest it has seen must
/// count writers' tokens only.
///
/// ```no_run
/// # async fn demo(locker: dlock::Locker) -> dlock::Result<()> {
/// let prices = locker.rwlock("price-table");
/// let reading = prices.read().await?;
/// reading.release().await?;
/// let writing = prices.write().await?;
/// // no reader and no other writer is here; pass writing.fencing_token() to the store
/// writing.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RwLock {
    locker: Locker,
    name: String,
}

impl RwLock {
    pub(crate) fn new(locker: Locker, name: &str) -> Self {
        RwLock {
            locker,
            name: name.to_owned(),
        }
    }

    /// The lock's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    fn forever(&self) -> LockOptions {
        LockOptions {
            wait: Wait::Forever,
            ..self.locker.default_options()
        }
    }

    /// Take a read hold, waiting as long as it takes.
    ///
    /// # Errors
    /// [`crate::Error::Unsupported`] where the backend offers no read-write lock
    /// ([`crate::Capabilities::primitives`]), [`crate::Error::InvalidName`], backend
    /// errors.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing held.
    pub async fn read(&self) -> Result<LockGuard> {
        self.read_with(&self.forever()).await
    }

    /// Take the write hold, waiting as long as it takes.
    ///
    /// # Errors
    /// As [`RwLock::read`], plus [`crate::Error::UpgradeRefused`] when this owner
    /// holds a read.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing held and no waiting entry behind.
    pub async fn write(&self) -> Result<LockGuard> {
        self.write_with(&self.forever()).await
    }

    /// Take a read hold with explicit options (`fair`: as for
    /// [`crate::Semaphore::acquire_with`]).
    ///
    /// # Errors
    /// As [`RwLock::read`], plus [`crate::Error::Timeout`] when `opts.wait` runs out.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing held.
    pub async fn read_with(&self, opts: &LockOptions) -> Result<LockGuard> {
        self.locker
            .hold_with(&self.name, opts, Primitive::Read)
            .await
    }

    /// Take the write hold with explicit options (`fair`: as for
    /// [`crate::Semaphore::acquire_with`]).
    ///
    /// # Errors
    /// As [`RwLock::write`], plus [`crate::Error::Timeout`] when `opts.wait` runs out.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves nothing held and no waiting entry behind.
    pub async fn write_with(&self, opts: &LockOptions) -> Result<LockGuard> {
        self.locker
            .hold_with(&self.name, opts, Primitive::Write)
            .await
    }

    /// Take a read hold, waiting at most `timeout`.
    ///
    /// # Errors
    /// As [`RwLock::read_with`].
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn read_timeout(&self, timeout: Duration) -> Result<LockGuard> {
        let opts = LockOptions {
            wait: Wait::Timeout(timeout),
            ..self.locker.default_options()
        };
        self.read_with(&opts).await
    }

    /// Take the write hold, waiting at most `timeout`.
    ///
    /// # Errors
    /// As [`RwLock::write_with`].
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn write_timeout(&self, timeout: Duration) -> Result<LockGuard> {
        let opts = LockOptions {
            wait: Wait::Timeout(timeout),
            ..self.locker.default_options()
        };
        self.write_with(&opts).await
    }

    /// One read attempt: `Ok(None)` when a writer holds or waits.
    ///
    /// # Errors
    /// As [`RwLock::read`].
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn try_read(&self) -> Result<Option<LockGuard>> {
        self.locker
            .try_hold(&self.name, &self.locker.default_options(), Primitive::Read)
            .await
    }

    /// One write attempt: `Ok(None)` when anyone holds the lock.
    ///
    /// # Errors
    /// As [`RwLock::write`].
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn try_write(&self) -> Result<Option<LockGuard>> {
        self.locker
            .try_hold(&self.name, &self.locker.default_options(), Primitive::Write)
            .await
    }

    /// Trade `write`, a write hold of this lock, for a read hold of the same owner,
    /// with no moment at which a writer of another owner could get in: the read is
    /// taken while the write is still held (an owner holding the write may read), and
    /// only then is the write released. The read is a new grant: its fencing token is
    /// above the write's; it is kept as the write was (its lease, its renewal, what is
    /// left of its maximum hold time), with the locker's default metadata.
    ///
    /// Where the backend counts holds (memory, SQLite, Redis, SQL) this always works.
    /// Where it orders contenders by arrival (etcd, ZooKeeper:
    /// [`crate::Primitives::downgrade_while_a_writer_waits`] is `false`), a read taken
    /// while a writer of another owner waits would queue behind that writer, which
    /// waits for this write: the downgrade is then refused with
    /// [`crate::Error::DowngradeRefused`] and the write handed back, still held. (A
    /// read after the writer's arrival, let in anyway, would be passed by that writer
    /// once the write ends — a reader and a writer together.)
    ///
    /// If the write's release fails once the read is held (the connection broke),
    /// the read is returned all the same; the write then ends when its lease does (it
    /// is no longer renewed), and other owners wait until then. If that release finds
    /// the write gone (broken, where [`crate::Capabilities::release_reports_loss`]:
    /// another owner may have written before the read was taken), the read is
    /// returned too, and the loss is only logged.
    ///
    /// # Errors
    /// [`NotDowngraded`], with the write handed back: [`crate::Error::InvalidOption`]
    /// when `write` is not a write hold of this lock taken through this locker,
    /// [`crate::Error::LockLost`] when it is no longer held,
    /// [`crate::Error::DowngradeRefused`] as above, backend errors of the read.
    /// `NotDowngraded` converts into its [`crate::Error`] (dropping the write, which
    /// releases it in the background), so `?` works.
    ///
    /// # Cancel safety
    /// Not cancel safe as a whole: dropped before the read is granted, the write is
    /// released (the guard drops) and no read is left behind; dropped after, the read
    /// is released in the background and the write's release finishes in a task of
    /// its own.
    pub async fn downgrade(
        &self,
        write: LockGuard,
    ) -> std::result::Result<LockGuard, NotDowngraded> {
        let hold = write.hold();
        let refuse = |error: Error, write: LockGuard| Err(NotDowngraded { error, write });
        if !hold.is_write || hold.name.as_str() != self.name || !hold.kept_by(self.locker.keepers())
        {
            return refuse(
                Error::option(
                    "downgrade",
                    format!(
                        "the guard is not a write hold of the read-write lock {:?} taken through this locker",
                        self.name
                    ),
                ),
                write,
            );
        }
        if !write.is_held() {
            let error = hold.lost_error();
            return refuse(error, write);
        }
        // Kept as the write was: its lease, its renewal, what is left of its
        // maximum hold time.
        let (ttl, renewal, hold_until) = hold.keeping().await;
        let max_hold = match hold_until {
            Some(end) => {
                let left = end.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    let error = hold.lost_error();
                    return refuse(error, write);
                }
                Some(left)
            }
            None => None,
        };
        let opts = LockOptions {
            owner: Some(write.owner().clone()),
            ttl,
            renewal,
            max_hold,
            ..self.locker.default_options()
        };
        let read = match self
            .locker
            .try_hold(&self.name, &opts, Primitive::Read)
            .await
        {
            Ok(Some(read)) => read,
            Ok(None) => {
                let name = self.name.clone();
                return refuse(Error::DowngradeRefused { name }, write);
            }
            Err(error) => return refuse(error, write),
        };
        match write.release().await {
            Ok(()) => {}
            Err(e @ Error::LockLost { .. }) => {
                tracing::warn!(lock = %self.name, error = %e, "downgrade: the write was found lost at its release: a writer of another owner may have got in before the read was taken");
            }
            Err(e) => {
                tracing::warn!(lock = %self.name, error = %e, "downgrade: the write's release failed; it ends with its lease");
            }
        }
        Ok(read)
    }

    /// Who holds the lock now, in token order: readers (`hold: Some(Read)`) or the
    /// writer (`Some(Write)`; with reads its owner took under it).
    ///
    /// # Errors
    /// As [`RwLock::read`].
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn holders(&self) -> Result<Vec<crate::LockInfo>> {
        self.locker.holders(&self.name, Primitive::Read).await
    }
}

/// A [`RwLock::downgrade`] that did not happen: why, and the write hold handed back as
/// it was (still held unless the error says it was lost).
#[derive(Debug)]
pub struct NotDowngraded {
    /// Why.
    pub error: Error,
    /// The write hold, unchanged.
    pub write: LockGuard,
}

impl std::fmt::Display for NotDowngraded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for NotDowngraded {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<NotDowngraded> for Error {
    /// The error alone: the write hold drops, and is released in the background.
    fn from(n: NotDowngraded) -> Error {
        n.error
    }
}
