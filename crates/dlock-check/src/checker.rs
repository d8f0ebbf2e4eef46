//! The offline checker of a `dlock check` history: O(n log n) over the grants the
//! workers reported (stamped by the collector's clock) and the fenced store's log
//! (stamped by the store's clock).

use std::collections::HashMap;

use serde::Serialize;

use crate::fenced::StoreOp;

/// A grant a worker reported: `acquire` returned this token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Grant {
    /// The collector's clock when it received the report, in nanoseconds.
    pub at_ns: u64,
    pub worker: u32,
    pub token: u64,
}

/// What the checker found. Every field is a count of anomalies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Findings {
    /// Critical sections (a worker's accepted store operations under one token) that
    /// overlap another's on the store's clock.
    pub overlaps: u64,
    /// Grants whose token another grant had already been given.
    pub duplicate_tokens: u64,
    /// Grants, in the collector's time order, with a token below an earlier grant's.
    pub token_inversions: u64,
    /// Operations the store accepted although their token was below the highest seen.
    pub stale_accepted: u64,
    /// Operations the store rejected as stale (fenced mode: the fence at work).
    pub stale_rejected: u64,
    /// Accepted writes based on a version that was no longer current.
    pub lost_updates: u64,
}

impl Findings {
    /// Whether a guarantee of a lock with fencing was broken: any stale operation
    /// accepted, a duplicate token or a lost update in fenced mode.
    #[must_use]
    pub fn fenced_violations(&self) -> u64 {
        self.stale_accepted + self.duplicate_tokens + self.lost_updates
    }
}

/// (lock, worker, token) of a critical section.
type SectionKey<'a> = (&'a str, u32, u64);

/// Check grants and the store log.
#[must_use]
pub fn check(grants: &[Grant], store: &[StoreOp]) -> Findings {
    let mut f = Findings::default();

    // Tokens: duplicates, and inversions against real (collector) time.
    let mut seen: HashMap<u64, u32> = HashMap::with_capacity(grants.len());
    let mut by_time: Vec<&Grant> = grants.iter().collect();
    by_time.sort_by_key(|g| (g.at_ns, g.token));
    let mut max_token = 0u64;
    for g in by_time {
        let n = seen.entry(g.token).or_insert(0);
        *n += 1;
        if *n > 1 {
            f.duplicate_tokens += 1;
        }
        if g.token < max_token {
            f.token_inversions += 1;
        }
        max_token = max_token.max(g.token);
    }

    // Store: stale operations and lost updates.
    for op in store {
        match (op.stale, op.accepted) {
            (true, true) => f.stale_accepted += 1,
            (_, false) => f.stale_rejected += 1,
            _ => {}
        }
        if op.accepted && op.write && op.lost_update {
            f.lost_updates += 1;
        }
    }

    // Critical sections on the store's clock: a worker's accepted read and the writes
    // after it (under the same token), per lock; overlaps by a sweep over their
    // starts. Keyed by the read, not by the token: a token source that forgot (a
    // restarted server without persistence) hands one worker the same token twice,
    // and those are two sections, not one long one.
    let mut accepted: Vec<&StoreOp> = store.iter().filter(|o| o.accepted).collect();
    accepted.sort_by_key(|o| (o.lock.as_str(), o.worker, o.at_ns));
    let mut sections: Vec<(SectionKey, (u64, u64))> = Vec::new();
    for op in accepted {
        let key = (op.lock.as_str(), op.worker, op.token);
        match sections.last_mut() {
            Some((k, span)) if op.write && *k == key => span.1 = span.1.max(op.at_ns),
            _ => sections.push((key, (op.at_ns, op.at_ns))),
        }
    }
    let mut list: Vec<(&str, u64, u64)> = sections
        .iter()
        .map(|((lock, _, _), (s, e))| (*lock, *s, *e))
        .collect();
    list.sort_unstable();
    let mut current: Option<(&str, u64)> = None;
    for (lock, start, end) in list {
        match current {
            Some((l, max_end)) if l == lock => {
                if start < max_end {
                    f.overlaps += 1;
                }
                current = Some((l, max_end.max(end)));
            }
            _ => current = Some((lock, end)),
        }
    }
    f
}
