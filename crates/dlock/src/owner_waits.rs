//! The waiting acquisitions of one [`crate::Locker`], by lock and owner, so that a grant
//! to an owner can wake that owner's other waiting acquisitions of the same lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::name::LockName;
use crate::options::Owner;

/// Each waiting acquisition's wake-up, by (lock, owner).
type Waits = HashMap<(LockName, Owner), Vec<Arc<Notify>>>;

/// The waiting acquisitions of one locker, by lock and owner. A grant to an owner wakes
/// the other acquisitions of that owner waiting for that lock: where the backend is
/// reentrant they re-enter at once (no release will come to wake them while their own
/// owner holds the lock); elsewhere they look once and wait on.
#[derive(Debug, Default)]
pub(crate) struct OwnerWaiters {
    /// Registered waits, so the uncontended path skips the map.
    count: AtomicUsize,
    map: Mutex<Waits>,
}

impl OwnerWaiters {
    fn map(&self) -> std::sync::MutexGuard<'_, Waits> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn register(self: &Arc<Self>, name: &LockName, owner: &Owner) -> OwnerWait {
        let notify = Arc::new(Notify::new());
        self.map()
            .entry((name.clone(), owner.clone()))
            .or_default()
            .push(Arc::clone(&notify));
        self.count.fetch_add(1, Ordering::SeqCst);
        OwnerWait {
            waiters: Arc::clone(self),
            key: (name.clone(), owner.clone()),
            notify,
        }
    }

    /// `owner` was granted `name`: wake its other waiting acquisitions of it.
    pub(crate) fn granted(&self, name: &LockName, owner: &Owner) {
        if self.count.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(list) = self.map().get(&(name.clone(), owner.clone())) {
            for n in list {
                n.notify_one();
            }
        }
    }
}

/// One waiting acquisition's registration (removed on drop).
pub(crate) struct OwnerWait {
    waiters: Arc<OwnerWaiters>,
    key: (LockName, Owner),
    notify: Arc<Notify>,
}

impl OwnerWait {
    /// Resolves when another acquisition of this owner was granted the lock (a wake-up
    /// that came while nobody awaited is kept for the next call).
    pub(crate) async fn granted(&self) {
        self.notify.notified().await;
    }
}

impl Drop for OwnerWait {
    fn drop(&mut self) {
        let mut map = self.waiters.map();
        if let Some(list) = map.get_mut(&self.key) {
            list.retain(|n| !Arc::ptr_eq(n, &self.notify));
            if list.is_empty() {
                map.remove(&self.key);
            }
        }
        drop(map);
        self.waiters.count.fetch_sub(1, Ordering::SeqCst);
    }
}
