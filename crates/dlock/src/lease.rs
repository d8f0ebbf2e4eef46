//! Lease arithmetic shared by the acquisition loop, the keeper and backends: how much
//! of a lease a holder may trust, and when a grant's lease began.

use tokio::time::Instant;

use crate::backend::HeldLock;

/// Safety margin subtracted from a lease before the holder trusts it: 1 % of the TTL
/// plus 2 ms (the Redlock drift rule). The core never uses less; a backend may ask for
/// more ([`HeldLock::clock_drift`]).
#[must_use]
pub fn drift_margin(ttl: std::time::Duration) -> std::time::Duration {
    ttl / 100 + std::time::Duration::from_millis(2)
}

/// When the lease of `held` began, at the latest: `sent_at` (the instant before the
/// attempt that returned it was sent), or earlier if the grant was made before that
/// (a hand-off made while its waiter slept).
pub(crate) fn lease_start(held: &dyn HeldLock, sent_at: Instant) -> Instant {
    held.granted_at()
        .map_or(sent_at, |g| Instant::from_std(g).min(sent_at))
}
