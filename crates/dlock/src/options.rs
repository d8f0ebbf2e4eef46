//! What a caller can ask for when acquiring: [`LockOptions`], [`Wait`], [`Renewal`],
//! [`Owner`] and [`Metadata`], and the duration syntax (`500ms`, `30s`, `2m`).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Shortest lease dlock accepts.
pub const MIN_TTL: Duration = Duration::from_millis(10);
/// Longest lease dlock accepts.
pub const MAX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// Lease used when none is given (as Redisson's watchdog default).
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// What no owner may begin with: the names of dlock's own fields in a lock's record
/// (the Redisson layout keeps the owners' hold counts in the same hash).
const RESERVED_OWNER_PREFIX: &str = "dlock:";

/// Who holds a lock: an opaque token, random by default.
///
/// Two acquisitions with the same owner are the same holder (reentrancy). Pass an owner
/// to another task or process as a string ([`Owner::as_str`] / [`str::parse`]).
///
/// Cloning one is cheap (the text is shared): a hold keeps its owner without a copy.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Owner(Arc<str>);

impl Owner {
    /// A fresh owner: 128 bits from the operating system's RNG, as 32 hex digits
    /// (never the bits of another owner of this process, nor of the process it was
    /// forked from).
    ///
    /// # Panics
    /// If the operating system has no usable random source (never on supported systems).
    #[must_use]
    pub fn random() -> Self {
        let bytes = crate::random::bytes::<16>();
        Owner(Arc::from(
            crate::hex::ascii(&crate::hex::encode_16(&bytes)).as_ref(),
        ))
    }

    /// The token text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Owner({})", self.0)
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Owner {
    type Err = Error;

    /// Accepts 1–128 characters from `[A-Za-z0-9._:-]`, not beginning with `dlock:`:
    /// in the Redisson layout an owner is a field of the lock's hash, beside dlock's
    /// own fields (`dlock:fence`, `dlock:g:…`, `dlock:handoff`), and an owner named like
    /// one of them would read as holding a lock that another owner holds.
    fn from_str(s: &str) -> Result<Self> {
        if s.is_empty() || s.len() > 128 {
            return Err(Error::option(
                "owner",
                "an owner token has 1 to 128 characters",
            ));
        }
        if !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
        {
            return Err(Error::option(
                "owner",
                "an owner token may only contain letters, digits and . _ : -",
            ));
        }
        if s.starts_with(RESERVED_OWNER_PREFIX) {
            return Err(Error::option(
                "owner",
                format!(
                    "an owner token may not begin with {RESERVED_OWNER_PREFIX:?} (dlock's own fields in a lock's record are named so)"
                ),
            ));
        }
        Ok(Owner(Arc::from(s)))
    }
}

/// Who is holding, shown by [`crate::Locker::inspect`] and `dlock status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metadata {
    /// Host name of the holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Process id of the holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Free text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Metadata {
    /// Host name and process id of this process, no note.
    #[must_use]
    pub fn this_process() -> Self {
        // The pid is read once per process (a forked child that keeps running Rust code
        // without exec would show its parent's pid).
        fn pid() -> u32 {
            static PID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
            *PID.get_or_init(std::process::id)
        }
        static HOST: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        Metadata {
            host: HOST.get_or_init(host_name).clone(),
            pid: Some(pid()),
            note: None,
        }
    }

    /// [`Metadata::this_process`], made once and shared (the default of every
    /// acquisition: no copy of the host name per lock).
    pub(crate) fn this_process_shared() -> Arc<Metadata> {
        Arc::clone(&own_metadata().0)
    }

    /// The same with a note.
    #[must_use]
    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }
}

/// What only the backends that store metadata (as JSON) need: ZooKeeper and etcd keep
/// none, and a library built with only those would carry dead code.
#[cfg(any(
    feature = "sqlite",
    feature = "redis",
    feature = "postgres",
    feature = "mysql"
))]
impl Metadata {
    /// The metadata as the backends store it (JSON). This process's own, the default
    /// of every acquisition, was serialized once and is borrowed: nothing is
    /// serialized or allocated per acquisition.
    pub(crate) fn to_json(&self) -> std::borrow::Cow<'static, str> {
        match self.own_json() {
            Some(json) => std::borrow::Cow::Borrowed(json),
            None => {
                std::borrow::Cow::Owned(serde_json::to_string(self).unwrap_or_else(|_| "{}".into()))
            }
        }
    }

    /// The JSON of this process's own metadata, when this is it.
    pub(crate) fn own_json(&self) -> Option<&'static str> {
        let (own, json) = own_metadata();
        (std::ptr::eq(self, &**own) || self == &**own).then_some(json.as_str())
    }
}

/// This process's metadata and its JSON, made once.
fn own_metadata() -> &'static (Arc<Metadata>, String) {
    static OWN: std::sync::OnceLock<(Arc<Metadata>, String)> = std::sync::OnceLock::new();
    OWN.get_or_init(|| {
        let own = Metadata::this_process();
        let json = serde_json::to_string(&own).unwrap_or_else(|_| "{}".into());
        (Arc::new(own), json)
    })
}

fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
}

/// How long an acquisition waits for a busy lock.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Wait until the lock is acquired (or the future is dropped).
    Forever,
    /// Wait at most this long, then fail with [`Error::Timeout`].
    Timeout(Duration),
    /// One attempt only; busy is [`Error::Timeout`] with a zero wait in `lock_with`,
    /// `Ok(None)` in `try_lock`.
    NoWait,
}

/// Whether and how the lease is renewed while the guard lives.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Renew every `ttl / 3` (Redisson's watchdog rhythm).
    Auto,
    /// Renew at this interval (must be shorter than the TTL), but at least every
    /// `ttl / 3`: each renewal must leave itself time to get its answer before the
    /// lease ends.
    Every(Duration),
    /// Never renew: the lease ends `ttl` after acquisition unless `extend` is called.
    Off,
}

/// Options for one acquisition. `LockOptions::default()` is a 30 s lease renewed
/// every 10 s, waiting forever, unfair, with a fresh random owner.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LockOptions {
    /// Lease length.
    pub ttl: Duration,
    /// Renewal policy.
    pub renewal: Renewal,
    /// Stop renewing after the lock has been held this long (the lease then runs out
    /// and `lost()` fires). `None`: renew while the guard lives.
    pub max_hold: Option<Duration>,
    /// How long to wait for a busy lock.
    pub wait: Wait,
    /// First come, first served among waiters (only where the backend supports it).
    pub fair: bool,
    /// Fair mode, on backends whose queue entries are leases of their own (memory,
    /// SQLite, Redis): how long a waiter's queue entry lives unless the waiter
    /// refreshes it (it does every third of this). A waiter that dies while queued
    /// holds up the ones behind it at most this long; shorter costs a refresh round
    /// trip per waiter more often. etcd's and ZooKeeper's queues are bound to the
    /// waiter's session instead (a dead waiter's entry ends with its session). Default
    /// [`DEFAULT_QUEUE_ENTRY_TTL`]; from 300 ms to 10 min.
    pub queue_entry_ttl: Duration,
    /// Holder identity; the same owner re-entering gets the lock at once. `None`: a
    /// fresh random owner for this acquisition.
    pub owner: Option<Owner>,
    /// Shown by `inspect`; `None`: this process's host and pid.
    pub metadata: Option<Metadata>,
    /// Set by [`crate::Election`]: the value campaigned with.
    pub(crate) campaign: Option<String>,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: DEFAULT_TTL,
            renewal: Renewal::Auto,
            max_hold: None,
            wait: Wait::Forever,
            fair: false,
            queue_entry_ttl: DEFAULT_QUEUE_ENTRY_TTL,
            owner: None,
            metadata: None,
            campaign: None,
        }
    }
}

/// How long a fair-mode queue entry lives unless its waiter refreshes it, by default.
pub const DEFAULT_QUEUE_ENTRY_TTL: Duration = Duration::from_secs(5);

impl LockOptions {
    /// Default options.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Set the lease length.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Set the renewal policy.
    #[must_use]
    pub fn renewal(mut self, renewal: Renewal) -> Self {
        self.renewal = renewal;
        self
    }

    /// Stop renewing after `max` of holding.
    #[must_use]
    pub fn max_hold(mut self, max: Duration) -> Self {
        self.max_hold = Some(max);
        self
    }

    /// Set the waiting policy.
    #[must_use]
    pub fn wait(mut self, wait: Wait) -> Self {
        self.wait = wait;
        self
    }

    /// Ask for first-come-first-served order.
    #[must_use]
    pub fn fair(mut self, fair: bool) -> Self {
        self.fair = fair;
        self
    }

    /// Set how long a fair-mode queue entry lives without its waiter
    /// ([`LockOptions::queue_entry_ttl`]).
    #[must_use]
    pub fn queue_entry_ttl(mut self, ttl: Duration) -> Self {
        self.queue_entry_ttl = ttl;
        self
    }

    /// Acquire as `owner` (reentrant with other holds of the same owner).
    #[must_use]
    pub fn owner(mut self, owner: Owner) -> Self {
        self.owner = Some(owner);
        self
    }

    /// Set the metadata shown by `inspect`.
    #[must_use]
    pub fn metadata(mut self, metadata: Metadata) -> Self {
        self.metadata = Some(metadata);
        self
    }

    /// Check ranges: TTL within [`MIN_TTL`]..=[`MAX_TTL`], renewal interval below the TTL.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] naming the offending option.
    pub fn validate(&self) -> Result<()> {
        validate_ttl(self.ttl)?;
        if let Renewal::Every(every) = self.renewal
            && (every.is_zero() || every >= self.ttl)
        {
            return Err(Error::option(
                "renewal",
                format!(
                    "the renewal interval {every:?} must be above zero and below the TTL {:?}",
                    self.ttl
                ),
            ));
        }
        if !(Duration::from_millis(300)..=Duration::from_secs(600)).contains(&self.queue_entry_ttl)
        {
            return Err(Error::option(
                "queue_entry_ttl",
                format!(
                    "{:?} is outside the accepted range 300ms to 10m",
                    self.queue_entry_ttl
                ),
            ));
        }
        if let Some(max) = self.max_hold
            && max.is_zero()
        {
            return Err(Error::option("max_hold", "must be above zero"));
        }
        if let Some(Metadata {
            note: Some(note), ..
        }) = &self.metadata
            && note.len() > 1024
        {
            return Err(Error::option("metadata", "the note is at most 1024 bytes"));
        }
        Ok(())
    }

    /// The interval at which the lease is renewed, if it is.
    #[must_use]
    pub fn renew_interval(&self) -> Option<Duration> {
        match self.renewal {
            Renewal::Auto => Some(self.ttl / 3),
            Renewal::Every(d) => Some(d),
            Renewal::Off => None,
        }
    }
}

/// Check that `ttl` is within [`MIN_TTL`]..=[`MAX_TTL`].
///
/// # Errors
/// [`Error::InvalidOption`] otherwise.
pub(crate) fn validate_ttl(ttl: Duration) -> Result<()> {
    if ttl < MIN_TTL || ttl > MAX_TTL {
        return Err(Error::option(
            "ttl",
            format!("{ttl:?} is outside the accepted range {MIN_TTL:?} to {MAX_TTL:?}"),
        ));
    }
    Ok(())
}

/// Parse a duration written as a number and a unit: `500us`, `250ms`, `30s`, `1.5s`,
/// `2m`, `1h`.
///
/// A bare number is rejected (is `30` seconds or milliseconds?).
///
/// # Errors
/// [`Error::InvalidOption`] naming `what` for anything else.
pub fn parse_duration(what: &str, text: &str) -> Result<Duration> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = |why: &str| Error::option(what, format!("{text:?}: {why}"));
    if num.is_empty() {
        return Err(bad(
            "expected a number followed by ms, s, m or h (e.g. 30s)",
        ));
    }
    let value: f64 = num.parse().map_err(|_| bad("not a number"))?;
    let scale = match unit.trim() {
        "us" | "µs" => 0.000_001,
        "ms" => 0.001,
        "s" | "sec" | "secs" => 1.0,
        "m" | "min" | "mins" => 60.0,
        "h" => 3600.0,
        "" => return Err(bad("missing unit: write e.g. 30s or 500ms")),
        _ => return Err(bad("unknown unit (use us, ms, s, m or h)")),
    };
    let secs = value * scale;
    if !secs.is_finite() || secs > 1e9 {
        return Err(bad("too large"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_metadata_is_what_serde_writes_and_this_processs_is_never_built_again() {
        let own = Metadata::this_process();
        let shared = Metadata::this_process_shared();
        let noted = Metadata::this_process().with_note("a \"quoted\" note");
        let empty = Metadata::default();
        for metadata in [&own, &*shared, &noted, &empty] {
            let json = metadata.to_json();
            assert_eq!(*json, serde_json::to_string(metadata).expect("json"));
            let back: Metadata = serde_json::from_str(&json).expect("valid JSON");
            assert_eq!(&back, metadata);
        }
        assert!(matches!(shared.to_json(), std::borrow::Cow::Borrowed(_)));
        assert!(matches!(own.to_json(), std::borrow::Cow::Borrowed(_)));
        assert!(matches!(noted.to_json(), std::borrow::Cow::Owned(_)));
    }

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("t", "500ms").ok(),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            parse_duration("t", "30s").ok(),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_duration("t", "2m").ok(),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_duration("t", "1.5s").ok(),
            Some(Duration::from_millis(1500))
        );
        for bad in ["", "30", "s", "-1s", "1x", "1e400s", "1..2s", "ms"] {
            assert!(parse_duration("t", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn owners() {
        let a = Owner::random();
        let b = Owner::random();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 32);
        assert_eq!(a.as_str().parse::<Owner>().ok(), Some(a));
        assert!("".parse::<Owner>().is_err());
        assert!("has space".parse::<Owner>().is_err());
        assert!("x".repeat(129).parse::<Owner>().is_err());
        // dlock's own fields in a Redisson-layout hash: an owner named like one would
        // count as holding whatever lock has that field.
        for reserved in [
            "dlock:fence",
            "dlock:meta",
            "dlock:handoff",
            "dlock:g:x",
            "dlock:",
        ] {
            assert!(reserved.parse::<Owner>().is_err(), "{reserved}");
        }
        assert!("dlock".parse::<Owner>().is_ok());
        assert!("DLOCK:fence".parse::<Owner>().is_ok());
        assert!("me:dlock:fence".parse::<Owner>().is_ok());
    }

    #[test]
    fn option_validation() {
        assert!(LockOptions::new().validate().is_ok());
        assert!(LockOptions::new().ttl(Duration::ZERO).validate().is_err());
        assert!(
            LockOptions::new()
                .ttl(Duration::from_secs(1))
                .renewal(Renewal::Every(Duration::from_secs(2)))
                .validate()
                .is_err()
        );
        assert!(LockOptions::new().ttl(MAX_TTL * 2).validate().is_err());
    }
}
