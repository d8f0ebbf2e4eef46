//! Lease arithmetic shared by the acquisition loop, the keeper and backends: how much
//! of a lease a holder may trust, and when a grant's lease began.

use tokio::time::Instant;

/// Safety margin subtracted from a lease before the holder trusts it: 1 % of the TTL
/// plus 2 ms (the Redlock drift rule). The core never uses less; a backend may ask for
/// more ([`HeldLock::clock_drift`](crate::backend::HeldLock::clock_drift)).
#[must_use]
pub fn drift_margin(ttl: std::time::Duration) -> std::time::Duration {
    ttl / 100 + std::time::Duration::from_millis(2)
}

/// Until when a session proven alive by a request sent at `sent` is trusted, the
/// server ending a session it has not heard from for `window` (its clock starts no
/// sooner than it received the request): less the drift margin and 50 ms. What every
/// session-bound backend feeds its holds' [`crate::backend::SessionTrust`].
#[cfg(any(
    feature = "etcd",
    feature = "zookeeper",
    feature = "postgres",
    feature = "mysql"
))]
pub(crate) fn trusted_until(
    sent: std::time::Instant,
    window: std::time::Duration,
) -> std::time::Instant {
    sent + window.saturating_sub(drift_margin(window) + std::time::Duration::from_millis(50))
}

/// `d` in nanoseconds, saturating at `u64::MAX` (584 years): how the keeper and the
/// Redis hand-off table store the instants of 100,000 held locks compactly, as
/// nanoseconds after a base instant.
#[must_use]
pub(crate) fn nanos_of(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// When a grant's lease began, at the latest: `sent_at` (the instant before the
/// attempt that returned it was sent), or `granted_at` if the grant was made before
/// that (a hand-off made while its waiter slept; `HeldLock::granted_at`).
pub(crate) fn lease_start(granted_at: Option<std::time::Instant>, sent_at: Instant) -> Instant {
    granted_at.map_or(sent_at, |g| Instant::from_std(g).min(sent_at))
}

/// `d` in whole milliseconds, saturating (what the servers' lease arguments take).
#[cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
