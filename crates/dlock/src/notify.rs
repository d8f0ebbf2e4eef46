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

impl<K: std::hash::Hash + Eq + Clone> ChangeHub<K> {
    /// Wake everyone watching any name (a notification may have been missed).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn notify_all(&self) {
        let mut map = self
            .senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.retain(|_, tx| tx.receiver_count() > 0);
        for tx in map.values() {
            tx.send_modify(|v| *v = v.wrapping_add(1));
        }
    }
}

/// Wait for a change on `rx`, at most `max`.
pub(crate) async fn wait_change(rx: &mut watch::Receiver<u64>, max: Duration) {
    let _ = tokio::time::timeout(max, rx.changed()).await;
}
