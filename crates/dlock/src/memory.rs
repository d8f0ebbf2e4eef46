//! `memory://[store]`: an in-process backend, always compiled.
//!
//! Useful in tests and for locking between tasks of one process. `memory://` opens a
//! fresh private store; `memory://NAME` joins the process-wide store called `NAME`, so two
//! lockers opened with the same URL exclude each other. Leases run on the monotonic
//! clock; waiters are woken by notification; fair mode keeps a FIFO queue. Semaphores
//! and read-write locks keep their entries per name beside the locks, keyed by the
//! acquisition.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::backend::{
    AcquireRequest, AcquisitionId, Attempt, Backend, Capabilities, Fencing, HeldLock, LockInfo,
    Primitive, Primitives, Waiter,
};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::{ChangeHub, wait_change};
use crate::options::{Metadata, Owner};
use crate::shared_holds::{EntryKind, LiveEntry, Verdict, decide, family};
use crate::url::ConnectUrl;

#[derive(Debug)]
struct Entry {
    owner: Owner,
    holds: u32,
    fence: u64,
    expires: Instant,
    metadata: Metadata,
}

#[derive(Debug)]
struct QueueEntry {
    /// Keyed by the acquisition: two waiters of one owner have a place each.
    acquisition: AcquisitionId,
    expires: Instant,
}

/// One entry of a semaphore or read-write lock, keyed by its acquisition.
#[derive(Debug)]
struct SharedEntry {
    kind: EntryKind,
    owner: Owner,
    acquisition: AcquisitionId,
    fence: u64,
    expires: Instant,
    metadata: Metadata,
}

/// A semaphore's or read-write lock's entries, and its last token (kept when the
/// entries are gone, so tokens never repeat).
#[derive(Debug, Default)]
struct SharedSet {
    entries: Vec<SharedEntry>,
    fence: u64,
}

/// A semaphore or read-write lock: its family and name.
type SharedKey = (&'static str, LockName);

#[derive(Debug, Default)]
struct State {
    locks: HashMap<LockName, Entry>,
    /// Last fencing token per name; kept after release so tokens never repeat.
    fences: HashMap<LockName, u64>,
    queues: HashMap<LockName, Vec<QueueEntry>>,
    shared: HashMap<SharedKey, SharedSet>,
}

impl State {
    fn live_queue(&mut self, name: &LockName, now: Instant) -> Option<&mut Vec<QueueEntry>> {
        let queue = self.queues.get_mut(name)?;
        queue.retain(|q| q.expires > now);
        if queue.is_empty() {
            self.queues.remove(name);
            return None;
        }
        self.queues.get_mut(name)
    }
}

#[derive(Debug, Default)]
struct Store {
    state: Mutex<State>,
    changes: ChangeHub,
}

impl Store {
    fn state(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::backend("memory", "state poisoned"))
    }
}

/// The in-process lock backend.
#[derive(Debug, Default)]
pub struct MemoryBackend {
    store: Arc<Store>,
}

fn named_stores() -> &'static Mutex<HashMap<String, Weak<Store>>> {
    static STORES: OnceLock<Mutex<HashMap<String, Weak<Store>>>> = OnceLock::new();
    STORES.get_or_init(Default::default)
}

impl MemoryBackend {
    /// A backend over a fresh, private store.
    #[must_use]
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub(crate) fn open(url: ConnectUrl) -> Result<Arc<Self>> {
        url.finish(&[])?;
        let name = match (url.hosts(), url.path()) {
            ([], "" | "/") => return Ok(Self::new()),
            ([h], "" | "/") if h.port.is_none() => h.host.clone(),
            _ => return Err(url.invalid("expected memory:// or memory://STORE_NAME")),
        };
        let mut stores = named_stores()
            .lock()
            .map_err(|_| Error::backend("memory", "store registry poisoned"))?;
        stores.retain(|_, w| w.strong_count() > 0);
        if let Some(store) = stores.get(&name).and_then(Weak::upgrade) {
            return Ok(Arc::new(MemoryBackend { store }));
        }
        let store = Arc::new(Store::default());
        stores.insert(name, Arc::downgrade(&store));
        Ok(Arc::new(MemoryBackend { store }))
    }

    fn state(&self) -> Result<MutexGuard<'_, State>> {
        self.store.state()
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    fn scheme(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            fencing: Fencing::Durable,
            fifo: true,
            native_wait: true,
            session_bound: false,
            reentrant: true,
            cross_process: false,
            max_ttl: None,
            queued_waiting: false,
            session_timeout: None,
            connection_loss_notice: None,
            release_reports_loss: true,
            primitives: Primitives::ALL,
        }
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        if req.primitive != Primitive::Lock {
            return self.try_shared(req);
        }
        let this = Arc::clone(&self.store);
        let mut st = self.state()?;
        let now = Instant::now();
        let busy_until = match st.locks.get_mut(&req.name) {
            Some(e) if e.expires > now && e.owner == req.owner => {
                e.holds += 1;
                e.expires = e.expires.max(now + req.ttl);
                let held = MemoryHeld::new(this, req, e.fence);
                // A re-entry that had queued leaves its place (it would block the head).
                if let Some(queue) = st.queues.get_mut(&req.name) {
                    queue.retain(|q| q.acquisition != req.acquisition);
                    if queue.is_empty() {
                        st.queues.remove(&req.name);
                    }
                }
                return Ok(Attempt::Acquired(Box::new(held)));
            }
            Some(e) if e.expires > now => Some(e.expires),
            _ => None,
        };
        let ahead = if req.fair {
            st.live_queue(&req.name, now)
                .and_then(|q| q.first())
                .is_some_and(|head| head.acquisition != req.acquisition)
        } else {
            false
        };
        if busy_until.is_some() || ahead {
            if let Some(entry_ttl) = req.enqueue {
                let queue = st.queues.entry(req.name.clone()).or_default();
                match queue.iter_mut().find(|q| q.acquisition == req.acquisition) {
                    Some(q) => q.expires = now + entry_ttl,
                    None => queue.push(QueueEntry {
                        acquisition: req.acquisition,
                        expires: now + entry_ttl,
                    }),
                }
            }
            return Ok(Attempt::Busy {
                retry_after: busy_until.map(|t| t - now),
            });
        }
        if let Some(queue) = st.queues.get_mut(&req.name) {
            queue.retain(|q| q.acquisition != req.acquisition);
            if queue.is_empty() {
                st.queues.remove(&req.name);
            }
        }
        let fence = st.fences.entry(req.name.clone()).or_insert(0);
        *fence += 1;
        let fence = *fence;
        st.locks.insert(
            req.name.clone(),
            Entry {
                owner: req.owner.clone(),
                holds: 1,
                fence,
                expires: now + req.ttl,
                metadata: Metadata::clone(&req.metadata),
            },
        );
        Ok(Attempt::Acquired(Box::new(MemoryHeld::new(
            this, req, fence,
        ))))
    }

    async fn subscribe(&self, req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        Ok(Box::new(MemoryWaiter {
            rx: self.store.changes.subscribe(&req.name),
        }))
    }

    async fn leave_queue(&self, req: &AcquireRequest) -> Result<()> {
        let name = &req.name;
        let mut st = self.state()?;
        if req.primitive != Primitive::Lock {
            let key = (family(req.primitive), req.name.clone());
            if let Some(set) = st.shared.get_mut(&key) {
                set.entries
                    .retain(|e| e.acquisition != req.acquisition || e.kind != EntryKind::WantWrite);
            }
            drop(st);
            self.store.changes.notify(name);
            return Ok(());
        }
        if let Some(queue) = st.queues.get_mut(name) {
            queue.retain(|q| q.acquisition != req.acquisition);
            if queue.is_empty() {
                st.queues.remove(name);
            }
        }
        drop(st);
        // The next waiter may now be at the head.
        self.store.changes.notify(name);
        Ok(())
    }

    async fn break_lock(&self, name: &LockName, fence: u64) -> Result<bool> {
        let broke = {
            let mut st = self.state()?;
            let now = Instant::now();
            let held = st
                .locks
                .get(name)
                .is_some_and(|e| e.fence == fence && e.holds > 0 && e.expires > now);
            if held {
                st.locks.remove(name);
            }
            held
        };
        if broke {
            self.store.changes.notify(name);
        }
        Ok(broke)
    }

    async fn holders(&self, name: &LockName, primitive: Primitive) -> Result<Vec<LockInfo>> {
        let st = self.state()?;
        let now = Instant::now();
        let Some(set) = st.shared.get(&(family(primitive), name.clone())) else {
            return Ok(Vec::new());
        };
        let mut held: Vec<LockInfo> = set
            .entries
            .iter()
            .filter(|e| e.kind.is_hold() && e.expires > now)
            .map(|e| {
                crate::shared_holds::holder_info(
                    name,
                    e.kind,
                    e.owner.as_str().to_owned(),
                    e.fence,
                    Some(e.expires - now),
                    e.metadata.clone(),
                )
            })
            .collect();
        held.sort_by_key(|i| i.fencing_token);
        Ok(held)
    }

    async fn names(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let mut names: Vec<String> = self
            .state()?
            .locks
            .keys()
            .filter(|n| n.as_str().starts_with(prefix))
            .map(|n| n.as_str().to_owned())
            .collect();
        names.sort_unstable();
        names.truncate(limit);
        Ok(names)
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let mut st = self.state()?;
        let now = Instant::now();
        let waiters = st.live_queue(name, now).map_or(0, |q| q.len());
        Ok(st
            .locks
            .get(name)
            .filter(|e| e.expires > now)
            .map(|e| LockInfo {
                name: name.as_str().to_owned(),
                owner: e.owner.as_str().to_owned(),
                holds: e.holds,
                fencing_token: e.fence,
                remaining: Some(e.expires - now),
                metadata: e.metadata.clone(),
                waiters: Some(waiters),
                hold: None,
            }))
    }
}

impl MemoryBackend {
    /// An attempt at a permit, read or write ([`crate::shared_holds`]).
    fn try_shared(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = (family(req.primitive), req.name.clone());
        let mut st = self.state()?;
        let now = Instant::now();
        let set = st.shared.entry(key.clone()).or_default();
        set.entries.retain(|e| e.expires > now);
        let live: Vec<LiveEntry<'_>> = set
            .entries
            .iter()
            .map(|e| LiveEntry {
                kind: e.kind,
                owner: e.owner.as_str(),
                acquisition: e.acquisition,
            })
            .collect();
        let verdict = decide(req, &live);
        drop(live);
        let mine = |e: &SharedEntry| e.acquisition == req.acquisition;
        match verdict {
            Verdict::Grant(kind) => {
                set.entries.retain(|e| !mine(e));
                set.fence += 1;
                let fence = set.fence;
                set.entries.push(SharedEntry {
                    kind,
                    owner: req.owner.clone(),
                    acquisition: req.acquisition,
                    fence,
                    expires: now + req.ttl,
                    metadata: Metadata::clone(&req.metadata),
                });
                Ok(Attempt::Acquired(Box::new(SharedHeld {
                    store: Arc::clone(&self.store),
                    key,
                    acquisition: req.acquisition,
                    fence,
                    released: std::sync::atomic::AtomicBool::new(false),
                })))
            }
            Verdict::Busy { want_write } => {
                if want_write && let Some(entry_ttl) = req.enqueue {
                    match set.entries.iter_mut().find(|e| mine(e)) {
                        Some(e) => e.expires = now + entry_ttl,
                        None => set.entries.push(SharedEntry {
                            kind: EntryKind::WantWrite,
                            owner: req.owner.clone(),
                            acquisition: req.acquisition,
                            fence: 0,
                            expires: now + entry_ttl,
                            metadata: Metadata::clone(&req.metadata),
                        }),
                    }
                }
                let retry_after = set
                    .entries
                    .iter()
                    .filter(|e| e.kind.is_hold())
                    .map(|e| e.expires - now)
                    .min();
                Ok(Attempt::Busy { retry_after })
            }
            Verdict::UpgradeRefused => Err(Error::UpgradeRefused {
                name: req.name.as_str().to_owned(),
            }),
        }
    }

    /// The capabilities (the same for every store).
    pub(crate) fn capabilities_with(_durable: bool) -> Capabilities {
        MemoryBackend::default().capabilities()
    }
}

#[derive(Debug)]
struct MemoryWaiter {
    rx: watch::Receiver<u64>,
}

#[async_trait]
impl Waiter for MemoryWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        wait_change(&mut self.rx, max).await;
        Ok(())
    }
}

#[derive(Debug)]
struct MemoryHeld {
    store: Arc<Store>,
    name: LockName,
    owner: Owner,
    fence: u64,
    released: std::sync::atomic::AtomicBool,
}

impl MemoryHeld {
    fn new(store: Arc<Store>, req: &AcquireRequest, fence: u64) -> Self {
        MemoryHeld {
            store,
            name: req.name.clone(),
            owner: req.owner.clone(),
            fence,
            released: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

#[async_trait]
impl HeldLock for MemoryHeld {
    fn fencing_token(&self) -> u64 {
        self.fence
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let mut st = self.store.state()?;
        let now = Instant::now();
        match st.locks.get_mut(&self.name) {
            Some(e) if e.owner == self.owner && e.fence == self.fence && e.expires > now => {
                e.expires = e.expires.max(now + ttl);
                Ok(())
            }
            _ => Err(Error::NotOwner {
                name: self.name.as_str().to_owned(),
            }),
        }
    }

    async fn release(&self) -> Result<()> {
        if self
            .released
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Ok(());
        }
        let mut st = self.store.state()?;
        let remove = match st.locks.get_mut(&self.name) {
            Some(e) if e.owner == self.owner && e.fence == self.fence && e.holds > 0 => {
                e.holds -= 1;
                e.holds == 0
            }
            // Broken, or its lease ended and the lock was taken or collected.
            _ => {
                return Err(Error::NotOwner {
                    name: self.name.as_str().to_owned(),
                });
            }
        };
        if remove {
            st.locks.remove(&self.name);
            drop(st);
            self.store.changes.notify(&self.name);
        }
        Ok(())
    }
}

/// One held permit, read or write.
#[derive(Debug)]
struct SharedHeld {
    store: Arc<Store>,
    key: SharedKey,
    acquisition: AcquisitionId,
    fence: u64,
    released: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl HeldLock for SharedHeld {
    fn fencing_token(&self) -> u64 {
        self.fence
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let mut st = self.store.state()?;
        let now = Instant::now();
        let entry = st.shared.get_mut(&self.key).and_then(|set| {
            set.entries.iter_mut().find(|e| {
                e.acquisition == self.acquisition && e.fence == self.fence && e.expires > now
            })
        });
        match entry {
            Some(e) => {
                e.expires = e.expires.max(now + ttl);
                Ok(())
            }
            None => Err(Error::NotOwner {
                name: self.key.1.as_str().to_owned(),
            }),
        }
    }

    async fn release(&self) -> Result<()> {
        if self
            .released
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Ok(());
        }
        let mut st = self.store.state()?;
        if let Some(set) = st.shared.get_mut(&self.key) {
            set.entries
                .retain(|e| e.acquisition != self.acquisition || e.fence != self.fence);
        }
        drop(st);
        self.store.changes.notify(&self.key.1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(b: &MemoryBackend, owner: &Owner, fair: bool) -> AcquireRequest {
        let _ = b;
        AcquireRequest {
            name: LockName::new("m").expect("name"),
            owner: owner.clone(),
            acquisition: AcquisitionId::new(),
            ttl: Duration::from_secs(30),
            fair,
            enqueue: fair.then_some(Duration::from_secs(5)),
            metadata: Metadata::default().into(),
            attempt: 1,
            will_wait: true,
            primitive: Primitive::Lock,
            campaign: None,
        }
    }

    async fn granted(b: &MemoryBackend, r: &AcquireRequest) -> Option<Box<dyn HeldLock>> {
        match b.try_acquire(r).await.expect("attempt") {
            Attempt::Acquired(h) => Some(h),
            _ => None,
        }
    }

    /// A fair waiter that gets in by re-entry (its owner came to hold the lock through
    /// another acquisition) leaves its queue place: once every hold is released, the
    /// next fair waiter is not held back by a dead head.
    #[tokio::test]
    async fn a_reentry_leaves_its_queue_place() {
        let b = MemoryBackend::new();
        let (x, y, z) = (Owner::random(), Owner::random(), Owner::random());
        let held_y = granted(&b, &req(&b, &y, false)).await.expect("free");
        let queued = req(&b, &x, true);
        assert!(granted(&b, &queued).await.is_none(), "queued behind y");
        held_y.release().await.expect("release");
        // Another acquisition of x, unfair, takes the lock past the queue.
        let held_x = granted(&b, &req(&b, &x, false)).await.expect("free");
        let reentered = granted(&b, &queued).await.expect("re-entry");
        reentered.release().await.expect("release");
        held_x.release().await.expect("release");
        assert!(
            granted(&b, &req(&b, &z, true)).await.is_some(),
            "a dead queue entry holds back the next fair waiter"
        );
    }
}
