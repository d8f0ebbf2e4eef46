//! What the PostgreSQL and MySQL/MariaDB backends share: URL options, the name → key
//! mapping, table-name validation, and the pinned connection that session-bound modes
//! (advisory, named, row) hold for as long as the lock.
//!
//! # Modes
//! - `mode=lease` (default): one row per name in `<prefix>_locks` (owner, hold count,
//!   fencing token, expiry computed by the **server's** clock). Acquire, renew and release
//!   are one autocommitted statement each, so it works through connection poolers. A
//!   holder that dies keeps the lock until its lease ends.
//! - session modes (`mode=advisory` on PostgreSQL, `mode=named` on MySQL, `mode=row` on
//!   both): the lock is held by one database session on a pinned connection and ends
//!   with it, so a holder that dies frees the lock as soon as the server sees its
//!   connection close. A heartbeat on the pinned connection fires `lost()` when the
//!   connection stops answering.
//!
//! # Guarantees, and what a session mode cannot promise
//! Lease mode: a renewal never shortens the lease (reentrant holds of one owner share
//! the row); the same owner after its lease ran out gets a new grant with a new token,
//! never the lapsed one's. Session modes: a connection that breaks (a reset, the server
//! or a proxy closing it) frees the lock on the server at once, and the holder hears of
//! it by its next heartbeat — [`Capabilities::connection_loss_notice`]. Only a resource
//! that checks fencing tokens protects that window. A holder that is SIGSTOPped keeps
//! its session, and so the lock, until it resumes.

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::backend::{Capabilities, Fencing, Waiter};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::{WakeOne, WakeWatch};
use crate::url::ConnectUrl;

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;

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
    /// Most pooled connections for lease statements.
    pub pool: u32,
    /// Most pinned connections (= locks held at once, session modes).
    pub sessions: u32,
    /// The database (URL path without its slash), if given.
    pub database: Option<String>,
    /// Lease mode: a lease that ran out without a release keeps the lock from other
    /// owners this much longer.
    pub lock_delay: Duration,
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
        Ok(SqlOptions {
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
    match url.take_param(key) {
        None => Ok(default),
        Some(v) => match v.parse::<u32>() {
            Ok(n) if (1..=10_000).contains(&n) => Ok(n),
            _ => Err(url.invalid(&format!(
                "{key}={v:?} must be a whole number from 1 to 10000"
            ))),
        },
    }
}

/// A table-name prefix dlock will put into SQL text: `[A-Za-z_][A-Za-z0-9_]{0,39}`.
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
    Sha256::digest(name.as_str().as_bytes()).into()
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
    serde_json::to_string(m).unwrap_or_else(|_| "{}".into())
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
        _ => Error::backend(backend, e),
    }
}

/// Whether a server error's SQLSTATE is one of `codes`.
#[cfg(feature = "postgres")]
pub(crate) fn has_code(e: &sqlx::Error, codes: &[&str]) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| codes.contains(&c.as_ref())),
        _ => false,
    }
}

/// A connection pinned to one held lock (session modes). The heartbeat pings it every
/// `interval`; when a ping fails or takes longer than `interval`, the connection is
/// dropped (its socket closed, so the server frees the lock too) and `lost` is cancelled.
#[derive(Debug)]
pub(crate) struct Pinned<C> {
    pub conn: Arc<Mutex<Option<C>>>,
    pub lost: CancellationToken,
    stop: CancellationToken,
}

impl<C: sqlx::Connection + 'static> Pinned<C> {
    /// Pin `conn` and start its heartbeat.
    pub(crate) fn new(conn: C, interval: Duration) -> Self {
        let conn = Arc::new(Mutex::new(Some(conn)));
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let (c2, l2, s2) = (Arc::clone(&conn), lost.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = s2.cancelled() => return,
                    () = tokio::time::sleep(interval) => {}
                }
                if !ping_or_drop(&c2, &l2, interval).await {
                    return;
                }
            }
        });
        Pinned { conn, lost, stop }
    }

    /// Renewal of a session hold: the session holds the lock, so renewing means proving
    /// the session is alive. A connection that does not answer within `timeout` is
    /// closed, which ends the session and the lock: the loss is certain.
    pub(crate) async fn prove_alive(&self, timeout: Duration) -> Result<()> {
        if ping_or_drop(&self.conn, &self.lost, timeout).await {
            Ok(())
        } else {
            Err(Error::NotOwner {
                name: String::new(),
            })
        }
    }

    /// Take the connection back (release); `None` when the heartbeat already lost it.
    pub(crate) async fn take(&self) -> Option<C> {
        self.stop.cancel();
        self.conn.lock().await.take()
    }
}

/// Ping the pinned connection; on failure or timeout drop it and cancel `lost`.
/// Returns whether the session is alive.
async fn ping_or_drop<C: sqlx::Connection + 'static>(
    conn: &Mutex<Option<C>>,
    lost: &CancellationToken,
    timeout: Duration,
) -> bool {
    let mut slot = conn.lock().await;
    let Some(c) = slot.as_mut() else { return false };
    if matches!(tokio::time::timeout(timeout, c.ping()).await, Ok(Ok(()))) {
        return true;
    }
    // Tell the holder first; close the session (which lets the server free the lock)
    // a moment later, so the holder always hears of the loss before anyone else can
    // take the lock.
    lost.cancel();
    if let Some(c) = slot.take() {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(c);
        });
    }
    false
}

impl<C> Drop for Pinned<C> {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Idle connections for session modes, kept for the next acquisition (at most `cap`,
/// none idle longer than `max_idle`, so a server-side idle timeout never hands us a dead
/// one). A connection comes back here only after a clean release or a clean "busy"; any
/// error drops it, which closes its session and frees whatever it held.
#[derive(Debug)]
pub(crate) struct IdleConns<C> {
    idle: std::sync::Mutex<Vec<(C, tokio::time::Instant)>>,
    cap: usize,
    max_idle: Duration,
}

impl<C> IdleConns<C> {
    pub(crate) fn new(cap: u32, max_idle: Duration) -> Self {
        IdleConns {
            idle: std::sync::Mutex::new(Vec::new()),
            cap: cap as usize,
            max_idle,
        }
    }

    pub(crate) fn pop(&self) -> Option<C> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while let Some((c, since)) = idle.pop() {
            if since.elapsed() < self.max_idle {
                return Some(c);
            }
        }
        None
    }

    pub(crate) fn put(&self, c: C) {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if idle.len() < self.cap {
            idle.push((c, tokio::time::Instant::now()));
        }
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
    if mode.is_session() {
        caps.session_bound = true;
        caps.connection_loss_notice = Some(heartbeat);
    } else {
        caps.reentrant = true;
    }
    caps
}

/// Waits until this process is told the lock's key was released (one waiter per
/// wake-up), or `poll` passes (jittered 50–100 % when `jitter`).
#[derive(Debug)]
pub(crate) struct SqlWaiter {
    pub watch: WakeWatch<[u8; 32]>,
    pub poll: Duration,
    pub jitter: bool,
}

#[async_trait::async_trait]
impl Waiter for SqlWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        let mut wait = self.poll.min(max);
        if self.jitter {
            let nanos = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
            wait = Duration::from_nanos(nanos / 2 + fastrand::u64(0..=nanos / 2));
        }
        self.watch.wait(wait).await;
        Ok(())
    }
}

/// The session side of a hold in a session mode: the pinned connection, where it goes
/// back after a clean release, and who to wake.
#[derive(Debug)]
pub(crate) struct Session<C> {
    pub pinned: Pinned<C>,
    pub idle: Arc<IdleConns<C>>,
    pub hub: Arc<WakeOne<[u8; 32]>>,
    pub key: [u8; 32],
    /// The lock's name, for errors.
    pub name: String,
    pub timeout: Duration,
    pub backend: &'static str,
}

impl<C: sqlx::Connection + 'static> Session<C> {
    /// Renewal: prove the session is alive (it holds the lock).
    pub(crate) async fn renew(&self) -> Result<()> {
        self.pinned.prove_alive(self.timeout).await
    }

    /// Fires when the heartbeat loses the session.
    pub(crate) fn loss_signal(&self) -> CancellationToken {
        self.pinned.lost.clone()
    }

    /// Let go: run `release` on the pinned connection (within the timeout); a clean
    /// release returns the connection for reuse and wakes a local waiter. On any error
    /// the connection is dropped, which ends the session and frees the lock anyway.
    /// A second call, or one after the heartbeat lost the session, reports the loss:
    /// the lock was no longer held when it was given back.
    pub(crate) async fn end<Fut>(&self, release: impl FnOnce(C) -> Fut) -> Result<()>
    where
        Fut: std::future::Future<Output = (C, std::result::Result<(), sqlx::Error>)>,
    {
        let Some(conn) = self.pinned.take().await else {
            return Err(Error::LockLost {
                name: self.name.clone(),
                reason: crate::LossReason::SessionLost(
                    "the lock's database connection was lost before the release".into(),
                ),
            });
        };
        match tokio::time::timeout(self.timeout, release(conn)).await {
            Ok((conn, Ok(()))) => {
                self.idle.put(conn);
                self.hub.wake(&self.key);
                Ok(())
            }
            Ok((_, Err(e))) => Err(db_err(self.backend, &e)),
            Err(_) => Err(Error::connection(
                self.backend,
                "release timed out; session closed",
            )),
        }
    }
}
