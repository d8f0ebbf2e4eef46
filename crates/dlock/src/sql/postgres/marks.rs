//! Waiter marks: a release sends its `NOTIFY` only when some process waits for a key
//! near it.
//!
//! A `NOTIFY` costs the server a write to its notification queue and a wake-up of every
//! listening session, and costs every listening dlock process a message — on every
//! release, waited for or not, and the more so the more processes listen. So a
//! process with waiters on a key *marks* the key's bucket (one of 64, by the key's
//! first six bits): its mark connection holds a shared
//! session-level advisory lock on (`MARK_SPACE`, bucket) — the two-`int4` form, a space
//! apart from the advisory mode's single-`bigint` locks — until a second after the
//! bucket's last waiter there left. 64 buckets keep a process within the lock-table
//! share PostgreSQL sizes per connection (`max_locks_per_transaction`, 64 by default),
//! however many keys it waits for; a bucket shared with other keys only costs them a
//! notification. A release asks `pg_try_advisory_xact_lock` on the same pair:
//!
//! - refused: a mark exists, so it notifies (delivered at its commit);
//! - granted: nobody marked the bucket, so it stays silent — and it holds that
//!   exclusive lock until its commit. A mark taken meanwhile waits for the commit.
//!
//! (A lease-mode lock waiter asks only while its key is neither held nor being taken
//! by its own backend, whose release wakes it anyway: `sql::LocalMark`.)
//!
//! A waiter that asks for the mark does not wait for it: when the task
//! takes a bucket's mark, it wakes one local waiter of each key in the bucket, and
//! that waiter's next attempt comes after the mark — it sees any release that stayed
//! silent before. A waiter is never stranded: its wait is still bounded by the re-poll
//! interval, whatever happens to the mark connection (it is pinged every second while
//! it holds marks, closed when it holds none, and made again as needed).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Executor};
use tokio::sync::mpsc;

use crate::notify::WakeOne;

/// The first `int4` of every mark ("dloc").
const MARK_SPACE: i32 = 0x646c_6f63;

/// How long a mark stays after its bucket's last waiter left.
const LINGER: Duration = Duration::from_secs(1);

/// The SQL a release announces itself with: `NOTIFY channel, hex` only if a waiter
/// marked the key's bucket. `hex` is an SQL expression for the key in lower-case hex,
/// `key` one for the key itself (`bytea`): the bucket is read from its first byte
/// (`get_byte`: cutting it out of the hex text and casting that through `bit(8)` cost
/// the server more on every release, as `pg_stat_statements` showed).
pub(super) fn notify_if_marked(channel: &str, hex: &str, key: &str) -> String {
    format!(
        "CASE WHEN pg_try_advisory_xact_lock({MARK_SPACE}, get_byte({key}, 0) >> 2) \
         THEN NULL ELSE pg_notify({channel}, {hex}) END"
    )
}

/// A key's bucket, as [`notify_if_marked`] reads it: its first six bits.
fn bucket(key: &[u8; 32]) -> i32 {
    i32::from(key[0] >> 2)
}

enum Cmd {
    /// A waiter on a key of the bucket.
    Mark(i32),
    /// A waiter on a key of the bucket is gone.
    Unmark(i32),
}

/// One backend's marks: the task that owns the mark connection.
#[derive(Debug)]
pub(super) struct Marks {
    tx: mpsc::UnboundedSender<Cmd>,
    task: tokio::task::JoinHandle<()>,
}

/// A waiter's mark: given up (a second after its bucket's last waiter) when dropped.
pub(crate) struct Mark {
    bucket: i32,
    tx: mpsc::UnboundedSender<Cmd>,
}

impl std::fmt::Debug for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mark")
            .field("bucket", &self.bucket)
            .finish()
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Unmark(self.bucket));
    }
}

impl Marks {
    /// Start the task; it connects with `connect` when the first key is marked.
    pub(super) fn start(
        connect: PgConnectOptions,
        hub: Arc<WakeOne<[u8; 32]>>,
        timeout: Duration,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(rx, connect, hub, timeout));
        Marks { tx, task }
    }

    /// Ask for `key`'s mark (the caller already watches the key locally: it is woken
    /// once the mark is taken, if it was not already).
    pub(super) fn mark(&self, key: &[u8; 32]) -> Mark {
        let bucket = bucket(key);
        let _ = self.tx.send(Cmd::Mark(bucket));
        Mark {
            bucket,
            tx: self.tx.clone(),
        }
    }
}

impl Drop for Marks {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether taking a mark may wait for a bucket held exclusively (by a release until
/// its commit, or by something outside dlock): up to `lock_timeout`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wait {
    No,
    Briefly,
}

/// One bucket the task keeps.
#[derive(Default)]
struct Bucket {
    /// Waiters of this process on keys of the bucket.
    waiters: u32,
    /// The mark is held on the connection.
    held: bool,
    /// Since when nobody waits (the mark is given up `LINGER` later).
    idle_since: Option<tokio::time::Instant>,
}

struct State {
    connect: PgConnectOptions,
    hub: Arc<WakeOne<[u8; 32]>>,
    timeout: Duration,
    conn: Option<PgConnection>,
    buckets: HashMap<i32, Bucket>,
}

async fn run(
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    connect: PgConnectOptions,
    hub: Arc<WakeOne<[u8; 32]>>,
    timeout: Duration,
) {
    let mut st = State {
        connect,
        hub,
        timeout,
        conn: None,
        buckets: HashMap::new(),
    };
    let mut check = tokio::time::interval(Duration::from_secs(1));
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            cmd = rx.recv() => {
                let Some(cmd) = cmd else { return };
                // Everything already asked, in one pass.
                let mut next = Some(cmd);
                while let Some(cmd) = next {
                    st.apply(cmd);
                    next = rx.try_recv().ok();
                }
                st.mark_all(Wait::No).await;
                st.close_if_unused().await;
            }
            // Nothing kept, nothing to check: the task sleeps until the next command.
            _ = check.tick(), if !st.buckets.is_empty() => st.check().await,
        }
    }
}

impl State {
    fn apply(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Mark(b) => {
                let bucket = self.buckets.entry(b).or_default();
                bucket.waiters += 1;
                bucket.idle_since = None;
            }
            Cmd::Unmark(b) => {
                if let Some(bucket) = self.buckets.get_mut(&b) {
                    bucket.waiters = bucket.waiters.saturating_sub(1);
                    if bucket.waiters == 0 {
                        if bucket.held {
                            bucket.idle_since = Some(tokio::time::Instant::now());
                        } else {
                            self.buckets.remove(&b);
                        }
                    }
                }
            }
        }
    }

    /// Take every mark waited for and not held, connecting if need be (twice at most:
    /// a connection found dead is made again at once); wake the waiters of each
    /// bucket newly marked. With `Wait::No` a bucket held exclusively is left for the
    /// next tick, so one busy bucket holds up no other.
    async fn mark_all(&mut self, wait: Wait) {
        for _ in 0..2 {
            if !self.buckets.values().any(|b| b.waiters > 0 && !b.held) {
                return;
            }
            if self.conn.is_none() && !self.connect_now().await {
                return;
            }
            let wanted: Vec<i32> = self
                .buckets
                .iter()
                .filter(|(_, b)| b.waiters > 0 && !b.held)
                .map(|(k, _)| *k)
                .collect();
            let mut broken = false;
            for b in wanted {
                let Some(conn) = self.conn.as_mut() else {
                    break;
                };
                let sql = match wait {
                    Wait::No => "SELECT pg_try_advisory_lock_shared($1, $2)",
                    Wait::Briefly => "SELECT true FROM (SELECT pg_advisory_lock_shared($1, $2)) m",
                };
                let taken = tokio::time::timeout(
                    self.timeout,
                    sqlx::query_scalar::<_, bool>(sql)
                        .bind(MARK_SPACE)
                        .bind(b)
                        .fetch_one(&mut *conn),
                )
                .await;
                match taken {
                    // Not now: the next tick waits for it.
                    Ok(Ok(false)) if wait == Wait::No => {}
                    Ok(Ok(_)) => {
                        if let Some(bucket) = self.buckets.get_mut(&b) {
                            bucket.held = true;
                        }
                        // A release of one of its keys may have stayed silent before.
                        self.hub.wake_where(|k| bucket(k) == b);
                    }
                    // Held exclusively past lock_timeout (by something outside dlock):
                    // this bucket's waiters poll; the next pass tries again.
                    Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("55P03") => {}
                    _ => {
                        broken = true;
                        break;
                    }
                }
            }
            if !broken {
                return;
            }
            self.drop_conn();
        }
    }

    async fn connect_now(&mut self) -> bool {
        let made = tokio::time::timeout(self.timeout, async {
            let mut c = PgConnection::connect_with(&self.connect).await?;
            // A mark waits for a release's commit; never for long on anything else,
            // and less than the statement timeout, so a wait is not taken for a dead
            // connection (at least 10 ms: 0 would mean no limit).
            let wait = (self.timeout / 2)
                .clamp(Duration::from_millis(10), Duration::from_secs(1))
                .as_millis();
            c.execute(sqlx::AssertSqlSafe(format!(
                "SET statement_timeout = 0; SET lock_timeout = '{wait}ms'"
            )))
            .await?;
            Ok::<_, sqlx::Error>(c)
        })
        .await;
        match made {
            Ok(Ok(c)) => {
                self.conn = Some(c);
                true
            }
            _ => {
                tracing::debug!("postgres: no waiter-mark connection; waiters poll");
                false
            }
        }
    }

    /// Every second: give up the marks nobody waited for since `LINGER` (and the
    /// connection with the last), check that the connection (and with it every mark)
    /// is still there, and take the marks still missing.
    async fn check(&mut self) {
        let due: Vec<i32> = self
            .buckets
            .iter()
            .filter(|(_, b)| b.idle_since.is_some_and(|t| t.elapsed() >= LINGER))
            .map(|(k, _)| *k)
            .collect();
        for b in due {
            self.buckets.remove(&b);
            if let Some(conn) = self.conn.as_mut() {
                let freed = tokio::time::timeout(
                    self.timeout,
                    sqlx::query("SELECT pg_advisory_unlock_shared($1, $2)")
                        .bind(MARK_SPACE)
                        .bind(b)
                        .execute(&mut *conn),
                )
                .await;
                if !matches!(freed, Ok(Ok(_))) {
                    self.drop_conn();
                }
            }
        }
        if self.close_if_unused().await {
            return;
        }
        if let Some(conn) = self.conn.as_mut()
            && !matches!(
                tokio::time::timeout(self.timeout, conn.ping()).await,
                Ok(Ok(()))
            )
        {
            self.drop_conn();
        }
        self.mark_all(Wait::Briefly).await;
    }

    /// With no bucket kept, no connection is kept either; `true` then.
    async fn close_if_unused(&mut self) -> bool {
        if !self.buckets.is_empty() {
            return false;
        }
        if let Some(conn) = self.conn.take() {
            let _ = tokio::time::timeout(self.timeout, conn.close()).await;
        }
        true
    }

    /// The connection is gone, and every mark with it.
    fn drop_conn(&mut self) {
        tracing::debug!("postgres: waiter-mark connection lost; marking again");
        self.conn = None;
        self.buckets.retain(|_, b| {
            b.held = false;
            b.waiters > 0
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bucket a mark takes is the one the release statement reads from the key:
    /// `get_byte(key, 0) >> 2`: 63 for a first byte 0xff, 1 for 0x07.
    #[test]
    fn buckets_match_the_statements_reading_of_the_key() {
        let mut key = [0u8; 32];
        key[0] = 0xff;
        assert_eq!(bucket(&key), 63);
        key[0] = 0x07;
        assert_eq!(bucket(&key), 1);
    }
}
