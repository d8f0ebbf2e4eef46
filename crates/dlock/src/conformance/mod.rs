//! The behaviour suite every backend must pass.
//!
//! Each `pub async fn` here checks one behaviour against a [`Harness`] (a URL plus
//! whatever keeps its server alive). [`conformance_suite!`](crate::conformance_suite)
//! turns the whole list into one `#[tokio::test]` per behaviour for a backend:
//!
//! ```text
//! async fn harness() -> Option<dlock::conformance::Harness> {
//!     Some(dlock::conformance::Harness::new("memory://"))
//! }
//! dlock::conformance_suite!(harness());
//! ```
//!
//! Behaviours that depend on a capability (reentrancy, FIFO) check
//! [`crate::Locker::capabilities`] and assert the opposite claim where it makes sense,
//! so a backend cannot pass by claiming nothing.
//!
//! Time bounds are generous (a lease plus half a second or more): they catch a lock
//! that is never freed, not a slow machine.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::{LockOptions, Locker, Owner, Renewal};

mod admin;
mod behaviours;
mod crowd;
mod faults;
mod fenced;
mod multi;
mod primitives;
mod shared;
pub use admin::list_shows_the_held_locks;
pub use behaviours::*;
pub use crowd::Crowd;
pub use faults::{
    a_stalled_holder_counts_as_lost, wait_until_queued, waiter_cancelled_in_an_outage,
};
pub use fenced::{BookReport, FencedBook, SectionId};
pub use multi::{a_set_goes_back_at_once, lock_all_is_all_or_nothing_and_never_deadlocks};
pub use primitives::*;
pub use shared::*;

/// What a harness's fault proxy (between a client and the server, on loopback) does
/// to the traffic of the lockers made by [`Harness::proxied_locker`].
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetFault {
    /// Forward everything.
    None,
    /// Hold every chunk this long, both ways.
    Delay(Duration),
    /// Forward requests, drop replies (requests run, their answers vanish).
    DropReplies,
    /// Reset every open connection now (then forward again).
    ResetAll,
}

/// A switch that puts a [`NetFault`] on the proxy.
type FaultSwitch = Arc<dyn Fn(NetFault) + Send + Sync>;

/// Where the backend under test lives, and what keeps it alive.
pub struct Harness {
    url: String,
    keep: Vec<Box<dyn Any + Send + Sync>>,
    proxy: Option<(String, FaultSwitch)>,
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness")
            .field("url", &crate::url::redact_secrets(&self.url))
            .finish_non_exhaustive()
    }
}

impl Harness {
    /// A harness for `url`.
    #[must_use]
    pub fn new(url: impl Into<String>) -> Self {
        Harness {
            url: url.into(),
            keep: Vec::new(),
            proxy: None,
        }
    }

    /// Add a fault proxy: `url` reaches the same server through it, and `switch` sets
    /// what the proxy does to the traffic.
    #[must_use]
    pub fn with_proxy(
        mut self,
        url: impl Into<String>,
        switch: impl Fn(NetFault) + Send + Sync + 'static,
    ) -> Self {
        self.proxy = Some((url.into(), Arc::new(switch)));
        self
    }

    /// A new client whose traffic goes through the fault proxy, if the harness has one.
    ///
    /// # Panics
    /// When the backend cannot be reached through the proxy.
    pub async fn proxied_locker(&self) -> Option<Locker> {
        let (url, _) = self.proxy.as_ref()?;
        match Locker::connect(url).await {
            Ok(l) => Some(l),
            Err(e) => panic!(
                "cannot connect through the proxy to {}: {e}",
                crate::url::redact_secrets(url)
            ),
        }
    }

    /// The proxy's switch (forwards everything when the harness has no proxy).
    #[must_use]
    pub fn fault_switch(&self) -> FaultSwitch {
        self.proxy
            .as_ref()
            .map_or_else(|| Arc::new(|_| {}) as FaultSwitch, |(_, s)| Arc::clone(s))
    }

    /// Keep `thing` (a server process, a temp dir) alive as long as the harness.
    #[must_use]
    pub fn keep(mut self, thing: impl Any + Send + Sync) -> Self {
        self.keep.push(Box::new(thing));
        self
    }

    /// The URL under test.
    #[must_use]
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A new, independent client of the backend (its own connections).
    ///
    /// # Panics
    /// When the backend cannot be reached: the test fails.
    pub async fn locker(&self) -> Locker {
        match Locker::connect(&self.url).await {
            Ok(l) => l,
            Err(e) => panic!(
                "cannot connect to {}: {e}",
                crate::url::redact_secrets(&self.url)
            ),
        }
    }
}

/// For a test whose server is missing: `None` (the test prints "skipped: …" and returns)
/// unless `DLOCK_REQUIRE_SERVERS=1`, in which case the test fails.
///
/// # Panics
/// When `DLOCK_REQUIRE_SERVERS=1`.
#[must_use]
pub fn skip(reason: &str) -> Option<Harness> {
    if std::env::var("DLOCK_REQUIRE_SERVERS").is_ok_and(|v| v == "1") {
        panic!("DLOCK_REQUIRE_SERVERS=1 but {reason}");
    }
    eprintln!("skipped: {reason}");
    None
}

/// Make one `#[tokio::test]` per conformance behaviour; `$harness` is an expression of
/// type `impl Future<Output = Option<Harness>>`, evaluated once per test.
#[macro_export]
macro_rules! conformance_suite {
    ($harness:expr) => {
        $crate::conformance_suite!(@each $harness;
            mutual_exclusion,
            try_lock_busy_is_none,
            timeout_bounds,
            release_then_reacquire,
            drop_releases_promptly,
            drop_off_the_runtime_releases_promptly,
            stale_owner_cannot_release_or_extend,
            release_after_a_break_reports_the_loss,
            forged_owners_never_succeed,
            ttl_expiry_frees,
            renewal_outlives_ttl,
            fencing_strictly_increases,
            cancel_while_waiting_leaves_nothing,
            cancel_mid_acquire_leaves_nothing,
            loss_signal_fires,
            with_lock_cancels_on_loss,
            reentrancy,
            fifo_order,
            waiter_wakes_promptly,
            independent_names,
            inspect_shows_holder,
            bad_input_errors,
            distinct_names_never_collide,
            max_hold_stops_renewal,
            shared_owners_crowd,
            shared_owner_renewal_never_shortens,
            same_owner_relock_while_holding,
            shared_owner_waiters_leave_nothing,
            renewal_never_shortens_the_server_lease,
            a_stale_grant_cannot_touch_its_owners_newer_grant,
            a_waiter_that_left_is_never_handed_the_lock,
            lock_all_is_all_or_nothing_and_never_deadlocks,
            list_shows_the_held_locks,
            semaphore_admits_at_most_its_permits,
            semaphore_permit_of_a_dead_holder_frees,
            semaphore_many_permits_all_or_none_without_deadlock,
            fair_primitives_are_served_in_arrival_order,
            rwlock_readers_share_and_a_writer_excludes,
            rwlock_a_waiting_writer_is_not_starved,
            rwlock_upgrade_is_refused_and_tokens_increase,
            rwlock_downgrade_keeps_writers_out,
            rwlock_readers_behind_a_writer_all_get_in,
            election_one_leader_terms_increase,
        );
    };
    (@each $harness:expr; $($behaviour:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $behaviour() {
                if let Some(harness) = $harness.await {
                    $crate::conformance::$behaviour(&harness).await;
                }
            }
        )*
    };
}

/// The behaviours that need a harness with a fault proxy
/// ([`Harness::with_proxy`]): one `#[tokio::test]` each.
#[macro_export]
macro_rules! conformance_faults {
    ($harness:expr) => {
        $crate::conformance_suite!(@each $harness;
            shared_owners_crowd_under_faults,
            primitives_under_faults,
        );
    };
}

/// The behaviours that need a harness with a fault proxy whose backend answers through
/// a delay of 60 ms each way ([`Harness::with_proxy`]; Redlock: a `node_timeout`
/// above it): one `#[tokio::test]` each.
#[macro_export]
macro_rules! conformance_slow_network {
    ($harness:expr) => {
        $crate::conformance_suite!(@each $harness;
            a_set_goes_back_at_once,
        );
    };
}

/// A lock name unique to one test run, so behaviours never see each other's locks.
fn unique(label: &str) -> String {
    format!("conf:{label}:{}", Owner::random())
}

fn opts() -> LockOptions {
    LockOptions::new()
}

fn short_lease(ms: u64) -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_millis(ms))
        .renewal(Renewal::Off)
}

/// Poll `cond` every 10 ms until it holds or `within` passes; returns whether it held.
async fn eventually<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + within;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The guard must be movable into spawned tasks.
const _: fn() = || {
    fn is_send_static<T: Send + 'static>() {}
    is_send_static::<crate::LockGuard>();
};
