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

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::node::Job;
use super::{Inner, RENEW};
use crate::error::{Error, Result};
use crate::lease::millis;
use crate::renewals::{Batching, by_ttl};

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
    /// How many batches were formed (tests watch it).
    #[cfg_attr(not(test), allow(dead_code))]
    formed: Arc<AtomicUsize>,
}

impl Renewer {
    pub(super) fn start(inner: Weak<Inner>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel::<Request>();
        let batching = Batching {
            max: MAX_BATCH,
            in_flight: IN_FLIGHT,
            abandoned: |r: &Request| r.reply.is_closed(),
        };
        let formed = batching.spawn(rx, move |batch| {
            let inner = inner.upgrade()?;
            Some(async move {
                for (ttl, same) in by_ttl(batch, |r| r.ttl) {
                    run(&inner, same, ttl).await;
                }
            })
        });
        Renewer { tx, formed }
    }

    /// How many batches were formed so far.
    #[cfg(test)]
    pub(super) fn batches_formed(&self) -> usize {
        self.formed.load(std::sync::atomic::Ordering::Relaxed)
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

/// What the nodes' answers to one grant's renewal say: the one place the quorum
/// arithmetic of a renewal lives (the batch's early exit and `renew`'s answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Verdict {
    /// A quorum extended the lease.
    Held,
    /// So many nodes no longer list this grant (`0`, or `-1`: another holds it) that
    /// no quorum is left: it can never be extended again (`NotOwner`).
    Refused,
    /// Neither, whatever the nodes still to answer say (`NoQuorum`).
    NoQuorum,
    /// Nodes still to answer could decide it.
    Open,
}

impl Verdict {
    /// From `held` (answered 1), `refused` (0 or −1) and `pending` (no answer yet;
    /// an error or a timeout is neither) of `nodes`, `quorum` needed.
    pub(super) fn of(
        held: usize,
        refused: usize,
        pending: usize,
        nodes: usize,
        quorum: usize,
    ) -> Self {
        let spare = nodes - quorum;
        if held >= quorum {
            Verdict::Held
        } else if refused > spare {
            Verdict::Refused
        } else if held + pending < quorum && refused + pending <= spare {
            Verdict::NoQuorum
        } else {
            Verdict::Open
        }
    }
}

/// One script call per node for `batch`, all of TTL `ttl`. Stops waiting once every
/// grant's answer is settled: held by a quorum of nodes; refused (`0` or `-1`) by so
/// many that no quorum is left (`NotOwner`); or neither possible whatever the nodes
/// still to answer say (`NoQuorum`). An error or a timeout is no refusal, so a grant
/// a majority refuses is told `NotOwner` even when a failed node answered first. Each
/// node's call is bounded by the call timeout.
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
                    let refused = answers
                        .iter()
                        .filter(|a| matches!(a, Some(Ok(v)) if matches!(v.get(i), Some(0 | -1))))
                        .count();
                    let pending = answers.iter().filter(|a| a.is_none()).count();
                    Verdict::of(held, refused, pending, nodes, quorum) != Verdict::Open
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

#[cfg(test)]
mod tests {
    use super::Verdict;

    /// The verdict once every node answered (`held` 1s, `refused` 0s or −1s, the rest
    /// errors or timeouts): what `renew` tells its caller.
    fn at_the_end(held: usize, refused: usize, nodes: usize, quorum: usize) -> Verdict {
        // Redlock's rule, stated apart from `Verdict::of`: extended on a majority;
        // else refused by more than a minority can be (never again a majority);
        // else no quorum.
        let rule = if held >= quorum {
            Verdict::Held
        } else if refused + quorum > nodes {
            Verdict::Refused
        } else {
            Verdict::NoQuorum
        };
        assert_eq!(
            Verdict::of(held, refused, 0, nodes, quorum),
            rule,
            "{held} held, {refused} refused of {nodes}, all answered"
        );
        rule
    }

    /// The early exit stops exactly when every way the pending nodes could still
    /// answer leads to the same verdict, and it is that verdict.
    #[test]
    fn a_verdict_is_settled_exactly_when_no_pending_answer_can_change_it() {
        for nodes in 1..=7 {
            let quorum = nodes / 2 + 1;
            for held in 0..=nodes {
                for refused in 0..=nodes - held {
                    for pending in 0..=nodes - held - refused {
                        let mut ends = std::collections::HashSet::new();
                        for more_held in 0..=pending {
                            for more_refused in 0..=pending - more_held {
                                ends.insert(at_the_end(
                                    held + more_held,
                                    refused + more_refused,
                                    nodes,
                                    quorum,
                                ));
                            }
                        }
                        let now = Verdict::of(held, refused, pending, nodes, quorum);
                        let settled = if ends.len() == 1 {
                            ends.iter().next().copied()
                        } else {
                            None
                        };
                        assert_eq!(
                            (now != Verdict::Open).then_some(now),
                            settled,
                            "{held} held, {refused} refused, {pending} pending of {nodes}"
                        );
                    }
                }
            }
        }
    }
}
