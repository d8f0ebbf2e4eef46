//! On-server layouts: which keys a lock uses, and the scripts that act on them.
//!
//! - [`Layout::Redisson`] (default): Redisson's RLock/RFencedLock. The lock is a hash at
//!   the name itself, field `<owner>` → hold count, with a lease (PEXPIRE); the token
//!   counter is `redisson_lock_token:{name}`; release publishes `0` on
//!   `redisson_lock__channel:{name}`. dlock adds fields of its own, which Redisson
//!   ignores: `dlock:fence`, and one `dlock:g:<nonce>` per hold, named by the attempt
//!   that took it, holding that acquisition's metadata (JSON) and deleted by its
//!   release; while an in-process
//!   hand-off's hold is unclaimed, `dlock:handoff` (its nonce), and for a hand-off its
//!   waiter gave up on before it ran, `dlock:void:<nonce>` (it then releases instead). A Redisson holder and a
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

use std::sync::{Arc, LazyLock};

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
        let lock: Arc<str> = match self {
            Layout::Redisson | Layout::RedisPy => Arc::from(name),
            Layout::PythonRedisLock => Arc::from(format!("{PYTHON_REDIS_LOCK_PREFIX}{name}")),
        };
        let braces = !lock.contains('{');
        Keys {
            lock,
            layout: self,
            braces,
        }
    }

    /// [`Layout::keys`] of a name held as shared text: where the lock key is the name
    /// itself, the text is shared, not copied (a held lock keeps its keys).
    pub(crate) fn keys_of(self, name: &Arc<str>) -> Keys {
        match self {
            Layout::Redisson | Layout::RedisPy => Keys {
                lock: Arc::clone(name),
                layout: self,
                braces: !name.contains('{'),
            },
            Layout::PythonRedisLock => self.keys(name),
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

/// python-redis-lock's lock key is the name after this.
const PYTHON_REDIS_LOCK_PREFIX: &str = "lock:";

/// The keys one lock uses: the lock's own, kept (a held lock keeps its `Keys`); the
/// others made from it when used, since a held lock needs them only to renew and
/// release, and 100,000 held locks would keep 300,000 more strings.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    /// The lock itself.
    pub lock: Arc<str>,
    layout: Layout,
    /// The keys made from the lock's put it in braces (it carries no hash tag).
    braces: bool,
}

impl Keys {
    /// dlock's (or RFencedLock's) fencing-token counter; never expires.
    pub(crate) fn counter(&self) -> String {
        self.counter_key().text()
    }

    /// [`Keys::counter`], to write where it goes.
    pub(crate) fn counter_key(&self) -> Key<'_> {
        match self.layout {
            Layout::Redisson => self.tagged("redisson_lock_token"),
            Layout::RedisPy | Layout::PythonRedisLock => self.tagged("dlock_token"),
        }
    }

    /// The unlock channel (or, for python-redis-lock, the signal list).
    pub(crate) fn signal(&self) -> String {
        self.signal_key().text()
    }

    /// [`Keys::signal`], to write where it goes.
    pub(crate) fn signal_key(&self) -> Key<'_> {
        match self.layout {
            Layout::Redisson => self.tagged("redisson_lock__channel"),
            Layout::RedisPy => self.tagged("dlock_unlock"),
            Layout::PythonRedisLock => Key::Joined(
                "lock-signal:",
                self.lock
                    .strip_prefix(PYTHON_REDIS_LOCK_PREFIX)
                    .unwrap_or(&self.lock),
            ),
        }
    }

    /// Plain layouts: where dlock keeps the holder's metadata (same lease as the lock).
    pub(crate) fn meta(&self) -> Option<String> {
        self.meta_key().map(Key::text)
    }

    /// [`Keys::meta`], to write where it goes.
    pub(crate) fn meta_key(&self) -> Option<Key<'_>> {
        match self.layout {
            Layout::Redisson => None,
            Layout::RedisPy | Layout::PythonRedisLock => Some(self.tagged("dlock_meta")),
        }
    }

    /// `prefix:{lock}`, or `prefix:lock` when the lock's key carries a hash tag.
    fn tagged(&self, prefix: &'static str) -> Key<'_> {
        Key::Tagged {
            prefix,
            name: &self.lock,
            braces: self.braces,
        }
    }

    /// Redisson layout, fair mode: the FIFO list of waiters and their deadlines
    /// (dlock's own keys: Redisson's RFairLock keeps different semantics in its own).
    pub(crate) fn queue(&self) -> Option<(String, String)> {
        (self.layout == Layout::Redisson).then(|| {
            (
                suffixed("dlock_lock_queue", &self.lock),
                suffixed("dlock_lock_timeout", &self.lock),
            )
        })
    }
}

/// A key as a command names it: written into the command where it goes (as an
/// argument, or as text), never built as a string of its own first — an acquisition
/// and a release each name up to three keys made from the lock's.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Key<'a> {
    /// A key as it is.
    Plain(&'a str),
    /// `prefix:{name}`, or `prefix:name` (`braces` false) when the name already
    /// carries a hash tag.
    Tagged {
        prefix: &'a str,
        name: &'a str,
        braces: bool,
    },
    /// The first part, then the second, as they are.
    Joined(&'a str, &'a str),
}

impl<'a> Key<'a> {
    /// The key's text, in order.
    fn parts(self) -> [&'a str; 4] {
        match self {
            Key::Plain(k) => [k, "", "", ""],
            Key::Tagged {
                prefix,
                name,
                braces: false,
            } => [prefix, ":", name, ""],
            Key::Tagged { prefix, name, .. } => [prefix, ":{", name, "}"],
            Key::Joined(first, second) => [first, second, "", ""],
        }
    }

    /// The key's length in bytes.
    pub(crate) fn len(self) -> usize {
        self.parts().iter().map(|p| p.len()).sum()
    }

    /// The key as a string of its own (for a watch, or a command built the slow way).
    pub(crate) fn text(self) -> String {
        let mut key = String::with_capacity(self.len());
        for part in self.parts() {
            key.push_str(part);
        }
        key
    }
}

impl redis::ToRedisArgs for Key<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        // Into the command's own buffer, which cannot fail to take it.
        let mut arg = out.writer_for_next_arg();
        for part in self.parts() {
            let _ = std::io::Write::write_all(&mut arg, part.as_bytes());
        }
    }
}

/// A hold's own field in the Redisson layout, `dlock:g:<nonce>`, as the acquire and
/// release scripts take it: whole, written into the command's buffer, so the scripts
/// need not build a string of their own on every call.
pub(crate) struct GrantField<'a>(pub(crate) &'a str);

impl redis::ToRedisArgs for GrantField<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        let mut arg = out.writer_for_next_arg();
        let _ = std::io::Write::write_all(&mut arg, b"dlock:g:");
        let _ = std::io::Write::write_all(&mut arg, self.0.as_bytes());
    }
}

/// `prefix:{name}`, or `prefix:name` when the name already carries a hash tag.
pub(crate) fn suffixed(prefix: &str, name: &str) -> String {
    Key::Tagged {
        prefix,
        name,
        braces: !name.contains('{'),
    }
    .text()
}

pub(crate) static SHARED_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/shared_acquire.lua")));
pub(crate) static SHARED_RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/shared_renew.lua")));
pub(crate) static SHARED_HOLDERS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/shared_holders.lua")));
pub(crate) static SHARED_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/shared_release.lua")));
/// What an acquire script (`scripts/redisson_acquire.lua`, `redisson_fair_acquire.lua`,
/// `plain_acquire.lua`) answers, in one integer: the fencing token (≥ 0) when granted;
/// when the lock is held, −3 − its `PTTL` (always < 0). One integer rather than a
/// `{granted, value}` table: the server turns a table into a reply at a cost (seen in
/// `INFO commandstats`' `usec` for `evalsha`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    Granted {
        token: u64,
    },
    /// The lock's remaining lease: `None` when it has none (`PTTL` −1) or is gone (−2).
    Held {
        lease: Option<std::time::Duration>,
    },
}

impl Answer {
    pub(crate) fn of(v: i64) -> Self {
        match u64::try_from(v) {
            Ok(token) => Answer::Granted { token },
            Err(_) => Answer::Held {
                lease: u64::try_from((-3i64).saturating_sub(v))
                    .ok()
                    .map(std::time::Duration::from_millis),
            },
        }
    }
}

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
pub(crate) static PLAIN_ABANDON: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/plain_signal.lua"),
        include_str!("scripts/plain_abandon.lua")
    ))
});
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
    fn an_acquire_answer_is_a_token_or_a_wait() {
        use std::time::Duration;
        assert_eq!(Answer::of(0), Answer::Granted { token: 0 });
        assert_eq!(Answer::of(41), Answer::Granted { token: 41 });
        let held = |v| match Answer::of(v) {
            Answer::Held { lease } => lease,
            granted => panic!("{v}: {granted:?}"),
        };
        // -3 - PTTL: no lease (-1) and no key (-2) give no wait.
        assert_eq!(held(-2), None);
        assert_eq!(held(-1), None);
        assert_eq!(held(-3), Some(Duration::ZERO));
        assert_eq!(held(-3 - 1500), Some(Duration::from_millis(1500)));
        // No overflow at the far end.
        assert_eq!(
            held(i64::MIN),
            Some(Duration::from_millis(i64::MAX as u64 - 2))
        );
    }

    #[test]
    fn redisson_naming_rule() {
        let k = Layout::Redisson.keys("orders:42");
        assert_eq!(&*k.lock, "orders:42");
        assert_eq!(k.counter(), "redisson_lock_token:{orders:42}");
        assert_eq!(k.signal(), "redisson_lock__channel:{orders:42}");
        assert_eq!(k.meta(), None);
        let k = Layout::Redisson.keys("{user1}:cart");
        assert_eq!(k.signal(), "redisson_lock__channel:{user1}:cart");
    }

    #[test]
    fn python_redis_lock_keys() {
        let k = Layout::PythonRedisLock.keys("job");
        assert_eq!(&*k.lock, "lock:job");
        assert_eq!(k.signal(), "lock-signal:job");
        assert_eq!(k.counter(), "dlock_token:{lock:job}");
        assert_eq!(k.meta().as_deref(), Some("dlock_meta:{lock:job}"));
    }

    #[test]
    fn redis_py_keys() {
        let k = Layout::RedisPy.keys("job");
        assert_eq!(&*k.lock, "job");
        assert_eq!(k.signal(), "dlock_unlock:{job}");
        assert_eq!(k.counter(), "dlock_token:{job}");
        assert_eq!(k.meta().as_deref(), Some("dlock_meta:{job}"));
        assert_eq!(k.queue(), None);
    }

    /// A key written into a command is the same bytes as its text, and its length is
    /// theirs: the command's arguments stay apart (each key one argument).
    #[test]
    fn keys_written_into_a_command_are_their_text() {
        let mut all = Vec::new();
        for layout in [Layout::Redisson, Layout::RedisPy, Layout::PythonRedisLock] {
            for name in ["job", "{user1}:cart", "lock:x", ""] {
                let k = layout.keys(name);
                all.extend([k.counter_key().text(), k.signal_key().text()]);
                all.extend(k.meta_key().map(Key::text));
                let mut cmd = redis::Cmd::new();
                cmd.arg("EVALSHA")
                    .arg(Key::Plain(&k.lock))
                    .arg(k.counter_key());
                cmd.arg(k.signal_key()).arg(7);
                let args: Vec<Vec<u8>> = cmd
                    .args_iter()
                    .map(|a| match a {
                        redis::Arg::Simple(bytes) => bytes.to_vec(),
                        _ => b"(not a plain argument)".to_vec(),
                    })
                    .collect();
                let expected: Vec<Vec<u8>> = [
                    "EVALSHA".to_owned(),
                    k.lock.to_string(),
                    k.counter(),
                    k.signal(),
                    "7".to_owned(),
                ]
                .into_iter()
                .map(String::into_bytes)
                .collect();
                assert_eq!(args, expected, "{layout:?} {name:?}");
                for key in [k.counter_key(), k.signal_key()] {
                    assert_eq!(key.len(), key.text().len());
                }
            }
        }
        assert!(all.iter().all(|k| !k.is_empty()));
    }
}
