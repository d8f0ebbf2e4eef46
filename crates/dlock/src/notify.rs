//! In-process change notification: a counter per lock name that waiters watch.
//!
//! Backends bump it on every release they perform, so waiters in the same process wake
//! at once even when the backend itself can only be polled.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

use crate::name::LockName;

/// The hasher of the in-process maps every acquisition and release looks its key up
/// in (these hubs, SQL's `LocalHolds`, Redis's hand-off table): foldhash, seeded per
/// map. SipHash, std's default, made those look-ups a visible share of a lock cycle;
/// the keys are lock names or their digests, within one process.
pub(crate) type KeyHasher = foldhash::fast::RandomState;

/// Change counters keyed by lock name. Entries without watchers are dropped on the
/// next notification, so the map stays as small as the set of names being waited on.
#[derive(Debug)]
pub(crate) struct ChangeHub<K = LockName> {
    senders: Mutex<HashMap<K, watch::Sender<u64>, KeyHasher>>,
}

impl<K> Default for ChangeHub<K> {
    fn default() -> Self {
        ChangeHub {
            senders: Mutex::new(HashMap::default()),
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
///
/// It also elects one *poller* per key and class of waiter (a lock's, a permit's, a
/// read's, a write's: one may succeed where another may not): the waiter that asks the
/// server on the backend's poll interval while the others wait for a wake-up (and only
/// fall back to asking at that interval times their number). A thousand waiters of one
/// name in one process (one backend) then cost the server one poll per interval, not a
/// thousand.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[derive(Debug)]
pub(crate) struct WakeOne<K> {
    map: Mutex<HashMap<K, KeyWaiters, KeyHasher>>,
}

/// The waiters of one key.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[derive(Debug, Default)]
struct KeyWaiters {
    notify: std::sync::Arc<tokio::sync::Notify>,
    /// Registered [`WakeWatch`]es.
    count: usize,
    /// Of them, those of each class.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    classes: [u32; 8],
    /// Bit `c` set: a waiter of class `c` holds that class's poller role.
    polled: u8,
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl<K> Default for WakeOne<K> {
    fn default() -> Self {
        WakeOne {
            map: Mutex::new(HashMap::default()),
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl<K: std::hash::Hash + Eq + Clone> WakeOne<K> {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<K, KeyWaiters, KeyHasher>> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Register a waiter of `key` (until the returned watch is dropped), of `class`
    /// (0–7: its poller role is its class's).
    pub(crate) fn watch(self: &std::sync::Arc<Self>, key: &K, class: u8) -> WakeWatch<K> {
        let notify = {
            let mut map = self.map();
            let entry = map.entry(key.clone()).or_default();
            entry.count += 1;
            entry.classes[usize::from(class & 7)] += 1;
            std::sync::Arc::clone(&entry.notify)
        };
        WakeWatch {
            hub: std::sync::Arc::clone(self),
            key: key.clone(),
            notify,
            role: 1 << (class & 7),
            polls: false,
        }
    }

    /// Wake one waiter of `key`, if this process has any.
    pub(crate) fn wake(&self, key: &K) {
        if let Some(w) = self.map().get(key) {
            w.notify.notify_one();
        }
    }

    /// Wake one waiter of `key`, if this process has any, and say how many of them
    /// are of `class`: one look at the key for both.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn wake_counting(&self, key: &K, class: u8) -> u32 {
        self.map().get(key).map_or(0, |w| {
            w.notify.notify_one();
            w.classes[usize::from(class & 7)]
        })
    }

    /// How many waiters of `key` of `class` this process has.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn waiters(&self, key: &K, class: u8) -> u32 {
        self.map()
            .get(key)
            .map_or(0, |w| w.classes[usize::from(class & 7)])
    }

    /// Wake every waiter of every key `which` picks (releases of it may have gone
    /// unannounced: several permits or readers may have come free).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn wake_where(&self, which: impl Fn(&K) -> bool) {
        for (key, w) in self.map().iter() {
            if which(key) {
                w.notify.notify_waiters();
                w.notify.notify_one();
            }
        }
    }

    /// Wake every waiter of every key (notifications may have been missed).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn wake_all(&self) {
        for w in self.map().values() {
            w.notify.notify_waiters();
            w.notify.notify_one();
        }
    }
}

/// One registered waiter of a [`WakeOne`] key.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[derive(Debug)]
pub(crate) struct WakeWatch<K: std::hash::Hash + Eq + Clone> {
    hub: std::sync::Arc<WakeOne<K>>,
    key: K,
    notify: std::sync::Arc<tokio::sync::Notify>,
    /// Its class's bit in [`KeyWaiters::polled`].
    role: u8,
    /// This waiter holds that role.
    polls: bool,
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl<K: std::hash::Hash + Eq + Clone> WakeWatch<K> {
    /// Until this waiter's wake-up, or `max`.
    pub(crate) async fn wait(&self, max: Duration) {
        let _ = tokio::time::timeout(max, self.notify.notified()).await;
    }

    /// The hub this waiter is registered with.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn hub(&self) -> std::sync::Arc<WakeOne<K>> {
        std::sync::Arc::clone(&self.hub)
    }

    /// How long this waiter may wait before asking the server again: `poll` for its
    /// key's poller (taking the role if no waiter holds it), else `poll` times the
    /// key's waiters in this process.
    pub(crate) fn poll_every(&mut self, poll: Duration) -> Duration {
        match self.poller() {
            (true, _) => poll,
            (false, waiters) => poll.saturating_mul(u32::try_from(waiters).unwrap_or(u32::MAX)),
        }
    }

    /// Whether this waiter is its key's poller (taking the role if no waiter holds
    /// it), and how many waiters the key has in this process.
    fn poller(&mut self) -> (bool, usize) {
        let mut map = self.hub.map();
        let Some(entry) = map.get_mut(&self.key) else {
            // Not reachable while this watch lives (it is counted); poll, to be safe.
            return (true, 1);
        };
        if !self.polls && entry.polled & self.role == 0 {
            entry.polled |= self.role;
            self.polls = true;
        }
        (self.polls, entry.count)
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl<K: std::hash::Hash + Eq + Clone> Drop for WakeWatch<K> {
    fn drop(&mut self) {
        let mut map = self.hub.map();
        if let Some(entry) = map.get_mut(&self.key) {
            entry.count -= 1;
            let class = usize::try_from(self.role.trailing_zeros()).unwrap_or(0) & 7;
            entry.classes[class] = entry.classes[class].saturating_sub(1);
            if entry.count == 0 {
                map.remove(&self.key);
            } else if self.polls || entry.polled & self.role == 0 {
                // The role is free (given up here, or still vacant: the waiter woken to
                // take it may be leaving without it): wake a waiter, which takes it as
                // it waits again.
                entry.polled &= !self.role;
                entry.notify.notify_one();
            }
        }
    }
}
