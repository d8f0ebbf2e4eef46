//! `sqlite:///path.db`: the embedded default. No server; processes on one machine
//! exclude each other through one database file.
//!
//! # Layout
//! See [`SCHEMA`]. One lease row per name in `dlock_locks` (owner, hold count, fencing
//! token, expiry, metadata). Release drops the hold count to 0 and keeps the row, so
//! the row's token counts on: every grant gets the previous token + 1, in the same
//! statement that grants it, committed before the grant is reported. Rows dead for a
//! day are collected after folding their tokens into a floor row in `dlock_counters`
//! that new rows start above. Only an open that finds the file's last collection (row
//! `collected` there) an hour old, missing or an hour ahead (the clock went back)
//! collects, and only if it can take the write lock at once (else a later open does);
//! its scan for dead rows holds other writers off meanwhile. Every other open makes one
//! read (its tables in `sqlite_master` and the stamp, in one statement), and none of
//! dlock's tables is scanned. `dlock_queue` holds fair-mode waiters, each entry expiring
//! [`LockOptions::queue_entry_ttl`](crate::LockOptions::queue_entry_ttl) after its
//! waiter's last refresh: a waiter that dies holds up the queue at most that long.
//!
//! # Semaphores and read-write locks
//! `dlock_shared` keeps one row per held permit, read or write — and per waiting writer
//! — keyed by name, family (`semaphore`/`rwlock`) and the acquisition, with its lease
//! (same clocks as a lock's). An attempt is one `BEGIN IMMEDIATE` transaction that
//! deletes the name's dead rows, reads the live ones and writes what the rule of
//! [`Locker::rwlock`](crate::Locker::rwlock) / [`Locker::semaphore`](crate::Locker::semaphore)
//! allows. Tokens come from one counter (`dlock_counters`, row `shared`): durable and
//! strictly increasing per semaphore and read-write lock.
//!
//! # Time
//! Expiry is kept on `CLOCK_MONOTONIC` together with the kernel's boot id, so a jump of
//! the wall clock changes nothing. It is the clock the holder's own deadline runs on
//! (tokio's `Instant`): both stop during a suspend, so a lease never ends on one clock
//! while the holder's deadline still lies ahead on the other. A row written under
//! another boot id (the machine rebooted) is judged by its wall-clock expiry instead.
//! A process that cannot read the boot id (`/proc/sys/kernel/random/boot_id`, hidden
//! e.g. by systemd's `ProcSubset=pid`) logs a warning and writes `unknown-boot`: the
//! processes that can read it judge its rows by the wall clock (a step of it forward
//! may end such a lease early, before its holder's deadline), and it theirs; and rows
//! such processes leave in a crash count as live after a reboot for up to the last
//! boot's uptime (`dlock break` frees them). Give every process on the file the boot id.
//!
//! # Writes
//! An unfair acquisition and a release are one autocommitted statement each; fair
//! acquisitions and queue changes are short `BEGIN IMMEDIATE` transactions (WAL mode).
//! With `synchronous=full` (the default) every commit that grants a token is fsynced
//! (the statement or transaction sets the level itself); a release and a batch of
//! renewals are not: they
//! are in the WAL, seen by every process, when they return, and only a power loss
//! could undo them — which leaves a lock taken until its lease ends and never moves a
//! token (the next grant's fsync makes them durable too).
//! Closing a connection never checkpoints the WAL (`SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE`):
//! for a short-lived process such as `dlock run`, the last connection's checkpoint on
//! the way out cost two syncs and made the next process create the WAL again. The WAL
//! is checkpointed as it grows instead (the `wal_autocheckpoint` option: SQLite's
//! 1,000 pages by default), and the next process to open the file reads what it holds.
//! A process that opens the file while no other has it open rebuilds SQLite's WAL
//! index from the whole WAL, so short-lived processes want a short one
//! ([`SHORT_LIVED_WAL_PAGES`]): `dlock run`, `status`, `list`, `break` and `leader` use
//! it unless the URL says otherwise, while a long-lived process, which pays for the
//! rebuild once, keeps the default (each checkpoint is paid by the commit that
//! triggers it).
//! Renewals are batched: those waiting when the writer connection is free (up to 256)
//! are one transaction, so one commit (one fsync) renews many leases. SQLite's busy
//! handler is switched off and dlock retries `SQLITE_BUSY` itself after 50–500 µs,
//! which hands the write lock over much faster than SQLite's own 1, 2, 5, 10 … ms
//! back-off.
//!
//! # Waiting
//! A release from this process wakes one of its waiters of that name at once (one
//! attempt, not a stampede of every waiter on one row); releases by other processes
//! are noticed by polling every `poll` (default 10 ms, jittered 50–100 %), by one
//! waiter per name and kind of hold in this process, while the others wait `poll`
//! times their number (see `notify::WakeOne`). A thousand waiters of one name then
//! cost one poll per interval, not a thousand. Fair-mode waiters, writers (who queue)
//! and readers are all woken by a release, and each polls: the queue's head, or every
//! reader, may go.
//!
//! # URL
//! `sqlite:///abs/path.db`, `sqlite://rel/path.db`, `sqlite::memory:` (one process).
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `synchronous` | `full` | `normal` can lose the last commits on power loss, so fencing drops to best effort |
//! | `poll` | `10ms` | waiting for other processes (jittered 50–100 %) |
//! | `wal_autocheckpoint` | `1000` | WAL pages at which a commit checkpoints it, 1 to 100,000 (never off: connections do not checkpoint on close; see # Writes) |
//! | `lock_delay` | none | a lease that ran out without a release keeps the lock from other owners this much longer (Chubby's lock-delay; at most 1 h). A clean release frees it at once. It narrows the window in which a paused holder and the next one work at once; only fencing closes it |
//!
//! A lock between processes on one machine: a database file on a network file system
//! shared by several machines is not supported. Fairness across processes exists only
//! in `fair` mode (a queue table with expiring entries).

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Connection, Sqlite, SqlitePool};
// Its `rollback`, for `mend_after_failure` (sqlx does not re-export the trait).
use sqlx_core::transaction::TransactionManager as _;
use tokio::sync::watch;

use crate::backend::{
    AcquireRequest, AcquisitionId, Attempt, Backend, Capabilities, Fencing, HeldLock, LockInfo,
    Primitive, Primitives, Waiter,
};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::{ChangeHub, WakeOne, WakeWatch, wait_change};
use crate::options::{Metadata, Owner};
use crate::url::ConnectUrl;

mod clock;
mod renewer;
mod shared;
mod statements;

use clock::{Now, read_boot_id};
use renewer::{Lease, Renewer};
use shared::SharedHold;
pub use statements::SCHEMA;
use statements::{Hold, Outcome, SyncLevel, Upkeep};

/// Give up retrying a busy database after this long.
const BUSY_LIMIT: Duration = Duration::from_secs(30);

fn db_err(e: &sqlx::Error) -> Error {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => {
            Error::connection("sqlite", e)
        }
        _ => Error::backend("sqlite", e),
    }
}

/// dlock's own back-off while the database is busy: a jittered pause that doubles from
/// `first` up to `cap`, for at most [`BUSY_LIMIT`] in all.
struct BusyBackoff {
    started: tokio::time::Instant,
    pause: Duration,
    cap: Duration,
}

impl BusyBackoff {
    fn new(first: Duration, cap: Duration) -> Self {
        BusyBackoff {
            started: tokio::time::Instant::now(),
            pause: first,
            cap,
        }
    }

    /// Pause and return `true` if `e` is SQLITE_BUSY and time is left; else `false`.
    async fn retry(&mut self, e: &sqlx::Error) -> bool {
        if !is_busy(e) || self.started.elapsed() >= BUSY_LIMIT {
            return false;
        }
        let us = u64::try_from(self.pause.as_micros()).unwrap_or(u64::MAX);
        tokio::time::sleep(Duration::from_micros(fastrand::u64(us / 2..=us))).await;
        self.pause = (self.pause * 2).min(self.cap);
        true
    }
}

fn is_busy(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|c| matches!(c & 0xff, 5 | 6)),
        _ => false,
    }
}

/// The operations the backend runs against the database.
#[derive(Debug)]
enum Op<'a> {
    Schema,
    Collect,
    Acquire {
        req: &'a AcquireRequest,
        metadata: &'a str,
        delay: Duration,
    },
    Release {
        hold: Hold<'a>,
    },
    LeaveQueue {
        name: &'a str,
        entry: &'a str,
    },
    AcquireShared {
        req: &'a AcquireRequest,
        metadata: &'a str,
    },
    ReleaseShared {
        hold: SharedHold<'a>,
    },
    LeaveShared {
        req: &'a AcquireRequest,
    },
    /// `dlock break`: free `name` if its holder still has `fence`.
    Break {
        name: &'a str,
        fence: i64,
    },
}

/// What an operation returned.
#[derive(Debug)]
enum Done {
    Nothing,
    Acquired(Outcome),
    /// Whether a break found the hold it was asked to free.
    Broke(bool),
    /// Whether a lock's release found its hold (not broken, nor expired and taken).
    Released(bool),
}

impl Op<'_> {
    /// Whether the operation needs a `BEGIN IMMEDIATE` transaction (several writes that
    /// must be atomic); single statements autocommit.
    fn needs_transaction(&self) -> bool {
        match self {
            Op::Schema | Op::Collect | Op::LeaveQueue { .. } | Op::AcquireShared { .. } => true,
            Op::Acquire { req, .. } => req.fair,
            Op::Release { .. }
            | Op::ReleaseShared { .. }
            | Op::LeaveShared { .. }
            | Op::Break { .. } => false,
        }
    }

    /// `level`: how a commit that grants reaches the disk.
    async fn run(
        &self,
        conn: &mut SqliteConnection,
        now: &Now,
        level: SyncLevel,
    ) -> sqlx::Result<Done> {
        Ok(match self {
            Op::Schema => {
                statements::create_schema(conn, now).await?;
                Done::Nothing
            }
            Op::Collect => {
                statements::collect(conn, now).await?;
                Done::Nothing
            }
            Op::Acquire {
                req,
                metadata,
                delay,
            } if req.fair => {
                Done::Acquired(statements::acquire_fair(conn, req, now, metadata, *delay).await?)
            }
            Op::Acquire {
                req,
                metadata,
                delay,
            } => {
                Done::Acquired(statements::acquire(conn, req, now, metadata, *delay, level).await?)
            }
            Op::Release { hold } => Done::Released(statements::release(conn, hold).await?),
            Op::LeaveQueue { name, entry } => {
                statements::leave_queue(conn, name, entry).await?;
                Done::Nothing
            }
            Op::AcquireShared { req, metadata } => {
                Done::Acquired(shared::acquire(conn, req, now, metadata).await?)
            }
            Op::ReleaseShared { hold } => {
                shared::release(conn, hold).await?;
                Done::Nothing
            }
            Op::LeaveShared { req } => {
                shared::leave(conn, req).await?;
                Done::Nothing
            }
            Op::Break { name, fence } => {
                Done::Broke(statements::break_hold(conn, name, *fence).await?)
            }
        })
    }
}

#[derive(Debug)]
struct Inner {
    writer: SqlitePool,
    /// Renews every held lease of this backend, many in one commit.
    renewer: Renewer,
    reader: SqlitePool,
    boot_id: Arc<str>,
    /// Fair-mode waiters, writers and readers: every one is woken by a release.
    changes: ChangeHub,
    /// The other waiters: one is woken by a release.
    waiters: Arc<WakeOne<LockName>>,
    poll: Duration,
    durable: bool,
    cross_process: bool,
    /// A lease that ran out without a release blocks others this much longer.
    lock_delay: Duration,
}

/// The largest `wal_autocheckpoint` accepted (about 400 MB of WAL).
const MAX_CHECKPOINT_PAGES: u32 = 100_000;

/// The `wal_autocheckpoint` for a process that opens the file for one lock and exits,
/// as `dlock run` does (see # Writes): at SQLite's 1,000 pages each such process could
/// read 4 MB of WAL on opening; at 64 a few hundred kB, for a checkpoint every few
/// dozen runs.
pub const SHORT_LIVED_WAL_PAGES: u32 = 64;

/// The SQLite backend.
#[derive(Debug)]
pub struct SqliteBackend {
    inner: Arc<Inner>,
}

impl SqliteBackend {
    pub(crate) async fn open(mut url: ConnectUrl) -> Result<Arc<Self>> {
        let durable = match url.take_param("synchronous").as_deref() {
            None | Some("full") => true,
            Some("normal") => false,
            Some(other) => {
                return Err(url.invalid(&format!("synchronous={other:?}: expected full or normal")));
            }
        };
        let poll = match url.take_param("poll") {
            Some(p) => {
                let d = crate::options::parse_duration("poll", &p)?;
                if d < Duration::from_millis(1) || d > Duration::from_secs(10) {
                    return Err(url.invalid("poll must be between 1ms and 10s"));
                }
                d
            }
            None => Duration::from_millis(10),
        };
        // Unset, SQLite's own default (1,000 pages) applies.
        let checkpoint_pages = url.take_count("wal_autocheckpoint", 1..=MAX_CHECKPOINT_PAGES)?;
        let lock_delay = url.take_lock_delay()?;
        url.finish(&["synchronous", "poll", "lock_delay", "wal_autocheckpoint"])?;
        let body = url.body();
        let target = crate::url::percent_decode(body)
            .ok_or_else(|| url.invalid("bad percent-encoding in path"))?;
        let in_memory = target == ":memory:";
        if target.is_empty() {
            return Err(url.invalid("missing database path (sqlite:///abs/path.db)"));
        }
        let mut opts = if in_memory {
            SqliteConnectOptions::from_str("sqlite::memory:").map_err(|e| db_err(&e))?
        } else {
            SqliteConnectOptions::new()
                .filename(PathBuf::from(&target))
                .create_if_missing(true)
        };
        opts = opts
            .journal_mode(if in_memory {
                SqliteJournalMode::Memory
            } else {
                SqliteJournalMode::Wal
            })
            .synchronous(if durable {
                SqliteSynchronous::Full
            } else {
                SqliteSynchronous::Normal
            })
            .busy_timeout(Duration::from_secs(10));
        if let Some(pages) = checkpoint_pages {
            opts = opts.pragma("wal_autocheckpoint", pages.to_string());
        }
        // All writes of this process go through one connection: SQLite admits one
        // writer at a time anyway, and a connection that did not write last must
        // revalidate its page cache (measured here: ~100 µs more per statement when
        // writes alternate between pooled connections). Reads (inspect, the busy
        // pre-check) use a second pool so they never queue behind a write. An in-memory
        // database exists per connection, so there both are the same single connection.
        let writer = Self::pool(opts.clone(), 1, in_memory, true, &target).await?;
        let reader = if in_memory {
            writer.clone()
        } else {
            Self::pool(opts, 2, false, false, &target).await?
        };
        let boot_id = read_boot_id();
        let inner = Arc::new(Inner {
            renewer: Renewer::start(writer.clone(), boot_id.clone(), !in_memory),
            writer,
            reader,
            boot_id,
            changes: ChangeHub::default(),
            waiters: Arc::new(WakeOne::default()),
            poll,
            durable,
            cross_process: !in_memory,
            lock_delay,
        });
        match inner.upkeep_due().await? {
            Upkeep::Nothing => {}
            Upkeep::CreateSchema => {
                inner.run(Op::Schema).await?;
            }
            Upkeep::Collect => {
                // Best effort: a busy file (a long write elsewhere), a read-only one or
                // a full disk must not keep this process from its locks; the stamp
                // stays old, so a later open tries again.
                match inner.run_once(Op::Collect).await {
                    Ok(_) => {}
                    Err(e) if is_busy(&e) => {
                        tracing::debug!("sqlite: collecting dead rows deferred: the file is busy");
                    }
                    Err(e) => {
                        let e = db_err(&e);
                        tracing::warn!(error = %e, "sqlite: cannot collect dead rows (a later open tries again)");
                    }
                }
            }
        }
        Ok(Arc::new(SqliteBackend { inner }))
    }

    /// The pool of `size` connections. The writer's one connection opens now (so a bad
    /// path fails here); readers open on first use, so a process that only takes and
    /// releases locks never opens a second connection (and its worker thread).
    async fn pool(
        opts: SqliteConnectOptions,
        size: u32,
        in_memory: bool,
        writer: bool,
        target: &str,
    ) -> Result<SqlitePool> {
        let options = SqlitePoolOptions::new()
            .max_connections(size)
            .min_connections(u32::from(in_memory))
            .idle_timeout(if in_memory {
                None
            } else {
                Some(Duration::from_secs(60))
            })
            .max_lifetime(None)
            .acquire_timeout(Duration::from_secs(30))
            // A local file needs no liveness ping before every use.
            .test_before_acquire(false)
            .acquire_slow_level(crate::telemetry::POOL_WAIT_LOG);
        let options = if in_memory {
            options
        } else {
            options.after_connect(|conn, _| Box::pin(no_checkpoint_on_close(conn)))
        };
        if !writer {
            // Readers keep SQLite's busy handler (a WAL read is rarely busy, but can be
            // while another process opens or checkpoints the file).
            return Ok(options.connect_lazy_with(opts));
        }
        // The writer retries SQLITE_BUSY itself, with much shorter sleeps.
        let opts = opts.busy_timeout(Duration::ZERO);
        // Opening can meet SQLITE_BUSY outside the busy handler's reach (another
        // process creating the file or switching it to WAL at the same moment): retry.
        let mut backoff = BusyBackoff::new(Duration::from_millis(10), Duration::from_millis(25));
        loop {
            match options.clone().connect_with(opts.clone()).await {
                Err(e) if backoff.retry(&e).await => {}
                other => {
                    return other.map_err(|e| {
                        Error::connection("sqlite", format!("cannot open {target:?}: {e}"))
                    });
                }
            }
        }
    }
}

/// After a transaction failed for good on `conn`. SQLite rolls a whole transaction back
/// itself on some errors (a full disk, an I/O error); sqlx's `ROLLBACK` then fails, and
/// it goes on counting a transaction that is gone, refusing every later `BEGIN` on this
/// — the process's only — writing connection. The count is mended in a task of its own,
/// which holds the connection until then (the next operation waits for it) and which a
/// caller that gives up cannot cancel. (A caller cancelled inside such a transaction
/// spawns no mend: the next transaction then fails once, and mends.) Should mending
/// fail, a file's connection is closed (the pool opens another); an in-memory
/// database's is kept, since the database and every hold in it live only as long as it.
fn mend_after_failure(mut conn: PoolConnection<Sqlite>, file: bool) {
    tokio::spawn(async move {
        // Queued behind the rollback the failed transaction left: that has run now.
        if conn.ping().await.is_err() || !conn.is_in_transaction() {
            return;
        }
        let mended = async {
            // sqlx counts a transaction: when SQLite has none, give it one, so that
            // sqlx's rollback succeeds and its count comes back to 0.
            if in_autocommit(&mut conn).await? {
                sqlx::raw_sql("BEGIN").execute(&mut *conn).await?;
            }
            <Sqlite as sqlx::Database>::TransactionManager::rollback(&mut conn).await
        }
        .await;
        if let Err(e) = mended {
            tracing::warn!(error = %e, "sqlite: cannot mend the writing connection after a failed transaction");
            if file {
                conn.close_on_drop();
            }
        }
    });
}

/// Whether SQLite has no transaction open on `conn`.
async fn in_autocommit(conn: &mut SqliteConnection) -> sqlx::Result<bool> {
    let mut handle = conn.lock_handle().await?;
    let db = handle.as_raw_handle().as_ptr();
    // SAFETY: `db` is this connection's open handle, held locked for the call.
    Ok(unsafe { libsqlite3_sys::sqlite3_get_autocommit(db) } != 0)
}

/// Keep `conn`'s close from checkpointing the WAL (module docs, # Writes).
async fn no_checkpoint_on_close(conn: &mut SqliteConnection) -> sqlx::Result<()> {
    let mut handle = conn.lock_handle().await?;
    let db = handle.as_raw_handle().as_ptr();
    // SAFETY: `db` is this connection's open handle, held locked for the call;
    // SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE takes an int (1: on) and an int pointer for the
    // new setting, which may be null.
    let rc = unsafe {
        libsqlite3_sys::sqlite3_db_config(
            db,
            libsqlite3_sys::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
            1 as std::ffi::c_int,
            std::ptr::null_mut::<std::ffi::c_int>(),
        )
    };
    if rc == libsqlite3_sys::SQLITE_OK {
        Ok(())
    } else {
        Err(sqlx::Error::Configuration(
            format!("sqlite3_db_config(NO_CKPT_ON_CLOSE) returned {rc}").into(),
        ))
    }
}

impl Inner {
    /// Tell this process's waiters of `name` that a hold of it went: one of those
    /// woken one at a time, and every fair-mode waiter, writer and reader.
    fn released(&self, name: &LockName) {
        self.changes.notify(name);
        self.waiters.wake(name);
    }

    fn now(&self) -> Now {
        Now::read(&self.boot_id)
    }

    /// How a commit that grants reaches the disk: synced (`synchronous=full`, the
    /// default: durable tokens) or not (`synchronous=normal`).
    fn grant_level(&self) -> SyncLevel {
        if self.durable {
            SyncLevel::Full
        } else {
            SyncLevel::Normal
        }
    }

    /// Run `op` (in a `BEGIN IMMEDIATE` transaction when it needs one), retrying while
    /// the database is busy.
    async fn run(&self, op: Op<'_>) -> Result<Done> {
        let mut conn = self.writer.acquire().await.map_err(|e| db_err(&e))?;
        let mut backoff = BusyBackoff::new(Duration::from_micros(50), Duration::from_micros(500));
        loop {
            match self.attempt(&mut conn, &op).await {
                Ok(done) => return Ok(done),
                Err(e) if backoff.retry(&e).await => {}
                Err(e) => {
                    if op.needs_transaction() {
                        mend_after_failure(conn, self.cross_process);
                    }
                    return Err(db_err(&e));
                }
            }
        }
    }

    /// Run `op` once: a busy database is an error, not waited for.
    async fn run_once(&self, op: Op<'_>) -> sqlx::Result<Done> {
        let mut conn = self.writer.acquire().await?;
        let done = self.attempt(&mut conn, &op).await;
        if done.is_err() && op.needs_transaction() {
            mend_after_failure(conn, self.cross_process);
        }
        done
    }

    /// One try of `op` (in a `BEGIN IMMEDIATE` transaction when it needs one).
    async fn attempt(&self, conn: &mut SqliteConnection, op: &Op<'_>) -> sqlx::Result<Done> {
        if op.needs_transaction() {
            let mut tx = conn.begin_with(self.grant_level().begin()).await?;
            let done = op.run(&mut tx, &self.now(), self.grant_level()).await?;
            tx.commit().await?;
            Ok(done)
        } else {
            op.run(conn, &self.now(), self.grant_level()).await
        }
    }

    /// What opening must do (reads on the writer's connection, so a process that only
    /// takes a lock never opens a reader).
    async fn upkeep_due(&self) -> Result<Upkeep> {
        let mut conn = self.writer.acquire().await.map_err(|e| db_err(&e))?;
        let mut backoff = BusyBackoff::new(Duration::from_micros(50), Duration::from_micros(500));
        loop {
            match statements::upkeep_due(&mut conn, &self.now()).await {
                Ok(due) => return Ok(due),
                Err(e) if backoff.retry(&e).await => {}
                Err(e) => return Err(db_err(&e)),
            }
        }
    }

    /// Renew `lease` (batched with whatever other renewals are waiting: [`renewer`]);
    /// [`Error::NotOwner`] when it found no live hold.
    async fn renewed(&self, lease: Lease, ttl: Duration, name: &LockName) -> Result<()> {
        if self.renewer.renew(lease, ttl).await? {
            Ok(())
        } else {
            Err(Error::NotOwner {
                name: name.as_str().to_owned(),
            })
        }
    }

    /// Run a release once (a failed one may be tried again) and wake this process's
    /// waiters of `name`; [`Error::NotOwner`] when it found the hold gone.
    async fn release_once(&self, released: &AtomicBool, op: Op<'_>, name: &LockName) -> Result<()> {
        if released.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        match self.run(op).await {
            Ok(Done::Released(false)) => {
                // Broken perhaps: free then, and a waiter here looks.
                self.released(name);
                Err(Error::NotOwner {
                    name: name.as_str().to_owned(),
                })
            }
            Ok(_) => {
                self.released(name);
                Ok(())
            }
            Err(e) => {
                released.store(false, Ordering::SeqCst);
                Err(e)
            }
        }
    }

    /// Read a lock row (WAL readers never wait for writers).
    async fn read(&self, name: &str) -> Result<(Now, Option<statements::LockRow>)> {
        let now = self.now();
        let mut conn = self.reader.acquire().await.map_err(|e| db_err(&e))?;
        let row = statements::read_lock(&mut conn, name, &now)
            .await
            .map_err(|e| db_err(&e))?;
        Ok((now, row))
    }
}

#[async_trait]
impl Backend for SqliteBackend {
    fn scheme(&self) -> &'static str {
        "sqlite"
    }

    fn capabilities(&self) -> Capabilities {
        caps(self.inner.durable, self.inner.cross_process)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        if req.primitive != Primitive::Lock {
            return self.try_shared(req).await;
        }
        let inner = &self.inner;
        // After a busy first attempt, read first: a lock plainly held by someone else
        // needs no write unless a queue place must be taken or refreshed.
        if req.attempt > 0 && req.enqueue.is_none() {
            let (_, row) = inner.read(req.name.as_str()).await?;
            if let Some(row) = row
                && row.owner != req.owner.as_str()
                && let blocked = statements::blocked_ms(&row, inner.lock_delay)
                && blocked > 0
            {
                return Ok(Attempt::Busy {
                    retry_after: Some(Duration::from_millis(u64::try_from(blocked).unwrap_or(0))),
                });
            }
        }
        let metadata = req.metadata.to_json().into_owned();
        let done = inner
            .run(Op::Acquire {
                req,
                metadata: &metadata,
                delay: inner.lock_delay,
            })
            .await?;
        Ok(match done {
            Done::Acquired(Outcome::Granted(fence)) => Attempt::Acquired(Box::new(SqliteHeld {
                inner: Arc::clone(inner),
                name: req.name.clone(),
                owner: req.owner.clone(),
                fence: i64::try_from(fence).unwrap_or(i64::MAX),
                released: AtomicBool::new(false),
            })),
            Done::Acquired(Outcome::Busy(retry_after)) => Attempt::Busy { retry_after },
            other => {
                return Err(Error::backend(
                    "sqlite",
                    format!("unexpected outcome {other:?}"),
                ));
            }
        })
    }

    async fn subscribe(&self, req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        let wake = match req.primitive {
            Primitive::Lock if req.enqueue.is_none() => {
                Wake::One(self.inner.waiters.watch(&req.name, 0))
            }
            Primitive::Permit { .. } if req.enqueue.is_none() => {
                Wake::One(self.inner.waiters.watch(&req.name, 1))
            }
            // A queue's head must go, whichever waiter it is (fair mode; a waiting
            // writer always queues), and every reader may go.
            _ => Wake::Every(self.inner.changes.subscribe(&req.name)),
        };
        Ok(Box::new(SqliteWaiter {
            wake,
            poll: self.inner.poll,
        }))
    }

    async fn leave_queue(&self, req: &AcquireRequest) -> Result<()> {
        if req.enqueue.is_none() {
            return Ok(());
        }
        if req.primitive != Primitive::Lock {
            self.inner.run(Op::LeaveShared { req }).await?;
            self.inner.released(&req.name);
            return Ok(());
        }
        let entry = statements::queue_entry(req);
        self.inner
            .run(Op::LeaveQueue {
                name: req.name.as_str(),
                entry: &entry,
            })
            .await?;
        self.inner.released(&req.name);
        Ok(())
    }

    async fn break_lock(&self, name: &LockName, fence: u64) -> Result<bool> {
        let fence = i64::try_from(fence).unwrap_or(i64::MAX);
        // Through `run`, which waits out another process's write (the writer's own busy
        // timeout is 0): `dlock break` must not fail because the file is busy.
        let op = Op::Break {
            name: name.as_str(),
            fence,
        };
        let broke = matches!(self.inner.run(op).await?, Done::Broke(true));
        if broke {
            self.inner.released(name);
        }
        Ok(broke)
    }

    async fn holders(&self, name: &LockName, primitive: Primitive) -> Result<Vec<LockInfo>> {
        let now = self.inner.now();
        let mut conn = self.inner.reader.acquire().await.map_err(|e| db_err(&e))?;
        let rows = shared::holders(
            &mut conn,
            name.as_str(),
            crate::shared_holds::family(primitive),
            &now,
        )
        .await
        .map_err(|e| db_err(&e))?;
        Ok(rows
            .into_iter()
            .map(|(kind, owner, fence, left, metadata)| {
                crate::shared_holds::holder_info(
                    name,
                    kind,
                    owner,
                    u64::try_from(fence).unwrap_or(0),
                    Some(Duration::from_millis(u64::try_from(left).unwrap_or(0))),
                    serde_json::from_str::<Metadata>(&metadata).unwrap_or_default(),
                )
            })
            .collect())
    }

    async fn names(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let mut conn = self.inner.reader.acquire().await.map_err(|e| db_err(&e))?;
        statements::names(&mut conn, prefix, limit)
            .await
            .map_err(|e| db_err(&e))
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let (now, row) = self.inner.read(name.as_str()).await?;
        let Some(row) = row.filter(|r| r.remaining_ms > 0) else {
            return Ok(None);
        };
        let mut conn = self.inner.reader.acquire().await.map_err(|e| db_err(&e))?;
        let waiters = statements::count_queue(&mut conn, name.as_str(), &now)
            .await
            .map_err(|e| db_err(&e))?;
        Ok(Some(LockInfo {
            name: name.as_str().to_owned(),
            owner: row.owner,
            holds: u32::try_from(row.holds).unwrap_or(u32::MAX),
            fencing_token: u64::try_from(row.fence).unwrap_or(0),
            remaining: Some(Duration::from_millis(
                u64::try_from(row.remaining_ms).unwrap_or(0),
            )),
            metadata: serde_json::from_str::<Metadata>(&row.metadata).unwrap_or_default(),
            waiters: Some(usize::try_from(waiters).unwrap_or(0)),
            hold: None,
        }))
    }
}

#[derive(Debug)]
struct SqliteWaiter {
    wake: Wake,
    poll: Duration,
}

/// How a waiter learns of a release in this process.
#[derive(Debug)]
enum Wake {
    /// Woken with every other such waiter of the name; polls every `poll`.
    Every(watch::Receiver<u64>),
    /// One waiter per release; polls every `poll` when it is the name's poller, else
    /// every `poll` times the name's waiters.
    One(WakeWatch<LockName>),
}

#[async_trait]
impl Waiter for SqliteWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        let every = match &mut self.wake {
            Wake::Every(_) => self.poll,
            Wake::One(watch) => watch.poll_every(self.poll),
        };
        let cap = u64::try_from(every.min(max).as_micros()).unwrap_or(u64::MAX);
        let sleep = Duration::from_micros(cap / 2 + fastrand::u64(0..=cap / 2));
        match &mut self.wake {
            Wake::Every(rx) => wait_change(rx, sleep).await,
            Wake::One(watch) => watch.wait(sleep).await,
        }
        Ok(())
    }
}

#[derive(Debug)]
struct SqliteHeld {
    inner: Arc<Inner>,
    name: LockName,
    owner: Owner,
    fence: i64,
    released: AtomicBool,
}

impl SqliteHeld {
    fn hold(&self) -> Hold<'_> {
        Hold {
            name: self.name.as_str(),
            owner: self.owner.as_str(),
            fence: self.fence,
        }
    }
}

#[async_trait]
impl HeldLock for SqliteHeld {
    fn fencing_token(&self) -> u64 {
        u64::try_from(self.fence).unwrap_or(0)
    }

    fn renews_in_batches(&self) -> bool {
        true
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let lease = Lease::Lock {
            name: self.name.clone(),
            owner: self.owner.clone(),
            fence: self.fence,
        };
        self.inner.renewed(lease, ttl, &self.name).await
    }

    async fn release(&self) -> Result<()> {
        // Wakes this process's waiters (spuriously when a reentrant hold remains:
        // they simply try again).
        let op = Op::Release { hold: self.hold() };
        self.inner
            .release_once(&self.released, op, &self.name)
            .await
    }

    fn keeps_lock_delay(&self) -> bool {
        !self.inner.lock_delay.is_zero()
    }
}

impl SqliteBackend {
    /// An attempt at a permit, read or write ([`shared`]).
    async fn try_shared(&self, req: &AcquireRequest) -> Result<Attempt> {
        let metadata = req.metadata.to_json().into_owned();
        let done = self
            .inner
            .run(Op::AcquireShared {
                req,
                metadata: &metadata,
            })
            .await?;
        Ok(match done {
            Done::Acquired(Outcome::Granted(fence)) => {
                Attempt::Acquired(Box::new(SqliteSharedHeld {
                    inner: Arc::clone(&self.inner),
                    name: req.name.clone(),
                    family: crate::shared_holds::family(req.primitive),
                    owner: req.owner.clone(),
                    acquisition: req.acquisition,
                    fence: i64::try_from(fence).unwrap_or(i64::MAX),
                    released: AtomicBool::new(false),
                }))
            }
            Done::Acquired(Outcome::Busy(retry_after)) => Attempt::Busy { retry_after },
            Done::Acquired(Outcome::Refused) => {
                return Err(Error::UpgradeRefused {
                    name: req.name.as_str().to_owned(),
                });
            }
            other => {
                return Err(Error::backend(
                    "sqlite",
                    format!("unexpected outcome {other:?}"),
                ));
            }
        })
    }
}

/// One held permit, read or write.
#[derive(Debug)]
struct SqliteSharedHeld {
    inner: Arc<Inner>,
    name: LockName,
    family: &'static str,
    owner: Owner,
    acquisition: AcquisitionId,
    fence: i64,
    released: AtomicBool,
}

impl SqliteSharedHeld {
    fn hold(&self) -> SharedHold<'_> {
        SharedHold {
            name: self.name.as_str(),
            family: self.family,
            owner: self.owner.as_str(),
            acquisition: self.acquisition,
            fence: self.fence,
        }
    }
}

#[async_trait]
impl HeldLock for SqliteSharedHeld {
    fn fencing_token(&self) -> u64 {
        u64::try_from(self.fence).unwrap_or(0)
    }

    fn renews_in_batches(&self) -> bool {
        true
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let lease = Lease::Shared {
            name: self.name.clone(),
            family: self.family,
            owner: self.owner.clone(),
            acquisition: self.acquisition,
            fence: self.fence,
        };
        self.inner.renewed(lease, ttl, &self.name).await
    }

    async fn release(&self) -> Result<()> {
        let op = Op::ReleaseShared { hold: self.hold() };
        self.inner
            .release_once(&self.released, op, &self.name)
            .await
    }
}

/// What an SQLite backend guarantees: `durable` with `synchronous=full`, across
/// processes for a file (not for `sqlite::memory:`).
fn caps(durable: bool, cross_process: bool) -> Capabilities {
    Capabilities {
        fencing: if durable {
            Fencing::Durable
        } else {
            Fencing::BestEffort
        },
        fifo: true,
        native_wait: false,
        session_bound: false,
        reentrant: true,
        cross_process,
        max_ttl: None,
        queued_waiting: false,
        session_timeout: None,
        connection_loss_notice: None,
        release_reports_loss: true,
        primitives: Primitives::ALL,
    }
}

impl SqliteBackend {
    /// The capabilities of a database file opened with default options
    /// (`synchronous=full`, so `durable` holds unless the disk lies).
    pub(crate) fn capabilities_with(durable: bool) -> Capabilities {
        caps(durable, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(name: &str) -> AcquireRequest {
        let name = LockName::new(name).expect("name");
        AcquireRequest::plain(name, Owner::random(), Duration::from_secs(30))
    }

    /// A backend on the file `file` (with its URL query) in `dir`.
    async fn open_in(dir: &tempfile::TempDir, file: &str) -> Arc<SqliteBackend> {
        let url = format!("sqlite://{}/{file}", dir.path().display());
        SqliteBackend::open(ConnectUrl::parse(&url).expect("url"))
            .await
            .expect("open")
    }

    async fn grant(b: &SqliteBackend, name: &str) -> Box<dyn HeldLock> {
        match b.try_acquire(&request(name)).await.expect("acquire") {
            Attempt::Acquired(h) => h,
            Attempt::Busy { .. } => panic!("{name} busy"),
        }
    }

    /// `dlock break` waits out another process's write, as every other write does:
    /// the writer's own busy timeout is 0, and a break that found the file busy failed.
    #[tokio::test]
    async fn a_break_waits_out_another_writer() {
        use sqlx::ConnectOptions;
        let dir = tempfile::tempdir().expect("dir");
        let b = open_in(&dir, "b.db").await;
        let held = grant(&b, "n").await;
        let fence = held.fencing_token();
        // Another process's write transaction, committed 200 ms later.
        let mut other = SqliteConnectOptions::new()
            .filename(dir.path().join("b.db"))
            .connect()
            .await
            .expect("another connection");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .expect("begin");
        let commit = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            sqlx::query("COMMIT")
                .execute(&mut other)
                .await
                .expect("commit");
        });
        let name = LockName::new("n").expect("name");
        let broke = b.break_lock(&name, fence).await;
        assert!(matches!(broke, Ok(true)), "{broke:?}");
        commit.await.expect("committed");
        assert!(b.inspect(&name).await.expect("inspect").is_none());
    }

    /// The open's one read tells a missing schema whatever is missing: a table its
    /// statement names (it cannot even be prepared) or another one; a file that has
    /// them all needs nothing.
    #[tokio::test]
    async fn upkeep_finds_any_missing_table() {
        let dir = tempfile::tempdir().expect("dir");
        let b = open_in(&dir, "t.db").await;
        let upkeep = || async { b.inner.upkeep_due().await.expect("check") };
        assert_eq!(upkeep().await, Upkeep::Nothing);
        for (drop, then) in [
            (
                "DROP TABLE dlock_shared",
                "an older schema without dlock_shared",
            ),
            (
                "DROP TABLE dlock_counters",
                "a file without the table the read names",
            ),
        ] {
            sqlx::query(drop)
                .execute(&b.inner.writer)
                .await
                .expect("drop");
            assert_eq!(upkeep().await, Upkeep::CreateSchema, "{then}");
            b.inner.run(Op::Schema).await.expect("schema");
            // A stampless file's dead rows are looked for at once.
            let want = if drop.contains("counters") {
                Upkeep::Collect
            } else {
                Upkeep::Nothing
            };
            assert_eq!(upkeep().await, want, "after {then}");
        }
    }

    /// Closing the last connection leaves the WAL as it is (no checkpoint, no new files
    /// for the next process to create), where a plain connection's close checkpoints it
    /// and deletes it.
    #[tokio::test]
    async fn closing_never_checkpoints() {
        let dir = tempfile::tempdir().expect("dir");
        let wal = dir.path().join("c.db-wal");
        let b = open_in(&dir, "c.db").await;
        grant(&b, "n").await.release().await.expect("release");
        b.inner.writer.close().await;
        b.inner.reader.close().await;
        let left = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
        assert!(
            left > 0,
            "the WAL was checkpointed away on close ({left} bytes)"
        );
        // The control: sqlx's own connection, closed, takes the WAL with it.
        let url = format!("sqlite://{}/c.db", dir.path().display());
        let mut plain = SqliteConnection::connect(&url).await.expect("connect");
        sqlx::query("UPDATE dlock_locks SET holds = holds WHERE name = 'n'")
            .execute(&mut plain)
            .await
            .expect("write");
        plain.close().await.expect("close");
        assert!(!wal.exists(), "a plain close left the WAL");
    }

    /// A grant commits at `synchronous=FULL` whatever the statement before it left on
    /// the writer connection (a release lowers it to NORMAL for itself): unfair grants
    /// set the level in their own call, transactions (fair grants, permits) in their
    /// `BEGIN`.
    /// With `synchronous=normal` in the URL, grants stay at NORMAL.
    #[tokio::test]
    async fn grants_commit_synced_and_releases_do_not() {
        let dir = tempfile::tempdir().expect("dir");
        for (query, grants) in [("", 2), ("?synchronous=normal", 1)] {
            let url = format!("s{grants}.db{query}");
            let b = open_in(&dir, &url).await;
            let level = || async {
                sqlx::query_scalar::<_, i64>("PRAGMA synchronous")
                    .fetch_one(&b.inner.writer)
                    .await
                    .expect("level")
            };
            for round in 0..2 {
                let h = grant(&b, "x").await;
                assert_eq!(level().await, grants, "{url} round {round}: unfair grant");
                h.release().await.expect("release");
                assert_eq!(level().await, 1, "{url} round {round}: release");
                let mut fair = request("y");
                fair.fair = true;
                let Attempt::Acquired(h) = b.try_acquire(&fair).await.expect("acquire") else {
                    panic!("y busy");
                };
                assert_eq!(level().await, grants, "{url} round {round}: fair grant");
                h.release().await.expect("release");
                assert_eq!(level().await, 1, "{url} round {round}: release");
                let mut permit = request("s");
                permit.primitive = Primitive::Permit { permits: 3 };
                let Attempt::Acquired(h) = b.try_acquire(&permit).await.expect("acquire") else {
                    panic!("s busy");
                };
                assert_eq!(level().await, grants, "{url} round {round}: permit");
                h.release().await.expect("release");
                assert_eq!(level().await, 1, "{url} round {round}: permit's release");
            }
            // A release of a hold already gone drops nothing.
            let h = grant(&b, "z").await;
            let hold = statements::Hold {
                name: "z",
                owner: "someone else",
                fence: i64::try_from(h.fencing_token()).expect("fence"),
            };
            let mut conn = b.inner.writer.acquire().await.expect("writer");
            assert!(
                !statements::release(&mut conn, &hold)
                    .await
                    .expect("release"),
                "{url}: a release of another owner's hold said it dropped one"
            );
            drop(conn);
            assert!(
                matches!(
                    b.try_acquire(&request("z")).await.expect("acquire"),
                    Attempt::Busy { .. }
                ),
                "a release by another owner freed the lock"
            );
            h.release().await.expect("release");
        }
    }

    /// A grant or a release whose commit fails is an error, never a grant (or a
    /// release) that was rolled back: an autocommitted grant commits after its
    /// RETURNING row. The commit is made to fail by a deferred foreign key that a
    /// trigger on the locks table breaks (checked only at the commit), standing in for
    /// a full disk or an I/O error there.
    #[tokio::test]
    async fn a_write_whose_commit_fails_is_an_error() {
        let dir = tempfile::tempdir().expect("dir");
        let b = open_in(&dir, "f.db").await;
        let held = grant(&b, "held").await;
        sqlx::raw_sql(
            "CREATE TABLE t_parent (id INTEGER PRIMARY KEY);
             CREATE TABLE t_child (parent INTEGER REFERENCES t_parent (id)
                                   DEFERRABLE INITIALLY DEFERRED);
             CREATE TRIGGER t_fail_insert AFTER INSERT ON dlock_locks
                 BEGIN INSERT INTO t_child VALUES (42); END;
             CREATE TRIGGER t_fail_update AFTER UPDATE ON dlock_locks
                 BEGIN INSERT INTO t_child VALUES (42); END;",
        )
        .execute(&b.inner.writer)
        .await
        .expect("triggers");
        for name in ["new", "held"] {
            match b.try_acquire(&request(name)).await {
                Err(_) => {}
                Ok(Attempt::Acquired(h)) => panic!(
                    "{name}: a grant whose commit failed was reported (token {})",
                    h.fencing_token()
                ),
                Ok(Attempt::Busy { .. }) if name == "held" => {}
                Ok(Attempt::Busy { .. }) => panic!("{name}: busy"),
            }
        }
        let released = held.release().await;
        assert!(
            matches!(&released, Err(e) if !matches!(e, Error::LockLost { .. } | Error::NotOwner { .. })),
            "a release whose commit failed was reported as {released:?}"
        );
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT name, holds FROM dlock_locks")
            .fetch_all(&b.inner.reader)
            .await
            .expect("rows");
        assert_eq!(
            rows,
            vec![("held".to_owned(), 1)],
            "what the failed commits left"
        );
    }

    /// Collected rows fold their fence into the floor, so a name's tokens keep
    /// increasing after its row was collected.
    #[tokio::test]
    async fn tokens_survive_collection() {
        let dir = tempfile::tempdir().expect("dir");
        let b = open_in(&dir, "c.db").await;
        let mut last = 0;
        for _ in 0..3 {
            let h = grant(&b, "x").await;
            assert!(h.fencing_token() > last);
            last = h.fencing_token();
            h.release().await.expect("release");
        }
        // Age the row by two days, then collect.
        sqlx::query(
            "UPDATE dlock_locks SET expires_boot_ms = expires_boot_ms - 172800000, \
             expires_wall_ms = expires_wall_ms - 172800000",
        )
        .execute(&b.inner.writer)
        .await
        .expect("age");
        // Dead rows are looked for at most once an hour: the new file's stamp is recent.
        assert_eq!(b.inner.upkeep_due().await.expect("check"), Upkeep::Nothing);
        sqlx::query("UPDATE dlock_counters SET value = value - 3600000 WHERE name = 'collected'")
            .execute(&b.inner.writer)
            .await
            .expect("age the stamp");
        assert_eq!(b.inner.upkeep_due().await.expect("check"), Upkeep::Collect);
        b.inner.run(Op::Collect).await.expect("collect");
        assert_eq!(
            b.inner.upkeep_due().await.expect("check"),
            Upkeep::Nothing,
            "a collection did not stamp itself"
        );
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM dlock_locks")
            .fetch_one(&b.inner.reader)
            .await
            .expect("count");
        assert_eq!(rows, 0, "the dead row was not collected");
        let h = grant(&b, "x").await;
        assert!(
            h.fencing_token() > last,
            "token {} after {last}",
            h.fencing_token()
        );
        h.release().await.expect("release");
        // A collection found due by an open that another process's collection then
        // stamped (the two took the write lock in turn) does nothing.
        sqlx::query(
            "UPDATE dlock_locks SET expires_boot_ms = expires_boot_ms - 172800000, \
             expires_wall_ms = expires_wall_ms - 172800000",
        )
        .execute(&b.inner.writer)
        .await
        .expect("age");
        b.inner.run(Op::Collect).await.expect("collect");
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM dlock_locks")
            .fetch_one(&b.inner.reader)
            .await
            .expect("count");
        assert_eq!(rows, 1, "collected again within the hour");
    }

    /// Renews every hold of `held` (for 90 s) while `busy`, the writer's connection,
    /// keeps them all waiting, then lets them run: their outcomes, in order.
    async fn renew_behind(
        busy: sqlx::pool::PoolConnection<Sqlite>,
        held: &[Arc<Box<dyn HeldLock>>],
    ) -> Vec<Result<()>> {
        let tasks: Vec<_> = held
            .iter()
            .map(|h| {
                let h = h.clone();
                tokio::spawn(async move { h.renew(Duration::from_secs(90)).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(busy);
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.push(t.await.expect("task"));
        }
        outcomes
    }

    /// Renewals waiting together are one batch, and each answers for its own lease:
    /// one no longer held is refused while the others in its batch are extended.
    #[tokio::test]
    async fn waiting_renewals_are_one_batch_and_answer_each_for_itself() {
        let dir = tempfile::tempdir().expect("dir");
        let b = open_in(&dir, "r.db").await;
        let mut held = Vec::new();
        for i in 0..40 {
            held.push(Arc::new(grant(&b, &format!("n{i}")).await));
        }
        let expiries = || async {
            let mut all = Vec::new();
            for i in 0..40 {
                let ms: i64 =
                    sqlx::query_scalar("SELECT expires_boot_ms FROM dlock_locks WHERE name = ?1")
                        .bind(format!("n{i}"))
                        .fetch_one(&b.inner.reader)
                        .await
                        .expect("expiry");
                all.push(ms);
            }
            all
        };
        let before = expiries().await;
        // One lease is given back: its renewal must fail alone.
        held[7].release().await.expect("release");
        let batches = b.inner.renewer.batches();
        // With the writer connection busy, every renewal queues behind it.
        let busy = b.inner.writer.acquire().await.expect("writer");
        for (i, outcome) in renew_behind(busy, &held).await.into_iter().enumerate() {
            if i == 7 {
                assert!(
                    matches!(outcome, Err(Error::NotOwner { .. })),
                    "n7: {outcome:?}"
                );
            } else {
                outcome.unwrap_or_else(|e| panic!("n{i}: {e}"));
            }
        }
        assert_eq!(
            b.inner.renewer.batches() - batches,
            1,
            "40 waiting renewals in one batch"
        );
        let after = expiries().await;
        for i in 0..40 {
            if i == 7 {
                assert_eq!(after[i], before[i], "the released lease was renewed");
            } else {
                assert!(
                    after[i] >= before[i] + 50_000,
                    "n{i}: {} -> {}",
                    before[i],
                    after[i]
                );
            }
        }
        for (i, h) in held.iter().enumerate() {
            if i != 7 {
                h.release().await.expect("release");
            }
        }
    }

    /// A renewal batch whose transaction SQLite rolled back itself (here a trigger's
    /// `RAISE(ROLLBACK)`, as a full disk or an I/O error can) answers each of its
    /// requests with an error, and the writing connection is mended: the same
    /// connection (its temporary trigger still there) takes the next batch, which a
    /// connection still counting the lost transaction would refuse at its `BEGIN`.
    #[tokio::test]
    async fn a_renewal_batch_sqlite_rolled_back_leaves_the_writer_usable() {
        let dir = tempfile::tempdir().expect("dir");
        let b = open_in(&dir, "m.db").await;
        let held: Vec<Arc<Box<dyn HeldLock>>> = vec![
            Arc::new(grant(&b, "m1").await),
            Arc::new(grant(&b, "m2").await),
        ];
        let mut refusing = b.inner.writer.acquire().await.expect("writer");
        sqlx::raw_sql(
            "CREATE TEMP TABLE refuse (on_ INTEGER); INSERT INTO refuse VALUES (1); \
             CREATE TEMP TRIGGER refuse_renewals \
               BEFORE UPDATE ON main.dlock_locks WHEN (SELECT on_ FROM refuse) = 1 \
               BEGIN SELECT RAISE(ROLLBACK, 'refused by the test'); END",
        )
        .execute(&mut *refusing)
        .await
        .expect("trigger");
        // Both renewals queue behind the writer held here: one batch.
        let batch = |busy: sqlx::pool::PoolConnection<Sqlite>| {
            let (b, held) = (b.clone(), held.clone());
            async move {
                let before = b.inner.renewer.batches();
                let outcomes = renew_behind(busy, &held).await;
                assert_eq!(b.inner.renewer.batches() - before, 1, "not one batch");
                outcomes
            }
        };
        let refused = batch(refusing).await;
        for (i, outcome) in refused.iter().enumerate() {
            assert!(
                matches!(outcome, Err(Error::Backend { message, .. }) if message.contains("refused by the test")),
                "m{}: {outcome:?}",
                i + 1
            );
        }
        // Waits for the mend, which holds the connection until it is done. The same
        // connection, not a new one the pool opened: its temporary trigger is there.
        let mut writer = b.inner.writer.acquire().await.expect("writer");
        let triggers: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM sqlite_temp_master WHERE name = 'refuse_renewals'",
        )
        .fetch_one(&mut *writer)
        .await
        .expect("temp schema");
        assert_eq!(triggers, 1, "the writer's connection was replaced");
        sqlx::query("UPDATE temp.refuse SET on_ = 0")
            .execute(&mut *writer)
            .await
            .expect("stop refusing");
        // A batch refused at its `BEGIN` would still answer, one request at a time:
        // ask the connection itself.
        let tx = sqlx::Connection::begin_with(&mut *writer, "BEGIN IMMEDIATE")
            .await
            .expect("a transaction on the mended connection");
        tx.rollback().await.expect("rollback");
        let renewed = batch(writer).await;
        for (i, outcome) in renewed.iter().enumerate() {
            assert!(outcome.is_ok(), "m{} after the mend: {outcome:?}", i + 1);
        }
        for h in &held {
            h.release().await.expect("release");
        }
    }

    /// A transaction SQLite rolled back itself leaves the process's writing connection
    /// usable: sqlx would still count it as open and refuse every later `BEGIN` on it
    /// (fair locks, semaphores, read-write locks, renewal batches, collection). Here a
    /// permit's grant meets a full disk (the file's pages capped), which rolls its
    /// whole transaction back. In memory too, where the connection is the database:
    /// the hold taken before the failure still stands.
    #[tokio::test]
    async fn a_transaction_the_disk_refused_leaves_the_writer_usable() {
        let dir = tempfile::tempdir().expect("dir");
        let file = format!("sqlite://{}/f.db", dir.path().display());
        for url in [file.as_str(), "sqlite::memory:"] {
            let b = SqliteBackend::open(ConnectUrl::parse(url).expect("url"))
                .await
                .expect("open");
            let held = grant(&b, "held").await;
            let pages: i64 = sqlx::query_scalar("PRAGMA page_count")
                .fetch_one(&b.inner.writer)
                .await
                .expect("pages");
            // The writer pool's one connection: the cap is this connection's.
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "PRAGMA max_page_count = {pages}"
            )))
            .execute(&b.inner.writer)
            .await
            .expect("cap");
            let mut big = request("big");
            big.primitive = Primitive::Permit { permits: 3 };
            big.metadata = Arc::new(Metadata::this_process().with_note("x".repeat(200_000)));
            let refused = b.try_acquire(&big).await;
            assert!(
                matches!(&refused, Err(Error::Backend { message, .. }) if message.contains("full")),
                "{url}: {:?}",
                refused.map(|_| ())
            );
            let shared: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM dlock_shared")
                .fetch_one(&b.inner.writer)
                .await
                .expect("count");
            assert_eq!(shared, 0, "{url}: the refused permit was kept");
            // The same connection, mended (a fresh one would have no cap).
            let cap: i64 = sqlx::query_scalar("PRAGMA max_page_count")
                .fetch_one(&b.inner.writer)
                .await
                .expect("cap");
            assert_eq!(cap, pages, "{url}: the writer's connection was replaced");
            sqlx::query("PRAGMA max_page_count = 1073741823")
                .execute(&b.inner.writer)
                .await
                .expect("uncap");
            assert!(
                matches!(
                    b.try_acquire(&request("held")).await,
                    Ok(Attempt::Busy { .. })
                ),
                "{url}: the hold taken before the failure is gone"
            );
            let mut fair = request("small");
            fair.fair = true;
            let Attempt::Acquired(h) = b
                .try_acquire(&fair)
                .await
                .unwrap_or_else(|e| panic!("{url}: a fair grant after the full disk: {e}"))
            else {
                panic!("small busy");
            };
            h.release().await.expect("release");
            held.release().await.expect("release");
        }
    }

    /// An open collects when the stamp is due, never waits for a busy file to do it
    /// (a later open does), and a file without a stamp (from an older dlock, maybe
    /// with a table missing) is collected at its next open.
    #[tokio::test]
    async fn an_open_collects_when_due_and_never_waits_to() {
        let dir = tempfile::tempdir().expect("dir");
        let url = format!("sqlite://{}/o.db", dir.path().display());
        let raw = |sql: &'static str| {
            let url = url.clone();
            async move {
                let mut c = SqliteConnection::connect(&url)
                    .await
                    .expect("raw connection");
                sqlx::query(sql).execute(&mut c).await.expect(sql);
            }
        };
        let rows = |b: Arc<SqliteBackend>| async move {
            let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM dlock_locks")
                .fetch_one(&b.inner.writer)
                .await
                .expect("count");
            n
        };
        let age_rows = "UPDATE dlock_locks SET expires_boot_ms = expires_boot_ms - 172800000, \
                        expires_wall_ms = expires_wall_ms - 172800000";
        let age_stamp =
            "UPDATE dlock_counters SET value = value - 3600000 WHERE name = 'collected'";
        let first = open_in(&dir, "o.db").await;
        let h = grant(&first, "x").await;
        let mut last = h.fencing_token();
        h.release().await.expect("release");
        drop(first);
        raw(age_rows).await;
        raw(age_stamp).await;

        // Due, but another connection holds the write lock: the open goes on at once
        // and leaves the row and the stamp for later.
        let mut writer = SqliteConnection::connect(&url)
            .await
            .expect("raw connection");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut writer)
            .await
            .expect("write lock");
        let busy = tokio::time::timeout(Duration::from_secs(2), open_in(&dir, "o.db"))
            .await
            .expect("the open waited for the write lock");
        sqlx::query("ROLLBACK")
            .execute(&mut writer)
            .await
            .expect("rollback");
        assert_eq!(
            rows(Arc::clone(&busy)).await,
            1,
            "collected through a write lock"
        );
        assert_eq!(
            busy.inner.upkeep_due().await.expect("check"),
            Upkeep::Collect
        );
        drop(busy);

        // The next open collects; the name's tokens go on above the collected row's.
        let next = open_in(&dir, "o.db").await;
        assert_eq!(
            rows(Arc::clone(&next)).await,
            0,
            "the dead row was not collected"
        );
        assert_eq!(
            next.inner.upkeep_due().await.expect("check"),
            Upkeep::Nothing
        );
        let h = grant(&next, "x").await;
        assert!(
            h.fencing_token() > last,
            "token {} after {last}",
            h.fencing_token()
        );
        last = h.fencing_token();
        h.release().await.expect("release");
        drop(next);

        // A file an older dlock kept has no stamp, and the oldest lack a table: the
        // open that completes the schema does not stamp it as collected, so the next
        // open collects.
        raw(age_rows).await;
        raw("DELETE FROM dlock_counters WHERE name = 'collected'").await;
        raw("DROP TABLE dlock_shared").await;
        let upgraded = open_in(&dir, "o.db").await;
        assert_eq!(rows(Arc::clone(&upgraded)).await, 1);
        assert_eq!(
            upgraded.inner.upkeep_due().await.expect("check"),
            Upkeep::Collect,
            "an upgraded schema was stamped as collected"
        );
        drop(upgraded);
        let old = open_in(&dir, "o.db").await;
        assert_eq!(
            rows(Arc::clone(&old)).await,
            0,
            "the unstamped file was not collected"
        );
        let h = grant(&old, "x").await;
        assert!(
            h.fencing_token() > last,
            "token {} after {last}",
            h.fencing_token()
        );
    }

    /// Opening a database whose schema exists (and that was collected within the hour)
    /// takes no write lock and opens no reader: a process can start while another holds
    /// a long write transaction, and `dlock run` pays for one connection only.
    #[tokio::test]
    async fn opening_an_existing_database_needs_no_write_lock() {
        let dir = tempfile::tempdir().expect("dir");
        let url = format!("sqlite://{}/w.db", dir.path().display());
        let first = SqliteBackend::open(ConnectUrl::parse(&url).expect("url"))
            .await
            .expect("open");
        let mut writer =
            SqliteConnection::connect(&format!("sqlite://{}/w.db", dir.path().display()))
                .await
                .expect("raw connection");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut writer)
            .await
            .expect("write lock");
        let second = tokio::time::timeout(
            Duration::from_secs(2),
            SqliteBackend::open(ConnectUrl::parse(&url).expect("url")),
        )
        .await
        .expect("opening waited for the write lock")
        .expect("open");
        assert_eq!(second.inner.reader.size(), 0, "a reader was opened");
        sqlx::query("ROLLBACK")
            .execute(&mut writer)
            .await
            .expect("rollback");
        drop((first, second));
    }

    /// The writer checkpoints at SQLite's default unless the URL says otherwise.
    #[tokio::test]
    async fn wal_autocheckpoint_reaches_the_writer() {
        let dir = tempfile::tempdir().expect("dir");
        for (query, pages) in [("", 1000), ("?wal_autocheckpoint=64", 64)] {
            let url = format!("sqlite://{}/c.db{query}", dir.path().display());
            let backend = SqliteBackend::open(ConnectUrl::parse(&url).expect("url"))
                .await
                .expect("open");
            let set: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
                .fetch_one(&backend.inner.writer)
                .await
                .expect("read the setting");
            assert_eq!(set, pages, "{url}");
        }
    }

    #[tokio::test]
    async fn rejects_bad_urls() {
        for bad in [
            "sqlite://",
            "sqlite:///tmp/x.db?synchronous=sometimes",
            "sqlite:///tmp/x.db?poll=0ms",
            "sqlite:///tmp/x.db?wal_autocheckpoint=many",
            "sqlite:///tmp/x.db?wal_autocheckpoint=100001",
            "sqlite:///tmp/x.db?wal_autocheckpoint=0",
            "sqlite:///tmp/x.db?pol=5ms",
        ] {
            let err = SqliteBackend::open(ConnectUrl::parse(bad).expect("parses"))
                .await
                .expect_err(bad);
            assert!(
                matches!(err, Error::InvalidUrl { .. } | Error::InvalidOption { .. }),
                "{bad}: {err}"
            );
        }
    }
}
