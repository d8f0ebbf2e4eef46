//! What dlock reports through the [`metrics`] facade (no exporter is forced on users:
//! install any recorder, e.g. `metrics-exporter-prometheus`, **before** connecting a
//! [`Locker`](crate::Locker); each locker registers its handles when it is made).
//!
//! Every series carries the label `scheme` (the backend's URL scheme: `redis`,
//! `postgres`, …). Durations are in seconds.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `dlock_acquire_seconds` | histogram | `outcome` | the whole call of `lock*`/`try_lock*`, from entry to answer; `outcome` is `granted`, `busy` (a `try_lock` that found the lock held), `timeout`, `error` (invalid names and options included) or `cancelled` (the caller dropped the future) |
//! | `dlock_wait_seconds` | histogram | | of granted acquisitions that waited: from the first busy answer to the grant |
//! | `dlock_acquisitions_total` | counter | `outcome` | calls of `lock*`/`try_lock*`, by outcome as above |
//! | `dlock_busy_answers_total` | counter | | attempts the backend answered busy |
//! | `dlock_renewals_total` | counter | `result` | lease renewals by the keeper: `ok` or `failed` (a failed one is retried until the lease's local end, but where it proves the lock lost); in SQL session modes each renewal is a ping of the pinned connection, at least every `heartbeat` (with renewal on; a hold without renewal pings on its own, uncounted) |
//! | `dlock_losses_total` | counter | `reason` | held locks lost: `lease_expired`, `not_owner`, `session_lost`, `max_hold_time` |
//! | `dlock_handoffs_total` | counter | | in-process hand-offs (Redis): a release that gave the lock straight to a waiting task of the same backend |
//!
//! Spans: every public async operation of [`Locker`](crate::Locker) and
//! [`LockGuard`](crate::LockGuard) runs in a `tracing` span at DEBUG level named after
//! it (`lock`, `try_lock`, `inspect`, `extend`, `release`, `connect`) with the fields
//! `lock` (the name) and `scheme`; never a URL or a password.

use std::time::Duration;

/// Awaits `$fut` inside `$span` where that span is enabled, else directly: what
/// `#[tracing::instrument]` does, without the second future it wraps the body in (moved
/// once more, and polled through one more layer, on every call of the hot operations).
macro_rules! in_span {
    ($span:expr, $fut:expr) => {{
        let span: tracing::Span = $span;
        if span.is_disabled() {
            $fut.await
        } else {
            tracing::Instrument::instrument($fut, span).await
        }
    }};
}
pub(crate) use in_span;

use metrics::{Counter, Histogram};

use crate::error::LossReason;

/// The handles one locker records through, registered once (a recorder installed later
/// is not seen by this locker).
#[derive(Debug)]
pub(crate) struct Meters {
    scheme: &'static str,
    acquire: [Histogram; 5],
    acquisitions: [Counter; 5],
    wait: Histogram,
    busy: Counter,
    renew_ok: Counter,
    renew_failed: Counter,
    /// By [`LOSS_REASONS`].
    losses: [Counter; 4],
}

/// How a `lock*`/`try_lock*` call ended.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ended {
    Granted = 0,
    Busy = 1,
    Timeout = 2,
    Error = 3,
    /// The caller dropped the future before it ended.
    Cancelled = 4,
}

const OUTCOMES: [&str; 5] = ["granted", "busy", "timeout", "error", "cancelled"];
const LOSS_REASONS: [&str; 4] = [
    "lease_expired",
    "not_owner",
    "session_lost",
    "max_hold_time",
];

impl Meters {
    pub(crate) fn new(scheme: &'static str) -> Self {
        Meters {
            scheme,
            acquire: OUTCOMES.map(|o| {
                metrics::histogram!("dlock_acquire_seconds", "scheme" => scheme, "outcome" => o)
            }),
            acquisitions: OUTCOMES.map(|o| {
                metrics::counter!("dlock_acquisitions_total", "scheme" => scheme, "outcome" => o)
            }),
            wait: metrics::histogram!("dlock_wait_seconds", "scheme" => scheme),
            busy: metrics::counter!("dlock_busy_answers_total", "scheme" => scheme),
            renew_ok: metrics::counter!("dlock_renewals_total", "scheme" => scheme, "result" => "ok"),
            renew_failed: metrics::counter!("dlock_renewals_total", "scheme" => scheme, "result" => "failed"),
            losses: LOSS_REASONS
                .map(|r| metrics::counter!("dlock_losses_total", "scheme" => scheme, "reason" => r)),
        }
    }

    /// The backend scheme these handles are labelled with.
    pub(crate) fn scheme(&self) -> &'static str {
        self.scheme
    }

    /// Start timing a `lock*`/`try_lock*` call: recorded as cancelled unless ended.
    pub(crate) fn start(&self) -> Call<'_> {
        Call {
            meters: self,
            started: std::time::Instant::now(),
            ended: false,
        }
    }

    /// A `lock*`/`try_lock*` call ended after `took`.
    pub(crate) fn acquired(&self, outcome: Ended, took: Duration) {
        let i = outcome as usize;
        self.acquire[i].record(took.as_secs_f64());
        self.acquisitions[i].increment(1);
    }

    /// A granted acquisition waited `waited` after its first busy answer.
    pub(crate) fn waited(&self, waited: Duration) {
        self.wait.record(waited.as_secs_f64());
    }

    /// The backend answered an attempt busy.
    pub(crate) fn busy(&self) {
        self.busy.increment(1);
    }

    /// A renewal finished.
    pub(crate) fn renewed(&self, ok: bool) {
        if ok {
            self.renew_ok.increment(1);
        } else {
            self.renew_failed.increment(1);
        }
    }

    /// A held lock was lost.
    pub(crate) fn lost(&self, reason: &LossReason) {
        let i = match reason {
            LossReason::LeaseExpired => 0,
            LossReason::NotOwner => 1,
            LossReason::SessionLost(_) => 2,
            LossReason::MaxHoldTime => 3,
        };
        self.losses[i].increment(1);
    }
}

/// One `lock*`/`try_lock*` call being timed.
pub(crate) struct Call<'a> {
    meters: &'a Meters,
    started: std::time::Instant,
    ended: bool,
}

impl Call<'_> {
    /// The call ended this way.
    pub(crate) fn end(mut self, outcome: Ended) {
        self.ended = true;
        self.meters.acquired(outcome, self.started.elapsed());
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.meters
                .acquired(Ended::Cancelled, self.started.elapsed());
        }
    }
}

impl Default for Meters {
    fn default() -> Self {
        Meters::new("unknown")
    }
}

/// One in-process hand-off on the backend `scheme` (counted where it happens).
#[cfg(feature = "redis")]
pub(crate) fn handoff(scheme: &'static str) {
    metrics::counter!("dlock_handoffs_total", "scheme" => scheme).increment(1);
}

/// The level of sqlx's report that a pool connection took long to come (its default is
/// a warning): on a busy backend, waiting for a pool connection is part of waiting for
/// a lock (64 tasks taking locks through SQLite's one writing connection wait for it
/// in turn), and the wait shows in `dlock_acquire_seconds`. At debug, a filter
/// such as `sqlx=debug` (the `dlock` CLI's `--log`) still shows it.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) const POOL_WAIT_LOG: log::LevelFilter = log::LevelFilter::Debug;
