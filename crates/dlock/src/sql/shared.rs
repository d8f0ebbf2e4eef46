//! Semaphores and read-write locks on PostgreSQL and MySQL/MariaDB, in every mode: two
//! tables of their own beside the lock's, created on first use (a user who only takes
//! locks needs no new table).
//!
//! `P_shared_gate` has one row per name and family (`semaphore`/`rwlock`): an attempt
//! upserts it first, which locks that row until commit or rollback, so attempts on one
//! name take turns; the upsert also draws the name's next token, which only a commit
//! keeps (strictly increasing per semaphore and read-write lock, durable as the
//! server's commits; an attempt that waits as a writer commits one it does not use).
//! `P_shared` has one row per held permit, read or write — and per waiting writer —
//! keyed by the acquisition, with its lease on the server's clock. In that one
//! transaction the attempt deletes the name's dead rows, reads the live ones (the gate,
//! the deletion and the read go in one round trip, each statement seeing what was
//! committed before it began, so the read sees every row committed while the gate was
//! awaited), asks [`crate::shared_holds::decide`] and writes what it says, on a
//! connection of the backend's own. A renewal and a release are one statement each.
//! An attempt that fails after it may have written (a lost commit reply) is undone by
//! its acquisition. The server ends an attempt whose client went silent, and frees the
//! gate, as each dialect's module documentation says.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use super::dialect::Dialect;
use crate::backend::{AcquireRequest, AcquisitionId, Attempt, HeldLock};
use crate::error::{Error, Result};
use crate::lease::millis;
use crate::notify::WakeOne;
use crate::shared_holds::{EntryKind, LiveEntry, Verdict, decide, family};

/// A live row, as an attempt reads it.
#[derive(Debug)]
pub(crate) struct SharedRow {
    pub kind: String,
    pub owner: String,
    pub acquisition: i64,
    /// Lease left by the server's clock.
    pub remaining_ms: i64,
}

/// What a removal takes away.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SharedRemove {
    /// The hold granted with this token.
    Token(u64),
    /// The acquisition's waiting-writer row.
    Want,
    /// Whatever the acquisition left (its attempt failed after it may have written).
    Any,
}

impl SharedRemove {
    /// The statement's selector and token.
    pub(crate) fn parts(self) -> (&'static str, i64) {
        match self {
            SharedRemove::Token(t) => ("token", i64::try_from(t).unwrap_or(i64::MAX)),
            SharedRemove::Want => ("want", 0),
            SharedRemove::Any => ("any", 0),
        }
    }
}

/// One row of `P_shared`, as renewals and removals name it.
#[derive(Debug, Clone)]
pub(crate) struct SharedKey {
    pub key: [u8; 32],
    /// `key` in hex: in the text of an attempt's first round trip ([`fill_in`]), and
    /// the release notification's payload (PostgreSQL).
    pub key_hex: String,
    pub family: &'static str,
    pub acquisition: i64,
}

impl SharedKey {
    pub(crate) fn of(req: &AcquireRequest) -> Self {
        let acquisition = i64::from_ne_bytes(req.acquisition.get().to_ne_bytes());
        Self::named(&req.name, req.primitive, acquisition)
    }

    /// The rows of `name`'s `primitive` family (`acquisition` 0: no acquisition's).
    pub(crate) fn named(
        name: &crate::name::LockName,
        primitive: crate::backend::Primitive,
        acquisition: i64,
    ) -> Self {
        let key = super::lock_key(name);
        SharedKey {
            key_hex: super::hex(&key),
            key,
            family: family(primitive),
            acquisition,
        }
    }
}

/// The text of an attempt's first round trip for `at`, from a dialect's template with
/// `{key}` and `{family}` where they go: neither needs quoting (hex digits, a fixed
/// word), and no bind can go in a batch of several statements.
pub(crate) fn fill_in(template: &str, at: &SharedKey) -> String {
    debug_assert!(at.family.bytes().all(|b| b.is_ascii_lowercase()));
    template
        .replace("{family}", at.family)
        .replace("{key}", &at.key_hex)
}

/// The outcome of one attempt.
enum Answer {
    Granted(u64),
    Busy(Option<Duration>),
    Refused,
}

/// One attempt at a permit, read or write: the transaction described above, in three
/// round trips when it writes (the gate, dead rows and live rows in the first) and two
/// when it does not (MySQL tries a deadlocked first round trip again).
async fn decide_in_tx<D: Dialect>(d: &D, req: &AcquireRequest, at: &SharedKey) -> Result<Answer> {
    let (mut tx, fence, rows) = d.shared_begin(at).await?;
    let live: Vec<LiveEntry<'_>> = rows
        .iter()
        .filter_map(|r| {
            Some(LiveEntry {
                kind: EntryKind::parse(&r.kind)?,
                owner: &r.owner,
                acquisition: AcquisitionId::from_raw(u64::from_ne_bytes(
                    r.acquisition.to_ne_bytes(),
                )),
            })
        })
        .collect();
    let verdict = decide(req, &live);
    let soonest = rows
        .iter()
        .filter(|r| EntryKind::parse(&r.kind).is_some_and(EntryKind::is_hold))
        .map(|r| r.remaining_ms)
        .filter(|ms| *ms > 0)
        .min()
        .map(|ms| Duration::from_millis(ms.unsigned_abs()));
    let answer = match verdict {
        // Nothing was written: should the rollback fail, its connection is dropped,
        // which ends the transaction all the same.
        Verdict::UpgradeRefused => {
            rolled_back(d.shared_rollback(tx).await);
            return Ok(Answer::Refused);
        }
        Verdict::Busy { want_write } => match req.enqueue {
            Some(entry_ttl) if want_write => {
                d.shared_put(&mut tx, req, at, EntryKind::WantWrite, 0, entry_ttl)
                    .await?;
                Answer::Busy(soonest)
            }
            _ => {
                rolled_back(d.shared_rollback(tx).await);
                return Ok(Answer::Busy(soonest));
            }
        },
        Verdict::Grant(kind) => {
            d.shared_put(&mut tx, req, at, kind, fence, req.ttl).await?;
            Answer::Granted(fence)
        }
    };
    d.shared_commit(tx).await?;
    Ok(answer)
}

/// A rollback of an attempt that wrote nothing: one that failed dropped its connection,
/// which ends the transaction all the same; said at debug level.
fn rolled_back(r: Result<()>) {
    if let Err(e) = r {
        tracing::debug!(error = %e, "rollback of an attempt that wrote nothing failed; its connection is closed");
    }
}

/// An attempt at a permit, read or write on `d`.
pub(crate) async fn acquire<D: Dialect>(
    d: &Arc<D>,
    hub: &Arc<WakeOne<[u8; 32]>>,
    req: &AcquireRequest,
) -> Result<Attempt> {
    let at = SharedKey::of(req);
    match decide_in_tx(&**d, req, &at).await {
        Ok(Answer::Granted(fence)) => Ok(Attempt::Acquired(Box::new(SqlSharedHeld {
            dialect: Arc::clone(d),
            hub: Arc::clone(hub),
            at,
            name: req.name.as_str().to_owned(),
            fence,
            lease_ms: AtomicU64::new(millis(req.ttl)),
        }))),
        Ok(Answer::Busy(retry_after)) => Ok(Attempt::Busy { retry_after }),
        Ok(Answer::Refused) => Err(Error::UpgradeRefused {
            name: req.name.as_str().to_owned(),
        }),
        Err(e) => {
            // The commit may have landed with its reply lost: undo whatever this
            // acquisition wrote (it ends with this error; nothing of it can follow).
            // Taking the name's gate first waits for that commit to finish (the
            // attempt's transaction holds the gate until it does), so the removal sees
            // its row if it landed.
            // Until the server answers, for as long as the lease it may have granted.
            let (d, hub) = (Arc::clone(d), Arc::clone(hub));
            let within = req.ttl + Duration::from_secs(1);
            crate::finish::release_later(CancellationToken::new(), within, move || {
                let (d, hub, at) = (Arc::clone(&d), Arc::clone(&hub), at.clone());
                async move {
                    let gated = match d.shared_begin(&at).await {
                        Ok((tx, _, _)) => d.shared_rollback(tx).await.is_ok(),
                        Err(_) => false,
                    };
                    if !gated {
                        return false;
                    }
                    match d.shared_remove(&at, SharedRemove::Any).await {
                        Ok(removed) => {
                            if removed {
                                hub.wake(&at.key);
                            }
                            true
                        }
                        Err(_) => false,
                    }
                }
            });
            Err(e)
        }
    }
}

/// Remove a waiting writer's row (`leave_queue`).
pub(crate) async fn leave<D: Dialect>(
    d: &D,
    hub: &WakeOne<[u8; 32]>,
    req: &AcquireRequest,
) -> Result<()> {
    let at = SharedKey::of(req);
    if d.shared_remove(&at, SharedRemove::Want).await? {
        hub.wake(&at.key);
    }
    Ok(())
}

/// One held permit, read or write.
struct SqlSharedHeld<D> {
    dialect: Arc<D>,
    hub: Arc<WakeOne<[u8; 32]>>,
    at: SharedKey,
    name: String,
    fence: u64,
    /// The lease last asked for (ms): how long a release that could not get through
    /// is worth trying again.
    lease_ms: AtomicU64,
}

impl<D> std::fmt::Debug for SqlSharedHeld<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlSharedHeld")
            .field("name", &self.name)
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<D: Dialect> HeldLock for SqlSharedHeld<D> {
    fn fencing_token(&self) -> u64 {
        self.fence
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        if self.dialect.shared_renew(&self.at, self.fence, ttl).await? {
            self.lease_ms.store(millis(ttl), Ordering::Relaxed);
            Ok(())
        } else {
            Err(Error::NotOwner {
                name: self.name.clone(),
            })
        }
    }

    async fn release(&self) -> Result<()> {
        let removed = match self
            .dialect
            .shared_remove(&self.at, SharedRemove::Token(self.fence))
            .await
        {
            Ok(removed) => removed,
            Err(e) => {
                // Keep trying in the background (this entry alone: by acquisition and
                // token), or the lease would keep it from everyone until it ran out.
                let (d, hub, at, fence) = (
                    Arc::clone(&self.dialect),
                    Arc::clone(&self.hub),
                    self.at.clone(),
                    self.fence,
                );
                let within = Duration::from_millis(self.lease_ms.load(Ordering::Relaxed))
                    + Duration::from_secs(1);
                crate::finish::release_later(CancellationToken::new(), within, move || {
                    let (d, hub, at) = (Arc::clone(&d), Arc::clone(&hub), at.clone());
                    async move {
                        match d.shared_remove(&at, SharedRemove::Token(fence)).await {
                            Ok(removed) => {
                                if removed {
                                    hub.wake(&at.key);
                                }
                                true
                            }
                            Err(_) => false,
                        }
                    }
                });
                return Err(e);
            }
        };
        if removed {
            self.hub.wake(&self.at.key);
        }
        Ok(())
    }
}
