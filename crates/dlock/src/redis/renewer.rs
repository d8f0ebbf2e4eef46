//! Batched renewal: every held lock's keeper asks here, and one task turns whatever
//! requests are waiting into a single renew script over many keys — so thousands of
//! held locks cost a few commands per tick, not one each (Redisson's watchdog does the
//! same). On a cluster, keys of different slots cannot share a script: requests are
//! sent one by one there, concurrently.

use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::call::Call;
use super::conn::Conn;
use super::layout::{Key, Keys, Layout};
use crate::error::{Error, Result};
use crate::options::Owner;

/// Most holds in one renew script (bounded so one call never blocks Redis for long).
const MAX_BATCH: usize = 512;

struct Request {
    keys: Keys,
    /// The hold's own owner, shared (no copy per renewal).
    owner: Owner,
    fence: u64,
    ttl: Duration,
    reply: oneshot::Sender<Result<bool>>,
}

/// The handle keepers renew through.
#[derive(Debug, Clone)]
pub(crate) struct Renewer {
    tx: mpsc::UnboundedSender<Request>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("lock", &self.keys.lock)
            .finish_non_exhaustive()
    }
}

impl Renewer {
    /// Start the batching task (it ends when the last handle is dropped).
    pub(crate) fn start(conn: Conn, layout: Layout, cluster: bool) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Request>();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let batch =
                    crate::renewals::gather(first, &mut rx, MAX_BATCH, |r| r.reply.is_closed());
                if batch.is_empty() {
                    continue;
                }
                if cluster {
                    for r in batch {
                        let conn = conn.clone();
                        tokio::spawn(async move { run(conn, layout, vec![r]).await });
                    }
                } else {
                    run(conn.clone(), layout, batch).await;
                }
            }
        });
        Renewer { tx }
    }

    /// Extend one hold to `ttl`; `Ok(false)` when the grant is no longer held.
    pub(crate) async fn renew(
        &self,
        keys: &Keys,
        owner: &Owner,
        fence: u64,
        ttl: Duration,
    ) -> Result<bool> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Request {
                keys: keys.clone(),
                owner: owner.clone(),
                fence,
                ttl,
                reply,
            })
            .map_err(|_| Error::connection("redis", "the renewal task has stopped"))?;
        answer
            .await
            .map_err(|_| Error::connection("redis", "the renewal task has stopped"))?
    }
}

/// One renew script for the whole batch, written straight into one command (see
/// [`Call`]): per hold, `KEYS` the lock (then, on plain layouts, its metadata key and
/// counter) and `ARGV` the owner, the token and the lease in milliseconds.
async fn run(conn: Conn, layout: Layout, batch: Vec<Request>) {
    let mut keys = Vec::with_capacity(batch.len() * 3);
    for r in &batch {
        keys.push(Key::Plain(&r.keys.lock));
        if let Some(meta) = r.keys.meta_key() {
            keys.push(meta);
            keys.push(r.keys.counter_key());
        }
    }
    let mut call = Call::new(layout.renew_script(), &keys, batch.len() * 3);
    for r in &batch {
        let ms = u64::try_from(r.ttl.as_millis()).unwrap_or(u64::MAX);
        call.arg(r.owner.as_str()).arg(r.fence).arg(ms);
    }
    drop(keys);
    let outcome: redis::RedisResult<Vec<i64>> = call.run(&conn).await;
    match outcome {
        Ok(flags) => {
            for (i, r) in batch.into_iter().enumerate() {
                let _ = r.reply.send(Ok(flags.get(i) == Some(&1)));
            }
        }
        Err(e) => {
            let err = super::map_err(&e);
            for r in batch {
                let _ = r.reply.send(Err(err.clone()));
            }
        }
    }
}
