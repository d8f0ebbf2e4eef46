//! Semaphores and read-write locks on ZooKeeper, in Curator's layouts (the module
//! rustdoc of [`super`] describes them for users).
//!
//! Every attempt is kept in the backend's `queued` map under its acquisition, as a
//! lock's is: `leave_queue` deletes exactly the nodes that attempt created.

use std::sync::Arc;

use zookeeper_client as zk;

use super::{Created, Inner, Queued, RECHECK, SCHEME, Session, delete_node, map_err};
use crate::backend::{AcquireRequest, Attempt, LockInfo, Primitive};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::queue::StoredHolder;
use crate::shared_holds::EntryKind;

/// The nodes of a semaphore (Curator's `InterProcessSemaphoreV2`).
pub(super) struct SemaphorePaths {
    /// The mutex every acquirer holds while it takes a lease.
    pub locks: String,
    /// The leases' parent: one ephemeral sequential child per permit.
    pub leases: String,
}

/// `<root>/%semaphore/<name>`: no lock name encodes to `%semaphore`.
pub(super) fn semaphore_paths(inner: &Inner, name: &LockName) -> SemaphorePaths {
    let base = format!("{}/%semaphore/{}", inner.root, name.encoded());
    SemaphorePaths {
        locks: format!("{base}/locks"),
        leases: format!("{base}/leases"),
    }
}

/// `<root>/%rwlock/<name>` (Curator's `InterProcessReadWriteLock` base path).
pub(super) fn rwlock_dir(inner: &Inner, name: &LockName) -> String {
    format!("{}/%rwlock/{}", inner.root, name.encoded())
}

/// Which side of a read-write lock a node is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Read,
    Write,
}

/// A read-write lock child's side and sequence: Curator's `__WRIT__`/`__READ__` names,
/// or kazoo's `__lock__`/`__rlock__`; anything else is not a contender.
fn rw_node(child: &str) -> Option<(Side, u64)> {
    for (marker, side) in [
        ("__WRIT__", Side::Write),
        ("__READ__", Side::Read),
        ("__rlock__", Side::Read),
        ("__lock__", Side::Write),
    ] {
        if let Some(i) = child.rfind(marker) {
            let tail = child.get(i + marker.len()..)?;
            if tail.is_empty() || !tail.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            return Some((side, tail.parse().ok()?));
        }
    }
    None
}

/// A contender of a read-write lock, as listed.
#[derive(Debug, Clone)]
struct RwEntry {
    child: String,
    side: Side,
    seq: u64,
    /// The dlock owner stored in the node; `None` for another client's node (never the
    /// same owner as anyone).
    owner: Option<Arc<str>>,
}

/// The contenders among `children`, lowest sequence first.
fn rw_entries(children: Vec<String>) -> Vec<RwEntry> {
    let mut entries: Vec<RwEntry> = children
        .into_iter()
        .filter_map(|child| {
            let (side, seq) = rw_node(&child)?;
            Some(RwEntry {
                child,
                side,
                seq,
                owner: None,
            })
        })
        .collect();
    entries.sort_by_key(|e| e.seq);
    entries
}

#[derive(Debug, PartialEq, Eq)]
enum RwVerdict {
    Grant,
    /// Wait for this child's deletion.
    Wait(String),
    UpgradeRefused,
}

fn same(a: Option<&Arc<str>>, b: Option<&Arc<str>>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a == b)
}

/// Which of `entries` (in order) the rule lets in: a write when every node below it
/// is its owner's; a read when every write below it is its owner's and let in.
fn admitted(entries: &[RwEntry]) -> Vec<bool> {
    let mut ok: Vec<bool> = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let below = &entries[..i];
        let mine = |j: usize| same(below[j].owner.as_ref(), e.owner.as_ref());
        let let_in = match e.side {
            Side::Write => (0..i).all(mine),
            Side::Read => (0..i).all(|j| below[j].side == Side::Read || (mine(j) && ok[j])),
        };
        ok.push(let_in);
    }
    ok
}

/// The order rule (Curator's, with owners): a read waits for every earlier write
/// of another owner, a write for every earlier node of another owner. A node is only
/// ever let in past nodes of its own owner, so any two nodes let in at once are two
/// reads or share an owner, whatever order they are decided in. A read is let in past
/// its owner's write only once that write is let in (its token is then the higher),
/// and an owner that holds a read and no write may not write (an upgrade).
///
/// `below`: the contenders below ours, lowest first, with owners.
fn rw_decide(below: &[RwEntry], side: Side, owner: &Arc<str>) -> RwVerdict {
    let ok = admitted(below);
    let me = Some(owner);
    let mine = |j: usize| same(below[j].owner.as_ref(), me);
    match side {
        Side::Write => {
            let reads = (0..below.len()).any(|j| below[j].side == Side::Read && mine(j) && ok[j]);
            let writes = (0..below.len()).any(|j| below[j].side == Side::Write && mine(j) && ok[j]);
            if reads && !writes {
                return RwVerdict::UpgradeRefused;
            }
            match (0..below.len()).rev().find(|&j| !mine(j)) {
                Some(j) => RwVerdict::Wait(below[j].child.clone()),
                None => RwVerdict::Grant,
            }
        }
        Side::Read => {
            let blocking =
                (0..below.len()).find(|&j| below[j].side == Side::Write && !(mine(j) && ok[j]));
            match blocking {
                None => RwVerdict::Grant,
                // Our owner's write, not let in yet: watch what holds it back.
                Some(j) if mine(j) => {
                    let k = (0..j).rev().find(|&k| !mine(k)).unwrap_or(j);
                    RwVerdict::Wait(below[k].child.clone())
                }
                Some(j) => RwVerdict::Wait(below[j].child.clone()),
            }
        }
    }
}

/// Fill in the owners of `entries` (from the cache, else read from their nodes, all
/// requests sent before the first answer is awaited). A node gone meanwhile is dropped.
async fn fill_owners(
    inner: &Inner,
    session: &Session,
    dir: &str,
    entries: &mut Vec<RwEntry>,
) -> Result<()> {
    let mut gone = Vec::new();
    {
        let cache = inner
            .owners
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for e in entries.iter_mut() {
            if let Some(o) = cache.get(&format!("{dir}/{}", e.child)) {
                e.owner.clone_from(o);
            }
        }
    }
    let asks: Vec<(usize, _)> = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.owner.is_none())
        .map(|(i, e)| (i, session.client.get_data(&format!("{dir}/{}", e.child))))
        .collect();
    let mut learned = Vec::new();
    for (i, ask) in asks {
        match ask.await {
            Ok((data, _)) => {
                let owner: Option<Arc<str>> =
                    StoredHolder::decode(&data).map(|s| Arc::from(s.owner));
                entries[i].owner.clone_from(&owner);
                learned.push((format!("{dir}/{}", entries[i].child), owner));
            }
            Err(zk::Error::NoNode) => gone.push(i),
            Err(e) => return Err(map_err(&e)),
        }
    }
    {
        let mut cache = inner
            .owners
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if cache.len() > 4096 {
            cache.clear();
        }
        cache.extend(learned);
    }
    for i in gone.into_iter().rev() {
        entries.remove(i);
    }
    Ok(())
}

/// Decide an attempt at the read-write lock: `mine` is our node's sequence (`None`:
/// not created yet, i.e. above everything listed).
async fn rw_verdict(
    inner: &Inner,
    session: &Session,
    dir: &str,
    children: Vec<String>,
    mine: Option<u64>,
    side: Side,
    owner: &Arc<str>,
) -> Result<RwVerdict> {
    let mut below: Vec<RwEntry> = rw_entries(children)
        .into_iter()
        .filter(|e| mine.is_none_or(|m| e.seq < m))
        .collect();
    // Without reading any node: nothing below a write, no write below a read.
    let clear = match side {
        Side::Write => below.is_empty(),
        Side::Read => below.iter().all(|e| e.side == Side::Read),
    };
    if clear {
        return Ok(RwVerdict::Grant);
    }
    fill_owners(inner, session, dir, &mut below).await?;
    Ok(rw_decide(&below, side, owner))
}

async fn list(session: &Session, dir: &str) -> Result<Vec<String>> {
    match session.client.list_children(dir).await {
        Ok(c) => Ok(c),
        Err(zk::Error::NoNode) => Ok(Vec::new()),
        Err(e) => Err(map_err(&e)),
    }
}

fn busy() -> Attempt {
    Attempt::Busy {
        retry_after: Some(RECHECK),
    }
}

fn refused(req: &AcquireRequest) -> Error {
    Error::UpgradeRefused {
        name: req.name.as_str().to_owned(),
    }
}

/// Our node is gone while we wait: its session expired.
fn vanished() -> Error {
    Error::connection(
        SCHEME,
        "our node is gone (the session expired while waiting)",
    )
}

/// Drop an attempt's node when the attempt ends without a grant (a delete that cannot
/// get through now is finished in the background).
async fn abandon(session: &Arc<Session>, node: &str) {
    if let Err(e) = delete_node(session, node).await {
        tracing::debug!(%node, error = %e, "deleting an abandoned node later");
    }
}

/// One attempt at a read or a write.
pub(super) async fn try_rwlock(inner: &Arc<Inner>, req: &AcquireRequest) -> Result<Attempt> {
    let dir = rwlock_dir(inner, &req.name);
    let side = if req.primitive == Primitive::Write {
        Side::Write
    } else {
        Side::Read
    };
    let owner: Arc<str> = Arc::from(req.owner.as_str());
    let slot = (dir.clone(), req.acquisition.get());
    let existing = inner.queued().remove(&slot);
    let (mut q, listed) = match existing {
        Some(q) => {
            if let Err(e) = q.session.check() {
                inner.queued().insert(slot, q);
                return Err(e);
            }
            (q, None)
        }
        None => {
            let session = inner.session().await?;
            if req.attempt == 0 && !req.will_wait {
                // Look before writing anything.
                let children = list(&session, &dir).await?;
                match rw_verdict(inner, &session, &dir, children, None, side, &owner).await? {
                    RwVerdict::Grant => {}
                    RwVerdict::Wait(_) => return Ok(busy()),
                    RwVerdict::UpgradeRefused => return Err(refused(req)),
                }
            }
            let base = if side == Side::Write {
                "__WRIT__"
            } else {
                "__READ__"
            };
            let mut created: Created = inner
                .create(&session, &dir, base, &StoredHolder::encode(req))
                .await?;
            let listed = created.children.take();
            (Queued::new(created, session), listed)
        }
    };
    let child = q.node.rsplit('/').next().unwrap_or_default().to_owned();
    let Some((_, seq)) = rw_node(&child) else {
        return Err(Error::backend(
            SCHEME,
            "a read-write lock node without a sequence",
        ));
    };
    let children = match listed.filter(|c| c.contains(&child)) {
        Some(c) => c,
        None => match list(&q.session, &dir).await {
            Ok(c) => c,
            Err(e) => {
                inner.queued().insert(slot, q);
                return Err(e);
            }
        },
    };
    if !children.contains(&child) {
        return Err(vanished());
    }
    let verdict = match rw_verdict(inner, &q.session, &dir, children, Some(seq), side, &owner).await
    {
        Ok(v) => v,
        Err(e) => {
            inner.queued().insert(slot, q);
            return Err(e);
        }
    };
    match verdict {
        RwVerdict::Grant => Ok(inner.held(&dir, q.node, q.token, q.session, false)),
        RwVerdict::UpgradeRefused => {
            abandon(&q.session, &q.node).await;
            Err(refused(req))
        }
        RwVerdict::Wait(_) if !req.will_wait => {
            abandon(&q.session, &q.node).await;
            Ok(busy())
        }
        RwVerdict::Wait(watch) => {
            q.predecessor = Some(format!("{dir}/{watch}"));
            q.predecessor_gone = false;
            inner.queued().insert(slot, q);
            Ok(busy())
        }
    }
}

/// One attempt at a permit: queue on the semaphore's mutex; once it is ours, create a
/// lease and count the leases (Curator's order: the new lease counts itself); while
/// there are more than `permits`, keep the mutex and wait for one to be returned.
pub(super) async fn try_permit(
    inner: &Arc<Inner>,
    req: &AcquireRequest,
    permits: u32,
) -> Result<Attempt> {
    let paths = semaphore_paths(inner, &req.name);
    let permits = usize::try_from(permits).unwrap_or(usize::MAX);
    let slot = (paths.locks.clone(), req.acquisition.get());
    let existing = inner.queued().remove(&slot);
    let (mut q, listed) = match existing {
        Some(q) => {
            if let Err(e) = q.session.check() {
                inner.queued().insert(slot, q);
                return Err(e);
            }
            (q, None)
        }
        None => {
            let session = inner.session().await?;
            if req.attempt == 0 && !req.will_wait {
                // Look before writing anything: someone takes a lease, or none is free.
                let (locks, leases) = (
                    session.client.list_children(&paths.locks),
                    session.client.list_children(&paths.leases),
                );
                let taking = match locks.await {
                    Ok(c) => !super::contenders(c).is_empty(),
                    Err(zk::Error::NoNode) => false,
                    Err(e) => return Err(map_err(&e)),
                };
                let full = match leases.await {
                    Ok(c) => c.len() >= permits,
                    Err(zk::Error::NoNode) => false,
                    Err(e) => return Err(map_err(&e)),
                };
                if taking || full {
                    return Ok(busy());
                }
            }
            let mut created = inner
                .create(&session, &paths.locks, "lock-", &StoredHolder::encode(req))
                .await?;
            let listed = created.children.take();
            (Queued::new(created, session), listed)
        }
    };
    if q.lease.is_none() {
        // Queued on the mutex: is our node the lowest?
        let child = q.node.rsplit('/').next().unwrap_or_default().to_owned();
        let children = match listed.filter(|c| c.contains(&child)) {
            Some(c) => super::contenders(c),
            None => match Inner::children(&q.session, &paths.locks).await {
                Ok(c) => c,
                Err(e) => {
                    inner.queued().insert(slot, q);
                    return Err(e);
                }
            },
        };
        let Some(pos) = children.iter().position(|c| *c == child) else {
            return Err(vanished());
        };
        if pos > 0 {
            if !req.will_wait {
                abandon(&q.session, &q.node).await;
                return Ok(busy());
            }
            q.predecessor = Some(format!("{}/{}", paths.locks, children[pos - 1]));
            q.predecessor_gone = false;
            inner.queued().insert(slot, q);
            return Ok(busy());
        }
        // The mutex is ours: take a lease. Kept in the entry before anything else can
        // fail, so that `leave_queue` deletes it.
        q.predecessor = None;
        match inner
            .create(
                &q.session,
                &paths.leases,
                "lease-",
                &StoredHolder::encode(req),
            )
            .await
        {
            Ok(lease) => q.lease = Some((lease.node, lease.token)),
            Err(e) => {
                inner.queued().insert(slot, q);
                return Err(e);
            }
        }
    }
    let leases = match list(&q.session, &paths.leases).await {
        Ok(c) => c,
        Err(e) => {
            inner.queued().insert(slot, q);
            return Err(e);
        }
    };
    let Some((lease, token)) = q.lease.clone() else {
        return Err(vanished());
    };
    let lease_child = lease.rsplit('/').next().unwrap_or_default();
    if !leases.iter().any(|c| c == lease_child) {
        // Keep the entry: `leave_queue` deletes the mutex node.
        inner.queued().insert(slot, q);
        return Err(vanished());
    }
    if leases.len() <= permits {
        // Ours: give the mutex back (finished in the background if it cannot be now).
        abandon(&q.session, &q.node).await;
        return Ok(inner.held(&paths.leases, lease, token, q.session, false));
    }
    if !req.will_wait {
        abandon(&q.session, &lease).await;
        abandon(&q.session, &q.node).await;
        return Ok(busy());
    }
    q.pool = Some((paths.leases.clone(), leases.len()));
    inner.queued().insert(slot, q);
    Ok(busy())
}

/// Who holds a semaphore's permits, or a read-write lock.
pub(super) async fn holders(
    inner: &Arc<Inner>,
    name: &LockName,
    primitive: Primitive,
) -> Result<Vec<LockInfo>> {
    let session = inner.session().await?;
    let (dir, held): (String, Vec<(String, EntryKind)>) = match primitive {
        Primitive::Permit { permits } => {
            let leases = semaphore_paths(inner, name).leases;
            let mut children: Vec<(u64, String)> = list(&session, &leases)
                .await?
                .into_iter()
                .map(|c| (super::sequence(&c).unwrap_or(u64::MAX), c))
                .collect();
            children.sort();
            // Beyond `permits`, the newest lease is one still waiting (Curator counts
            // a waiter's lease while it waits).
            children.truncate(usize::try_from(permits).unwrap_or(usize::MAX));
            let held = children
                .into_iter()
                .map(|(_, c)| (c, EntryKind::Permit))
                .collect();
            (leases, held)
        }
        Primitive::Read | Primitive::Write => {
            let dir = rwlock_dir(inner, name);
            let mut entries = rw_entries(list(&session, &dir).await?);
            fill_owners(inner, &session, &dir, &mut entries).await?;
            let ok = admitted(&entries);
            let held = entries
                .into_iter()
                .zip(ok)
                .filter(|(_, ok)| *ok)
                .map(|(e, _)| {
                    let kind = if e.side == Side::Write {
                        EntryKind::Write
                    } else {
                        EntryKind::Read
                    };
                    (e.child, kind)
                })
                .collect();
            (dir, held)
        }
        _ => {
            return Err(Error::Unsupported(
                "holders() is for semaphores and read-write locks".into(),
            ));
        }
    };
    let asks: Vec<_> = held
        .into_iter()
        .map(|(child, kind)| {
            (
                child.clone(),
                kind,
                session.client.get_data(&format!("{dir}/{child}")),
            )
        })
        .collect();
    let mut out = Vec::new();
    for (child, kind, ask) in asks {
        let (data, stat) = match ask.await {
            Ok(d) => d,
            Err(zk::Error::NoNode) => continue,
            Err(e) => return Err(map_err(&e)),
        };
        let stored = StoredHolder::decode(&data);
        let owner = stored
            .as_ref()
            .map_or_else(|| child.clone(), |s| s.owner.clone());
        let metadata = stored.map(|s| s.metadata).unwrap_or_default();
        out.push(crate::shared_holds::holder_info(
            name,
            kind,
            owner,
            stat.czxid.unsigned_abs(),
            None,
            metadata,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(child: &str, owner: Option<&str>) -> RwEntry {
        let (side, seq) = rw_node(child).expect("a contender");
        RwEntry {
            child: child.into(),
            side,
            seq,
            owner: owner.map(Arc::from),
        }
    }

    #[test]
    fn curator_and_kazoo_names_are_contenders() {
        assert_eq!(rw_node("_c_1f-__WRIT__0000000004"), Some((Side::Write, 4)));
        assert_eq!(rw_node("_c_1f-__READ__0000000012"), Some((Side::Read, 12)));
        assert_eq!(rw_node("9ab__rlock__0000000002"), Some((Side::Read, 2)));
        assert_eq!(rw_node("9ab__lock__0000000003"), Some((Side::Write, 3)));
        assert_eq!(rw_node("_c_1f-lock-0000000003"), None, "a mutex's node");
        assert_eq!(rw_node("__READ__€"), None);
        assert_eq!(rw_node("junk"), None);
    }

    #[test]
    fn reads_wait_for_earlier_writes_and_writes_for_everyone() {
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let r1 = entry("_c_x-__READ__0000000001", Some("a"));
        let w2 = entry("_c_y-__WRIT__0000000002", Some("b"));
        assert_eq!(
            rw_decide(std::slice::from_ref(&r1), Side::Read, &b),
            RwVerdict::Grant
        );
        assert_eq!(
            rw_decide(std::slice::from_ref(&r1), Side::Write, &b),
            RwVerdict::Wait(r1.child.clone())
        );
        // A read queued behind a waiting writer waits, even if its owner reads already
        // (letting it in would let that writer in beside it once the first read ends).
        assert_eq!(
            rw_decide(&[r1.clone(), w2.clone()], Side::Read, &a),
            RwVerdict::Wait(w2.child.clone())
        );
        // An upgrade is refused; a writer reads; a reader of another client's node waits.
        assert_eq!(
            rw_decide(std::slice::from_ref(&r1), Side::Write, &a),
            RwVerdict::UpgradeRefused
        );
        assert_eq!(
            rw_decide(std::slice::from_ref(&w2), Side::Read, &b),
            RwVerdict::Grant
        );
        let foreign = entry("9ab__lock__0000000001", None);
        assert_eq!(
            rw_decide(std::slice::from_ref(&foreign), Side::Read, &a),
            RwVerdict::Wait(foreign.child.clone())
        );
        // Our owner's write that still waits for another's read: a read of ours waits
        // too, watching that read.
        assert_eq!(
            rw_decide(&[r1.clone(), w2.clone()], Side::Read, &b),
            RwVerdict::Wait(r1.child.clone())
        );
    }

    #[test]
    fn any_two_nodes_let_in_together_are_reads_or_share_an_owner() {
        // Every order of up to 5 nodes over 2 owners and a foreign client, both sides.
        let owners = [Some("a"), Some("b"), None];
        for n in 1..=5u32 {
            for code in 0..6u32.pow(n) {
                let mut c = code;
                let entries: Vec<RwEntry> = (0..n)
                    .map(|i| {
                        let (side, owner) = (c % 2, owners[(c / 2 % 3) as usize]);
                        c /= 6;
                        let marker = if side == 0 { "__READ__" } else { "__WRIT__" };
                        entry(&format!("_c_{i}-{marker}{:010}", i + 1), owner)
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
