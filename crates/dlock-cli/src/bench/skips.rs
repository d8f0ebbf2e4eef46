//! Errors a measured loop of `dlock bench` steps over rather than ending the run on.
//!
//! Under load a backend can refuse one cycle without anything being wrong with dlock or
//! the run: Redlock answers [`NoQuorum`](dlock::Error::NoQuorum) at once when its nodes
//! pass `node_timeout` together (a stalled CPU or disk), a connection can drop. The
//! loop goes on, and the run reports how many errors it stepped over and the first
//! one's message. An acquisition that failed is not counted; a release that failed
//! follows one that succeeded, so that grant is counted (and a lock whose release
//! failed stays taken until its lease ends: the waits behind it are measured as they
//! are). A wait that timed out ([`Timeout`](dlock::Error::Timeout): a stuck hand-off)
//! and any error that trying again cannot mend still end the run, and so does one
//! more than [`MAX_SKIPPED`] in one loop (one [`Skips`] tally: the uncontended run
//! with its limit, counted and single-node runs, a contended worker process, a scaling
//! level, a hand-off or parallel run). The floors' bare requests are not stepped over.
//! The uncontended loop, the lock's only taker, goes on on a fresh name after a
//! release that failed (`floor::measure`) rather than wait for the lease to end.

use std::sync::{Arc, Mutex, PoisonError};

use serde::Serialize;

/// The most errors one tally steps over; the next one ends its loop.
pub const MAX_SKIPPED: u64 = 100;

/// What a run stepped over.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// Retryable errors stepped over: acquisitions given up, releases that failed.
    pub count: u64,
    /// The first such error's message.
    pub first: Option<String>,
}

impl Skipped {
    /// `"; N cycles stepped over on an error (the first: …)"`, or nothing when there
    /// were none.
    pub fn suffix(&self) -> String {
        match (&self.first, self.count) {
            (Some(first), n) if n > 0 => {
                format!(
                    "; {n} cycle{} stepped over on an error (the first: {first})",
                    if n == 1 { "" } else { "s" }
                )
            }
            _ => String::new(),
        }
    }

    /// Both runs' errors: the counts added, the earlier first kept.
    pub fn merge(&mut self, other: Skipped) {
        self.count += other.count;
        if self.first.is_none() {
            self.first = other.first;
        }
    }
}

/// The tally one loop's tasks share.
#[derive(Debug, Clone, Default)]
pub struct Skips(Arc<Mutex<Skipped>>);

impl Skips {
    /// `Ok` when `e` is stepped over (counted), else `e` back: the run ends on it.
    ///
    /// # Errors
    ///
    /// `e` itself when it is not retryable, is a [`Timeout`](dlock::Error::Timeout),
    /// or would be this tally's `MAX_SKIPPED + 1`th.
    pub fn step_over(&self, e: dlock::Error) -> Result<(), dlock::Error> {
        if !e.is_retryable() || matches!(e, dlock::Error::Timeout { .. }) {
            return Err(e);
        }
        let mut s = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if s.count >= MAX_SKIPPED {
            return Err(e);
        }
        s.count += 1;
        if s.first.is_none() {
            s.first = Some(e.to_string());
        }
        Ok(())
    }

    /// Give `guard` back: `true` when it was, `false` when the release failed on a
    /// retryable error, stepped over (the grant stays counted; the lock stays taken
    /// until its lease ends).
    ///
    /// # Errors
    /// As [`Skips::step_over`].
    pub async fn release(&self, guard: dlock::LockGuard) -> Result<bool, dlock::Error> {
        match guard.release().await {
            Ok(()) => Ok(true),
            Err(e) => self.step_over(e).map(|()| false),
        }
    }

    /// What was stepped over so far.
    pub fn tally(&self) -> Skipped {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_quorum() -> dlock::Error {
        dlock::Error::NoQuorum {
            granted: 0,
            needed: 3,
            unreachable: 5,
        }
    }

    #[test]
    fn retryable_errors_are_counted_up_to_the_limit_and_others_end_the_run() {
        let skips = Skips::default();
        assert!(skips.step_over(no_quorum()).is_ok());
        assert_eq!(skips.tally().count, 1);
        let first = skips.tally().first.unwrap_or_default();
        assert!(first.contains("quorum"), "{first}");
        let timeout = dlock::Error::Timeout {
            name: "x".into(),
            waited: std::time::Duration::from_secs(30),
        };
        assert!(
            skips.step_over(timeout).is_err(),
            "a stuck wait ends the run"
        );
        let bad = dlock::Error::InvalidOption {
            option: "ttl".into(),
            reason: "too short".into(),
        };
        assert!(skips.step_over(bad).is_err(), "a bad option ends the run");
        for _ in 1..MAX_SKIPPED {
            assert!(skips.clone().step_over(no_quorum()).is_ok());
        }
        assert!(skips.step_over(no_quorum()).is_err(), "the 101st ends it");
        assert_eq!(skips.tally().count, MAX_SKIPPED);
        assert!(skips.tally().suffix().contains("100 cycles stepped over"));
        assert_eq!(Skipped::default().suffix(), "");
    }
}
