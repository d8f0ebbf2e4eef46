//! `sqlite:///path.db`: the embedded default. No server; processes on one machine
//! exclude each other through one database file.
//!
//! # Layout
//! See [`SCHEMA`]. One row per held lock in `dlock_locks` (owner, hold count, fencing
//! token, expiry, metadata); a global counter row in `dlock_counters` supplies fencing
//! tokens, bumped inside the acquiring transaction, so tokens strictly increase per lock
//! (and across locks) and survive crashes; `dlock_queue` holds fair-mode waiters.
//!
//! # Time
//! Expiry is kept on `CLOCK_BOOTTIME` together with the kernel's boot id, so a jump of
//! the wall clock changes nothing. A row written under another boot id (the machine
//! rebooted) is judged by its wall-clock expiry instead.
//!
//! # Writes
//! Every write is a short `BEGIN IMMEDIATE` transaction in WAL mode. The SQLite busy
//! handler is switched off and dlock retries `SQLITE_BUSY` itself after 50–500 µs, which
//! hands the write lock over much faster than SQLite's own 1, 2, 5, 10 … ms back-off.
//!
//! # Waiting
//! Waiters in the same process are woken at once by a release from that process; other
//! processes are noticed by polling every `poll` (default 10 ms, jittered 50–100 %).
//!
//! # URL
//! `sqlite:///abs/path.db`, `sqlite://rel/path.db`, `sqlite::memory:` (one process),
//! options `synchronous=full|normal` (default `full`; `normal` can lose the last
//! commits on power loss, so fencing drops to best effort) and `poll=10ms`.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Connection, Row, SqlitePool};
use tokio::sync::watch;

use crate::backend::{
    AcquireRequest, Attempt, Backend, Capabilities, Fencing, HeldLock, LockInfo, Waiter,
};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::{ChangeHub, wait_change};
use crate::options::{Metadata, Owner};
use crate::url::ConnectUrl;

/// The tables dlock creates (idempotently) in the database file.
pub const SCHEMA: &str = "\
CREATE TABLE IF NOT EXISTS dlock_locks (
    name            TEXT PRIMARY KEY NOT NULL,
    owner           TEXT NOT NULL,
    holds           INTEGER NOT NULL,
    fence           INTEGER NOT NULL,
    boot_id         TEXT NOT NULL,
    expires_boot_ms INTEGER NOT NULL,
    expires_wall_ms INTEGER NOT NULL,
    metadata        TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dlock_counters (
    name  TEXT PRIMARY KEY NOT NULL,
    value INTEGER NOT NULL
) WITHOUT ROWID;
INSERT OR IGNORE INTO dlock_counters (name, value) VALUES ('fence', 0);
CREATE TABLE IF NOT EXISTS dlock_queue (
    name            TEXT NOT NULL,
    owner           TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    boot_id         TEXT NOT NULL,
    expires_boot_ms INTEGER NOT NULL,
    expires_wall_ms INTEGER NOT NULL,
    PRIMARY KEY (name, owner)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS dlock_queue_order ON dlock_queue (name, seq);
";

/// Give up retrying a busy database after this long.
const BUSY_LIMIT: Duration = Duration::from_secs(30);

/// A point in time as every process on this machine sees it.
#[derive(Debug, Clone)]
struct Now {
    boot_id: Arc<str>,
    boot_ms: i64,
    wall_ms: i64,
}

impl Now {
    fn read(boot_id: &Arc<str>) -> Self {
        let boot_ms = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
            .map(|ts| ts.tv_sec() * 1000 + ts.tv_nsec() / 1_000_000)
            .unwrap_or(0);
        let wall_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        Now {
            boot_id: Arc::clone(boot_id),
            boot_ms,
            wall_ms,
        }
    }

    /// Milliseconds left on a lease stored as (boot id, boot expiry, wall expiry);
    /// zero or less means expired.
    fn remaining_ms(&self, boot_id: &str, expires_boot: i64, expires_wall: i64) -> i64 {
        if boot_id == &*self.boot_id {
            expires_boot - self.boot_ms
        } else {
            expires_wall - self.wall_ms
        }
    }

    fn ms_after(&self, d: Duration) -> (i64, i64) {
        let ms = d.as_millis() as i64;
        (self.boot_ms + ms, self.wall_ms + ms)
    }
}

#[derive(Debug)]
struct Inner {
    pool: SqlitePool,
    boot_id: Arc<str>,
    changes: ChangeHub,
    poll: Duration,
    durable: bool,
    cross_process: bool,
}

/// The SQLite backend.
#[derive(Debug)]
pub struct SqliteBackend {
    inner: Arc<Inner>,
}

fn db_err(e: &sqlx::Error) -> Error {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => {
            Error::connection("sqlite", e)
        }
        _ => Error::backend("sqlite", e),
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

fn read_boot_id() -> Arc<str> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown-boot".to_owned())
        .into()
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
        url.finish(&["synchronous", "poll"])?;
        let body = url.body();
        let target = crate::url::percent_decode(body)
            .ok_or_else(|| url.invalid("bad percent-encoding in path"))?;
        let in_memory = target == ":memory:" || target.is_empty() && body.is_empty();
        if target.is_empty() && !in_memory {
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
        let pool = SqlitePoolOptions::new()
            // An in-memory database exists per connection: keep exactly one.
            .max_connections(if in_memory { 1 } else { 4 })
            .min_connections(if in_memory { 1 } else { 0 })
            .idle_timeout(if in_memory {
                None
            } else {
                Some(Duration::from_secs(60))
            })
            .max_lifetime(None)
            .acquire_timeout(Duration::from_secs(30))
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    // dlock retries SQLITE_BUSY itself, with much shorter sleeps.
                    sqlx::query("PRAGMA busy_timeout = 0").execute(conn).await?;
                    Ok(())
                })
            })
            .connect_with(opts)
            .await
            .map_err(|e| Error::connection("sqlite", format!("cannot open {target:?}: {e}")))?;
        let inner = Arc::new(Inner {
            pool,
            boot_id: read_boot_id(),
            changes: ChangeHub::default(),
            poll,
            durable,
            cross_process: !in_memory,
        });
        inner.write(WriteOp::Schema).await?;
        Ok(Arc::new(SqliteBackend { inner }))
    }
}

impl Inner {
    fn now(&self) -> Now {
        Now::read(&self.boot_id)
    }

    /// Run `op` in a `BEGIN IMMEDIATE` transaction, retrying while the database is busy.
    async fn write(&self, op: WriteOp<'_>) -> Result<WriteOut> {
        let started = tokio::time::Instant::now();
        let mut conn = self.pool.acquire().await.map_err(|e| db_err(&e))?;
        let mut pause_us = 50;
        loop {
            let outcome = async {
                let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
                let value = run_op(&mut tx, &op, &self.now()).await?;
                tx.commit().await?;
                Ok::<WriteOut, sqlx::Error>(value)
            }
            .await;
            match outcome {
                Ok(v) => return Ok(v),
                Err(e) if is_busy(&e) && started.elapsed() < BUSY_LIMIT => {
                    let us = fastrand::u64(pause_us / 2..=pause_us);
                    tokio::time::sleep(Duration::from_micros(us)).await;
                    pause_us = (pause_us * 2).min(500);
                }
                Err(e) => return Err(db_err(&e)),
            }
        }
    }
}

/// The write transactions dlock runs.
enum WriteOp<'a> {
    Schema,
    Acquire {
        req: &'a AcquireRequest,
        metadata: &'a str,
    },
    Renew {
        name: &'a str,
        owner: &'a str,
        fence: i64,
        ttl: Duration,
    },
    Release {
        name: &'a str,
        owner: &'a str,
        fence: i64,
    },
    LeaveQueue {
        name: &'a str,
        owner: &'a str,
    },
}

enum WriteOut {
    Done,
    Acquire(Outcome),
    Rows(u64),
}

async fn run_op(
    conn: &mut SqliteConnection,
    op: &WriteOp<'_>,
    now: &Now,
) -> Result<WriteOut, sqlx::Error> {
    match *op {
        WriteOp::Schema => {
            sqlx::raw_sql(SCHEMA).execute(&mut *conn).await?;
            Ok(WriteOut::Done)
        }
        WriteOp::Acquire { req, metadata } => Ok(WriteOut::Acquire(
            acquire_tx(conn, req, now, metadata).await?,
        )),
        WriteOp::Renew {
            name,
            owner,
            fence,
            ttl,
        } => {
            let (eb, ew) = now.ms_after(ttl);
            let r = sqlx::query(
                "UPDATE dlock_locks SET \
                 expires_boot_ms = CASE WHEN boot_id = ?1 THEN MAX(expires_boot_ms, ?4) ELSE ?4 END, \
                 expires_wall_ms = MAX(expires_wall_ms, ?5), boot_id = ?1 \
                 WHERE name = ?6 AND owner = ?7 AND fence = ?8 AND \
                 ((boot_id = ?1 AND expires_boot_ms > ?2) OR (boot_id <> ?1 AND expires_wall_ms > ?3))",
            )
            .bind(&*now.boot_id)
            .bind(now.boot_ms)
            .bind(now.wall_ms)
            .bind(eb)
            .bind(ew)
            .bind(name)
            .bind(owner)
            .bind(fence)
            .execute(&mut *conn)
            .await?;
            Ok(WriteOut::Rows(r.rows_affected()))
        }
        WriteOp::Release { name, owner, fence } => {
            let deleted = sqlx::query(
                "DELETE FROM dlock_locks WHERE name = ?1 AND owner = ?2 AND fence = ?3 AND holds <= 1",
            )
            .bind(name)
            .bind(owner)
            .bind(fence)
            .execute(&mut *conn)
            .await?
            .rows_affected();
            if deleted == 0 {
                sqlx::query(
                    "UPDATE dlock_locks SET holds = holds - 1 \
                     WHERE name = ?1 AND owner = ?2 AND fence = ?3 AND holds > 1",
                )
                .bind(name)
                .bind(owner)
                .bind(fence)
                .execute(&mut *conn)
                .await?;
            }
            Ok(WriteOut::Rows(deleted))
        }
        WriteOp::LeaveQueue { name, owner } => {
            sqlx::query("DELETE FROM dlock_queue WHERE name = ?1 AND owner = ?2")
                .bind(name)
                .bind(owner)
                .execute(&mut *conn)
                .await?;
            Ok(WriteOut::Done)
        }
    }
}

/// A lock row as read from `dlock_locks`.
struct LockRow {
    owner: String,
    holds: i64,
    fence: i64,
    remaining_ms: i64,
    metadata: String,
}

async fn read_lock(
    conn: &mut SqliteConnection,
    name: &str,
    now: &Now,
) -> Result<Option<LockRow>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT owner, holds, fence, boot_id, expires_boot_ms, expires_wall_ms, metadata \
         FROM dlock_locks WHERE name = ?1",
    )
    .bind(name)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(|r| {
        let boot_id: String = r.get(3);
        LockRow {
            owner: r.get(0),
            holds: r.get(1),
            fence: r.get(2),
            remaining_ms: now.remaining_ms(&boot_id, r.get(4), r.get(5)),
            metadata: r.get(6),
        }
    }))
}

async fn enqueue(
    conn: &mut SqliteConnection,
    req: &AcquireRequest,
    now: &Now,
    entry_ttl: Duration,
) -> Result<(), sqlx::Error> {
    let (eb, ew) = now.ms_after(entry_ttl);
    sqlx::query(
        "INSERT INTO dlock_queue (name, owner, seq, boot_id, expires_boot_ms, expires_wall_ms) \
         VALUES (?1, ?2, (SELECT COALESCE(MAX(seq), 0) + 1 FROM dlock_queue WHERE name = ?1), ?3, ?4, ?5) \
         ON CONFLICT (name, owner) DO UPDATE SET boot_id = excluded.boot_id, \
         expires_boot_ms = excluded.expires_boot_ms, expires_wall_ms = excluded.expires_wall_ms",
    )
    .bind(req.name.as_str())
    .bind(req.owner.as_str())
    .bind(&*now.boot_id)
    .bind(eb)
    .bind(ew)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

enum Outcome {
    Granted(u64),
    Busy(Option<Duration>),
}

async fn acquire_tx(
    conn: &mut SqliteConnection,
    req: &AcquireRequest,
    now: &Now,
    metadata: &str,
) -> Result<Outcome, sqlx::Error> {
    let name = req.name.as_str();
    if let Some(row) = read_lock(conn, name, now).await?
        && row.remaining_ms > 0
    {
        if row.owner == req.owner.as_str() {
            let (eb, ew) = now.ms_after(req.ttl);
            sqlx::query(
                    "UPDATE dlock_locks SET holds = holds + 1, boot_id = ?2, \
                     expires_boot_ms = CASE WHEN boot_id = ?2 THEN MAX(expires_boot_ms, ?3) ELSE ?3 END, \
                     expires_wall_ms = MAX(expires_wall_ms, ?4) WHERE name = ?1",
                )
                .bind(name)
                .bind(&*now.boot_id)
                .bind(eb)
                .bind(ew)
                .execute(&mut *conn)
                .await?;
            return Ok(Outcome::Granted(row.fence as u64));
        }
        if let Some(entry_ttl) = req.enqueue {
            enqueue(conn, req, now, entry_ttl).await?;
        }
        return Ok(Outcome::Busy(Some(Duration::from_millis(
            row.remaining_ms as u64,
        ))));
    }
    if req.fair {
        sqlx::query(DELETE_EXPIRED_QUEUE)
            .bind(&*now.boot_id)
            .bind(now.boot_ms)
            .bind(now.wall_ms)
            .bind(name)
            .execute(&mut *conn)
            .await?;
        let head: Option<String> = sqlx::query_scalar(
            "SELECT owner FROM dlock_queue WHERE name = ?1 ORDER BY seq LIMIT 1",
        )
        .bind(name)
        .fetch_optional(&mut *conn)
        .await?;
        if head.as_deref().is_some_and(|h| h != req.owner.as_str()) {
            if let Some(entry_ttl) = req.enqueue {
                enqueue(conn, req, now, entry_ttl).await?;
            }
            return Ok(Outcome::Busy(None));
        }
    }
    let fence: i64 = sqlx::query_scalar(
        "UPDATE dlock_counters SET value = value + 1 WHERE name = 'fence' RETURNING value",
    )
    .fetch_one(&mut *conn)
    .await?;
    let (eb, ew) = now.ms_after(req.ttl);
    sqlx::query(
        "INSERT OR REPLACE INTO dlock_locks \
         (name, owner, holds, fence, boot_id, expires_boot_ms, expires_wall_ms, metadata) \
         VALUES (?1, ?2, 1, ?3, ?4, ?5, ?6, ?7)",
    )
    .bind(name)
    .bind(req.owner.as_str())
    .bind(fence)
    .bind(&*now.boot_id)
    .bind(eb)
    .bind(ew)
    .bind(metadata)
    .execute(&mut *conn)
    .await?;
    if req.fair {
        sqlx::query("DELETE FROM dlock_queue WHERE name = ?1 AND owner = ?2")
            .bind(name)
            .bind(req.owner.as_str())
            .execute(&mut *conn)
            .await?;
    }
    Ok(Outcome::Granted(fence as u64))
}

/// `DELETE` of expired queue entries of one name (binds: boot id, boot ms, wall ms, name).
const DELETE_EXPIRED_QUEUE: &str = "DELETE FROM dlock_queue WHERE name = ?4 AND NOT \
     ((boot_id = ?1 AND expires_boot_ms > ?2) OR (boot_id <> ?1 AND expires_wall_ms > ?3))";

#[async_trait]
impl Backend for SqliteBackend {
    fn scheme(&self) -> &'static str {
        "sqlite"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            fencing: if self.inner.durable {
                Fencing::Durable
            } else {
                Fencing::BestEffort
            },
            fifo: true,
            native_wait: false,
            session_bound: false,
            reentrant: true,
            cross_process: self.inner.cross_process,
            max_ttl: None,
        }
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        let inner = &self.inner;
        // Cheap read first (WAL readers never block): a lock plainly held by someone
        // else needs no write transaction unless we must take a queue place.
        if req.enqueue.is_none() {
            let now = inner.now();
            let mut conn = inner.pool.acquire().await.map_err(|e| db_err(&e))?;
            if let Some(row) = read_lock(&mut conn, req.name.as_str(), &now)
                .await
                .map_err(|e| db_err(&e))?
                && row.remaining_ms > 0
                && row.owner != req.owner.as_str()
            {
                return Ok(Attempt::Busy {
                    retry_after: Some(Duration::from_millis(row.remaining_ms as u64)),
                });
            }
        }
        let metadata = serde_json::to_string(&req.metadata).unwrap_or_else(|_| "{}".into());
        let outcome = inner
            .write(WriteOp::Acquire {
                req,
                metadata: &metadata,
            })
            .await?;
        Ok(match outcome {
            WriteOut::Acquire(Outcome::Granted(fence)) => Attempt::Acquired(Box::new(SqliteHeld {
                inner: Arc::clone(inner),
                name: req.name.clone(),
                owner: req.owner.clone(),
                fence,
                released: AtomicBool::new(false),
            })),
            WriteOut::Acquire(Outcome::Busy(retry_after)) => Attempt::Busy { retry_after },
            _ => return Err(Error::backend("sqlite", "unexpected write outcome")),
        })
    }

    async fn subscribe(&self, name: &LockName) -> Result<Box<dyn Waiter>> {
        Ok(Box::new(SqliteWaiter {
            rx: self.inner.changes.subscribe(name),
            poll: self.inner.poll,
        }))
    }

    async fn leave_queue(&self, name: &LockName, owner: &Owner) -> Result<()> {
        self.inner
            .write(WriteOp::LeaveQueue {
                name: name.as_str(),
                owner: owner.as_str(),
            })
            .await?;
        self.inner.changes.notify(name);
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let now = self.inner.now();
        let mut conn = self.inner.pool.acquire().await.map_err(|e| db_err(&e))?;
        let Some(row) = read_lock(&mut conn, name.as_str(), &now)
            .await
            .map_err(|e| db_err(&e))?
            .filter(|r| r.remaining_ms > 0)
        else {
            return Ok(None);
        };
        let waiters: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM dlock_queue WHERE name = ?4 AND \
             ((boot_id = ?1 AND expires_boot_ms > ?2) OR (boot_id <> ?1 AND expires_wall_ms > ?3))",
        )
        .bind(&*now.boot_id)
        .bind(now.boot_ms)
        .bind(now.wall_ms)
        .bind(name.as_str())
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| db_err(&e))?;
        Ok(Some(LockInfo {
            name: name.as_str().to_owned(),
            owner: row.owner,
            holds: u32::try_from(row.holds).unwrap_or(u32::MAX),
            fencing_token: row.fence as u64,
            remaining: Some(Duration::from_millis(row.remaining_ms as u64)),
            metadata: serde_json::from_str::<Metadata>(&row.metadata).unwrap_or_default(),
            waiters: Some(waiters as usize),
        }))
    }
}

#[derive(Debug)]
struct SqliteWaiter {
    rx: watch::Receiver<u64>,
    poll: Duration,
}

#[async_trait]
impl Waiter for SqliteWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        let cap = self.poll.min(max).as_micros() as u64;
        let sleep = Duration::from_micros(cap / 2 + fastrand::u64(0..=cap / 2));
        wait_change(&mut self.rx, sleep).await;
        Ok(())
    }
}

#[derive(Debug)]
struct SqliteHeld {
    inner: Arc<Inner>,
    name: LockName,
    owner: Owner,
    fence: u64,
    released: AtomicBool,
}

#[async_trait]
impl HeldLock for SqliteHeld {
    fn fencing_token(&self) -> u64 {
        self.fence
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let out = self
            .inner
            .write(WriteOp::Renew {
                name: self.name.as_str(),
                owner: self.owner.as_str(),
                fence: self.fence as i64,
                ttl,
            })
            .await?;
        if matches!(out, WriteOut::Rows(1)) {
            Ok(())
        } else {
            Err(Error::NotOwner {
                name: self.name.as_str().to_owned(),
            })
        }
    }

    async fn release(&self) -> Result<()> {
        if self.released.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let result = self
            .inner
            .write(WriteOp::Release {
                name: self.name.as_str(),
                owner: self.owner.as_str(),
                fence: self.fence as i64,
            })
            .await;
        match result {
            Ok(out) => {
                if matches!(out, WriteOut::Rows(n) if n > 0) {
                    self.inner.changes.notify(&self.name);
                }
                Ok(())
            }
            Err(e) => {
                // Let a later call try again.
                self.released.store(false, Ordering::SeqCst);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remaining_uses_boot_clock_for_same_boot() {
        let id: Arc<str> = "b1".into();
        let now = Now {
            boot_id: Arc::clone(&id),
            boot_ms: 1000,
            wall_ms: 5_000_000,
        };
        // Same boot: the wall clock is ignored, so a wall-clock jump changes nothing.
        assert_eq!(now.remaining_ms("b1", 1500, 0), 500);
        // Other boot: judged by the wall clock.
        assert_eq!(now.remaining_ms("b0", 999_999, 5_000_100), 100);
        assert!(now.remaining_ms("b0", 999_999, 4_000_000) < 0);
    }
}
