//! On-server layouts: which keys a lock uses, and the scripts that act on them.
//!
//! - [`Layout::Redisson`] (default): Redisson's RLock/RFencedLock. The lock is a hash at
//!   the name itself, field `<owner>` → hold count, with a lease (PEXPIRE); the token
//!   counter is `redisson_lock_token:{name}`; release publishes `0` on
//!   `redisson_lock__channel:{name}`. dlock adds two fields to its own holds
//!   (`dlock:fence`, `dlock:meta`), which Redisson ignores. A Redisson holder and a
//!   dlock holder exclude each other; Redisson waiters wake on dlock's release and
//!   dlock waiters on Redisson's.
//! - [`Layout::RedisPy`]: the plain-string lock of redis-py's `Lock`, redsync, rslock
//!   and node-redlock: key = name, value = random owner token, `SET NX PX`, release =
//!   delete if the value matches. No reentrancy. dlock keeps its token counter at
//!   `dlock_token:{name}` and publishes releases on `dlock_unlock:{name}`.
//! - [`Layout::PythonRedisLock`]: python-redis-lock: key `lock:NAME`, signal list
//!   `lock-signal:NAME` that release pushes one element to (expiring after 1 s).
//!
//! In both plain layouts dlock keeps the holder's metadata in `dlock_meta:{key}` with
//! the lock's lease, since the lock value is only the owner token.
//!
//! Suffix keys follow Redisson's naming rule: `prefix:{name}` unless the name already
//! contains `{`, so every key of one lock lands in the name's cluster hash slot.

use std::sync::LazyLock;

use redis::Script;

/// Which foreign client's on-server layout dlock uses.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Redisson RLock / RFencedLock (the default).
    Redisson,
    /// redis-py `Lock`, redsync, rslock, node-redlock.
    RedisPy,
    /// python-redis-lock.
    PythonRedisLock,
}

impl Layout {
    /// Parse the `layout=` URL option.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        match text {
            "redisson" => Some(Layout::Redisson),
            "redis-py" | "redis_py" => Some(Layout::RedisPy),
            "python-redis-lock" | "python_redis_lock" => Some(Layout::PythonRedisLock),
            _ => None,
        }
    }

    /// The `layout=` URL value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Layout::Redisson => "redisson",
            Layout::RedisPy => "redis-py",
            Layout::PythonRedisLock => "python-redis-lock",
        }
    }

    /// Whether the same owner may hold the lock more than once.
    pub(crate) fn reentrant(self) -> bool {
        matches!(self, Layout::Redisson)
    }

    /// Whether releases are announced on a pub/sub channel (else waiters poll).
    pub(crate) fn publishes(self) -> bool {
        !matches!(self, Layout::PythonRedisLock)
    }

    /// The keys of lock `name` (with the configured key prefix already applied).
    pub(crate) fn keys(self, name: &str) -> Keys {
        match self {
            Layout::Redisson => Keys {
                lock: name.to_owned(),
                counter: suffixed("redisson_lock_token", name),
                signal: suffixed("redisson_lock__channel", name),
                meta: None,
                fair_queue: true,
            },
            Layout::RedisPy => Keys {
                lock: name.to_owned(),
                counter: suffixed("dlock_token", name),
                signal: suffixed("dlock_unlock", name),
                meta: Some(suffixed("dlock_meta", name)),
                fair_queue: false,
            },
            Layout::PythonRedisLock => {
                let lock = format!("lock:{name}");
                Keys {
                    counter: suffixed("dlock_token", &lock),
                    signal: format!("lock-signal:{name}"),
                    meta: Some(suffixed("dlock_meta", &lock)),
                    fair_queue: false,
                    lock,
                }
            }
        }
    }

    pub(crate) fn acquire_script(self) -> &'static Script {
        match self {
            Layout::Redisson => &REDISSON_ACQUIRE,
            Layout::RedisPy | Layout::PythonRedisLock => &PLAIN_ACQUIRE,
        }
    }

    pub(crate) fn renew_script(self) -> &'static Script {
        match self {
            Layout::Redisson => &REDISSON_RENEW,
            Layout::RedisPy | Layout::PythonRedisLock => &PLAIN_RENEW,
        }
    }

    pub(crate) fn release_script(self) -> &'static Script {
        match self {
            Layout::Redisson => &REDISSON_RELEASE,
            Layout::RedisPy | Layout::PythonRedisLock => &PLAIN_RELEASE,
        }
    }

    /// An operator's forced release of the hold with a given token (`dlock break`).
    pub(crate) fn break_script(self) -> &'static Script {
        match self {
            Layout::Redisson => &REDISSON_BREAK,
            Layout::RedisPy | Layout::PythonRedisLock => &PLAIN_BREAK,
        }
    }
}

/// The keys one lock uses.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    /// The lock itself.
    pub lock: String,
    /// dlock's (or RFencedLock's) fencing-token counter; never expires.
    pub counter: String,
    /// The unlock channel (or, for python-redis-lock, the signal list).
    pub signal: String,
    /// Plain layouts: where dlock keeps the holder's metadata (same lease as the lock).
    pub meta: Option<String>,
    /// Whether the layout has a fair mode (see [`Keys::queue`]).
    pub fair_queue: bool,
}

impl Keys {
    /// Redisson layout, fair mode: the FIFO list of waiters and their deadlines
    /// (dlock's own keys: Redisson's RFairLock keeps different semantics in its own).
    /// Made on demand: most locks are never fair, and a held lock keeps its keys.
    pub(crate) fn queue(&self) -> Option<(String, String)> {
        self.fair_queue.then(|| {
            (
                suffixed("dlock_lock_queue", &self.lock),
                suffixed("dlock_lock_timeout", &self.lock),
            )
        })
    }
}

/// `prefix:{name}`, or `prefix:name` when the name already carries a hash tag.
pub(crate) fn suffixed(prefix: &str, name: &str) -> String {
    // Built by hand: this runs for every key of every acquisition.
    let mut key = String::with_capacity(prefix.len() + name.len() + 3);
    key.push_str(prefix);
    key.push(':');
    if name.contains('{') {
        key.push_str(name);
    } else {
        key.push('{');
        key.push_str(name);
        key.push('}');
    }
    key
}

pub(crate) static SHARED_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/shared_acquire.lua")));
pub(crate) static SHARED_RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/shared_renew.lua")));
pub(crate) static SHARED_HOLDERS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/shared_holders.lua")));
pub(crate) static SHARED_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/shared_release.lua")));
pub(crate) static REDISSON_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/redisson_acquire.lua")));
pub(crate) static REDISSON_FAIR_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/redisson_fair_acquire.lua")));
pub(crate) static REDISSON_LEAVE_QUEUE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/redisson_leave_queue.lua")));
static REDISSON_RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/redisson_renew.lua")));
static REDISSON_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/redisson_release.lua")));
pub(crate) static REDISSON_HANDOFF: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/redisson_handoff.lua")));
pub(crate) static REDISSON_ABANDON: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/redisson_abandon.lua")));
static PLAIN_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/plain_acquire.lua")));
static PLAIN_RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/plain_renew.lua")));
static PLAIN_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/plain_signal.lua"),
        include_str!("scripts/plain_release.lua")
    ))
});
static REDISSON_BREAK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/redisson_break.lua")));
static PLAIN_BREAK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/plain_signal.lua"),
        include_str!("scripts/plain_break.lua")
    ))
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redisson_naming_rule() {
        let k = Layout::Redisson.keys("orders:42");
        assert_eq!(k.lock, "orders:42");
        assert_eq!(k.counter, "redisson_lock_token:{orders:42}");
        assert_eq!(k.signal, "redisson_lock__channel:{orders:42}");
        let k = Layout::Redisson.keys("{user1}:cart");
        assert_eq!(k.signal, "redisson_lock__channel:{user1}:cart");
    }

    #[test]
    fn python_redis_lock_keys() {
        let k = Layout::PythonRedisLock.keys("job");
        assert_eq!(k.lock, "lock:job");
        assert_eq!(k.signal, "lock-signal:job");
        assert_eq!(k.counter, "dlock_token:{lock:job}");
    }
}
