//! Batched renewals: every held grant's keeper asks here, and one task renews whatever
//! requests are waiting with one script call per node (`scripts/renew.lua` takes many
//! grants), so a hundred thousand held locks cost each node a few calls per tick, not
//! ten thousand a second. The answers per node are split back per grant, and each
//! grant decides on its own quorum exactly as a renewal alone would.
//!
//! A batch is what waited while the batches before it ran (at most 512 grants, at most
//! four batches at once), one call per TTL among them. A request whose keeper stopped
//! waiting for it is dropped unrun. The task keeps only a weak reference to the
//! backend, so it ends with it; it runs on the runtime that opened the backend, which
//! must not outlive it. Several grants' keys in one call: every node must be a plain
//! Redis master (a cluster or a proxy that splits keys by slot refuses such a call).

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::node::Job;
use super::{Inner, RENEW};
use crate::error::{Error, Result};
use crate::lease::millis;

/// Most grants in one script call (bounded so one call never blocks a node for long).
const MAX_BATCH: usize = 512;

/// Batches running at once: a slow node holds up only its own batch.
pub(super) const IN_FLIGHT: usize = 4;

/// What each node answered for one grant (`None`: not waited for).
pub(super) type Answers = Vec<Option<Result<i64>>>;

#[derive(Debug)]
pub(super) struct Grant {
    pub lock: String,
    pub meta: String,
    pub token: String,
    pub owner: String,
    pub nonce: String,
}

struct Request {
    grant: Grant,
    ttl: Duration,
    reply: oneshot::Sender<Answers>,
}

/// The handle keepers renew through.
#[derive(Debug)]
pub(super) struct Renewer {
    tx: mpsc::UnboundedSender<Request>,
}

impl Renewer {
    pub(super) fn start(inner: Weak<Inner>) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Request>();
        tokio::spawn(async move {
            let in_flight = Arc::new(Semaphore::new(IN_FLIGHT));
            while let Some(first) = rx.recv().await {
                // While every batch place is taken, requests gather for the next.
                let Ok(place) = Arc::clone(&in_flight).acquire_owned().await else {
                    return;
                };
                let mut batch =
                    crate::renewals::gather(first, &mut rx, MAX_BATCH, |r| r.reply.is_closed());
                let Some(inner) = inner.upgrade() else {
                    return;
                };
                tokio::spawn(async move {
                    while let Some(ttl) = batch.first().map(|r| r.ttl) {
                        let (same, rest): (Vec<Request>, Vec<Request>) =
                            batch.into_iter().partition(|r| r.ttl == ttl);
                        batch = rest;
                        run(&inner, same, ttl).await;
                    }
                    drop(place);
                });
            }
        });
        Renewer { tx }
    }

    /// Renew `grant` to `ttl` on every node; each node's answer.
    ///
    /// # Errors
    /// Only when the renewal task is gone (the backend is being dropped).
    pub(super) async fn renew(&self, grant: Grant, ttl: Duration) -> Result<Answers> {
        let stopped = || Error::connection("redlock", "the renewal task has stopped");
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Request { grant, ttl, reply })
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())
    }
}

/// One script call per node for `batch`, all of TTL `ttl`. Stops waiting once every
/// grant's answer is settled — held by a quorum of nodes, or refused or unanswered by
/// so many that no quorum is left — as a renewal alone would; each node's call is
/// bounded by the call timeout.
async fn run(inner: &Inner, batch: Vec<Request>, ttl: Duration) {
    let mut inv = RENEW.prepare_invoke();
    inv.arg(millis(ttl));
    for r in &batch {
        let g = &r.grant;
        inv.key(&g.lock)
            .key(&g.meta)
            .key(&g.token)
            .arg(&g.owner)
            .arg(&g.nonce);
    }
    let (n, nodes, quorum) = (batch.len(), inner.nodes.len(), inner.quorum);
    let per_node = inner
        .fan_out_until::<Vec<i64>>(
            &inner.all(),
            inner.node_timeout(ttl),
            Job::Script(inv),
            |answers| {
                (0..n).all(|i| {
                    let held = answers
                        .iter()
                        .filter(|a| matches!(a, Some(Ok(v)) if v.get(i) == Some(&1)))
                        .count();
                    let not = answers
                        .iter()
                        .filter(|a| match a {
                            Some(Ok(v)) => v.get(i) != Some(&1),
                            Some(Err(_)) => true,
                            None => false,
                        })
                        .count();
                    held >= quorum || not > nodes - quorum
                })
            },
        )
        .await;
    for (i, r) in batch.into_iter().enumerate() {
        let answers = per_node
            .iter()
            .map(|node| match node {
                None => None,
                Some(Ok(v)) => Some(v.get(i).copied().ok_or_else(|| {
                    Error::backend("redlock", "a renewal answer is missing a grant")
                })),
                Some(Err(e)) => Some(Err(e.clone())),
            })
            .collect();
        let _ = r.reply.send(answers);
    }
}
