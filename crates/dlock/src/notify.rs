//! In-process change notification: a counter per lock name that waiters watch.
//!
//! Backends bump it on every release they perform, so waiters in the same process wake
//! at once even when the backend itself can only be polled.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

use crate::name::LockName;

/// Change counters keyed by lock name. Entries without watchers are dropped on the
/// next notification, so the map stays as small as the set of names being waited on.
#[derive(Debug)]
pub(crate) struct ChangeHub<K = LockName> {
    senders: Mutex<HashMap<K, watch::Sender<u64>>>,
}

impl<K> Default for ChangeHub<K> {
    fn default() -> Self {
        ChangeHub {
            senders: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: std::hash::Hash + Eq + Clone> ChangeHub<K> {
    /// A receiver that sees every later [`ChangeHub::notify`] of `name`.
    pub(crate) fn subscribe(&self, name: &K) -> watch::Receiver<u64> {
        let mut map = self
            .senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match map.get(name) {
            Some(tx) => tx.subscribe(),
            None => {
                let (tx, rx) = watch::channel(0);
                map.insert(name.clone(), tx);
                rx
            }
        }
    }

    /// Wake everyone watching `name`.
    pub(crate) fn notify(&self, name: &K) {
        let mut map = self
            .senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(tx) = map.get(name) {
            if tx.receiver_count() == 0 {
                map.remove(name);
            } else {
                tx.send_modify(|v| *v = v.wrapping_add(1));
            }
        }
    }
}

/// Wait for a change on `rx`, at most `max`.
pub(crate) async fn wait_change(rx: &mut watch::Receiver<u64>, max: Duration) {
    let _ = tokio::time::timeout(max, rx.changed()).await;
}

/// Wake-ups handed to **one** waiter of a key at a time, in the order they started
/// waiting (`tokio::sync::Notify::notify_one`; a wake-up with nobody waiting is kept for
/// the next). A release then costs one attempt in this process, not a stampede of every
/// waiter on one row.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug)]
pub(crate) struct WakeOne<K> {
    map: Mutex<HashMap<K, (std::sync::Arc<tokio::sync::Notify>, usize)>>,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<K> Default for WakeOne<K> {
    fn default() -> Self {
        WakeOne {
            map: Mutex::new(HashMap::new()),
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<K: std::hash::Hash + Eq + Clone> WakeOne<K> {
    fn map(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<K, (std::sync::Arc<tokio::sync::Notify>, usize)>> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Register a waiter of `key` (until the returned watch is dropped).
    pub(crate) fn watch(self: &std::sync::Arc<Self>, key: &K) -> WakeWatch<K> {
        let notify = {
            let mut map = self.map();
            let entry = map
                .entry(key.clone())
                .or_insert_with(|| (std::sync::Arc::default(), 0));
            entry.1 += 1;
            std::sync::Arc::clone(&entry.0)
        };
        WakeWatch {
            hub: std::sync::Arc::clone(self),
            key: key.clone(),
            notify,
        }
    }

    /// Wake one waiter of `key`, if this process has any.
    pub(crate) fn wake(&self, key: &K) {
        if let Some((n, _)) = self.map().get(key) {
            n.notify_one();
        }
    }

    /// Wake every waiter of every key `which` picks (releases of it may have gone
    /// unannounced: several permits or readers may have come free).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn wake_where(&self, which: impl Fn(&K) -> bool) {
        for (key, (n, _)) in self.map().iter() {
            if which(key) {
                n.notify_waiters();
                n.notify_one();
            }
        }
    }

    /// Wake every waiter of every key (notifications may have been missed).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn wake_all(&self) {
        for (n, _) in self.map().values() {
            n.notify_waiters();
            n.notify_one();
        }
    }
}

/// One registered waiter of a [`WakeOne`] key.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug)]
pub(crate) struct WakeWatch<K: std::hash::Hash + Eq + Clone> {
    hub: std::sync::Arc<WakeOne<K>>,
    key: K,
    notify: std::sync::Arc<tokio::sync::Notify>,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<K: std::hash::Hash + Eq + Clone> WakeWatch<K> {
    /// Until this waiter's wake-up, or `max`.
    pub(crate) async fn wait(&self, max: Duration) {
        let _ = tokio::time::timeout(max, self.notify.notified()).await;
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<K: std::hash::Hash + Eq + Clone> Drop for WakeWatch<K> {
    fn drop(&mut self) {
        let mut map = self.hub.map();
        if let Some(entry) = map.get_mut(&self.key) {
            entry.1 -= 1;
            if entry.1 == 0 {
                map.remove(&self.key);
            }
        }
    }
}
