//! Semaphores and read-write locks on etcd (the module rustdoc of [`super`] describes
//! the layout for users): one key per acquisition, ordered by create revision.
//!
//! Every waiting attempt is kept in `Inner::shared` under its acquisition; its key is
//! recorded there before the put is sent, so `leave_queue` deletes a key whose put's
//! reply was lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use super::client::{Client, prefix_end, revision};
use super::proto::{self, SortOrder, SortTarget};
use super::session::Session;
use super::{Inner, RECHECK, SCHEME, late_put, map_err};
use crate::backend::{AcquireRequest, Attempt, HeldLock, LockInfo, Primitive, Waiter};
use crate::error::{Error, LossReason, Result};
use crate::name::LockName;
use crate::queue::StoredHolder;
use crate::shared_holds::EntryKind;
use crate::shared_order::{
    Ordered, Side, Verdict, admitted, clear_without_owners, decide, refused,
};

/// A waiting attempt: its key, the session it is attached to, and the revision from
/// which a deletion under the name may let it in.
pub(super) struct SharedWait {
    key: String,
    session: Arc<Session>,
    /// 0 until the attempt has listed and waits.
    watch_from: i64,
    /// etcd answered the put (else the key may or may not exist, or appear later).
    put_confirmed: bool,
}

/// Keep `slot`'s attempt waiting (or pending a cleanup) under its key: what
/// `leave_queue` deletes, and what the next attempt of the acquisition goes on with.
fn keep_waiting(
    inner: &Inner,
    slot: (String, u64),
    key: String,
    session: Arc<Session>,
    watch_from: i64,
    put_confirmed: bool,
) {
    inner.shared().insert(
        slot,
        SharedWait {
            key,
            session,
            watch_from,
            put_confirmed,
        },
    );
}

/// For tests: `req`'s attempt put `key` and the put went unanswered.
#[cfg(test)]
pub(super) fn keep_unanswered(
    inner: &Inner,
    req: &AcquireRequest,
    key: String,
    session: Arc<Session>,
) {
    let slot = (dir(inner, &req.name, req.primitive), req.acquisition.get());
    keep_waiting(inner, slot, key, session, 0, false);
}

/// The directory of a semaphore or read-write lock: `<prefix>%semaphore/<NAME>/` or
/// `<prefix>%rwlock/<NAME>/` (no encoded name begins with `%` and a letter).
pub(super) fn dir(inner: &Inner, name: &LockName, primitive: Primitive) -> String {
    let family = if matches!(primitive, Primitive::Permit { .. }) {
        "%semaphore"
    } else {
        "%rwlock"
    };
    let name = if inner.raw_names {
        name.as_str().to_owned()
    } else {
        name.encoded()
    };
    format!("{}{family}/{name}/", inner.prefix)
}

/// Whether a directory below the prefix is a semaphore's or a read-write lock's.
pub(super) fn is_shared_dir(dir: &str) -> bool {
    dir.starts_with("%semaphore/") || dir.starts_with("%rwlock/")
}

fn side_of(primitive: Primitive) -> Side {
    if primitive == Primitive::Write {
        Side::Write
    } else {
        Side::Read
    }
}

/// The contenders under `dir`, oldest first, their values, and the listing's revision.
async fn listing(client: &Client, dir: &str) -> Result<(Vec<Ordered>, Vec<Vec<u8>>, i64)> {
    let resp = client
        .range(proto::RangeRequest {
            key: dir.as_bytes().to_vec(),
            range_end: prefix_end(dir.as_bytes()),
            sort_target: SortTarget::Create as i32,
            sort_order: SortOrder::Ascend as i32,
            ..proto::RangeRequest::default()
        })
        .await
        .map_err(|e| map_err(&e))?;
    // Only keys right under the directory: with raw names, `x/y`'s keys are below `x/`.
    let ours: Vec<&proto::KeyValue> = resp
        .kvs
        .iter()
        .filter(|kv| {
            kv.key
                .get(dir.len()..)
                .is_some_and(|rest| !rest.contains(&b'/'))
        })
        .collect();
    let entries = ours
        .iter()
        .map(|kv| {
            let key = String::from_utf8_lossy(&kv.key).into_owned();
            let side = if kv.key[dir.len()..].starts_with(b"write-") {
                Side::Write
            } else {
                Side::Read
            };
            Ordered {
                key,
                side,
                order: u64::try_from(kv.create_revision).unwrap_or(0),
                owner: StoredHolder::decode(&kv.value).map(|s| Arc::from(s.owner)),
            }
        })
        .collect();
    let values = ours.iter().map(|kv| kv.value.clone()).collect();
    Ok((entries, values, revision(resp.header.as_ref())))
}

/// The verdict for an attempt whose earlier contenders are `below`.
fn verdict(req: &AcquireRequest, below: &[Ordered]) -> Verdict {
    match req.primitive {
        Primitive::Permit { permits } => {
            if below.len() < usize::try_from(permits).unwrap_or(usize::MAX) {
                Verdict::Grant
            } else {
                Verdict::Wait(String::new())
            }
        }
        p => {
            let side = side_of(p);
            if clear_without_owners(below, side) {
                Verdict::Grant
            } else {
                decide(below, side, &Arc::from(req.owner.as_str()))
            }
        }
    }
}

fn busy() -> Attempt {
    Attempt::Busy {
        retry_after: Some(RECHECK),
    }
}

/// Delete an attempt's key; when etcd cannot be reached, finish in the background
/// (the key would otherwise stay for as long as the session lives).
async fn delete(client: &Client, session: &Session, key: &str) -> Result<()> {
    let del = proto::DeleteRangeRequest {
        key: key.as_bytes().to_vec(),
        ..proto::DeleteRangeRequest::default()
    };
    match client.delete_range(del.clone()).await {
        Ok(_) => Ok(()),
        Err(e) => {
            let (client, del) = (client.clone(), del);
            crate::finish::release_later(
                session.lost.clone(),
                crate::finish::SESSION_RELEASE_RETRIES,
                move || {
                    let (client, del) = (client.clone(), del.clone());
                    async move { client.delete_range(del).await.is_ok() }
                },
            );
            Err(map_err(&e))
        }
    }
}

/// One attempt at a permit, a read or a write.
pub(super) async fn try_acquire(inner: &Arc<Inner>, req: &AcquireRequest) -> Result<Attempt> {
    let dir = dir(inner, &req.name, req.primitive);
    let slot = (dir.clone(), req.acquisition.get());
    let existing = inner.shared().remove(&slot);
    let (key, session, confirmed) = match existing {
        Some(w) => {
            if let Err(e) = w.session.check() {
                inner.shared().insert(slot, w);
                return Err(e);
            }
            (w.key, w.session, w.put_confirmed)
        }
        None => {
            let session = inner.session().await?;
            if req.attempt == 0 && !req.will_wait {
                // Look before writing anything.
                let (entries, _, _) = listing(&inner.client, &dir).await?;
                match verdict(req, &entries) {
                    Verdict::Grant => {}
                    Verdict::Wait(_) => return Ok(busy()),
                    Verdict::UpgradeRefused => return Err(refused(req)),
                }
            }
            let side = match req.primitive {
                Primitive::Write => "write-",
                Primitive::Read => "read-",
                _ => "",
            };
            // A fresh key per put (the nonce): a grant given back (it came too late) is
            // deleted in the background while the acquisition tries again, and that
            // delete must never meet the new attempt's key.
            let key = format!(
                "{dir}{side}{:x}-{:x}-{:x}",
                session.id,
                req.acquisition.get(),
                fastrand::u64(..)
            );
            keep_waiting(
                inner,
                slot.clone(),
                key.clone(),
                Arc::clone(&session),
                0,
                false,
            );
            let value = StoredHolder::encode(req);
            let put = proto::PutRequest {
                key: key.as_bytes().to_vec(),
                value,
                lease: session.id,
                ..proto::PutRequest::default()
            };
            // On an error the entry stays: `leave_queue` deletes the key.
            inner
                .client
                .put(put)
                .await
                .map_err(|e| super::session_err(&session, &e))?;
            inner.shared().remove(&slot);
            (key, session, true)
        }
    };
    let (entries, _, at) = match listing(&inner.client, &dir).await {
        Ok(l) => l,
        Err(e) => {
            keep_waiting(inner, slot, key, session, 0, confirmed);
            return Err(e);
        }
    };
    let Some(mine) = entries.iter().position(|e| e.key == key) else {
        if !confirmed {
            // Its put was never answered: nothing says the session ended, and the put
            // may still be applied. The entry stays, so `leave_queue` deletes the key
            // now and once more after `LATE_PUT`.
            keep_waiting(inner, slot, key, session, 0, false);
            return Err(Error::connection(
                SCHEME,
                "this attempt's put was not applied",
            ));
        }
        // Our key (its put answered) went with the session lease (then etcd says so,
        // and the session is lost), or someone deleted it (then only this attempt ends).
        super::session::confirm(&inner.client, &session).await;
        return Err(Error::connection(
            SCHEME,
            "this waiter's key was deleted (with its session, or by hand)",
        ));
    };
    let token = entries[mine].order;
    match verdict(req, &entries[..mine]) {
        // Lost while the answer was on its way: the key goes with the session (it is
        // revoked), and no hold may start under it.
        Verdict::Grant if session.lost.is_cancelled() => Err(Error::connection(
            SCHEME,
            "the etcd session was lost while acquiring",
        )),
        Verdict::Grant => Ok(Attempt::Acquired(Box::new(SharedHeld {
            client: inner.client.clone(),
            name: req.name.as_str().to_owned(),
            key,
            revision: i64::try_from(token).unwrap_or(i64::MAX),
            session,
            released: AtomicBool::new(false),
        }))),
        Verdict::UpgradeRefused => {
            let _ = delete(&inner.client, &session, &key).await;
            Err(refused(req))
        }
        Verdict::Wait(_) if !req.will_wait => {
            let _ = delete(&inner.client, &session, &key).await;
            Ok(busy())
        }
        Verdict::Wait(_) => {
            keep_waiting(inner, slot, key, session, at + 1, true);
            Ok(busy())
        }
    }
}

/// The attempt ended without a grant: delete its key, if it put one.
pub(super) async fn leave_queue(inner: &Arc<Inner>, req: &AcquireRequest) -> Result<()> {
    let slot = (dir(inner, &req.name, req.primitive), req.acquisition.get());
    let Some(w) = inner.shared().remove(&slot) else {
        return Ok(());
    };
    if !w.put_confirmed {
        // The put may still be applied after this delete: look for the key again for a
        // while (it is this attempt's alone, so nothing else can be hit).
        let (client, key, session) = (inner.client.clone(), w.key.clone(), Arc::clone(&w.session));
        late_put::sweep(
            Arc::clone(&w.session),
            std::time::Instant::now() + late_put::LATE_PUT,
            move || {
                let (client, key, session) = (client.clone(), key.clone(), Arc::clone(&session));
                async move {
                    if let Some(revision) = late_put::find(&client, &key).await {
                        late_put::delete_found(&client, &session.lost, &key, revision).await;
                    }
                }
            },
        );
    }
    delete(&inner.client, &w.session, &w.key).await
}

/// Who holds a semaphore's permits, or a read-write lock.
pub(super) async fn holders(
    inner: &Arc<Inner>,
    name: &LockName,
    primitive: Primitive,
) -> Result<Vec<LockInfo>> {
    let dir = dir(inner, name, primitive);
    let (entries, values, _) = listing(&inner.client, &dir).await?;
    let ok = admitted(&entries);
    let permits = match primitive {
        Primitive::Permit { permits } => Some(usize::try_from(permits).unwrap_or(usize::MAX)),
        _ => None,
    };
    Ok(entries
        .into_iter()
        .zip(values)
        .zip(ok)
        .enumerate()
        .filter(|(i, (_, ok))| permits.map_or(*ok, |n| *i < n))
        .map(|(_, ((e, value), _))| {
            let kind = match (permits, e.side) {
                (Some(_), _) => EntryKind::Permit,
                (None, Side::Write) => EntryKind::Write,
                (None, Side::Read) => EntryKind::Read,
            };
            let stored = StoredHolder::decode(&value);
            let owner = stored.as_ref().map_or_else(
                || e.key.rsplit('/').next().unwrap_or_default().to_owned(),
                |s| s.owner.clone(),
            );
            let metadata = stored.map(|s| s.metadata).unwrap_or_default();
            crate::shared_holds::holder_info(name, kind, owner, e.order, None, metadata)
        })
        .collect())
}

/// A watch on a directory: the request stream must stay open for it to go on.
type DirWatch = (
    tokio::sync::mpsc::Sender<proto::WatchRequest>,
    tonic::Streaming<proto::WatchResponse>,
);

/// Open a watch on `dir` from the store's current revision and wait until etcd says
/// it is created: every deletion after that is delivered as it happens. (A watch from
/// an older revision is caught up by etcd's background sync, up to 100 ms late: under
/// contention that was every wait.)
pub(super) async fn watch_from_now(client: &Client, dir: &str) -> Option<DirWatch> {
    let dir = dir.as_bytes();
    let open = async {
        let (requests, mut stream) = client.watch_range(dir, &prefix_end(dir), 0).await.ok()?;
        while let Some(resp) = stream.message().await.ok()? {
            if resp.canceled {
                return None;
            }
            if resp.created {
                return Some((requests, stream));
            }
        }
        None
    };
    // Bounded well below a caller's wait: without it, the waiter opens a watch from
    // the listing's revision on its first wait instead.
    tokio::time::timeout(Duration::from_secs(1), open)
        .await
        .ok()
        .flatten()
}

/// Waits for a deletion under the name after the attempt's listing.
pub(super) struct SharedWaiter {
    pub(super) inner: Arc<Inner>,
    pub(super) slot: (String, u64),
    /// Opened when the waiter is made, before the attempt that lists again: every
    /// deletion after that listing comes through it as it happens. `None` when it
    /// could not be opened or broke: a watch is then opened from the listing's
    /// revision on each wait.
    pub(super) watch: Option<DirWatch>,
}

impl std::fmt::Debug for SharedWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWaiter")
            .field("dir", &self.slot.0)
            .finish_non_exhaustive()
    }
}

/// How a wait on the directory's watch ended.
enum Woken {
    /// A deletion at or after the listing's revision.
    Deleted,
    /// The watch ended or failed: open another.
    Broken,
}

#[async_trait]
impl Waiter for SharedWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        let ours = self
            .inner
            .shared()
            .get(&self.slot)
            .map(|w| (w.watch_from, w.session.lost.clone()));
        let Some((from, lost)) = ours.filter(|(from, _)| *from > 0) else {
            tokio::time::sleep(max.min(Duration::from_millis(20))).await;
            return Ok(());
        };
        if self.watch.is_none() {
            let dir = self.slot.0.as_bytes();
            match self
                .inner
                .client
                .watch_range(dir, &prefix_end(dir), from)
                .await
            {
                Ok(w) => self.watch = Some(w),
                Err(e) => {
                    tracing::debug!(error = %e, "etcd watch failed; looking again");
                    tokio::time::sleep(Duration::from_millis(50).min(max)).await;
                    return Ok(());
                }
            }
        }
        let Some((_, stream)) = self.watch.as_mut() else {
            return Ok(());
        };
        let deleted = async {
            loop {
                match stream.message().await {
                    Ok(Some(resp)) if resp.canceled => return Woken::Broken,
                    Ok(Some(resp)) => {
                        // Deletions the listing already saw are no news.
                        if resp.events.iter().any(|e| {
                            e.r#type == proto::EventType::Delete as i32
                                && e.kv.as_ref().is_some_and(|kv| kv.mod_revision >= from)
                        }) {
                            return Woken::Deleted;
                        }
                    }
                    Ok(None) | Err(_) => return Woken::Broken,
                }
            }
        };
        let woken = tokio::select! {
            () = lost.cancelled() => return Err(Error::connection(
                SCHEME,
                "the etcd session ended while waiting (its lease expired)",
            )),
            () = tokio::time::sleep(max) => return Ok(()),
            w = deleted => w,
        };
        if let Woken::Broken = woken {
            // Refused, compacted or cut: open another, but not in a tight loop.
            self.watch = None;
            tokio::time::sleep(Duration::from_millis(50).min(max)).await;
        }
        Ok(())
    }
}

/// A permit, read or write: the key, deleted on release if it is still the grant's.
struct SharedHeld {
    client: Client,
    name: String,
    key: String,
    revision: i64,
    session: Arc<Session>,
    released: AtomicBool,
}

impl std::fmt::Debug for SharedHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedHeld")
            .field("key", &self.key)
            .field("token", &self.revision)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl HeldLock for SharedHeld {
    fn fencing_token(&self) -> u64 {
        u64::try_from(self.revision).unwrap_or(0)
    }

    async fn renew(&self, _ttl: Duration) -> Result<()> {
        self.session.check().map_err(|_| Error::NotOwner {
            name: self.name.clone(),
        })
    }

    async fn release(&self) -> Result<()> {
        if self.released.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let lost = || Error::LockLost {
            name: self.name.clone(),
            reason: LossReason::SessionLost(
                "the etcd session (and the hold's key) expired before the release".into(),
            ),
        };
        if self.session.check().is_err() {
            return Err(lost());
        }
        match Inner::delete_key(&self.client, &self.key, Some(self.revision)).await {
            Ok(true) => Ok(()),
            // Gone: did the session expire (then its other holds end now)?
            Ok(false) => {
                super::session::confirm(&self.client, &self.session).await;
                Err(lost())
            }
            Err(e) => {
                let (client, key, rev) = (self.client.clone(), self.key.clone(), self.revision);
                crate::finish::release_later(
                    self.session.lost.clone(),
                    crate::finish::SESSION_RELEASE_RETRIES,
                    move || {
                        let (client, key) = (client.clone(), key.clone());
                        async move { Inner::delete_key(&client, &key, Some(rev)).await.is_ok() }
                    },
                );
                Err(map_err(&e))
            }
        }
    }

    fn loss_signal(&self) -> Option<tokio_util::sync::CancellationToken> {
        Some(self.session.lost.clone())
    }
    fn session_trust(&self) -> Option<crate::backend::SessionTrust> {
        Some(self.session.trust.clone())
    }
}
