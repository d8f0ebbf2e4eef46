//! What the PostgreSQL and MySQL/MariaDB backends share: URL options, the name → key
//! mapping, table-name validation, the pinned connection that session-bound modes
//! (advisory, named, row) hold for as long as the lock, and the backend itself — each
//! server supplies only its statements and error classification (a dialect).
//!
//! # Modes
//! - `mode=lease` (default): one row per name in `<prefix>_locks` (owner, hold count,
//!   fencing token, expiry computed by the **server's** clock). Acquire and release are
//!   one autocommitted statement each, and renewals are batched (the renewals waiting
//!   together: one statement per TTL, up to 256 holds), so it works through connection
//!   poolers. A
//!   holder that dies keeps the lock until its lease ends.
//! - session modes (`mode=advisory` on PostgreSQL, `mode=named` on MySQL, `mode=row` on
//!   both): the lock is held by one database session on a pinned connection and ends
//!   with it, so a holder that dies frees the lock as soon as the server sees its
//!   connection close. The pinned connection is pinged every `heartbeat` (the keeper's
//!   renewals of a session hold are these pings; a hold taken with renewal off pings on
//!   its own), and `lost()` fires when it stops answering. The keeper's renewals run in
//!   short tasks its timer task starts (on the runtime that last started that timer
//!   task): a runtime stalled for seconds delays them, as it delays every renewal.
//!
//! # Guarantees, and what a session mode cannot promise
//! Lease mode: a renewal never shortens the lease (reentrant holds of one owner share
//! the row); the same owner after its lease ran out gets a new grant with a new token,
//! never the lapsed one's. Session modes: a connection that breaks (a reset, the server
//! or a proxy closing it) frees the lock on the server at once, and the holder hears of
//! it by its next heartbeat — [`Capabilities::connection_loss_notice`]. Only a resource
//! that checks fencing tokens protects that window. The server ends a pinned session
//! that sends nothing for five heartbeats, at least 5 s (PostgreSQL 14 and later:
//! `idle_session_timeout`, and in row mode `idle_in_transaction_session_timeout`;
//! MySQL/MariaDB: `wait_timeout`, whole seconds), so a holder that is SIGSTOPped, or
//! whose runtime stalls, may lose the lock meanwhile: its hold counts as lost from the
//! moment its session was last proven alive plus that limit (less a margin), whether or
//! not a ping has run since ([`crate::backend::HeldLock::session_trust`]), so
//! `is_held()` is false and `lost()` fires the moment it runs again.
//!
//! # Semaphores and read-write locks
//! In every mode they are leases in two tables of their own, created on first use:
//! `<prefix>_shared_gate` (one row per name and family, locked by each attempt's
//! transaction so attempts on a name take turns, and counting its tokens) and
//! `<prefix>_shared` (one row per held permit, read or write, and per waiting writer,
//! keyed by the acquisition, expiring by the server's clock). An attempt is one short
//! transaction; a renewal and a release one statement each. A holder that dies frees
//! its permit when its lease ends (not with its connection, whatever the mode).

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::backend::{Capabilities, Fencing, Waiter};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::WakeWatch;
use crate::url::ConnectUrl;

/// `format!` for a statement's text, returned without the spaces that indent its
/// lines in the source ([`compact`]).
macro_rules! sql_text {
    ($($arg:tt)*) => {
        $crate::sql::compact(format!($($arg)*))
    };
}

/// For the dialects' tests: `shown`, the `Debug` of their statements, keeps its line
/// breaks, has no indented line, and holds nothing `compact` cannot tell from a
/// standard literal (shown escaped: a backslash as two).
#[cfg(test)]
pub(crate) fn assert_sent_compacted(shown: &str) {
    assert!(shown.contains("\\n"), "line breaks kept");
    assert!(!shown.contains("\\n "), "an indented line: {shown}");
    for unknown in ["\\\\", "$$", "--", "/*"] {
        assert!(
            !shown.contains(unknown),
            "{unknown} in a statement: {shown}"
        );
    }
}

/// A statement's text without the spaces and tabs that begin its lines (outside
/// quoted literals): the indentation of the source. sqlx looks each statement up in
/// its cache by its text, hashing and comparing all of it, on every run; and the
/// server shows the text in its logs and statistics. Line breaks stay, so the text
/// still reads line by line (and a `--` comment still ends where it did).
///
/// Only standard literals are told apart (`'…'`, a quote doubled inside): a
/// statement with a backslash escape, an `E'…'` or dollar-quoted string, or a quote
/// in a comment or a quoted identifier is outside what this keeps intact, and the
/// statements' tests refuse such text.
pub(crate) fn compact(text: String) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut quoted, mut line_start) = (false, false);
    for c in text.chars() {
        if line_start && !quoted && (c == ' ' || c == '\t') {
            continue;
        }
        line_start = c == '\n';
        if c == '\'' {
            quoted = !quoted;
        }
        out.push(c);
    }
    out
}

mod dialect;
mod engine;
#[cfg(feature = "mysql")]
pub mod mysql;
mod own_conns;
#[cfg(feature = "postgres")]
pub mod postgres;
mod renewer;
mod session;
mod shared;

/// How a lock is held on the server.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A lease row per name, expiry by the server's clock (the default).
    Lease,
    /// PostgreSQL session advisory lock (`pg_try_advisory_lock`) on a pinned connection.
    Advisory,
    /// MySQL/MariaDB `GET_LOCK` on a pinned connection.
    Named,
    /// `SELECT … FOR UPDATE` on a lock row, in a transaction held open on a pinned
    /// connection for the lock's lifetime.
    Row,
}

impl Mode {
    /// The `mode=` URL value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Lease => "lease",
            Mode::Advisory => "advisory",
            Mode::Named => "named",
            Mode::Row => "row",
        }
    }

    /// Whether the lock lives in a database session (ends with the connection).
    #[must_use]
    pub fn is_session(self) -> bool {
        self != Mode::Lease
    }
}

/// Options both SQL backends take from the URL.
#[derive(Debug, Clone)]
pub(crate) struct SqlOptions {
    pub mode: Mode,
    /// Validated identifier prefix of dlock's tables (`dlock` → `dlock_locks`, …).
    pub prefix: String,
    /// Polling interval while waiting (MySQL), fallback re-poll (PostgreSQL).
    pub poll: Duration,
    /// Connect and statement timeout.
    pub timeout: Duration,
    /// Heartbeat interval on a pinned connection (session modes).
    pub heartbeat: Duration,
    /// Most connections for lease statements and row mode's tokens; as many again for
    /// semaphore and read-write lock attempts, and for the rest (sqlx's pool).
    pub pool: u32,
    /// Most pinned connections (= locks held at once, session modes).
    pub sessions: u32,
    /// The database (URL path without its slash), if given.
    pub database: Option<String>,
    /// Lease mode: a lease that ran out without a release keeps the lock from other
    /// owners this much longer.
    pub lock_delay: Duration,
    /// PEM file of the CA that signs the server (checked to exist).
    pub ssl_ca: Option<String>,
}

/// The URL options every SQL backend accepts (besides its own).
pub(crate) const COMMON_OPTIONS: [&str; 9] = [
    "mode",
    "lock_delay",
    "table_prefix",
    "poll",
    "timeout",
    "heartbeat",
    "pool",
    "sessions",
    "ssl_ca",
];

impl SqlOptions {
    /// Take the shared options from `url`; `modes` are the session modes this database
    /// offers besides `lease`.
    pub(crate) fn take(
        url: &mut ConnectUrl,
        modes: &[(&str, Mode)],
        poll: Duration,
    ) -> Result<Self> {
        let mode = match url.take_param("mode") {
            None => Mode::Lease,
            Some(m) if m == "lease" => Mode::Lease,
            Some(m) => match modes.iter().find(|(n, _)| *n == m) {
                Some((_, mode)) => *mode,
                None => {
                    let mut known = vec!["lease"];
                    known.extend(modes.iter().map(|(n, _)| *n));
                    return Err(
                        url.invalid(&format!("mode={m:?} is not one of {}", known.join(", ")))
                    );
                }
            },
        };
        let prefix = url
            .take_param("table_prefix")
            .unwrap_or_else(|| "dlock".into());
        if !valid_prefix(&prefix) {
            return Err(url.invalid(
                "table_prefix must be a plain identifier: a letter or _, then letters, digits or _, at most 40 characters",
            ));
        }
        let lock_delay = url.take_lock_delay()?;
        if !lock_delay.is_zero() && mode.is_session() {
            // A session lock is freed by the server the moment the session ends; dlock
            // has no say in when it is granted next.
            return Err(url.invalid("lock_delay applies to mode=lease only"));
        }
        let poll = url.take_duration("poll", poll)?;
        let timeout = url.take_duration("timeout", Duration::from_secs(5))?;
        let heartbeat = url.take_duration("heartbeat", Duration::from_secs(1))?;
        let pool = take_count(url, "pool", 10)?;
        let sessions = take_count(url, "sessions", 100)?;
        let database = url.path().trim_start_matches('/');
        let database = (!database.is_empty()).then(|| database.to_owned());
        if let Some(db) = &database
            && (db.contains('/') || db.len() > 64)
        {
            return Err(url.invalid("the path must be one database name"));
        }
        let ssl_ca = url.take_param("ssl_ca");
        if let Some(ca) = &ssl_ca
            && !std::path::Path::new(ca).is_file()
        {
            return Err(url.invalid(&format!("ssl_ca file {ca:?} not found")));
        }
        Ok(SqlOptions {
            ssl_ca,
            mode,
            prefix,
            poll,
            timeout,
            heartbeat,
            pool,
            sessions,
            database,
            lock_delay,
        })
    }
}

fn take_count(url: &mut ConnectUrl, key: &str, default: u32) -> Result<u32> {
    Ok(url.take_count(key, 1..=10_000)?.unwrap_or(default))
}

/// A table-name prefix dlock will put into SQL text: `[A-Za-z_][A-Za-z0-9_]{0,39}`.
/// The pool both SQL servers' backends open: at most `max` connections, each statement
/// bounded by `timeout` while it waits for one.
/// - No ping before each statement (it would double the round trips): a broken
///   connection shows up as a connection error on the statement instead.
/// - No connection lent idle for `own_idle` or longer: the pool sweeps idle connections
///   only every `idle_timeout`, so one could otherwise sit idle twice that, which is
///   the server's whole limit (`own_idle` is half of it).
pub(crate) fn pool_options<DB: sqlx::Database>(
    max: u32,
    own_idle: Duration,
    timeout: Duration,
) -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new()
        .max_connections(max)
        .idle_timeout(own_idle)
        .acquire_timeout(timeout)
        .test_before_acquire(false)
        .before_acquire(move |_, meta| Box::pin(async move { Ok(meta.idle_for < own_idle) }))
        .acquire_slow_level(crate::telemetry::POOL_WAIT_LOG)
}

pub(crate) fn valid_prefix(p: &str) -> bool {
    let mut chars = p.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && p.len() <= 40
}

/// The fixed-length key of a lock name: SHA-256 of its UTF-8 bytes. Names differing in
/// any byte (case, trailing spaces, Unicode normalization) get different keys.
#[must_use]
pub fn lock_key(name: &LockName) -> [u8; 32] {
    // The last name this thread hashed, and its key: a process that takes the same
    // name again and again (a job's, a leader's, a busy item's) hashes it once. Without
    // SHA instructions in the CPU, SHA-256 runs in software, a noticeable share of an
    // uncontended cycle's client work (callgrind). A different name costs one
    // comparison more. Only ever a copy of a pure function's answer, found by the
    // whole name: never another name's key.
    thread_local! {
        static LAST: std::cell::RefCell<(String, Option<[u8; 32]>)> =
            const { std::cell::RefCell::new((String::new(), None)) };
    }
    let hash = |n: &str| -> [u8; 32] { Sha256::digest(n.as_bytes()).into() };
    let name = name.as_str();
    LAST.try_with(|last| {
        let mut last = last.borrow_mut();
        let (memo_name, memo_key) = &mut *last;
        match memo_key {
            Some(key) if memo_name.as_str() == name => *key,
            _ => {
                let key = hash(name);
                // No key while the name changes: nothing half-written can answer.
                *memo_key = None;
                memo_name.clear();
                memo_name.push_str(name);
                *memo_key = Some(key);
                key
            }
        }
    })
    // The thread is ending (its locals are gone): hash without the memo.
    .unwrap_or_else(|_| hash(name))
}

pub(crate) use crate::hex::encode as hex;

/// A session lock the server reports taken, with no dlock holder record for this name:
/// a client outside dlock (raw SQL, another library) — or dlock under another name
/// that maps to the same key. It has no fencing token dlock knows (0).
pub(crate) fn foreign_holder(name: &LockName, session: String) -> crate::LockInfo {
    let mut info = crate::LockInfo::new(name, session, 1, 0);
    info.metadata.note = Some("held outside dlock under this name (no holder record)".into());
    info
}

/// Metadata as stored (JSON text).
pub(crate) fn metadata_json(m: &crate::Metadata) -> String {
    m.to_json().into_owned()
}

/// Metadata as read back; a foreign value reads as empty.
pub(crate) fn metadata_from(json: &str) -> crate::Metadata {
    serde_json::from_str(json).unwrap_or_default()
}

/// Map a driver error: I/O, timeouts and pool trouble are connection errors (retried
/// by the core while time is left), the rest are server errors.
pub(crate) fn db_err(backend: &'static str, e: &sqlx::Error) -> Error {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Error::connection(backend, e),
        // The server's own words and its SQLSTATE, without the driver's additions
        // (PostgreSQL's "at line N" is a line of the server's C source).
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default().into_owned();
            let message = format!("{} (SQLSTATE {code})", db.message());
            if denied(&code, db.as_ref()) {
                Error::denied(backend, message)
            } else {
                Error::backend(backend, message)
            }
        }
        _ => Error::backend(backend, e),
    }
}

/// A refusal of the credentials (SQLSTATE class 28) or of a privilege (PostgreSQL
/// 42501; MySQL's access-denied errors, whose SQLSTATE 42000 is shared with syntax
/// errors, by number).
fn denied(code: &str, db: &dyn sqlx::error::DatabaseError) -> bool {
    if code.starts_with("28") || code == "42501" {
        return true;
    }
    #[cfg(feature = "mysql")]
    if let Some(m) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        // 1044 db access, 1045 access denied, 1142/1143 table/column, 1227 privilege,
        // 1698 access denied (auth plugin).
        return [1044, 1045, 1142, 1143, 1227, 1698].contains(&m.number());
    }
    let _ = db;
    false
}

/// Whether a server error's SQLSTATE is one of `codes`.
#[cfg(feature = "postgres")]
pub(crate) fn has_code(e: &sqlx::Error, codes: &[&str]) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| codes.contains(&c.as_ref())),
        _ => false,
    }
}

/// Run `fut` under the statement timeout; a timeout is a connection error.
pub(crate) async fn timed<T>(
    backend: &'static str,
    timeout: Duration,
    fut: impl std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r.map_err(|e| db_err(backend, &e)),
        Err(_) => Err(no_answer(backend, timeout)),
    }
}

/// Arguments with room for values of the byte lengths `lens`, one per value bound
/// (8 for an integer), each with its length prefix (PostgreSQL 4 bytes, MySQL at most
/// 9): the hot statements' arguments are encoded without growing their buffers bind
/// by bind, a reallocation and copy each time.
pub(crate) fn reserved<A: sqlx::Arguments>(lens: &[usize]) -> A {
    let mut args = A::default();
    args.reserve(lens.len(), lens.iter().map(|len| len + 9).sum());
    args
}

/// How long a lease acquire may have run on the server and still grant: four fifths
/// of the client's statement `timeout`, the rest left for the answer's way back. Past
/// it the client has given up (or is about to), and a grant it never hears of would
/// keep the lock from everyone for a TTL.
pub(crate) fn grant_budget(timeout: Duration) -> Duration {
    timeout * 4 / 5
}

/// A statement that did not finish within the statement timeout.
pub(crate) fn no_answer(backend: &'static str, timeout: Duration) -> Error {
    Error::connection(backend, format!("no answer within {timeout:?}"))
}

/// Capabilities of an SQL backend in `mode`; fencing is durable when the server flushes
/// every commit (`durable`), best effort otherwise. A session mode's holder hears of a
/// broken connection by its next `heartbeat`.
pub(crate) fn capabilities(
    mode: Mode,
    native_wait: bool,
    durable: bool,
    heartbeat: Duration,
) -> Capabilities {
    let mut caps = Capabilities::new(if durable {
        Fencing::Durable
    } else {
        Fencing::BestEffort
    });
    caps.native_wait = native_wait;
    caps.cross_process = true;
    caps.primitives = crate::backend::Primitives::ALL;
    if mode.is_session() {
        caps.session_bound = true;
        caps.connection_loss_notice = Some(heartbeat);
    } else {
        caps.reentrant = true;
        caps.release_reports_loss = true;
    }
    caps
}

/// Waits until this process is told the lock's key was released (one waiter per
/// wake-up), or `poll` passes (jittered 50–100 % when `jitter`) — for the key's one
/// poller (per class of hold) in this process; the others wait `poll` times the number
/// of waiters (see [`crate::notify::WakeOne`]).
#[derive(Debug)]
pub(crate) struct SqlWaiter {
    /// `None` only while the waiter is dropped.
    pub watch: Option<WakeWatch<[u8; 32]>>,
    pub poll: Duration,
    pub jitter: bool,
    /// The server-side mark that makes releases of the key notify (see
    /// [`dialect::Dialect::mark_waiting`]), kept while the waiter lives — or, with
    /// `local`, taken or given up before each wait ([`LocalMark`]).
    pub mark: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// A lease-mode lock's waiter on a server that notifies: see [`LocalMark`].
    pub local: Option<LocalMark>,
}

/// The class of a lock's waiters in the backend's [`crate::notify::WakeOne`] hub (a
/// permit's, a read's and a write's have classes of their own).
pub(crate) const LOCK_CLASS: u8 = 0;

/// The longest an unmarked [`LocalMark`] waiter's poller waits between looks: no
/// longer than a bucket's mark lingers after its last waiter (`postgres::marks`), so a
/// key the process stopped marking is looked at again before releases go silent.
const UNMARKED_POLL: Duration = Duration::from_secs(1);

/// A waiter's mark, taken only while the key is neither held nor being taken by this
/// backend.
///
/// While a lease-mode hold of the backend has the key, its release wakes this
/// process's waiters itself, and a `NOTIFY` would only cost the server a queue write
/// and every listening process a message: so hand-offs within a process stay silent.
/// An attempt of the backend in flight counts as here too: it is the hand-off under
/// way (the task a release woke), and the waiter that lost to it must not mark the
/// key in that instant and keep the mark for its whole wait. So does the instant
/// between a release here and the woken task's attempt ([`LocalHold::hand_on`]): a
/// waiter looking then (one just subscribed, or back from an attempt that found the
/// key held) would otherwise mark a key about to be taken here, and the mark would
/// make the releases of the next second or two notify. Should the woken task not
/// attempt (it left; or it waits for a permit, a read or a write of the same name,
/// which shares the key's waiters), the key counts as handed on until the next
/// attempt here (the poller's, within [`UNMARKED_POLL`]), or until the key's last
/// lock waiter here has gone; a release with no lock waiter here hands nothing on.
/// Before each wait the waiter looks again ([`LocalHolds::here`]): a key neither
/// held nor being taken here (another process has it, or a hold was lost) gets its
/// mark back, and the mark's
/// taking wakes the waiter, whose next attempt sees any release that stayed silent
/// meanwhile; a key here again gives it up (the bucket's mark lingers one to two
/// seconds: `postgres::marks`). A hold the core counts lost is uncounted at once, and wakes a
/// waiter to look ([`crate::backend::HeldLock::lost`]). A key that stops being here
/// without a wake-up here (an attempt that found it held elsewhere and left, a release
/// that failed) is seen by the key's poller within `poll` or [`UNMARKED_POLL`],
/// whichever is shorter, and the other waiters within that times their number — as
/// long as a missing mark costs them anyway.
pub(crate) struct LocalMark {
    pub key: [u8; 32],
    pub here: Arc<LocalHolds>,
    /// Asks for the key's mark ([`dialect::Dialect::mark_waiting`]).
    pub take: Box<dyn Fn() -> Option<Box<dyn std::any::Any + Send + Sync>> + Send + Sync>,
}

impl std::fmt::Debug for LocalMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalMark").finish_non_exhaustive()
    }
}

impl SqlWaiter {
    /// Mark the key unless it is here, or give the mark up if it is ([`LocalMark`]);
    /// without `local`, the mark taken at the start stays.
    pub(crate) fn mark_as_needed(&mut self) {
        let Some(local) = &self.local else {
            return;
        };
        if local.here.here(&local.key) {
            self.mark = None;
        } else if self.mark.is_none() {
            self.mark = (local.take)();
        }
    }
}

/// The lease-mode locks a backend holds now, the attempts at them it has in flight,
/// and the hand-offs under way from one to the next, by key: what [`LocalMark`] asks.
/// One lock covers all three, so a key goes from held to handed on to attempted
/// without an instant in which it looks free here.
#[derive(Debug, Default)]
pub(crate) struct LocalHolds(std::sync::Mutex<HoldsMap>);

/// [`LocalHolds`]' map: every lease acquisition and release looks its key up here.
type HoldsMap = std::collections::HashMap<[u8; 32], Here, crate::notify::KeyHasher>;

/// A key's entry in [`LocalHolds`]: there while `count` or `handing` is.
#[derive(Debug, Default)]
struct Here {
    /// Holds and attempts counted.
    count: u32,
    /// A release here woke a waiter here whose attempt has not begun
    /// ([`LocalHold::hand_on`]).
    handing: bool,
}

impl LocalHolds {
    /// Count a hold of `key`, or an attempt at it, until the entry is dropped. An
    /// attempt takes over a hand-off under way: the key is counted by it from now on.
    pub(crate) fn enter(self: &Arc<Self>, key: [u8; 32]) -> LocalHold {
        let mut map = self.map();
        let here = map.entry(key).or_default();
        here.count += 1;
        here.handing = false;
        LocalHold {
            here: Some(Arc::clone(self)),
            key,
        }
    }

    /// Whether a hold of `key`, an attempt at it or a hand-off of it is under way.
    pub(crate) fn here(&self, key: &[u8; 32]) -> bool {
        self.map().contains_key(key)
    }

    /// Whether a hold of `key` or an attempt at it is counted besides the caller's own
    /// (`counted`: whether the caller's is).
    pub(crate) fn here_besides(&self, key: &[u8; 32], counted: bool) -> bool {
        self.map()
            .get(key)
            .is_some_and(|h| h.count > u32::from(counted))
    }

    /// A lock's waiter of `key` has left (its watch is gone): if no other is left in
    /// `hub`, a hand-off under way ends, as nobody is left to take the key over. Under
    /// this map's lock, as [`LocalHold::hand_on`] counts the waiters: of two waiters
    /// leaving at once, the one that looks last sees neither.
    pub(crate) fn waiter_left(&self, key: &[u8; 32], hub: &crate::notify::WakeOne<[u8; 32]>) {
        let mut map = self.map();
        if hub.waiters(key, LOCK_CLASS) == 0 {
            // A hold or attempt of the key stays counted: only the hand-off ends.
            settle(&mut map, key, 0, Some(false));
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HoldsMap> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One counted hold or attempt ([`LocalHolds::enter`]): uncounted when dropped.
#[derive(Debug)]
pub(crate) struct LocalHold {
    /// `None` once handed on.
    here: Option<Arc<LocalHolds>>,
    key: [u8; 32],
}

impl LocalHold {
    /// A released hold: uncounted, and, if that wakes a waiter here, the key counts as
    /// handed on until the next attempt at it ([`LocalHolds::enter`]) — in one step, so
    /// no waiter here sees the key free between the hold and the woken task's attempt.
    pub(crate) fn hand_on(mut self, hub: &crate::notify::WakeOne<[u8; 32]>) {
        let Some(holds) = self.here.take() else {
            return;
        };
        let mut map = holds.map();
        // Only a lock's waiter takes the key over: a permit's, a read's or a write's
        // of the same name shares the key's waiters, but attempts something else.
        let lock_waiters = hub.wake_counting(&self.key, LOCK_CLASS) > 0;
        settle(&mut map, &self.key, 1, Some(lock_waiters));
    }
}

/// `by` holds or attempts of `key` fewer in `map` (0: none), with the hand-off set to
/// `handing` if given; the entry goes once neither is left.
fn settle(map: &mut HoldsMap, key: &[u8; 32], by: u32, handing: Option<bool>) {
    // One lookup, whether the entry stays or goes.
    if let std::collections::hash_map::Entry::Occupied(mut entry) = map.entry(*key) {
        let here = entry.get_mut();
        here.count = here.count.saturating_sub(by);
        if let Some(handing) = handing {
            here.handing = handing;
        }
        if here.count == 0 && !here.handing {
            entry.remove();
        }
    }
}

impl Drop for LocalHold {
    fn drop(&mut self) {
        let Some(holds) = self.here.take() else {
            return;
        };
        settle(&mut holds.map(), &self.key, 1, None);
    }
}

impl Drop for SqlWaiter {
    fn drop(&mut self) {
        // The watch goes first: a hand-off that comes after no longer counts it.
        if let (Some(local), Some(watch)) = (&self.local, self.watch.take()) {
            let hub = watch.hub();
            drop(watch);
            local.here.waiter_left(&local.key, &hub);
        }
    }
}

#[async_trait::async_trait]
impl Waiter for SqlWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        self.mark_as_needed();
        // Unmarked, the key's poller looks at least every UNMARKED_POLL: a key that
        // stopped being here without a wake-up here (an attempt that left, a release
        // that failed) gets its mark within that, whatever `poll`.
        let poll = if self.local.is_some() && self.mark.is_none() {
            self.poll.min(UNMARKED_POLL)
        } else {
            self.poll
        };
        let Some(watch) = self.watch.as_mut() else {
            return Ok(());
        };
        let mut wait = watch.poll_every(poll).min(max);
        if self.jitter {
            let nanos = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
            wait = Duration::from_nanos(nanos / 2 + fastrand::u64(0..=nanos / 2));
        }
        watch.wait(wait).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A waiter that looks between a release here and the woken task's attempt (it
    /// just subscribed, or came back from an attempt that found the key held) does not
    /// mark the key: the release hands it on, and only the next attempt's end, with
    /// nothing here, lets the waiter mark it. A hand-off with no waiter here, or whose
    /// last waiter left, leaves nothing behind.
    #[test]
    fn a_waiter_looking_during_a_hand_off_here_does_not_mark_the_key() {
        let key = [7u8; 32];
        let hub = Arc::new(crate::notify::WakeOne::<[u8; 32]>::default());
        let here = Arc::new(LocalHolds::default());
        let marks = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let waiter = |marks: &Arc<std::sync::atomic::AtomicU32>| {
            let counter = Arc::clone(marks);
            SqlWaiter {
                watch: Some(hub.watch(&key, LOCK_CLASS)),
                poll: Duration::from_secs(60),
                jitter: false,
                mark: None,
                local: Some(LocalMark {
                    key,
                    here: Arc::clone(&here),
                    take: Box::new(move || {
                        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        Some(Box::new(()))
                    }),
                }),
            }
        };
        let mut waiting = waiter(&marks);
        let taken = || marks.load(std::sync::atomic::Ordering::Relaxed);

        // Held here: no mark.
        let hold = here.enter(key);
        waiting.mark_as_needed();
        assert_eq!(taken(), 0);
        // Released here, the woken task's attempt not begun: still none.
        hold.hand_on(&hub);
        waiting.mark_as_needed();
        assert!(waiting.mark.is_none(), "marked a key being handed on here");
        // The woken task's attempt is counted, then ends without a hold (another
        // process had it): now the waiter marks the key.
        let attempt = here.enter(key);
        waiting.mark_as_needed();
        assert_eq!(taken(), 0);
        drop(attempt);
        waiting.mark_as_needed();
        assert_eq!(taken(), 1);
        assert!(waiting.mark.is_some());
        // A hand-off that starts while marked gives the mark up until an attempt has
        // counted itself and ended.
        let hold = here.enter(key);
        waiting.mark_as_needed();
        assert!(waiting.mark.is_none());
        hold.hand_on(&hub);
        waiting.mark_as_needed();
        assert!(waiting.mark.is_none());
        assert_eq!(taken(), 1);
        // The woken task left without an attempt: its leaving, as the key's last
        // waiter here, ends the hand-off.
        drop(waiting);
        assert!(!here.here(&key), "a hand-off to nobody stays");
        // With no waiter here, a release hands nothing on.
        here.enter(key).hand_on(&hub);
        assert!(!here.here(&key), "a hand-off to nobody stays");
        // A failed release (dropped, not handed on) leaves nothing either.
        let waiting = waiter(&marks);
        drop(here.enter(key));
        assert!(!here.here(&key));
        drop(waiting);

        // Two waiters: the first to leave keeps the hand-off for the other; the
        // second's leaving ends it.
        let (first, second) = (waiter(&marks), waiter(&marks));
        here.enter(key).hand_on(&hub);
        drop(first);
        assert!(
            here.here(&key),
            "a hand-off ended while a lock waiter is left"
        );
        drop(second);
        assert!(!here.here(&key), "a hand-off to nobody stays");
        // Only a permit's waiter here: a lock's release hands nothing on; a lock
        // waiter leaving while a permit's waiter stays ends a hand-off.
        let permit = hub.watch(&key, 1);
        here.enter(key).hand_on(&hub);
        assert!(!here.here(&key), "handed on to a waiter of another class");
        let waiting = waiter(&marks);
        here.enter(key).hand_on(&hub);
        assert!(here.here(&key));
        drop(waiting);
        assert!(!here.here(&key), "a hand-off to a permit's waiter stays");
        drop(permit);
        // Another hold of the key still counted (a re-entry, another task's attempt)
        // when the last waiter leaves: the hand-off ends with the waiter, and the
        // hold's end leaves nothing.
        let other = here.enter(key);
        let waiting = waiter(&marks);
        here.enter(key).hand_on(&hub);
        drop(waiting);
        assert!(here.here(&key), "a hold still counted is not here");
        drop(other);
        assert!(!here.here(&key), "a hand-off to nobody stays");
    }

    /// The indentation goes, line breaks stay, and a quoted literal keeps every
    /// character, a line break and what follows it included.
    #[test]
    fn compact_removes_only_the_indentation_outside_literals() {
        let text = "SELECT 1\n        FROM t\n\t WHERE a = 'x\n   y' AND b = ''\n    AND c = 2";
        assert_eq!(
            compact(text.to_owned()),
            "SELECT 1\nFROM t\nWHERE a = 'x\n   y' AND b = ''\nAND c = 2"
        );
        assert_eq!(compact("  lead stays".to_owned()), "  lead stays");
    }

    /// The memo of the last name answers only for that very name: names taken in any
    /// order, again and again, each get SHA-256 of their own bytes.
    #[test]
    fn lock_key_is_each_names_own_hash_in_any_order() {
        let names = ["a", "b", "a", "a", "ab", "b", "stock:42", "stock:42 ", "a"];
        for n in names {
            let expected: [u8; 32] = Sha256::digest(n.as_bytes()).into();
            let name = LockName::new(n).expect("a valid name");
            assert_eq!(lock_key(&name), expected, "{n:?}");
            assert_eq!(lock_key(&name), expected, "{n:?}, memoized");
        }
        // Another thread has a memo of its own.
        let other = std::thread::spawn(|| lock_key(&LockName::new("b").expect("valid")))
            .join()
            .expect("the thread ends");
        assert_eq!(other, <[u8; 32]>::from(Sha256::digest(b"b")));
        assert_eq!(
            lock_key(&LockName::new("a").expect("valid")),
            <[u8; 32]>::from(Sha256::digest(b"a"))
        );
    }
}
