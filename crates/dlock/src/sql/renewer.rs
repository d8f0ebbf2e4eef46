//! Batched lease renewals (lease mode): every held lease's keeper asks here, and one
//! task renews whatever requests are waiting with as few statements as the server
//! allows ([`Dialect::lease_renew_many`]: PostgreSQL one `INSERT … ON CONFLICT DO
//! UPDATE` per batch, which locks each row before judging it; MySQL one `UPDATE …
//! WHERE … IN (…)`). A lease renewed by a statement of its own costs the server a
//! statement and a commit per renewal: 100,000 held leases renewed every 10 s are
//! 10,000 a second, competing with the acquisitions.
//!
//! A batch is what waited while the batches before it ran (at most [`MAX_BATCH`], at
//! most [`IN_FLIGHT`] batches at once), one statement per TTL among them. Each hold
//! still answers for itself (one no longer held is refused, the others are renewed),
//! and expiry is still `max(current, now + ttl)` with the server's `now` of the
//! statement — after every request in the batch was sent. A request whose keeper
//! stopped waiting for it is dropped unrun. The task runs on the runtime that opened
//! the backend, which must not outlive it (its connections are bound to it too).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::dialect::{Dialect, Hold};
use crate::error::{Error, Result};
use crate::renewals::{Batching, by_ttl};

/// Most holds in one statement (bounded so one statement stays short on the server).
pub(crate) const MAX_BATCH: usize = 256;

/// Most batches running at once: a statement that hangs (a row locked by someone else,
/// a slow network) holds up only its own batch. Fewer with a small pool
/// ([`in_flight`]).
const IN_FLIGHT: usize = 4;

/// Batches running at once for a pool of `pool` connections: at most half of it, so
/// that hung renewals never take every connection from the acquisitions.
pub(crate) fn in_flight(pool: u32) -> usize {
    (pool as usize / 2).clamp(1, IN_FLIGHT)
}

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
    /// Start the batching task, with at most `in_flight` batches at once (each holds
    /// a lease connection while it runs).
    pub(crate) fn start<D: Dialect>(dialect: Arc<D>, in_flight: usize) -> Self {
        let (tx, rx) = mpsc::unbounded_channel::<Request>();
        let batching = Batching {
            max: MAX_BATCH,
            in_flight,
            abandoned: |r: &Request| r.reply.is_closed(),
        };
        batching.spawn(rx, move |batch| {
            let dialect = Arc::clone(&dialect);
            Some(async move { run(&*dialect, batch).await })
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

/// Renew `batch`: one statement per TTL among its requests, each request answered.
async fn run<D: Dialect>(dialect: &D, batch: Vec<Request>) {
    for (ttl, mut same) in by_ttl(batch, |r| r.ttl) {
        // In key order, which makes two batches touching the same rows (an owner
        // shared by two processes) likely to lock them in one order; a deadlock the
        // server still reports fails that batch, whose keepers retry.
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

/// How many different holds `holds` names (the same grant twice — two reentrant holds
/// of one owner — counts once: one row answers for both).
#[cfg(feature = "mysql")]
pub(crate) fn distinct(holds: &[Arc<Hold>]) -> usize {
    let mut seen: Vec<(&[u8; 32], &str, u64)> = holds
        .iter()
        .map(|h| (&h.key, h.owner.as_str(), h.fence))
        .collect();
    seen.sort_unstable();
    seen.dedup();
    seen.len()
}

/// Renewals never take more than half of a pool, nor fewer than one place.
#[test]
fn renewal_batches_in_flight_keep_half_the_pool_for_acquisitions() {
    let places: Vec<usize> = [1, 2, 3, 4, 5, 8, 10, 100].map(in_flight).into();
    assert_eq!(places, [1, 1, 1, 2, 2, 4, 4, 4]);
}

#[cfg(all(test, feature = "postgres", feature = "mysql"))]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use sqlx::{AssertSqlSafe, Connection};

    use crate::backend::{AcquireRequest, Attempt, Backend, HeldLock};
    use crate::error::Error;
    use crate::name::LockName;
    use crate::options::Owner;
    use crate::sql::lock_key;
    use crate::url::ConnectUrl;

    const N: usize = 40;
    /// How often the server's lock waits are read.
    const POLL: Duration = Duration::from_millis(150);
    /// The backends' pool, and their statement timeout: longer than the test holds
    /// its row locks, however slowly the machine runs.
    const POOL: u32 = 10;
    const OPTIONS: &str = "pool=10&timeout=60s";

    fn with_options(url: &str) -> String {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}{OPTIONS}")
    }

    fn request(name: &str) -> AcquireRequest {
        let name = LockName::new(name).expect("name");
        AcquireRequest::plain(name, Owner::random(), Duration::from_secs(30))
    }

    /// A server's own connection, for what the test does beside the backend.
    trait Side: Sized {
        async fn block_rows(&mut self, keys: &[[u8; 32]]);
        async fn unblock(&mut self);
        /// Each lease's expiry, in µs on the server's clock.
        async fn expiries(&mut self, keys: &[[u8; 32]]) -> Vec<i64>;
        /// How many statements wait for a row lock now (on a connection outside any
        /// transaction: PostgreSQL's activity view is one snapshot per transaction).
        /// Read at most every [`POLL`]: InnoDB refreshes its transaction view only
        /// when it was not read for 100 ms.
        async fn lock_waits(&mut self) -> i64;
    }

    impl Side for sqlx::PgConnection {
        async fn block_rows(&mut self, keys: &[[u8; 32]]) {
            sqlx::query("BEGIN")
                .execute(&mut *self)
                .await
                .expect("begin");
            for key in keys {
                sqlx::query("SELECT 1 FROM dlock_locks WHERE lock_key = $1 FOR UPDATE")
                    .bind(&key[..])
                    .execute(&mut *self)
                    .await
                    .expect("row lock");
            }
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
        async fn lock_waits(&mut self) -> i64 {
            sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
            )
            .fetch_one(&mut *self)
            .await
            .expect("lock waits")
        }
    }

    impl Side for sqlx::MySqlConnection {
        async fn block_rows(&mut self, keys: &[[u8; 32]]) {
            sqlx::query(AssertSqlSafe("BEGIN"))
                .execute(&mut *self)
                .await
                .expect("begin");
            for key in keys {
                sqlx::query("SELECT 1 FROM dlock_locks WHERE lock_key = ? FOR UPDATE")
                    .bind(&key[..])
                    .execute(&mut *self)
                    .await
                    .expect("row lock");
            }
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
        async fn lock_waits(&mut self) -> i64 {
            sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'",
            )
            .fetch_one(&mut *self)
            .await
            .expect("lock waits")
        }
    }

    /// Renew every hold at once: the first [`super::in_flight`], one after another, are
    /// each a batch of their own held up by a row lock of `side` (each seen waiting on
    /// the server by `watch` before the next is sent), so that every batch place is
    /// taken and the others wait together for the renewal task; their answers, in
    /// order.
    async fn renew_together<S: Side>(
        held: &[Arc<Box<dyn HeldLock>>],
        (side, watch): (&mut S, &mut S),
        keys: &[[u8; 32]],
        ttl: Duration,
    ) -> Vec<crate::error::Result<()>> {
        let blocked = super::in_flight(POOL);
        side.block_rows(&keys[..blocked]).await;
        let renew = |h: &Arc<Box<dyn HeldLock>>| {
            let h = Arc::clone(h);
            tokio::spawn(async move { h.renew(ttl).await })
        };
        let mut tasks = Vec::new();
        for (i, h) in held[..blocked].iter().enumerate() {
            tasks.push(renew(h));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while watch.lock_waits().await < i as i64 + 1 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "renewal {i} never waited for its row"
                );
                tokio::time::sleep(POLL).await;
            }
        }
        tasks.extend(held[blocked..].iter().map(renew));
        // Every request of the others reaches the renewal task while every batch
        // place is still taken (each is sent at its task's first poll).
        tokio::time::sleep(Duration::from_millis(300)).await;
        side.unblock().await;
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.expect("task"));
        }
        answers
    }

    /// Lease renewals waiting together are one statement (every row gets the same
    /// server timestamp), and each answers for itself: a hold given back is refused,
    /// the others in its batch are renewed.
    async fn batched_on<S: Side>(
        backend: Arc<dyn Backend>,
        side: &mut S,
        watch: &mut S,
        label: &str,
    ) {
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
        let answers = renew_together(
            &held,
            (&mut *side, &mut *watch),
            &keys,
            Duration::from_secs(90),
        )
        .await;
        for (i, a) in answers.iter().enumerate() {
            assert!(a.is_ok(), "{label}: hold {i}: {a:?}");
        }
        let after_first = side.expiries(&keys).await;
        let together = &after_first[super::in_flight(POOL)..];
        assert!(
            together.iter().all(|&e| e == together[0]),
            "{label}: the {} renewals that waited together were not one statement: {together:?}",
            together.len(),
        );
        held[7].release().await.expect("release");
        let answers = renew_together(
            &held,
            (&mut *side, &mut *watch),
            &keys,
            Duration::from_secs(120),
        )
        .await;
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
        let backend =
            crate::sql::postgres::open(ConnectUrl::parse(&with_options(&pg.url())).expect("url"))
                .await
                .expect("open");
        let pg_side = || async { sqlx::PgConnection::connect(&pg.url()).await.expect("side") };
        let (mut side, mut watch) = (pg_side().await, pg_side().await);
        batched_on(backend, &mut side, &mut watch, "postgres").await;
        let url = maria.url();
        let backend = crate::sql::mysql::open(ConnectUrl::parse(&with_options(&url)).expect("url"))
            .await
            .expect("open");
        let my_url = url.replacen("mariadb://", "mysql://", 1);
        let my_side = || async { sqlx::MySqlConnection::connect(&my_url).await.expect("side") };
        let (mut side, mut watch) = (my_side().await, my_side().await);
        batched_on(backend, &mut side, &mut watch, "mariadb").await;
    }
}
