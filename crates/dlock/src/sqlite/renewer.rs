//! Batched renewals: every held lease's keeper asks here, and one task renews whatever
//! requests are waiting when it gets the writer connection in one `BEGIN IMMEDIATE`
//! transaction. One file takes a few thousand commits a second: a lease renewed by a
//! commit of its own would cap one machine at a few ten thousand held locks, all of that
//! file's write capacity spent on renewals. Batched, a hundred thousand cost a few
//! commits per tick. A renewal needs no fsync (it moves no token, and the power loss
//! that could undo it ends every holder on this machine): a batch commits at
//! `synchronous=NORMAL`, a lone renewal at the level the connection was left at.
//!
//! Each request is its own `UPDATE`, owner- and token-checked exactly as alone, and
//! answers for itself (a lease no longer held answers `false`, the others are renewed
//! all the same). Expiry is `max(current, now + ttl)` as before, with `now` read when
//! the transaction starts — after every request in it was sent, so no lease ends before
//! the instant its keeper counts from. A batch that fails for anything but a busy
//! database is tried again one request at a time, so no lease's error is another's. A
//! request whose keeper stopped waiting for it is dropped unrun.
//!
//! The task runs on the runtime that opened the backend: the backend must not outlive
//! it (the connections' I/O is bound to it too).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::sqlite::SqliteConnection;
use sqlx::{Connection, SqlitePool};
use tokio::sync::{mpsc, oneshot};

use super::clock::Now;
use super::shared::{self, SharedHold};
use super::statements::{self, Hold, SyncLevel};
use super::{BusyBackoff, db_err};
use crate::backend::AcquisitionId;
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::options::Owner;

/// Most renewals in one transaction (it holds the file's write lock while it runs).
const MAX_BATCH: usize = 256;

/// The lease a renewal is for: a lock's row, or a permit's (read, write or semaphore).
#[derive(Debug)]
pub(super) enum Lease {
    Lock {
        name: LockName,
        owner: Owner,
        fence: i64,
    },
    Shared {
        name: LockName,
        family: &'static str,
        owner: Owner,
        acquisition: AcquisitionId,
        fence: i64,
    },
}

impl Lease {
    async fn renew(
        &self,
        conn: &mut SqliteConnection,
        ttl: Duration,
        now: &Now,
    ) -> sqlx::Result<bool> {
        match self {
            Lease::Lock { name, owner, fence } => {
                let hold = Hold {
                    name: name.as_str(),
                    owner: owner.as_str(),
                    fence: *fence,
                };
                statements::renew(conn, &hold, ttl, now).await
            }
            Lease::Shared {
                name,
                family,
                owner,
                acquisition,
                fence,
            } => {
                let hold = SharedHold {
                    name: name.as_str(),
                    family,
                    owner: owner.as_str(),
                    acquisition: *acquisition,
                    fence: *fence,
                };
                shared::renew(conn, &hold, ttl, now).await
            }
        }
    }
}

#[derive(Debug)]
struct Request {
    lease: Lease,
    ttl: Duration,
    reply: oneshot::Sender<Result<bool>>,
}

/// The handle keepers renew through; the task ends when the last handle is dropped.
#[derive(Debug)]
pub(super) struct Renewer {
    tx: mpsc::UnboundedSender<Request>,
    /// Batches run so far (what the tests observe).
    #[cfg_attr(not(test), allow(dead_code))]
    batches: Arc<AtomicU64>,
}

impl Renewer {
    /// Start the batching task on `writer`, the backend's one writing connection.
    /// `file`: the database is a file (a connection to it may be closed and opened
    /// again; an in-memory one would be lost with it).
    pub(super) fn start(writer: SqlitePool, boot_id: Arc<str>, file: bool) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Request>();
        let batches = Arc::new(AtomicU64::new(0));
        let counted = batches.clone();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut conn = match writer.acquire().await {
                    Ok(conn) => conn,
                    Err(e) => {
                        let _ = first.reply.send(Err(db_err(&e)));
                        continue;
                    }
                };
                // Everything that came while waiting for the connection goes along,
                // but not a request whose keeper stopped waiting for it (it gave up on
                // this renewal and will send another if the hold still stands).
                let batch =
                    crate::renewals::gather(first, &mut rx, MAX_BATCH, |r| r.reply.is_closed());
                if batch.is_empty() {
                    continue;
                }
                counted.fetch_add(1, Ordering::Relaxed);
                match renew_retrying(&mut conn, &boot_id, &batch).await {
                    Ok(flags) => {
                        for (r, held) in batch.into_iter().zip(flags) {
                            let _ = r.reply.send(Ok(held));
                        }
                    }
                    // A database still busy after the back-off would be as busy for
                    // each request alone: that is the answer for all of them.
                    Err(e) if batch.len() > 1 && !super::is_busy(&e) => {
                        tracing::debug!(error = %e, n = batch.len(), "sqlite: batched renewal failed; renewing one at a time");
                        for r in batch {
                            let one = renew_retrying(&mut conn, &boot_id, std::slice::from_ref(&r))
                                .await
                                .map(|flags| flags.first().copied().unwrap_or(false))
                                .map_err(|e| db_err(&e));
                            let _ = r.reply.send(one);
                        }
                        // SQLite may have rolled the batch back itself (a full disk),
                        // leaving sqlx counting a transaction that is gone.
                        super::mend_after_failure(conn, file);
                    }
                    Err(e) => {
                        for r in batch {
                            let _ = r.reply.send(Err(db_err(&e)));
                        }
                    }
                }
            }
        });
        Renewer { tx, batches }
    }

    /// How many batches the task has run.
    #[cfg(test)]
    pub(super) fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Extend `lease` to `ttl` from now; `Ok(false)` when it is no longer held.
    pub(super) async fn renew(&self, lease: Lease, ttl: Duration) -> Result<bool> {
        let stopped = || Error::connection("sqlite", "the renewal task has stopped");
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Request { lease, ttl, reply })
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// Renew `batch` (alone: one autocommitted statement; several: one transaction),
/// retrying while the database is busy.
async fn renew_retrying(
    conn: &mut SqliteConnection,
    boot_id: &Arc<str>,
    batch: &[Request],
) -> sqlx::Result<Vec<bool>> {
    let mut backoff = BusyBackoff::new(Duration::from_micros(50), Duration::from_micros(500));
    loop {
        match renew_all(conn, boot_id, batch).await {
            Err(e) if backoff.retry(&e).await => {}
            other => return other,
        }
    }
}

async fn renew_all(
    conn: &mut SqliteConnection,
    boot_id: &Arc<str>,
    batch: &[Request],
) -> sqlx::Result<Vec<bool>> {
    if let [one] = batch {
        let now = Now::read(boot_id);
        return Ok(vec![one.lease.renew(conn, one.ttl, &now).await?]);
    }
    let mut tx = conn.begin_with(SyncLevel::Normal.begin()).await?;
    // Read after the write lock is ours: later than every request's sending.
    let now = Now::read(boot_id);
    let mut flags = Vec::with_capacity(batch.len());
    for r in batch {
        flags.push(r.lease.renew(&mut tx, r.ttl, &now).await?);
    }
    tx.commit().await?;
    Ok(flags)
}
