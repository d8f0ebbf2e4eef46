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
use crate::shared_order::{Ordered, Side, Verdict, admitted, decide, refused};

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

/// The contenders among `children`, lowest sequence first.
fn rw_entries(children: Vec<String>) -> Vec<Ordered> {
    let mut entries: Vec<Ordered> = children
        .into_iter()
        .filter_map(|child| {
            let (side, seq) = rw_node(&child)?;
            Some(Ordered {
                key: child,
                side,
                order: seq,
                owner: None,
            })
        })
        .collect();
    entries.sort_by_key(|e| e.order);
    entries
}

/// Fill in the owners of `entries` (from the cache, else read from their nodes, all
/// requests sent before the first answer is awaited). A node gone meanwhile is dropped.
async fn fill_owners(
    inner: &Inner,
    session: &Session,
    dir: &str,
    entries: &mut Vec<Ordered>,
) -> Result<()> {
    let mut gone = Vec::new();
    {
        let cache = inner
            .owners
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for e in entries.iter_mut() {
            if let Some(o) = cache.get(&format!("{dir}/{}", e.key)) {
                e.owner.clone_from(o);
            }
        }
    }
    let asks: Vec<(usize, _)> = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.owner.is_none())
        .map(|(i, e)| (i, session.client.get_data(&format!("{dir}/{}", e.key))))
        .collect();
    let mut learned = Vec::new();
    for (i, ask) in asks {
        match ask.await {
            Ok((data, _)) => {
                let owner: Option<Arc<str>> =
                    StoredHolder::decode(&data).map(|s| Arc::from(s.owner));
                entries[i].owner.clone_from(&owner);
                learned.push((format!("{dir}/{}", entries[i].key), owner));
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
) -> Result<Verdict> {
    let mut below: Vec<Ordered> = rw_entries(children)
        .into_iter()
        .filter(|e| mine.is_none_or(|m| e.order < m))
        .collect();
    if crate::shared_order::clear_without_owners(&below, side) {
        return Ok(Verdict::Grant);
    }
    fill_owners(inner, session, dir, &mut below).await?;
    Ok(decide(&below, side, owner))
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
                    Verdict::Grant => {}
                    Verdict::Wait(_) => return Ok(busy()),
                    Verdict::UpgradeRefused => return Err(refused(req)),
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
        Verdict::Grant => Ok(inner.held(&dir, q.node, q.token, q.session, false)),
        Verdict::UpgradeRefused => {
            abandon(&q.session, &q.node).await;
            Err(refused(req))
        }
        Verdict::Wait(_) if !req.will_wait => {
            abandon(&q.session, &q.node).await;
            Ok(busy())
        }
        Verdict::Wait(watch) => {
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
                    (e.key, kind)
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
}
