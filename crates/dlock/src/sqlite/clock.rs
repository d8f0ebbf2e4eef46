//! Time as every process on this machine sees it: `CLOCK_MONOTONIC` plus the boot id,
//! with the wall clock kept only for rows written under another boot.
//!
//! `CLOCK_MONOTONIC` is the clock of `std::time::Instant`, and so of the holder's
//! local deadline: the lease and the deadline advance together, also across a
//! suspend (where `CLOCK_BOOTTIME` would run on and end a lease whose holder, asleep,
//! still saw time left).

use std::sync::Arc;
use std::time::Duration;

/// Where the kernel tells its boot id.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// The kernel's boot id (`unknown-boot`, with a warning once per process, where it
/// cannot be read: see the module's docs on what that costs).
pub(super) fn read_boot_id() -> Arc<str> {
    match std::fs::read_to_string(BOOT_ID) {
        Ok(id) => id.trim().into(),
        Err(e) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    path = BOOT_ID,
                    error = %e,
                    "cannot read the boot id: other processes' leases on this SQLite file \
                     are judged by the wall clock, and leases left by a crash may count as \
                     live after a reboot (see the sqlite module's docs)"
                );
            });
            "unknown-boot".into()
        }
    }
}

/// The clock leases are kept on: the one `std::time::Instant` reads on Linux.
pub(super) const LEASE_CLOCK: nix::time::ClockId = nix::time::ClockId::CLOCK_MONOTONIC;

/// A point in time: boot id, milliseconds on [`LEASE_CLOCK`], wall-clock milliseconds.
#[derive(Debug, Clone)]
pub(super) struct Now {
    pub boot_id: Arc<str>,
    pub boot_ms: i64,
    pub wall_ms: i64,
}

impl Now {
    pub(super) fn read(boot_id: &Arc<str>) -> Self {
        let boot_ms = nix::time::clock_gettime(LEASE_CLOCK)
            .map(|ts| ts.tv_sec() * 1000 + ts.tv_nsec() / 1_000_000)
            .unwrap_or(0);
        let wall_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        Now {
            boot_id: Arc::clone(boot_id),
            boot_ms,
            wall_ms,
        }
    }

    /// Milliseconds left on a lease stored as (boot id, boot expiry, wall expiry); zero
    /// or less means expired. Same boot: the boot clock decides, so a wall-clock jump
    /// changes nothing. Another boot: the wall clock is all there is.
    pub(super) fn remaining_ms(&self, boot_id: &str, expires_boot: i64, expires_wall: i64) -> i64 {
        if boot_id == &*self.boot_id {
            expires_boot - self.boot_ms
        } else {
            expires_wall - self.wall_ms
        }
    }

    /// (boot ms, wall ms) of now + `d`.
    pub(super) fn after(&self, d: Duration) -> (i64, i64) {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4);
        (self.boot_ms + ms, self.wall_ms + ms)
    }

    /// (boot ms, wall ms) of now − `d`.
    pub(super) fn before(&self, d: Duration) -> (i64, i64) {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4);
        (self.boot_ms - ms, self.wall_ms - ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_boot_ignores_the_wall_clock() {
        let now = Now {
            boot_id: "b1".into(),
            boot_ms: 1000,
            wall_ms: 5_000_000,
        };
        assert_eq!(now.remaining_ms("b1", 1500, 0), 500);
        assert_eq!(now.remaining_ms("b1", 1500, i64::MAX), 500);
        // Another boot: judged by the wall clock.
        assert_eq!(now.remaining_ms("b0", 999_999, 5_000_100), 100);
        assert!(now.remaining_ms("b0", 999_999, 4_000_000) < 0);
    }

    /// The lease clock is the holder's clock: a suspend stops both (issue: leases on
    /// `CLOCK_BOOTTIME` ran on through a suspend while the holder's deadline, on the
    /// monotonic clock, stood still — another process took the lock from a holder that
    /// still saw time left).
    #[test]
    fn leases_run_on_the_clock_of_the_holders_deadline() {
        assert_eq!(LEASE_CLOCK, nix::time::ClockId::CLOCK_MONOTONIC);
        // And it advances with std's Instant (the keeper's clock).
        let id = read_boot_id();
        let (a, i) = (Now::read(&id), std::time::Instant::now());
        std::thread::sleep(Duration::from_millis(30));
        let (b, j) = (Now::read(&id), std::time::Instant::now());
        let ours = b.boot_ms - a.boot_ms;
        let std_ms = i64::try_from(j.duration_since(i).as_millis()).unwrap_or(0);
        assert!((ours - std_ms).abs() <= 2, "{ours} ms vs {std_ms} ms");
    }

    #[test]
    fn boot_clock_is_monotonic_and_boot_id_stable() {
        let id = read_boot_id();
        let a = Now::read(&id);
        std::thread::sleep(Duration::from_millis(5));
        let b = Now::read(&id);
        assert!(b.boot_ms >= a.boot_ms + 4);
        assert_eq!(read_boot_id(), id);
    }
}
