//! The order rule: how a read-write lock is decided on the backends that queue
//! contenders in order (ZooKeeper's sequential nodes, etcd's create revisions), written
//! once for both. The backend lists the contenders of a name in order (with the owner
//! each stored), asks [`decide`] for its own, and [`admitted`] for `holders()`.
//!
//! Curator's rule, refined by owners: **a read waits for every earlier write of
//! another owner, a write for every earlier contender of another owner** — a waiting
//! writer is never starved, and readers behind it wait for it. A contender is only
//! ever let in past contenders of its own owner, so any two let in at once are two
//! reads or share an owner, whichever order they are decided in and from whichever
//! listing (a contender's set of earlier ones only shrinks, and the rule stays true
//! as it does). A read passes its owner's earlier write only once that write is let
//! in (a writer may read; the read's token is then the higher), and an owner that
//! holds a read and no write is refused a write (an upgrade: two readers upgrading
//! would wait for each other forever).

use std::sync::Arc;

/// Which side of a read-write lock a contender is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Read,
    Write,
}

/// A contender of a read-write lock, as listed.
#[derive(Debug, Clone)]
pub(crate) struct Ordered {
    /// Its node or key (what a waiter watches), relative to the lock.
    pub key: String,
    pub side: Side,
    /// Its place: a ZooKeeper sequence, an etcd create revision.
    pub order: u64,
    /// The dlock owner it stores; `None` for another client's (never the same owner as
    /// anyone).
    pub owner: Option<Arc<str>>,
}

/// The error for [`Verdict::UpgradeRefused`].
pub(crate) fn refused(req: &crate::backend::AcquireRequest) -> crate::error::Error {
    crate::error::Error::UpgradeRefused {
        name: req.name.as_str().to_owned(),
    }
}

/// Whether the contenders `below` ours (lowest first) let a `side` in without knowing
/// their owners: nothing below a write, no write below a read.
pub(crate) fn clear_without_owners(below: &[Ordered], side: Side) -> bool {
    match side {
        Side::Write => below.is_empty(),
        Side::Read => below.iter().all(|e| e.side == Side::Read),
    }
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Grant,
    /// Wait for the deletion of this key (or node).
    Wait(String),
    UpgradeRefused,
}

fn same(a: Option<&Arc<str>>, b: Option<&Arc<str>>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a == b)
}

/// Which of `entries` (in order) the rule lets in: a write when every node below it
/// is its owner's; a read when every write below it is its owner's and let in.
pub(crate) fn admitted(entries: &[Ordered]) -> Vec<bool> {
    let mut ok: Vec<bool> = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let below = &entries[..i];
        let mine = |j: usize| same(below[j].owner.as_ref(), e.owner.as_ref());
        let let_in = match e.side {
            Side::Write => (0..i).all(mine) && !upgrade(below, &ok, mine),
            Side::Read => (0..i).all(|j| below[j].side == Side::Read || (mine(j) && ok[j])),
        };
        ok.push(let_in);
    }
    ok
}

/// Whether an owner (`mine`) holds a read and no write among `below` (let in: `ok`):
/// its write would be an upgrade.
fn upgrade(below: &[Ordered], ok: &[bool], mine: impl Fn(usize) -> bool) -> bool {
    let holds = |side: Side| (0..below.len()).any(|j| below[j].side == side && mine(j) && ok[j]);
    holds(Side::Read) && !holds(Side::Write)
}

/// The verdict for a `side` of `owner` whose earlier contenders are `below` (lowest
/// first, owners filled in): see the module documentation.
pub(crate) fn decide(below: &[Ordered], side: Side, owner: &Arc<str>) -> Verdict {
    let ok = admitted(below);
    let me = Some(owner);
    let mine = |j: usize| same(below[j].owner.as_ref(), me);
    match side {
        Side::Write => {
            if upgrade(below, &ok, mine) {
                return Verdict::UpgradeRefused;
            }
            match (0..below.len()).rev().find(|&j| !mine(j)) {
                Some(j) => Verdict::Wait(below[j].key.clone()),
                None => Verdict::Grant,
            }
        }
        Side::Read => {
            let blocking =
                (0..below.len()).find(|&j| below[j].side == Side::Write && !(mine(j) && ok[j]));
            match blocking {
                None => Verdict::Grant,
                // Our owner's write, not let in yet: watch it (gone: look again; let in:
                // the grant wakes its owner's other waiters of the name).
                Some(j) => Verdict::Wait(below[j].key.clone()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, owner: Option<&str>) -> Ordered {
        let side = if key.contains("W") {
            Side::Write
        } else {
            Side::Read
        };
        let order = key
            .rsplit('-')
            .next()
            .and_then(|n| n.parse().ok())
            .expect("order");
        Ordered {
            key: key.into(),
            side,
            order,
            owner: owner.map(Arc::from),
        }
    }

    #[test]
    fn reads_wait_for_earlier_writes_and_writes_for_everyone() {
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let r1 = entry("R-1", Some("a"));
        let w2 = entry("W-2", Some("b"));
        assert_eq!(
            decide(std::slice::from_ref(&r1), Side::Read, &b),
            Verdict::Grant
        );
        assert_eq!(
            decide(std::slice::from_ref(&r1), Side::Write, &b),
            Verdict::Wait(r1.key.clone())
        );
        // A read queued behind a waiting writer waits, even if its owner reads already
        // (letting it in would let that writer in beside it once the first read ends).
        assert_eq!(
            decide(&[r1.clone(), w2.clone()], Side::Read, &a),
            Verdict::Wait(w2.key.clone())
        );
        // An upgrade is refused; a writer reads; a reader of another client's node waits.
        assert_eq!(
            decide(std::slice::from_ref(&r1), Side::Write, &a),
            Verdict::UpgradeRefused
        );
        assert_eq!(
            decide(std::slice::from_ref(&w2), Side::Read, &b),
            Verdict::Grant
        );
        let foreign = entry("W-1", None);
        assert_eq!(
            decide(std::slice::from_ref(&foreign), Side::Read, &a),
            Verdict::Wait(foreign.key.clone())
        );
        // Our owner's write that still waits for another's read: a read of ours waits
        // too, watching that write (its deletion or its grant wakes the read).
        assert_eq!(
            decide(&[r1.clone(), w2.clone()], Side::Read, &b),
            Verdict::Wait(w2.key.clone())
        );
        // A write that is about to be refused (an upgrade) lets no second write in.
        let w3 = entry("W-3", Some("a"));
        assert_eq!(
            admitted(&[r1.clone(), entry("W-2", Some("a")), w3]),
            [true, false, false]
        );
    }

    #[test]
    fn any_two_nodes_let_in_together_are_reads_or_share_an_owner() {
        // Every order of up to 5 nodes over 2 owners and a foreign client, both sides.
        let owners = [Some("a"), Some("b"), None];
        for n in 1..=5u32 {
            for code in 0..6u32.pow(n) {
                let mut c = code;
                let entries: Vec<Ordered> = (0..n)
                    .map(|i| {
                        let (side, owner) = (c % 2, owners[(c / 2 % 3) as usize]);
                        c /= 6;
                        let marker = if side == 0 { "R" } else { "W" };
                        entry(&format!("{marker}-{}", i + 1), owner)
                    })
                    .collect();
                let ok = admitted(&entries);
                for i in 0..entries.len() {
                    for j in 0..i {
                        if ok[i] && ok[j] {
                            let (x, y) = (&entries[i], &entries[j]);
                            assert!(
                                (x.side == Side::Read && y.side == Side::Read)
                                    || same(x.owner.as_ref(), y.owner.as_ref()),
                                "{entries:?} lets in {x:?} and {y:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
