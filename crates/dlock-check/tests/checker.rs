//! The checker itself, property-tested: clean synthetic histories report nothing, and
//! every injected anomaly is found.

use dlock_check::{Findings, Grant, StoreOp, check};
use proptest::prelude::*;

/// A clean history: `n` critical sections one after another, tokens strictly
/// increasing, each a read then a write of the current version.
fn clean(n: usize, gaps: &[u64]) -> (Vec<Grant>, Vec<StoreOp>) {
    let mut grants = Vec::new();
    let mut ops = Vec::new();
    let mut t = 0u64;
    let mut token = 0u64;
    for i in 0..n {
        let worker = u32::try_from(i % 5).unwrap_or(0);
        token += 1 + gaps[i % gaps.len()] % 3;
        t += 10 + gaps[i % gaps.len()];
        grants.push(Grant {
            at_ns: t,
            worker,
            token,
        });
        let op = |at_ns, write, version_read| StoreOp {
            at_ns,
            worker,
            lock: "l".into(),
            token,
            write,
            version_read,
            stale: false,
            accepted: true,
            lost_update: false,
        };
        ops.push(op(t + 1, false, 0));
        ops.push(op(t + 5, true, i as u64));
        t += 6;
    }
    (grants, ops)
}

#[derive(Debug, Clone, Copy)]
enum Anomaly {
    Overlap,
    DuplicateToken,
    Inversion,
    StaleAccepted,
    StaleRejected,
    LostUpdate,
}

fn inject(a: Anomaly, at: usize, grants: &mut [Grant], ops: &mut Vec<StoreOp>) {
    let i = at % (grants.len() - 1);
    match a {
        Anomaly::Overlap => {
            // Another worker's section starts inside section i.
            let mut intruder = ops[2 * i].clone();
            intruder.worker = 99;
            intruder.token = grants[i].token + 1_000_000;
            intruder.at_ns = ops[2 * i].at_ns + 2;
            ops.push(intruder);
        }
        Anomaly::DuplicateToken => grants[i + 1].token = grants[i].token,
        // Tokens start at 1, so this cannot underflow.
        Anomaly::Inversion => grants[i + 1].token = grants[i].token - 1,
        Anomaly::StaleAccepted => ops[2 * i + 1].stale = true,
        Anomaly::StaleRejected => {
            ops[2 * i + 1].stale = true;
            ops[2 * i + 1].accepted = false;
        }
        Anomaly::LostUpdate => ops[2 * i + 1].lost_update = true,
    }
}

fn anomaly() -> impl Strategy<Value = Anomaly> {
    prop_oneof![
        Just(Anomaly::Overlap),
        Just(Anomaly::DuplicateToken),
        Just(Anomaly::Inversion),
        Just(Anomaly::StaleAccepted),
        Just(Anomaly::StaleRejected),
        Just(Anomaly::LostUpdate),
    ]
}

proptest! {
    #[test]
    fn clean_histories_report_nothing(n in 1usize..300, gaps in prop::collection::vec(0u64..1000, 1..20)) {
        let (grants, ops) = clean(n, &gaps);
        prop_assert_eq!(check(&grants, &ops), Findings::default());
    }

    #[test]
    fn every_injected_anomaly_is_found(
        n in 3usize..300,
        gaps in prop::collection::vec(0u64..1000, 1..20),
        a in anomaly(),
        at in 0usize..10_000,
    ) {
        let (mut grants, mut ops) = clean(n, &gaps);
        inject(a, at, &mut grants, &mut ops);
        let f = check(&grants, &ops);
        let found = match a {
            Anomaly::Overlap => f.overlaps,
            Anomaly::DuplicateToken => f.duplicate_tokens,
            Anomaly::Inversion => f.token_inversions,
            Anomaly::StaleAccepted => f.stale_accepted,
            Anomaly::StaleRejected => f.stale_rejected,
            Anomaly::LostUpdate => f.lost_updates,
        };
        prop_assert!(found >= 1, "{:?} not found: {:?}", a, f);
    }
}

proptest! {
    /// A token source that forgot (tokens start over, as on a restarted Redis without
    /// persistence): duplicates are reported, but a worker given the same token twice
    /// has two critical sections, not one long one overlapping everyone else's.
    #[test]
    fn repeated_tokens_do_not_merge_sections(n in 10usize..200, gaps in prop::collection::vec(0u64..1000, 1..20)) {
        let (mut grants, mut ops) = clean(n, &gaps);
        // A multiple of the 5 workers, so the same worker gets the same token again.
        let half = (n / 10) * 5;
        for i in half..n {
            let token = grants[i - half].token;
            grants[i].token = token;
            ops[2 * i].token = token;
            ops[2 * i + 1].token = token;
        }
        let f = check(&grants, &ops);
        prop_assert!(f.duplicate_tokens >= 1);
        prop_assert_eq!(f.overlaps, 0);
    }
}
