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

/// How many critical sections of one semaphore were open at once: `(most, over)`, where
/// `over` counts the section starts at which more than `permits` were open. A section
/// is a worker's accepted operations under one token (on the store's clock); sections
/// whose lock is `<group>` or begins with `<group>#` belong to the semaphore `group` (a
/// worker of a semaphore keeps its own cell `<group>#<worker>`).
#[must_use]
pub fn concurrency(store: &[StoreOp], group: &str, permits: u64) -> (u64, u64) {
    let mine = |lock: &str| {
        lock == group
            || lock
                .strip_prefix(group)
                .is_some_and(|rest| rest.starts_with('#'))
    };
    let mut spans: HashMap<(u32, u64), (u64, u64)> = HashMap::new();
    for op in store.iter().filter(|o| o.accepted && mine(&o.lock)) {
        let span = spans
            .entry((op.worker, op.token))
            .or_insert((op.at_ns, op.at_ns));
        span.0 = span.0.min(op.at_ns);
        span.1 = span.1.max(op.at_ns);
    }
    // Starts before ends at one instant: touching sections count as overlapping.
    let mut events: Vec<(u64, i8)> = spans
        .values()
        .flat_map(|&(s, e)| [(s, -1), (e, 1)])
        .collect();
    events.sort_unstable();
    let (mut open, mut most, mut over) = (0u64, 0u64, 0u64);
    for (_, kind) in events {
        if kind < 0 {
            open += 1;
            most = most.max(open);
            if open > permits {
                over += 1;
            }
        } else {
            open = open.saturating_sub(1);
        }
    }
    (most, over)
}

/// Writers of one read-write lock that overlapped anyone: sections (a worker's
/// accepted operations under one token, on the store's clock) whose lock is `group`
/// itself are writes, those of `<group>#<worker>` reads; the count is of the writes
/// that overlap another section of the group, read or write.
#[must_use]
pub fn writer_overlaps(store: &[StoreOp], group: &str) -> u64 {
    let mut spans: HashMap<(u32, u64, bool), (u64, u64)> = HashMap::new();
    for op in store.iter().filter(|o| o.accepted) {
        let write = op.lock == group;
        let read = op
            .lock
            .strip_prefix(group)
            .is_some_and(|rest| rest.starts_with('#'));
        if !(write || read) {
            continue;
        }
        let span = spans
            .entry((op.worker, op.token, write))
            .or_insert((op.at_ns, op.at_ns));
        span.0 = span.0.min(op.at_ns);
        span.1 = span.1.max(op.at_ns);
    }
    // By start: a write overlaps an earlier-starting section still open at its start,
    // or the next section starting before its end.
    let mut list: Vec<(u64, u64, bool)> = spans
        .iter()
        .map(|((_, _, write), (s, e))| (*s, *e, *write))
        .collect();
    list.sort_unstable();
    let mut max_end: Option<u64> = None;
    let mut count = 0;
    for (i, &(start, end, write)) in list.iter().enumerate() {
        let before = max_end.is_some_and(|m| m >= start);
        let after = list.get(i + 1).is_some_and(|n| n.0 <= end);
        if write && (before || after) {
            count += 1;
        }
        max_end = Some(max_end.map_or(end, |m| m.max(end)));
    }
    count
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn op(worker: u32, token: u64, at_ns: u64, lock: &str) -> StoreOp {
        StoreOp {
            at_ns,
            worker,
            lock: lock.into(),
            token,
            write: at_ns % 2 == 1,
            version_read: 0,
            stale: false,
            accepted: true,
            lost_update: false,
        }
    }

    #[test]
    fn concurrency_counts_sections_open_together() {
        // Workers 1 and 2 overlap (10..20 and 15..30); 3 starts as 2 ends (30..40),
        // which counts as overlapping.
        let log = [
            op(1, 5, 10, "s#1"),
            op(1, 5, 20, "s#1"),
            op(2, 6, 15, "s#2"),
            op(2, 6, 30, "s#2"),
            op(3, 7, 30, "s#3"),
            op(3, 7, 40, "s#3"),
            op(4, 8, 12, "other#4"),
            op(4, 8, 18, "other#4"),
        ];
        assert_eq!(concurrency(&log, "s", 2), (2, 0));
        assert_eq!(concurrency(&log, "s", 1), (2, 2));
        assert_eq!(concurrency(&log, "s", 3), (2, 0));
        assert_eq!(concurrency(&log, "other", 1), (1, 0));
        assert_eq!(
            concurrency(&log, "s#", 1),
            (0, 0),
            "a group is a whole name"
        );
    }

    #[test]
    fn writer_overlaps_count_writes_beside_anyone() {
        // Reads 1 and 2 together (10..20, 15..25); write 3 alone (30..40); write 4
        // (45..55) overlaps read 5 (50..60) that starts inside it; write 6 (70..80)
        // starts inside read 7 (65..75).
        let log = [
            op(1, 1, 10, "rw#1"),
            op(1, 1, 20, "rw#1"),
            op(2, 2, 15, "rw#2"),
            op(2, 2, 25, "rw#2"),
            op(3, 3, 30, "rw"),
            op(3, 3, 40, "rw"),
            op(4, 4, 45, "rw"),
            op(4, 4, 55, "rw"),
            op(5, 5, 50, "rw#5"),
            op(5, 5, 60, "rw#5"),
            op(7, 7, 65, "rw#7"),
            op(7, 7, 75, "rw#7"),
            op(6, 6, 70, "rw"),
            op(6, 6, 80, "rw"),
            op(8, 8, 31, "other"),
        ];
        assert_eq!(writer_overlaps(&log, "rw"), 2);
        assert_eq!(
            writer_overlaps(&log[..6], "rw"),
            0,
            "readers together are fine"
        );
    }
}
