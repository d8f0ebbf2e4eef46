//! The one rule that decides a semaphore's or a read-write lock's grant from the holds
//! it has, written once for every backend that decides in Rust (memory, SQLite): the
//! backend reads the live entries of the name, asks [`decide`], and writes what it says
//! in the same critical section (a mutex, a `BEGIN IMMEDIATE` transaction).
//!
//! Every entry belongs to one acquisition (its owner and [`AcquisitionId`]), never to an
//! owner alone: two tasks sharing an owner hold two permits, and one of them leaving
//! cannot take the other's entry.
//!
//! Read-write policy: **a waiting writer goes first.** A writer that has to wait leaves
//! an entry (`WantWrite`, a lease of the queue-entry TTL its waiting loop refreshes, removed
//! by `leave_queue`), and no new reader is let in while one lives — except a reader
//! whose owner already holds the lock (read or write): refusing it could leave it
//! waiting on itself. Writers among themselves are not ordered. An owner that holds a
//! read and asks to write is refused ([`Verdict::UpgradeRefused`]): two readers
//! upgrading at once would wait for each other forever. An owner that holds the write
//! may also read (the write already excludes everyone else).

use crate::backend::{AcquireRequest, AcquisitionId, Primitive};

/// What one entry of a semaphore or read-write lock is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryKind {
    /// A held permit.
    Permit,
    /// A held read.
    Read,
    /// A held write.
    Write,
    /// A writer waiting (keeps new readers out).
    WantWrite,
}

// Stored names: used by the backends that keep entries in tables (and Redis's).
#[cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis"
    )),
    allow(dead_code)
)]
impl EntryKind {
    /// The name stored in a row.
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            EntryKind::Permit => "permit",
            EntryKind::Read => "read",
            EntryKind::Write => "write",
            EntryKind::WantWrite => "want-write",
        }
    }

    /// The kind a stored name stands for (`None`: written by something else).
    pub(crate) fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "permit" => EntryKind::Permit,
            "read" => EntryKind::Read,
            "write" => EntryKind::Write,
            "want-write" => EntryKind::WantWrite,
            _ => return None,
        })
    }

    /// What a holder of this entry holds (`None`: a waiting writer).
    pub(crate) fn hold_kind(self) -> Option<crate::backend::HoldKind> {
        use crate::backend::HoldKind;
        match self {
            EntryKind::Permit => Some(HoldKind::Permit),
            EntryKind::Read => Some(HoldKind::Read),
            EntryKind::Write => Some(HoldKind::Write),
            EntryKind::WantWrite => None,
        }
    }

    /// Whether the entry is a hold (not a waiting writer).
    pub(crate) fn is_hold(self) -> bool {
        !matches!(self, EntryKind::WantWrite)
    }
}

/// A live (unexpired) entry, as the deciding backend read it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LiveEntry<'a> {
    pub kind: EntryKind,
    pub owner: &'a str,
    pub acquisition: AcquisitionId,
}

/// What to do with an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Write an entry of this kind for the acquisition (replacing its `WantWrite`).
    Grant(EntryKind),
    /// Busy; `want_write`: take or refresh the acquisition's `WantWrite` entry (a
    /// writer that will wait).
    Busy { want_write: bool },
    /// The owner holds a read and asks to write.
    UpgradeRefused,
}

/// Which namespace a primitive's entries live in (a semaphore and a read-write lock of
/// one name are two things).
pub(crate) fn family(p: Primitive) -> &'static str {
    match p {
        Primitive::Permit { .. } => "semaphore",
        _ => "rwlock",
    }
}

/// A holder as `holders` shows it.
pub(crate) fn holder_info(
    name: &crate::name::LockName,
    kind: EntryKind,
    owner: String,
    fence: u64,
    remaining: Option<std::time::Duration>,
    metadata: crate::options::Metadata,
) -> crate::backend::LockInfo {
    let mut info = crate::backend::LockInfo::new(name, owner, 1, fence);
    info.remaining = remaining;
    info.metadata = metadata;
    info.hold = kind.hold_kind();
    info
}

/// Decide `req` (a permit, read or write) against the live entries of its name and
/// family. Entries of `req`'s own acquisition (its `WantWrite`) never block it.
pub(crate) fn decide(req: &AcquireRequest, live: &[LiveEntry<'_>]) -> Verdict {
    let others = || live.iter().filter(|e| e.acquisition != req.acquisition);
    let owner = req.owner.as_str();
    match req.primitive {
        Primitive::Permit { permits } => {
            let held = others().filter(|e| e.kind == EntryKind::Permit).count();
            if u64::try_from(held).unwrap_or(u64::MAX) < u64::from(permits) {
                Verdict::Grant(EntryKind::Permit)
            } else {
                Verdict::Busy { want_write: false }
            }
        }
        Primitive::Read => {
            let foreign_write = others().any(|e| e.kind == EntryKind::Write && e.owner != owner);
            let owner_holds = others().any(|e| e.kind.is_hold() && e.owner == owner);
            let writer_waits = others().any(|e| e.kind == EntryKind::WantWrite);
            if foreign_write || (writer_waits && !owner_holds) {
                Verdict::Busy { want_write: false }
            } else {
                Verdict::Grant(EntryKind::Read)
            }
        }
        Primitive::Write => {
            let foreign_hold = others().any(|e| e.kind.is_hold() && e.owner != owner);
            let owner_writes = others().any(|e| e.kind == EntryKind::Write && e.owner == owner);
            let owner_reads = others().any(|e| e.kind == EntryKind::Read && e.owner == owner);
            if owner_reads && !owner_writes {
                Verdict::UpgradeRefused
            } else if foreign_hold {
                Verdict::Busy {
                    want_write: req.enqueue.is_some(),
                }
            } else {
                Verdict::Grant(EntryKind::Write)
            }
        }
        // The lock is decided by each backend's own statements.
        _ => Verdict::Busy { want_write: false },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::name::LockName;
    use crate::options::{Metadata, Owner};

    fn req(owner: &Owner, primitive: Primitive, waits: bool) -> AcquireRequest {
        AcquireRequest {
            name: LockName::new("x").expect("name"),
            owner: owner.clone(),
            acquisition: AcquisitionId::new(),
            ttl: Duration::from_secs(10),
            fair: false,
            enqueue: waits.then_some(Duration::from_secs(5)),
            metadata: Metadata::default().into(),
            attempt: 0,
            will_wait: waits,
            primitive,
            campaign: None,
        }
    }

    fn entry<'a>(kind: EntryKind, owner: &'a Owner) -> LiveEntry<'a> {
        LiveEntry {
            kind,
            owner: owner.as_str(),
            acquisition: AcquisitionId::new(),
        }
    }

    #[test]
    fn permits_count_every_acquisition_whoever_owns_it() {
        let a = Owner::random();
        let two = Primitive::Permit { permits: 2 };
        let one = [entry(EntryKind::Permit, &a)];
        assert_eq!(
            decide(&req(&a, two, false), &one),
            Verdict::Grant(EntryKind::Permit)
        );
        let both = [entry(EntryKind::Permit, &a), entry(EntryKind::Permit, &a)];
        assert_eq!(
            decide(&req(&a, two, false), &both),
            Verdict::Busy { want_write: false },
            "a shared owner is no pass past the count"
        );
        assert_eq!(
            decide(&req(&a, Primitive::Permit { permits: 0 }, false), &[]),
            Verdict::Busy { want_write: false }
        );
    }

    #[test]
    fn readers_share_and_a_waiting_writer_goes_first() {
        let (r, w, other) = (Owner::random(), Owner::random(), Owner::random());
        let read = [entry(EntryKind::Read, &r)];
        assert_eq!(
            decide(&req(&other, Primitive::Read, true), &read),
            Verdict::Grant(EntryKind::Read)
        );
        assert_eq!(
            decide(&req(&w, Primitive::Write, true), &read),
            Verdict::Busy { want_write: true }
        );
        assert_eq!(
            decide(&req(&w, Primitive::Write, false), &read),
            Verdict::Busy { want_write: false },
            "a try_lock leaves no entry"
        );
        let waiting = [entry(EntryKind::Read, &r), entry(EntryKind::WantWrite, &w)];
        assert_eq!(
            decide(&req(&other, Primitive::Read, true), &waiting),
            Verdict::Busy { want_write: false },
            "a new reader passed a waiting writer"
        );
        assert_eq!(
            decide(&req(&r, Primitive::Read, true), &waiting),
            Verdict::Grant(EntryKind::Read),
            "a holding reader must not wait on itself"
        );
        let written = [entry(EntryKind::Write, &w)];
        assert_eq!(
            decide(&req(&other, Primitive::Read, true), &written),
            Verdict::Busy { want_write: false }
        );
        assert_eq!(
            decide(&req(&w, Primitive::Read, true), &written),
            Verdict::Grant(EntryKind::Read),
            "the writer may read"
        );
        assert_eq!(
            decide(&req(&w, Primitive::Write, true), &written),
            Verdict::Grant(EntryKind::Write),
            "the writer re-enters"
        );
    }

    #[test]
    fn an_upgrade_is_refused_and_a_writers_own_entry_never_blocks_it() {
        let (r, w) = (Owner::random(), Owner::random());
        let read = [entry(EntryKind::Read, &r)];
        assert_eq!(
            decide(&req(&r, Primitive::Write, true), &read),
            Verdict::UpgradeRefused
        );
        let want = req(&w, Primitive::Write, true);
        let mine = [LiveEntry {
            kind: EntryKind::WantWrite,
            owner: w.as_str(),
            acquisition: want.acquisition,
        }];
        assert_eq!(decide(&want, &mine), Verdict::Grant(EntryKind::Write));
    }
}
