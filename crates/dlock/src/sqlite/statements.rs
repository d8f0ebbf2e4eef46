//! Every SQL statement the SQLite backend runs, and the operations built from them.
//!
//! A lock row is never deleted on release (its hold count drops to 0), so its `fence`
//! column keeps counting: the next grant of that name gets `fence + 1`, in the same
//! single statement that grants it. Rows dead for a day are collected, and their highest
//! fence is first folded into the `dlock_counters` floor that new rows start above, so
//! tokens of a name stay strictly increasing across collection too.

use std::time::Duration;

use futures_util::TryStreamExt as _;
use sqlx::sqlite::SqliteConnection;
use sqlx::{Executor, Row};

use super::clock::Now;
use crate::backend::AcquireRequest;

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
CREATE TABLE IF NOT EXISTS dlock_shared (
    name            TEXT NOT NULL,
    family          TEXT NOT NULL,
    owner           TEXT NOT NULL,
    acquisition     INTEGER NOT NULL,
    kind            TEXT NOT NULL,
    fence           INTEGER NOT NULL,
    boot_id         TEXT NOT NULL,
    expires_boot_ms INTEGER NOT NULL,
    expires_wall_ms INTEGER NOT NULL,
    metadata        TEXT NOT NULL,
    PRIMARY KEY (name, family, owner, acquisition)
) WITHOUT ROWID;
";

/// Rows dead (expired or released) for this long are collected.
const COLLECT_AFTER: Duration = Duration::from_secs(24 * 3600);

/// An open looks for dead rows only when the database's last collection (its
/// `dlock_counters` row `collected`, wall-clock ms) is this old: finding them scans the
/// tables, which must not cost every short-lived process (`dlock run`) time that grows
/// with the names the database has seen.
const COLLECT_EVERY: Duration = Duration::from_secs(3600);

/// Stamp a collection (or a new schema, which has nothing to collect). Binds: 1 now (wall ms).
const STAMP_COLLECTED: &str = "INSERT INTO dlock_counters (name, value) VALUES ('collected', ?1) \
     ON CONFLICT (name) DO UPDATE SET value = excluded.value";

/// Grant (new grant or reentrant hold) in one statement; returns the fence, or no row
/// when someone else holds the lock (or its lease ran out without a release less than
/// the lock-delay ago).
/// Binds: 1 name, 2 owner, 3 boot id, 4 new boot expiry, 5 new wall expiry, 6 metadata,
/// 7 now (boot ms), 8 now (wall ms), 9 now − lock-delay (boot ms), 10 (wall ms).
///
/// "Now" is read just before the statement runs, not once it holds the write lock: the
/// statement never waits for that lock (the writer's busy timeout is zero; a busy
/// database is retried with a fresh "now"), so only a pause of this thread between
/// the two can make it stale. A stale "now" can find the owner's own lease live a
/// moment after it ended (a re-entry with the ended hold's token, where PostgreSQL
/// and MySQL read their clock after locking the row); another owner's lease it can
/// only find live longer.
macro_rules! grant_sql {
    () => {
        "\
INSERT INTO dlock_locks (name, owner, holds, fence, boot_id, expires_boot_ms, expires_wall_ms, metadata)
VALUES (?1, ?2, 1, (SELECT value FROM dlock_counters WHERE name = 'fence') + 1, ?3, ?4, ?5, ?6)
ON CONFLICT (name) DO UPDATE SET
    holds = CASE WHEN owner = ?2 AND holds > 0 AND ((boot_id = ?3 AND expires_boot_ms > ?7) OR (boot_id <> ?3 AND expires_wall_ms > ?8))
                 THEN holds + 1 ELSE 1 END,
    fence = CASE WHEN owner = ?2 AND holds > 0 AND ((boot_id = ?3 AND expires_boot_ms > ?7) OR (boot_id <> ?3 AND expires_wall_ms > ?8))
                 THEN fence ELSE fence + 1 END,
    expires_boot_ms = CASE WHEN owner = ?2 AND holds > 0 AND boot_id = ?3 AND expires_boot_ms > ?7
                 THEN MAX(expires_boot_ms, ?4) ELSE ?4 END,
    expires_wall_ms = CASE WHEN owner = ?2 AND holds > 0 AND ((boot_id = ?3 AND expires_boot_ms > ?7) OR (boot_id <> ?3 AND expires_wall_ms > ?8))
                 THEN MAX(expires_wall_ms, ?5) ELSE ?5 END,
    metadata = CASE WHEN owner = ?2 AND holds > 0 AND ((boot_id = ?3 AND expires_boot_ms > ?7) OR (boot_id <> ?3 AND expires_wall_ms > ?8))
                 THEN metadata ELSE ?6 END,
    owner = ?2,
    boot_id = ?3
WHERE owner = ?2 OR holds <= 0 OR NOT ((boot_id = ?3 AND expires_boot_ms > ?9) OR (boot_id <> ?3 AND expires_wall_ms > ?10))
RETURNING fence"
    };
}

/// [`grant_sql`] inside a transaction, whose `BEGIN` set the level ([`SyncLevel::begin`]).
const GRANT: &str = grant_sql!();

/// [`grant_sql`] autocommitted, with the level its commit syncs at set in the same call.
const GRANT_FULL: &str = concat!("PRAGMA synchronous = FULL; ", grant_sql!());
const GRANT_NORMAL: &str = concat!("PRAGMA synchronous = NORMAL; ", grant_sql!());

/// How a commit reaches the disk. Every statement that commits a grant names its level
/// in the same call (an autocommitted one as a `PRAGMA` before it, a transaction in its
/// `BEGIN`), so no grant depends on the level an earlier statement left on the
/// connection: a release lowers it for itself ([`RELEASE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SyncLevel {
    /// `synchronous=FULL`: the WAL is fsynced at the commit (durable tokens).
    Full,
    /// `synchronous=NORMAL`: written to the WAL (every process sees it at once), fsynced
    /// with a later `FULL` commit or checkpoint; a power loss may undo it.
    Normal,
}

impl SyncLevel {
    /// The `BEGIN IMMEDIATE` of a transaction that commits at this level (the level
    /// cannot change inside a transaction, so it is set just before).
    pub(super) fn begin(self) -> &'static str {
        match self {
            SyncLevel::Full => "PRAGMA synchronous = FULL; BEGIN IMMEDIATE",
            SyncLevel::Normal => "PRAGMA synchronous = NORMAL; BEGIN IMMEDIATE",
        }
    }
}

/// Binds: 1 name.
const READ: &str = "SELECT owner, holds, fence, boot_id, expires_boot_ms, expires_wall_ms, metadata \
                    FROM dlock_locks WHERE name = ?1";

/// Extend a live hold. Binds: 1 boot id, 2 now boot, 3 now wall, 4 new boot expiry,
/// 5 new wall expiry, 6 name, 7 owner, 8 fence.
const RENEW: &str = "\
UPDATE dlock_locks SET
    expires_boot_ms = CASE WHEN boot_id = ?1 THEN MAX(expires_boot_ms, ?4) ELSE ?4 END,
    expires_wall_ms = MAX(expires_wall_ms, ?5),
    boot_id = ?1
WHERE name = ?6 AND owner = ?7 AND fence = ?8 AND holds > 0
  AND ((boot_id = ?1 AND expires_boot_ms > ?2) OR (boot_id <> ?1 AND expires_wall_ms > ?3))";

/// Drop one hold (none when this grant holds nothing any more). Binds: 1 name,
/// 2 owner, 3 fence.
///
/// Committed without an fsync (`synchronous=NORMAL` for this statement): the release is
/// in the WAL before it returns, so every process sees the lock free at once, and
/// only a power loss can undo it — the lease then frees the lock (a lost release never
/// touches a token), and the next grant's fsync makes it durable with it. A release
/// costs no disk flush, so an uncontended cycle costs one instead of two.
const RELEASE: &str = "PRAGMA synchronous = NORMAL; \
                       UPDATE dlock_locks SET holds = holds - 1 \
                       WHERE name = ?1 AND owner = ?2 AND fence = ?3 AND holds > 0";

/// Binds: 1 name, 2 queue entry ([`queue_entry`]), 3 boot id, 4 entry boot expiry,
/// 5 entry wall expiry.
const ENQUEUE: &str = "\
INSERT INTO dlock_queue (name, owner, seq, boot_id, expires_boot_ms, expires_wall_ms)
VALUES (?1, ?2, (SELECT COALESCE(MAX(seq), 0) + 1 FROM dlock_queue WHERE name = ?1), ?3, ?4, ?5)
ON CONFLICT (name, owner) DO UPDATE SET
    boot_id = excluded.boot_id,
    expires_boot_ms = excluded.expires_boot_ms,
    expires_wall_ms = excluded.expires_wall_ms";

/// Binds: 1 boot id, 2 now boot, 3 now wall, 4 name.
const PRUNE_QUEUE: &str = "DELETE FROM dlock_queue WHERE name = ?4 AND NOT \
     ((boot_id = ?1 AND expires_boot_ms > ?2) OR (boot_id <> ?1 AND expires_wall_ms > ?3))";

/// Binds: 1 name.
const QUEUE_HEAD: &str = "SELECT owner FROM dlock_queue WHERE name = ?1 ORDER BY seq LIMIT 1";

/// Binds: 1 name, 2 queue entry.
const LEAVE_QUEUE: &str = "DELETE FROM dlock_queue WHERE name = ?1 AND owner = ?2";

/// Binds: 1 boot id, 2 now boot, 3 now wall, 4 name.
const COUNT_QUEUE: &str = "SELECT COUNT(*) FROM dlock_queue WHERE name = ?4 AND \
     ((boot_id = ?1 AND expires_boot_ms > ?2) OR (boot_id <> ?1 AND expires_wall_ms > ?3))";

/// Rows whose lease ended before a cut-off. Binds: 1 boot id, 2 cut-off boot, 3 cut-off wall.
const DEAD: &str =
    "((boot_id = ?1 AND expires_boot_ms < ?2) OR (boot_id <> ?1 AND expires_wall_ms < ?3))";

/// A lock row as read.
#[derive(Debug)]
pub(super) struct LockRow {
    pub owner: String,
    pub holds: i64,
    pub fence: i64,
    /// Zero or less: free (expired or released).
    pub remaining_ms: i64,
    pub metadata: String,
}

/// What an acquisition attempt found.
#[derive(Debug)]
pub(super) enum Outcome {
    Granted(u64),
    Busy(Option<Duration>),
    /// A write asked for by an owner holding a read (read-write locks).
    Refused,
}

/// How many of dlock's four tables exist (a query: one source for [`schema_present`]
/// and [`upkeep_due`]).
macro_rules! tables_present {
    () => {
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' \
         AND name IN ('dlock_locks', 'dlock_counters', 'dlock_queue', 'dlock_shared')"
    };
}

/// The last collection's stamp (a query: one source for [`collected_at`] and
/// [`upkeep_due`]).
macro_rules! collection_stamp {
    () => {
        "SELECT value FROM dlock_counters WHERE name = 'collected'"
    };
}

/// Whether all of dlock's tables exist.
async fn schema_present(conn: &mut SqliteConnection) -> sqlx::Result<bool> {
    let present: i64 = sqlx::query_scalar(tables_present!())
        .fetch_one(&mut *conn)
        .await?;
    Ok(present == 4)
}

pub(super) async fn create_schema(conn: &mut SqliteConnection, now: &Now) -> sqlx::Result<()> {
    if !schema_present(conn).await? {
        // A new file has nothing to collect for an hour; one whose older schema lacks
        // a table may well have, and stays unstamped (due).
        let new_file: bool = sqlx::query_scalar(
            "SELECT NOT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'dlock_locks')",
        )
        .fetch_one(&mut *conn)
        .await?;
        conn.execute(sqlx::raw_sql(SCHEMA)).await?;
        if new_file {
            stamp_collected(conn, now).await?;
        }
    }
    Ok(())
}

/// The last collection's stamp (wall ms), if the file has one.
async fn collected_at(conn: &mut SqliteConnection) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar(collection_stamp!())
        .fetch_optional(&mut *conn)
        .await
}

async fn stamp_collected(conn: &mut SqliteConnection, now: &Now) -> sqlx::Result<()> {
    sqlx::query(STAMP_COLLECTED)
        .bind(now.wall_ms)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// What opening has to do before the first lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Upkeep {
    Nothing,
    CreateSchema,
    Collect,
}

/// Find out, with reads only (one statement, unless a table seems missing), whether
/// the schema must be created or dead rows collected: the common case (neither) then
/// takes no write lock, and costs one statement of two lookups whatever the number of
/// rows (the tables are scanned for dead rows at most once per [`COLLECT_EVERY`], by
/// [`collect`]).
pub(super) async fn upkeep_due(conn: &mut SqliteConnection, now: &Now) -> sqlx::Result<Upkeep> {
    // Both lookups in one statement (one trip to the connection's thread, on every
    // open). It names `dlock_counters`, so a file without that table cannot even
    // prepare it.
    let found: sqlx::Result<(i64, Option<i64>)> = sqlx::query_as(concat!(
        "SELECT (",
        tables_present!(),
        "), (",
        collection_stamp!(),
        ")"
    ))
    .fetch_one(&mut *conn)
    .await;
    match found {
        Ok((4, collected)) => Ok(due(collected, now)),
        Ok(_) => Ok(Upkeep::CreateSchema),
        // A table is missing — or this connection's copy of the schema is older than
        // the file's, and SQLite could not read the new one (busy): the schema's own
        // lookup tells the two apart, and waits out a busy file like any read.
        Err(sqlx::Error::Database(e)) if e.message().starts_with("no such table") => {
            if !schema_present(conn).await? {
                return Ok(Upkeep::CreateSchema);
            }
            Ok(due(collected_at(conn).await?, now))
        }
        Err(e) => Err(e),
    }
}

/// Whether a file with dlock's schema and this collection stamp needs collecting. Due,
/// it is a write (the stamp) even when nothing has died.
fn due(collected: Option<i64>, now: &Now) -> Upkeep {
    if collection_due(collected, now.wall_ms) {
        Upkeep::Collect
    } else {
        Upkeep::Nothing
    }
}

/// Whether a collection stamped at `collected` (wall ms; none: a database from before
/// the stamp) is due at `now_wall`: [`COLLECT_EVERY`] after it, or at once when the
/// stamp lies that far ahead (the wall clock was set back).
fn collection_due(collected: Option<i64>, now_wall: i64) -> bool {
    let every = i64::try_from(COLLECT_EVERY.as_millis()).unwrap_or(i64::MAX);
    collected.is_none_or(|at| {
        now_wall.saturating_sub(at) >= every || at.saturating_sub(now_wall) >= every
    })
}

/// Collect rows dead for a day, folding their fences into the floor first, and stamp
/// the collection — unless another process collected since this one found it due
/// (opens that found it due at once then collect once). In a `BEGIN IMMEDIATE`
/// transaction.
pub(super) async fn collect(conn: &mut SqliteConnection, now: &Now) -> sqlx::Result<u64> {
    if !collection_due(collected_at(conn).await?, now.wall_ms) {
        return Ok(0);
    }
    if !anything_to_collect(conn, now).await? {
        stamp_collected(conn, now).await?;
        return Ok(0);
    }
    let (cut_boot, cut_wall) = now.before(COLLECT_AFTER);
    let fold = format!(
        "UPDATE dlock_counters SET value = MAX(value, COALESCE((SELECT MAX(fence) FROM dlock_locks WHERE {DEAD}), 0)) \
         WHERE name = 'fence'"
    );
    sqlx::query(sqlx::AssertSqlSafe(fold))
        .bind(&*now.boot_id)
        .bind(cut_boot)
        .bind(cut_wall)
        .execute(&mut *conn)
        .await?;
    let shared = format!("DELETE FROM dlock_shared WHERE {DEAD}");
    sqlx::query(sqlx::AssertSqlSafe(shared))
        .bind(&*now.boot_id)
        .bind(cut_boot)
        .bind(cut_wall)
        .execute(&mut *conn)
        .await?;
    let delete = format!("DELETE FROM dlock_locks WHERE {DEAD}");
    let done = sqlx::query(sqlx::AssertSqlSafe(delete))
        .bind(&*now.boot_id)
        .bind(cut_boot)
        .bind(cut_wall)
        .execute(&mut *conn)
        .await?;
    stamp_collected(conn, now).await?;
    Ok(done.rows_affected())
}

/// Whether any row is due for collection (a read: most hours, a collection that is
/// due finds nothing and only stamps itself).
async fn anything_to_collect(conn: &mut SqliteConnection, now: &Now) -> sqlx::Result<bool> {
    let (cut_boot, cut_wall) = now.before(COLLECT_AFTER);
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM dlock_locks WHERE {DEAD}) \
         OR EXISTS (SELECT 1 FROM dlock_shared WHERE {DEAD})"
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(&*now.boot_id)
        .bind(cut_boot)
        .bind(cut_wall)
        .fetch_one(&mut *conn)
        .await
}

pub(super) async fn read_lock(
    conn: &mut SqliteConnection,
    name: &str,
    now: &Now,
) -> sqlx::Result<Option<LockRow>> {
    let row = sqlx::query(READ)
        .bind(name)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(row.map(|r| {
        let boot_id: String = r.get(3);
        let holds: i64 = r.get(1);
        let remaining = now.remaining_ms(&boot_id, r.get(4), r.get(5));
        LockRow {
            owner: r.get(0),
            holds,
            fence: r.get(2),
            remaining_ms: if holds > 0 { remaining } else { 0 },
            metadata: r.get(6),
        }
    }))
}

/// Milliseconds until `row` can be granted to another owner: its remaining lease plus
/// the lock-delay (a hold left to expire, not released, blocks for `delay` more).
pub(super) fn blocked_ms(row: &LockRow, delay: Duration) -> i64 {
    if row.holds <= 0 {
        return 0;
    }
    row.remaining_ms + i64::try_from(delay.as_millis()).unwrap_or(i64::MAX / 4)
}

/// The busy answer for a lock held by someone else.
fn busy(row: Option<&LockRow>, delay: Duration) -> Outcome {
    Outcome::Busy(
        row.map(|r| blocked_ms(r, delay))
            .filter(|ms| *ms > 0)
            .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
    )
}

/// `autocommit`: the level of a grant that is its own transaction; `None` inside a
/// transaction (its `BEGIN` set the level).
async fn grant(
    conn: &mut SqliteConnection,
    req: &AcquireRequest,
    now: &Now,
    metadata: &str,
    delay: Duration,
    autocommit: Option<SyncLevel>,
) -> sqlx::Result<Option<u64>> {
    let (eb, ew) = now.after(req.ttl);
    let (db, dw) = now.before(delay);
    let sql = match autocommit {
        None => GRANT,
        Some(SyncLevel::Full) => GRANT_FULL,
        Some(SyncLevel::Normal) => GRANT_NORMAL,
    };
    // Every row fetched, so the statement runs to its end: an autocommitted one commits
    // after its RETURNING row, and a commit that fails (a full disk, an I/O error, a
    // deferred constraint) must come back as the error, not as the row of a grant
    // that was rolled back (stopping at the first row leaves the commit to the
    // statement's reset, whose error no one sees).
    let fences: Vec<i64> = sqlx::query_scalar(sql)
        .bind(req.name.as_str())
        .bind(req.owner.as_str())
        .bind(&*now.boot_id)
        .bind(eb)
        .bind(ew)
        .bind(metadata)
        .bind(now.boot_ms)
        .bind(now.wall_ms)
        .bind(db)
        .bind(dw)
        .fetch_all(&mut *conn)
        .await?;
    Ok(fences.first().map(|f| u64::try_from(*f).unwrap_or(0)))
}

/// Unfair acquisition: one autocommitted statement when the lock is free (its commit
/// synced at `level`); a read for the holder's remaining lease when it is not.
pub(super) async fn acquire(
    conn: &mut SqliteConnection,
    req: &AcquireRequest,
    now: &Now,
    metadata: &str,
    delay: Duration,
    level: SyncLevel,
) -> sqlx::Result<Outcome> {
    if let Some(fence) = grant(conn, req, now, metadata, delay, Some(level)).await? {
        return Ok(Outcome::Granted(fence));
    }
    let row = read_lock(conn, req.name.as_str(), now).await?;
    Ok(busy(row.as_ref(), delay))
}

/// Fair acquisition (inside a `BEGIN IMMEDIATE` transaction): only the queue's head
/// (or a reentering owner) is granted; a busy waiter takes or refreshes its place.
pub(super) async fn acquire_fair(
    conn: &mut SqliteConnection,
    req: &AcquireRequest,
    now: &Now,
    metadata: &str,
    delay: Duration,
) -> sqlx::Result<Outcome> {
    let name = req.name.as_str();
    let row = read_lock(conn, name, now).await?;
    let held = row.as_ref().is_some_and(|r| blocked_ms(r, delay) > 0);
    let mine = row.as_ref().is_some_and(|r| r.owner == req.owner.as_str());
    if held && !mine {
        enqueue(conn, req, now).await?;
        return Ok(busy(row.as_ref(), delay));
    }
    if !held {
        sqlx::query(PRUNE_QUEUE)
            .bind(&*now.boot_id)
            .bind(now.boot_ms)
            .bind(now.wall_ms)
            .bind(name)
            .execute(&mut *conn)
            .await?;
        let head: Option<String> = sqlx::query_scalar(QUEUE_HEAD)
            .bind(name)
            .fetch_optional(&mut *conn)
            .await?;
        if head.as_deref().is_some_and(|h| h != queue_entry(req)) {
            enqueue(conn, req, now).await?;
            return Ok(Outcome::Busy(None));
        }
    }
    let Some(fence) = grant(conn, req, now, metadata, delay, None).await? else {
        return Ok(busy(row.as_ref(), delay));
    };
    leave_queue(conn, name, &queue_entry(req)).await?;
    Ok(Outcome::Granted(fence))
}

/// A waiter's key in `dlock_queue` (its `owner` column): the owner and the
/// acquisition, so two waiters of one owner each have a place of their own and one
/// leaving cannot take the other's.
pub(super) fn queue_entry(req: &AcquireRequest) -> String {
    format!("{}/{}", req.owner.as_str(), req.acquisition)
}

async fn enqueue(conn: &mut SqliteConnection, req: &AcquireRequest, now: &Now) -> sqlx::Result<()> {
    let Some(entry_ttl) = req.enqueue else {
        return Ok(());
    };
    let (eb, ew) = now.after(entry_ttl);
    sqlx::query(ENQUEUE)
        .bind(req.name.as_str())
        .bind(queue_entry(req))
        .bind(&*now.boot_id)
        .bind(eb)
        .bind(ew)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub(super) async fn leave_queue(
    conn: &mut SqliteConnection,
    name: &str,
    entry: &str,
) -> sqlx::Result<()> {
    sqlx::query(LEAVE_QUEUE)
        .bind(name)
        .bind(entry)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// An operator's forced release of the hold granted with `fence` (its renewals and
/// release then find nothing; the next grant takes a new token).
pub(super) async fn break_hold(
    conn: &mut SqliteConnection,
    name: &str,
    fence: i64,
) -> sqlx::Result<bool> {
    let done = sqlx::query(
        "UPDATE dlock_locks SET holds = 0 WHERE name = ?1 AND fence = ?2 AND holds > 0",
    )
    .bind(name)
    .bind(fence)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected() > 0)
}

/// Names beginning with `prefix` that have a lock row (held or not), in byte order.
pub(super) async fn names(
    conn: &mut SqliteConnection,
    prefix: &str,
    limit: usize,
) -> sqlx::Result<Vec<String>> {
    // substr, not LIKE: a name may hold % and _. SQLite compares TEXT by bytes.
    sqlx::query_scalar(
        "SELECT name FROM dlock_locks WHERE substr(name, 1, length(?1)) = ?1 ORDER BY name LIMIT ?2",
    )
    .bind(prefix)
    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
    .fetch_all(&mut *conn)
    .await
}

pub(super) async fn count_queue(
    conn: &mut SqliteConnection,
    name: &str,
    now: &Now,
) -> sqlx::Result<i64> {
    sqlx::query_scalar(COUNT_QUEUE)
        .bind(&*now.boot_id)
        .bind(now.boot_ms)
        .bind(now.wall_ms)
        .bind(name)
        .fetch_one(&mut *conn)
        .await
}

/// Extend a live hold; `false` when this grant no longer holds the lock.
pub(super) async fn renew(
    conn: &mut SqliteConnection,
    hold: &Hold<'_>,
    ttl: Duration,
    now: &Now,
) -> sqlx::Result<bool> {
    let (eb, ew) = now.after(ttl);
    let done = sqlx::query(RENEW)
        .bind(&*now.boot_id)
        .bind(now.boot_ms)
        .bind(now.wall_ms)
        .bind(eb)
        .bind(ew)
        .bind(hold.name)
        .bind(hold.owner)
        .bind(hold.fence)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Drop one hold; whether this grant still held one (nothing changes when it did not).
pub(super) async fn release(conn: &mut SqliteConnection, hold: &Hold<'_>) -> sqlx::Result<bool> {
    // Run to its end, so a commit that fails is the error. Whether a hold was dropped
    // is the UPDATE's own count of changes, the last statement's: summed with the
    // PRAGMA's before it (as `execute` does), it would count the connection's previous
    // write too. (A RETURNING row would tell as much, at more client instructions per
    // release for the row, as callgrind showed.)
    let (results, changed) = conn
        .execute_many(
            sqlx::query(RELEASE)
                .bind(hold.name)
                .bind(hold.owner)
                .bind(hold.fence),
        )
        .try_fold((0, 0), |(n, _), done| {
            std::future::ready(Ok((n + 1, done.rows_affected())))
        })
        .await?;
    // One result per statement: fewer means the run was cut short (the last count
    // would be the PRAGMA's, the previous write's).
    if results != 2 {
        return Err(sqlx::Error::Protocol(format!(
            "the release ran {results} of its 2 statements"
        )));
    }
    Ok(changed > 0)
}

/// One grant of a lock, as the statements see it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Hold<'a> {
    pub name: &'a str,
    pub owner: &'a str,
    pub fence: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collection_is_due_an_hour_after_the_last_or_when_the_clock_went_back() {
        let hour = 3_600_000;
        let now = 1_800_000_000_000;
        assert!(collection_due(None, now), "a file from before the stamp");
        assert!(!collection_due(Some(now), now));
        assert!(!collection_due(Some(now - hour + 1), now));
        assert!(collection_due(Some(now - hour), now));
        assert!(
            !collection_due(Some(now + hour - 1), now),
            "a clock a little behind"
        );
        assert!(
            collection_due(Some(now + hour), now),
            "the clock was set back"
        );
        assert!(collection_due(Some(i64::MIN), now));
        assert!(collection_due(Some(i64::MAX), now));
    }
}
