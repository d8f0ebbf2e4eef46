//! [`Election`]: leader election on the lock — campaign, resign, observe.
//!
//! A leader is the holder of the lock `NAME`, with its value in the holder's metadata
//! (the note) and its term = the grant's fencing token: strictly increasing from one
//! leader to the next on every backend whose fencing is durable. Leadership has the
//! lock's lease (or session) semantics: a leader that dies is replaced within the TTL
//! (or the session timeout) plus the backend's tick; a leader whose renewals fail hears
//! of it through [`Leadership::lost`] before its lease can end on the server.
//!
//! An election and a lock of the same name are the same thing (as with etcd, where
//! `etcdctl elect NAME` and `etcdctl lock NAME` share a key prefix): a lock holder of
//! `NAME` is the leader, its note (if any) its value. On etcd a candidate's key holds
//! its value alone (etcd's `concurrency.Election`), and on ZooKeeper its node does
//! (Curator's `LeaderLatch`); there, a value that is itself a JSON object with a string
//! `owner` field is read back as dlock's lock record (avoid such values).

use std::time::Duration;

use crate::error::{Error, Result};
use crate::guard::LockGuard;
use crate::locker::Locker;
use crate::options::{LockOptions, Metadata, Wait};

/// An election of a [`Locker`]'s backend. Made by [`Locker::election`]; cheap to clone.
///
/// ```no_run
/// # async fn demo(locker: dlock::Locker) -> dlock::Result<()> {
/// let election = locker.election("cron-scheduler");
/// let leadership = election.campaign("node-a:8080").await?; // waits until leader
/// println!("leader for term {}", leadership.term());
/// tokio::select! {
///     () = async { /* schedule jobs, passing leadership.term() to what they touch */ } => {}
///     err = leadership.lost() => return Err(err),
/// }
/// leadership.resign().await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Election {
    locker: Locker,
    name: String,
}

/// The current leader, as an observer sees it.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Leader {
    /// The election's name.
    pub name: String,
    /// What the leader campaigned with (empty for a plain lock holder or a holder
    /// outside dlock).
    pub value: String,
    /// The leader's term: its grant's fencing token (0 for a holder outside dlock).
    pub term: u64,
    /// The leader's owner token.
    pub owner: String,
    /// Time left on its lease, when the backend knows it (`None`: while its session
    /// lives).
    #[serde(serialize_with = "ser_opt_ms", rename = "remaining_ms")]
    pub remaining: Option<Duration>,
    /// The leader's host and process, when it said.
    pub metadata: Metadata,
}

fn ser_opt_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        None => s.serialize_none(),
    }
}

impl Election {
    pub(crate) fn new(locker: Locker, name: &str) -> Self {
        Election {
            locker,
            name: name.to_owned(),
        }
    }

    /// The election's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Campaign with `value` (what observers see: an address, a node name) and wait as
    /// long as it takes to become leader (the locker's default options).
    ///
    /// # Errors
    /// [`Error::InvalidName`], backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves no leadership and no candidacy behind.
    pub async fn campaign(&self, value: &str) -> Result<Leadership> {
        let opts = LockOptions {
            wait: Wait::Forever,
            ..self.locker.default_options()
        };
        self.campaign_with(value, &opts).await
    }

    /// Campaign with explicit options (TTL, wait). The value replaces the note of
    /// `opts.metadata`. Each campaign has a fresh owner of its own: an owner in `opts`
    /// is refused, as two campaigns sharing one would both lead (an owner re-enters
    /// its own hold).
    ///
    /// # Errors
    /// As [`Election::campaign`], plus [`Error::Timeout`] when `opts.wait` runs out and
    /// [`Error::InvalidOption`] for an owner in `opts`.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future leaves no leadership and no candidacy behind.
    pub async fn campaign_with(&self, value: &str, opts: &LockOptions) -> Result<Leadership> {
        if opts.owner.is_some() {
            return Err(Error::option(
                "owner",
                "a campaign has a fresh owner of its own: two campaigns sharing one would both lead",
            ));
        }
        let metadata = opts
            .metadata
            .clone()
            .unwrap_or_else(Metadata::this_process)
            .with_note(value);
        let opts = LockOptions {
            metadata: Some(metadata),
            campaign: Some(value.to_owned()),
            ..opts.clone()
        };
        let guard = self.locker.lock_with(&self.name, &opts).await?;
        Ok(Leadership {
            guard,
            value: value.to_owned(),
        })
    }

    /// The current leader, if there is one.
    ///
    /// # Errors
    /// [`Error::InvalidName`], backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn leader(&self) -> Result<Option<Leader>> {
        Ok(self.locker.inspect(&self.name).await?.map(|info| Leader {
            name: info.name,
            value: info.metadata.note.clone().unwrap_or_default(),
            term: info.fencing_token,
            owner: info.owner,
            remaining: info.remaining,
            metadata: Metadata {
                note: None,
                ..info.metadata
            },
        }))
    }

    /// Observe leader changes: each [`LeaderWatch::changed`] returns the leader (or
    /// `None`) once it differs from what the watch returned last (another term, or no
    /// leader), looking every `every` (observers poll: no backend offers a change feed
    /// of the lock that every reader could share).
    #[must_use]
    pub fn watch(&self, every: Duration) -> LeaderWatch {
        LeaderWatch {
            election: self.clone(),
            every: every.max(Duration::from_millis(10)),
            last: None,
        }
    }
}

/// A stream of leader changes ([`Election::watch`]).
#[derive(Debug)]
pub struct LeaderWatch {
    election: Election,
    every: Duration,
    /// The last answer given: `None` before the first, `Some(None)` no leader.
    last: Option<Option<(u64, String)>>,
}

impl LeaderWatch {
    /// The leader once it differs from the last one returned (the first call returns
    /// at once).
    ///
    /// # Errors
    /// Backend errors (the watch can be asked again).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is changed until an answer is returned.
    pub async fn changed(&mut self) -> Result<Option<Leader>> {
        loop {
            let now = self.election.leader().await?;
            let seen = now.as_ref().map(|l| (l.term, l.owner.clone()));
            if self.last.as_ref() != Some(&seen) {
                self.last = Some(seen);
                return Ok(now);
            }
            tokio::time::sleep(self.every).await;
        }
    }
}

/// Being the leader: a [`LockGuard`] of the election's lock, with its value.
#[derive(Debug)]
#[must_use = "dropping the leadership resigns it"]
pub struct Leadership {
    guard: LockGuard,
    value: String,
}

impl Leadership {
    /// The term: the grant's fencing token. Pass it to what the leader acts on.
    #[must_use]
    pub fn term(&self) -> u64 {
        self.guard.fencing_token()
    }

    /// The value campaigned with.
    #[must_use]
    pub fn value(&self) -> &str {
        &self.value
    }

    /// Whether leadership is still held (its local deadline has not passed and no loss
    /// was reported).
    #[must_use]
    pub fn is_leader(&self) -> bool {
        self.guard.is_held()
    }

    /// Resolves when leadership is lost (a renewal failed past the deadline, the session
    /// ended, the lock was broken).
    pub fn lost(&self) -> impl std::future::Future<Output = Error> + Send + 'static {
        self.guard.lost()
    }

    /// The lock guard behind the leadership.
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// The lock guard behind the leadership, taken out of it (for code that handles
    /// locks: a tool running a command under it).
    pub fn into_guard(self) -> LockGuard {
        self.guard
    }

    /// Step down: the next candidate becomes leader at once.
    ///
    /// # Errors
    /// [`crate::Error::LockLost`] when the leadership had been lost, or was found gone
    /// (see [`crate::LockGuard::release`]); backend errors (the lease ends the
    /// leadership anyway).
    ///
    /// # Cancel safety
    /// Cancel safe: an unfinished resignation finishes in the background.
    pub async fn resign(self) -> Result<()> {
        self.guard.release().await
    }
}
