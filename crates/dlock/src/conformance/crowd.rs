//! A crowd of waiters on one lock, each with its own `Locker` (its own session on
//! session-bound backends): for tests that count what one release costs the server.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::{LockGuard, Locker};

/// `n` waiters queued behind a held lock.
#[derive(Debug)]
pub struct Crowd {
    holder: Locker,
    guard: LockGuard,
    name: String,
    n: usize,
    tokens: mpsc::UnboundedReceiver<u64>,
}

impl Crowd {
    /// Hold `name` from `url`, then start `n` waiters, each connecting on its own;
    /// returns once all `n` are queued (as `inspect` counts them).
    ///
    /// # Panics
    /// When connecting or locking fails, or the waiters are not all queued within 60 s.
    pub async fn queue(url: &str, name: &str, n: usize) -> Self {
        let holder = Locker::connect(url).await.expect("connect");
        let guard = holder.lock(name).await.expect("lock");
        let (tx, tokens) = mpsc::unbounded_channel();
        for _ in 0..n {
            let waiter = Locker::connect(url).await.expect("connect");
            let (tx, name) = (tx.clone(), name.to_owned());
            tokio::spawn(async move {
                let g = waiter
                    .lock_timeout(&name, Duration::from_secs(120))
                    .await
                    .unwrap_or_else(|e| panic!("waiter: {e}"));
                // Sent while holding, so the order received is the order granted (a
                // send after the release could be overtaken by the next holder's).
                let _ = tx.send(g.fencing_token());
                g.release().await.expect("release");
            });
        }
        super::wait_until_queued(&holder, name, n, Duration::from_secs(60)).await;
        Crowd {
            holder,
            guard,
            name: name.to_owned(),
            n,
            tokens,
        }
    }

    /// Release the held lock and wait until every waiter has held and released it.
    /// Returns how long that took; asserts that all were granted, in queue order.
    ///
    /// # Panics
    /// When a waiter is missing or the grants are out of order.
    pub async fn release_all(mut self) -> Duration {
        let started = Instant::now();
        self.guard.release().await.expect("release");
        let mut tokens = Vec::with_capacity(self.n);
        while tokens.len() < self.n {
            match tokio::time::timeout(Duration::from_secs(120), self.tokens.recv()).await {
                Ok(Some(t)) => tokens.push(t),
                _ => break,
            }
        }
        let took = started.elapsed();
        assert_eq!(
            tokens.len(),
            self.n,
            "not every waiter of {} got it",
            self.name
        );
        let inversions = tokens.windows(2).filter(|w| w[0] >= w[1]).count();
        assert_eq!(inversions, 0, "grants out of queue order");
        drop(self.holder);
        took
    }
}
