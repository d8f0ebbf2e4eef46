//! Batched lease renewals (lease mode): every held lease's keeper asks here, and one
//! task renews whatever requests are waiting with as few statements as the server
//! allows ([`Dialect::lease_renew_many`]: PostgreSQL one `UPDATE … FROM unnest(…)`
//! per batch, MySQL one `UPDATE … WHERE … IN (…)`). A lease renewed by a statement of
//! its own costs the server a statement and a commit per renewal: 100,000 held leases
//! renewed every 10 s are 10,000 a second, competing with the acquisitions.
//!
//! Each hold still answers for itself (one no longer held is refused, the others are
//! renewed), and expiry is still `max(current, now + ttl)` with the server's `now` of
//! the statement — after every request in the batch was sent. Requests of different
//! TTLs go in separate statements.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::dialect::{Dialect, Hold};
use crate::error::{Error, Result};

/// Most holds in one statement (bounded so one statement stays short on the server).
pub(crate) const MAX_BATCH: usize = 256;

#[derive(Debug)]
struct Request {
    hold: Arc<Hold>,
    ttl: Duration,
    reply: oneshot::Sender<Result<bool>>,
}

/// The handle keepers renew through; the task ends when the last handle is dropped.
#[derive(Debug, Clone)]
pub(crate) struct LeaseRenewer {
    tx: mpsc::UnboundedSender<Request>,
    backend: &'static str,
}

impl LeaseRenewer {
    /// Start the batching task.
    pub(crate) fn start<D: Dialect>(dialect: Arc<D>) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Request>();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
                while let Some(ttl) = batch.first().map(|r| r.ttl) {
                    let (mut same, rest): (Vec<Request>, Vec<Request>) =
                        batch.into_iter().partition(|r| r.ttl == ttl);
                    batch = rest;
                    // In key order: two batches touching the same rows (an owner shared
                    // by two processes) lock them in one order.
                    same.sort_by_key(|r| r.hold.key);
                    let holds: Vec<Arc<Hold>> = same.iter().map(|r| Arc::clone(&r.hold)).collect();
                    match dialect.lease_renew_many(&holds, ttl).await {
                        Ok(flags) => {
                            for (r, held) in same.into_iter().zip(flags) {
                                let _ = r.reply.send(Ok(held));
                            }
                        }
                        Err(e) => {
                            for r in same {
                                let _ = r.reply.send(Err(e.clone()));
                            }
                        }
                    }
                }
            }
        });
        LeaseRenewer {
            tx,
            backend: D::BACKEND,
        }
    }

    /// Extend `hold` to at least `ttl` from now; `Ok(false)` when it is no longer held.
    pub(crate) async fn renew(&self, hold: &Arc<Hold>, ttl: Duration) -> Result<bool> {
        let stopped = || Error::connection(self.backend, "the renewal task has stopped");
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Request {
                hold: Arc::clone(hold),
                ttl,
                reply,
            })
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// How many different holds `holds` names (the same grant twice — two reentrant holds
/// of one owner — counts once: one row answers for both).
pub(crate) fn distinct(holds: &[Arc<Hold>]) -> usize {
    let mut seen: Vec<(&[u8; 32], &str, u64)> = holds
        .iter()
        .map(|h| (&h.key, h.owner.as_str(), h.fence))
        .collect();
    seen.sort_unstable();
    seen.dedup();
    seen.len()
}

#[cfg(all(test, feature = "postgres", feature = "mysql"))]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use sqlx::{AssertSqlSafe, Connection};

    use crate::backend::{AcquireRequest, AcquisitionId, Attempt, Backend, HeldLock, Primitive};
    use crate::error::Error;
    use crate::name::LockName;
    use crate::options::{Metadata, Owner};
    use crate::sql::lock_key;
    use crate::url::ConnectUrl;

    const N: usize = 40;

    fn request(name: &str) -> AcquireRequest {
        AcquireRequest {
            name: LockName::new(name).expect("name"),
            owner: Owner::random(),
            acquisition: AcquisitionId::new(),
            ttl: Duration::from_secs(30),
            fair: false,
            enqueue: None,
            metadata: Metadata::default(),
            attempt: 0,
            will_wait: false,
            primitive: Primitive::Lock,
            campaign: None,
        }
    }

    /// A server's own connection, for what the test does beside the backend.
    trait Side: Sized {
        async fn block_row(&mut self, key: &[u8; 32]);
        async fn unblock(&mut self);
        /// Each lease's expiry, in µs on the server's clock.
        async fn expiries(&mut self, keys: &[[u8; 32]]) -> Vec<i64>;
    }

    impl Side for sqlx::PgConnection {
        async fn block_row(&mut self, key: &[u8; 32]) {
            sqlx::query("BEGIN")
                .execute(&mut *self)
                .await
                .expect("begin");
            sqlx::query("SELECT 1 FROM dlock_locks WHERE lock_key = $1 FOR UPDATE")
                .bind(&key[..])
                .execute(&mut *self)
                .await
                .expect("row lock");
        }
        async fn unblock(&mut self) {
            sqlx::query("COMMIT")
                .execute(&mut *self)
                .await
                .expect("commit");
        }
        async fn expiries(&mut self, keys: &[[u8; 32]]) -> Vec<i64> {
            let mut all = Vec::new();
            for k in keys {
                let us: i64 = sqlx::query_scalar(
                    "SELECT (EXTRACT(EPOCH FROM expires_at) * 1000000)::bigint FROM dlock_locks WHERE lock_key = $1",
                )
                .bind(&k[..])
                .fetch_one(&mut *self)
                .await
                .expect("expiry");
                all.push(us);
            }
            all
        }
    }

    impl Side for sqlx::MySqlConnection {
        async fn block_row(&mut self, key: &[u8; 32]) {
            sqlx::query(AssertSqlSafe("BEGIN"))
                .execute(&mut *self)
                .await
                .expect("begin");
            sqlx::query("SELECT 1 FROM dlock_locks WHERE lock_key = ? FOR UPDATE")
                .bind(&key[..])
                .execute(&mut *self)
                .await
                .expect("row lock");
        }
        async fn unblock(&mut self) {
            sqlx::query(AssertSqlSafe("COMMIT"))
                .execute(&mut *self)
                .await
                .expect("commit");
        }
        async fn expiries(&mut self, keys: &[[u8; 32]]) -> Vec<i64> {
            let mut all = Vec::new();
            for k in keys {
                let us: i64 = sqlx::query_scalar(
                    "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '2000-01-01', expires_at) AS SIGNED) FROM dlock_locks WHERE lock_key = ?",
                )
                .bind(&k[..])
                .fetch_one(&mut *self)
                .await
                .expect("expiry");
                all.push(us);
            }
            all
        }
    }

    /// Renew every hold at once, the first held up by a row lock of `side` so that
    /// the others wait together for the renewal task; their answers, in order.
    async fn renew_together(
        held: &[Arc<Box<dyn HeldLock>>],
        side: &mut impl Side,
        first_key: &[u8; 32],
        ttl: Duration,
    ) -> Vec<crate::error::Result<()>> {
        side.block_row(first_key).await;
        let first = {
            let h = Arc::clone(&held[0]);
            tokio::spawn(async move { h.renew(ttl).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let rest: Vec<_> = held[1..]
            .iter()
            .map(|h| {
                let h = Arc::clone(h);
                tokio::spawn(async move { h.renew(ttl).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        side.unblock().await;
        let mut answers = vec![first.await.expect("task")];
        for t in rest {
            answers.push(t.await.expect("task"));
        }
        answers
    }

    /// Lease renewals waiting together are one statement (every row gets the same
    /// server timestamp), and each answers for itself: a hold given back is refused,
    /// the others in its batch are renewed.
    async fn batched_on(backend: Arc<dyn Backend>, side: &mut impl Side, label: &str) {
        let mut held = Vec::new();
        let mut keys = Vec::new();
        for i in 0..N {
            let req = request(&format!("batch-{label}-{i}"));
            keys.push(lock_key(&req.name));
            match backend.try_acquire(&req).await.expect("acquire") {
                Attempt::Acquired(h) => held.push(Arc::new(h)),
                Attempt::Busy { .. } => panic!("{label}: busy"),
            }
        }
        let answers = renew_together(&held, side, &keys[0], Duration::from_secs(90)).await;
        for (i, a) in answers.iter().enumerate() {
            assert!(a.is_ok(), "{label}: hold {i}: {a:?}");
        }
        let after_first = side.expiries(&keys).await;
        assert!(
            after_first[1..].iter().all(|&e| e == after_first[1]),
            "{label}: the {} renewals that waited together were not one statement: {:?}",
            N - 1,
            &after_first[1..]
        );
        held[7].release().await.expect("release");
        let answers = renew_together(&held, side, &keys[0], Duration::from_secs(120)).await;
        let after = side.expiries(&keys).await;
        for (i, a) in answers.iter().enumerate() {
            if i == 7 {
                assert!(
                    matches!(a, Err(Error::NotOwner { .. })),
                    "{label}: the given-back hold: {a:?}"
                );
            } else {
                assert!(a.is_ok(), "{label}: hold {i}: {a:?}");
                assert!(
                    after[i] >= after_first[i] + 25_000_000,
                    "{label}: hold {i} not renewed: {} -> {}",
                    after_first[i],
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lease_renewals_waiting_together_are_one_statement_and_answer_each_for_itself() {
        let (Some(pg), Some(maria)) = (
            dlock_testkit::PgServer::start(),
            dlock_testkit::MariaDbServer::start(),
        ) else {
            return;
        };
        let backend = crate::sql::postgres::open(ConnectUrl::parse(&pg.url()).expect("url"))
            .await
            .expect("open");
        let mut side = sqlx::PgConnection::connect(&pg.url()).await.expect("side");
        batched_on(backend, &mut side, "postgres").await;
        let url = maria.url();
        let backend = crate::sql::mysql::open(ConnectUrl::parse(&url).expect("url"))
            .await
            .expect("open");
        let mut side = sqlx::MySqlConnection::connect(&url.replacen("mariadb://", "mysql://", 1))
            .await
            .expect("side");
        batched_on(backend, &mut side, "mariadb").await;
    }
}
