//! Semaphores and read-write locks on SQLite: the `dlock_shared` table, one row per
//! held permit, read or write (and per waiting writer), keyed by the acquisition.
//!
//! An attempt is one `BEGIN IMMEDIATE` transaction: delete the name's dead rows, read
//! the live ones, ask [`crate::shared_holds::decide`], write what it says. Tokens come
//! from one counter row (`dlock_counters.name = 'shared'`) bumped in that transaction,
//! so they are strictly increasing per semaphore and read-write lock (and across them).
//! A renewal and a release are one autocommitted statement each.

use std::time::Duration;

use sqlx::Row;
use sqlx::sqlite::SqliteConnection;

use super::clock::Now;
use super::statements::Outcome;
use crate::backend::{AcquireRequest, AcquisitionId};
use crate::shared_holds::{EntryKind, LiveEntry, Verdict, decide, family};

/// A live row. Binds: 1 boot id, 2 now boot, 3 now wall.
const LIVE: &str =
    "((boot_id = ?1 AND expires_boot_ms > ?2) OR (boot_id <> ?1 AND expires_wall_ms > ?3))";

/// One held permit, read or write, as the statements see it.
#[derive(Debug, Clone, Copy)]
pub(super) struct SharedHold<'a> {
    pub name: &'a str,
    pub family: &'static str,
    pub owner: &'a str,
    pub acquisition: AcquisitionId,
    pub fence: i64,
}

/// The acquisition id as stored (the same 64 bits, signed).
fn stored(id: AcquisitionId) -> i64 {
    i64::from_ne_bytes(id.get().to_ne_bytes())
}

/// An attempt at a permit, read or write (inside a `BEGIN IMMEDIATE` transaction).
pub(super) async fn acquire(
    conn: &mut SqliteConnection,
    req: &AcquireRequest,
    now: &Now,
    metadata: &str,
) -> sqlx::Result<Outcome> {
    let name = req.name.as_str();
    let fam = family(req.primitive);
    let prune = format!("DELETE FROM dlock_shared WHERE name = ?4 AND family = ?5 AND NOT {LIVE}");
    sqlx::query(sqlx::AssertSqlSafe(prune))
        .bind(&*now.boot_id)
        .bind(now.boot_ms)
        .bind(now.wall_ms)
        .bind(name)
        .bind(fam)
        .execute(&mut *conn)
        .await?;
    let rows = sqlx::query(
        "SELECT kind, owner, acquisition, boot_id, expires_boot_ms, expires_wall_ms \
         FROM dlock_shared WHERE name = ?1 AND family = ?2",
    )
    .bind(name)
    .bind(fam)
    .fetch_all(&mut *conn)
    .await?;
    let mut owners = Vec::with_capacity(rows.len());
    let mut soonest: Option<i64> = None;
    for r in &rows {
        let Some(kind) = EntryKind::parse(r.get::<&str, _>(0)) else {
            continue;
        };
        let acquisition: i64 = r.get(2);
        if kind.is_hold() {
            let left = now.remaining_ms(r.get(3), r.get(4), r.get(5));
            soonest = Some(soonest.map_or(left, |s| s.min(left)));
        }
        owners.push((kind, r.get::<String, _>(1), acquisition));
    }
    let live: Vec<LiveEntry<'_>> = owners
        .iter()
        .map(|(kind, owner, acq)| LiveEntry {
            kind: *kind,
            owner,
            acquisition: AcquisitionId::from_raw(u64::from_ne_bytes(acq.to_ne_bytes())),
        })
        .collect();
    let (kind, expiry, fence) = match decide(req, &live) {
        Verdict::UpgradeRefused => return Ok(Outcome::Refused),
        Verdict::Busy { want_write } => {
            let retry_after = soonest
                .filter(|ms| *ms > 0)
                .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
            match req.enqueue {
                Some(entry_ttl) if want_write => (EntryKind::WantWrite, entry_ttl, 0),
                _ => return Ok(Outcome::Busy(retry_after)),
            }
        }
        Verdict::Grant(kind) => {
            let fence: i64 = sqlx::query_scalar(
                "INSERT INTO dlock_counters (name, value) VALUES ('shared', 1) \
                 ON CONFLICT (name) DO UPDATE SET value = value + 1 RETURNING value",
            )
            .fetch_one(&mut *conn)
            .await?;
            (kind, req.ttl, fence)
        }
    };
    let (eb, ew) = now.after(expiry);
    // A grant replaces the acquisition's own waiting-writer row.
    sqlx::query(
        "INSERT OR REPLACE INTO dlock_shared \
         (name, family, owner, acquisition, kind, fence, boot_id, expires_boot_ms, expires_wall_ms, metadata) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    )
    .bind(name)
    .bind(fam)
    .bind(req.owner.as_str())
    .bind(stored(req.acquisition))
    .bind(kind.as_str())
    .bind(fence)
    .bind(&*now.boot_id)
    .bind(eb)
    .bind(ew)
    .bind(metadata)
    .execute(&mut *conn)
    .await?;
    Ok(if kind == EntryKind::WantWrite {
        Outcome::Busy(None)
    } else {
        Outcome::Granted(u64::try_from(fence).unwrap_or(0))
    })
}

/// Extend a live hold, never shortening it; `false` when it is no longer held.
pub(super) async fn renew(
    conn: &mut SqliteConnection,
    hold: &SharedHold<'_>,
    ttl: Duration,
    now: &Now,
) -> sqlx::Result<bool> {
    let (eb, ew) = now.after(ttl);
    let sql = format!(
        "UPDATE dlock_shared SET \
             expires_boot_ms = CASE WHEN boot_id = ?1 THEN MAX(expires_boot_ms, ?4) ELSE ?4 END, \
             expires_wall_ms = MAX(expires_wall_ms, ?5), \
             boot_id = ?1 \
         WHERE name = ?6 AND family = ?7 AND owner = ?8 AND acquisition = ?9 AND fence = ?10 \
           AND kind <> 'want-write' AND {LIVE}"
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&*now.boot_id)
        .bind(now.boot_ms)
        .bind(now.wall_ms)
        .bind(eb)
        .bind(ew)
        .bind(hold.name)
        .bind(hold.family)
        .bind(hold.owner)
        .bind(stored(hold.acquisition))
        .bind(hold.fence)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Give the hold back (nothing when it is gone already), without an fsync, as a
/// lock's release (see its `RELEASE` statement): left at the grant's
/// `synchronous=FULL`, it would cost a cycle a second disk flush.
pub(super) async fn release(
    conn: &mut SqliteConnection,
    hold: &SharedHold<'_>,
) -> sqlx::Result<()> {
    sqlx::query(
        "PRAGMA synchronous = NORMAL; \
         DELETE FROM dlock_shared WHERE name = ?1 AND family = ?2 AND owner = ?3 \
         AND acquisition = ?4 AND fence = ?5 AND kind <> 'want-write'",
    )
    .bind(hold.name)
    .bind(hold.family)
    .bind(hold.owner)
    .bind(stored(hold.acquisition))
    .bind(hold.fence)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Remove the acquisition's waiting-writer row, if any (without an fsync, as
/// [`release`]).
pub(super) async fn leave(conn: &mut SqliteConnection, req: &AcquireRequest) -> sqlx::Result<()> {
    sqlx::query(
        "PRAGMA synchronous = NORMAL; \
         DELETE FROM dlock_shared WHERE name = ?1 AND family = ?2 AND owner = ?3 \
         AND acquisition = ?4 AND kind = 'want-write'",
    )
    .bind(req.name.as_str())
    .bind(family(req.primitive))
    .bind(req.owner.as_str())
    .bind(stored(req.acquisition))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Every live hold of `name` in `family`, in token order: (kind, owner, token, lease
/// left in ms, metadata).
pub(super) async fn holders(
    conn: &mut SqliteConnection,
    name: &str,
    family: &str,
    now: &Now,
) -> sqlx::Result<Vec<(EntryKind, String, i64, i64, String)>> {
    let rows = sqlx::query(
        "SELECT kind, owner, fence, boot_id, expires_boot_ms, expires_wall_ms, metadata \
         FROM dlock_shared WHERE name = ?1 AND family = ?2 AND kind <> 'want-write' ORDER BY fence",
    )
    .bind(name)
    .bind(family)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let kind = EntryKind::parse(r.get::<&str, _>(0))?;
            let left = now.remaining_ms(r.get(3), r.get(4), r.get(5));
            (left > 0).then(|| (kind, r.get(1), r.get(2), left, r.get(6)))
        })
        .collect())
}
