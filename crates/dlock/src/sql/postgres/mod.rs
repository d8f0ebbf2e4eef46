//! `postgres://user[:password]@host[:port]/database`: PostgreSQL.
//!
//! # Modes
//! - `mode=lease` (default): a lease row per name in `<prefix>_locks`; expiry by the
//!   server's clock (another owner's lease by the statement's start,
//!   `statement_timestamp()`, which can only find it live longer; the asking owner's
//!   own lease, and a renewal's, by `clock_timestamp()` once the row is locked, so a
//!   statement that waited cannot re-enter or renew a lease that ended meanwhile); the
//!   fencing token is `nextval` of the sequence `<prefix>_fence`, drawn once the name's
//!   row is locked (so it follows every token granted for the name before) and
//!   committed by the statement that grants it. An acquire that waited for the row
//!   longer than four fifths of `timeout` grants nothing: its client has given up (the
//!   server does not notice), and a grant no one hears of would block the name for a
//!   TTL. One autocommitted statement per acquire and release (a waiter whose
//!   second or later try finds the name busy, while no hold or attempt of its backend
//!   has the key, asks a second: how long the lease has left, when to try again should
//!   no release be announced), and renewals batched
//!   (one statement per TTL for those waiting together): works through transaction
//!   poolers (PgBouncer). Reentrant for the same owner.
//! - `mode=advisory`: a session `pg_try_advisory_lock(key)` on a pinned connection;
//!   `key` is the first 8 bytes of SHA-256 of the name (`advisory_key=sha256`, default)
//!   or the name itself read as a decimal int8 (`advisory_key=number`, to share locks
//!   with code that calls `pg_advisory_lock(42)`). A session connection reads its
//!   own `backend_start` once, when it is made, and gives it to each holder record it
//!   writes (a prepared statement then: two more round trips when it connects).
//! - `mode=row`: `SELECT … FOR UPDATE NOWAIT` on the name's row in `<prefix>_rows`, in a
//!   READ COMMITTED transaction held open on a pinned connection; the lock ends at
//!   commit or when the connection dies. The token is taken on another connection, by a
//!   statement that fails unless that transaction is still open after `nextval`
//!   (`txid_status`), so a later holder's token is always higher. Three round trips a
//!   cycle: lock, token, and one batch that notifies and commits. The lock and release
//!   are statements each session connection prepares once (`PREPARE`): row mode needs
//!   session-level state, so it does not work through a transaction pooler (neither
//!   do the other session modes), nor on a connection someone `DISCARD`s.
//!
//! Needs PostgreSQL 10 or later (`txid_status`, `ON CONFLICT`).
//!
//! In session modes the holder (owner, token, metadata, backend pid) is recorded in
//! `<prefix>_holders` for `inspect`. The pinned connection is pinged every `heartbeat`
//! (default 1 s; the keeper's renewals, or a heartbeat of the hold's own when renewal
//! is off); a ping that fails or takes longer than that (or than the `timeout`, if
//! shorter) fires `lost()`, and the connection is closed after that. The server is
//! asked to end a session silent for five heartbeats (at least 5 s;
//! `idle_session_timeout` needs PostgreSQL 14, `idle_in_transaction_session_timeout`
//! covers row mode) and to probe a silent client with TCP keepalives that give up no
//! sooner (3 probes a second apart after an idle time of the rest): a cut-off holder
//! declares the loss after one to two heartbeats, before the server frees the lock,
//! and a paused one counts it lost the moment it runs again (its hold's session
//! trust, [`crate::backend::HeldLock::session_trust`]).
//!
//! # Waiting
//! A release sends `NOTIFY <prefix>_released, '<key hex>'` when some process waits for
//! the key: a process with waiters marks the key's bucket (one of 64) with a shared
//! advisory lock on one more connection, `(1684828003, bucket)` in the two-`int4` key
//! space, and the release notifies only if it cannot take that pair exclusively. A
//! release nobody waits for thus costs neither the server's notification queue nor any
//! listener a message. One listener connection per backend wakes the waiters of the
//! notified key in this process. A release that frees a key wakes one waiter of its
//! own backend itself, so a lease-mode lock waiter marks its key only while its backend
//! neither holds nor is taking it (`sql::LocalMark` says how): a lock handed from task
//! to task within a process stays silent. A lease that ends without a release is
//! re-polled at its expiry (a waiter asks how long it has left, in a statement of its
//! own, when its second or later try finds the name busy and no hold or attempt of its
//! backend has the key; otherwise within `poll` or a second, whichever is shorter); a
//! session that dies without a release is found by the fallback re-poll
//! every `poll` (default 100 ms), which also bounds every wait should a mark be missing
//! (one waiter per key and kind of hold in a process re-polls so; the others, woken
//! one at a time by releases in this process, every `poll` times their number).
//! Waiters in a dlock older than these marks are not notified by newer releasers (they
//! poll): upgrade the processes that share a `table_prefix` together. Through a
//! transaction pooler neither the marks nor `LISTEN` hold (both are session state):
//! waiters there rely on `poll`.
//!
//! # Options
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `mode` | `lease` | how the lock is held (above) |
//! | `table_prefix` | `dlock` | prefix of dlock's tables (a plain identifier) |
//! | `lock_delay` | none | lease mode: a lease that ran out without a release keeps the lock from other owners this much longer (at most 1 h) |
//! | `poll` | `100ms` (a fallback: releases notify) | waiting: re-poll interval |
//! | `timeout` | `5s` | connecting, and per statement (twice it: how long a semaphore's or read-write lock's attempt may leave its name's gate taken, below) |
//! | `heartbeat` | `1s` | session modes: ping interval of the pinned connection (a failed ping fires `lost()`) |
//! | `pool` | `10` | connections for lease statements and row mode's tokens, as many for semaphores and read-write locks, and as many for the rest (`inspect`, `list`, `break`) |
//! | `sessions` | `100` | idle pinned connections kept for session modes |
//! | `advisory_key` | `sha256` | advisory mode: `sha256` (first 8 bytes of the name's SHA-256) or `number` (the name as a decimal int8) |
//! | `sslmode` | `prefer` | `disable`, `prefer`, `require`, `verify-ca`, `verify-full` |
//! | `ssl_ca` | none | PEM file of the CA that signs the server |
//!
//! `inspect` asks the server what the acquire asks (`pg_locks` for the advisory key):
//! a key held outside dlock is reported held, with no token (0). With
//! `advisory_key=number` only the canonical spelling of a number names its key (`42`,
//! not `042` or `+42`): one lock, one name. Least privilege (tested): once the tables exist,
//! `SELECT, INSERT, UPDATE` on them and `USAGE` on the sequence are enough in every mode;
//! a user that cannot create the tables gets a clear permission error. Row mode also
//! needs a column that tables made by an earlier dlock lack, `<prefix>_holders.xact`:
//! the first row-mode `open` by the tables' owner adds it (the other modes work
//! without it; the ALTER gives up after waiting 2 s for a long reader of the table,
//! and `open` fails then). Advisory and row mode share the holder records: give each
//! session mode its own `table_prefix` when both lock the same names. Upgrade every process that shows row-mode holders together: an earlier
//! dlock's `inspect` reads the records differently. `inspect` in row mode shows the
//! record of a holder whose transaction is
//! still open (`txid_status`, readable by every role); in advisory mode, the record of
//! the backend holding the key, told from a stale one of an earlier backend with the
//! same pid by the session's start, which PostgreSQL shows for other roles' sessions
//! only to members of `pg_read_all_stats` (for others it goes by the pid alone). A row
//! locked outside dlock is reported free. Semaphores and
//! read-write locks use two tables of their own (`<prefix>_shared_gate`,
//! `<prefix>_shared`), made on first use: they also need `DELETE` on `<prefix>_shared`,
//! and `CREATE` unless they exist already. An attempt at one holds its name's gate row
//! in a short transaction: the server ends it when its client goes silent inside it for
//! twice `timeout`, and gives up its wait for the gate by then
//! (`SET LOCAL idle_in_transaction_session_timeout` and `lock_timeout`, so through a
//! transaction pooler too) — the server does not see a client leave while a statement
//! waits.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgListener, PgPool, PgSslMode};
use sqlx::{AssertSqlSafe, Connection, Executor, Row};

use super::dialect::{Dialect, Hold, HolderRow, LeaseAnswer, LeaseReleased, RowLock};
use super::engine::SqlBackend;
use super::own_conns::{OwnConn, OwnConns};
use super::shared::{SharedKey, SharedRemove, SharedRow, fill_in};
use super::{
    COMMON_OPTIONS, Mode, SqlOptions, db_err, has_code, lock_key, metadata_json, reserved, timed,
};
use crate::backend::{AcquireRequest, Backend, Capabilities};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::WakeOne;
use crate::shared_holds::EntryKind;
use crate::url::ConnectUrl;
use pinned::{BackendStart, PgSession};

mod marks;
mod pinned;
mod statements;
use statements::Statements;

const BACKEND: &str = "postgres";

/// How a name becomes a PostgreSQL advisory lock key (`mode=advisory`).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdvisoryKey {
    /// The first 8 bytes of SHA-256 of the name, big-endian, as an int8.
    Sha256,
    /// The name is a decimal int8 in its canonical spelling (`"42"` →
    /// `pg_advisory_lock(42)`; `"042"` and `"+42"` are refused).
    Number,
}

impl AdvisoryKey {
    /// The int8 key of `name`.
    ///
    /// # Errors
    /// [`Error::InvalidName`] when `Number` is asked for and the name is not an int8.
    pub fn key(self, name: &LockName) -> Result<i64> {
        match self {
            AdvisoryKey::Sha256 => Ok(digest_key(&lock_key(name))),
            AdvisoryKey::Number => number_key(name),
        }
    }

    /// [`AdvisoryKey::key`], given the name's [`lock_key`] (`digest`), which an
    /// acquisition has computed already: SHA-256 costs a few thousand instructions
    /// where the CPU has no SHA extensions.
    pub(crate) fn key_of(self, name: &LockName, digest: &[u8; 32]) -> Result<i64> {
        match self {
            AdvisoryKey::Sha256 => {
                debug_assert!(*digest == lock_key(name), "not the name's digest");
                Ok(digest_key(digest))
            }
            AdvisoryKey::Number => number_key(name),
        }
    }
}

/// `advisory_key=sha256`: the digest's first 8 bytes, big-endian.
fn digest_key(digest: &[u8; 32]) -> i64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(b)
}

/// `advisory_key=number`: only the canonical spelling. "042" and "+42" would be other
/// names for the lock "42", and two names of one lock defeat every ordering
/// (lock_all) and every per-name bookkeeping.
fn number_key(name: &LockName) -> Result<i64> {
    match name.as_str().parse::<i64>() {
        Ok(n) if n.to_string() == name.as_str() => Ok(n),
        Ok(n) => Err(Error::InvalidName {
            name: name.as_str().to_owned(),
            reason: format!("advisory_key=number takes the key as {n}"),
        }),
        Err(_) => Err(Error::InvalidName {
            name: name.as_str().to_owned(),
            reason: "advisory_key=number needs a decimal int8 name".into(),
        }),
    }
}

/// Connect, create the tables if missing, and start listening for releases — what
/// [`crate::Locker::connect`] does for a `postgres://` URL.
///
/// # Errors
/// [`Error::InvalidUrl`] for a bad URL or option; connection errors; a permission
/// error when the tables are missing and the user may not create them.
///
/// # Cancel safety
/// Cancel safe: nothing is held until it returns (a table creation that already ran
/// stays, which is harmless).
pub async fn open(mut url: ConnectUrl) -> Result<Arc<dyn Backend>> {
    let opts = SqlOptions::take(
        &mut url,
        &[("advisory", Mode::Advisory), ("row", Mode::Row)],
        Duration::from_millis(100),
    )?;
    let advisory_key = match url.take_param("advisory_key").as_deref() {
        None | Some("sha256") => AdvisoryKey::Sha256,
        Some("number") => AdvisoryKey::Number,
        Some(other) => {
            return Err(url.invalid(&format!(
                "advisory_key={other:?} is not one of sha256, number"
            )));
        }
    };
    let sslmode = url.take_param("sslmode");
    let mut accepted = COMMON_OPTIONS.to_vec();
    accepted.extend(["advisory_key", "sslmode"]);
    url.finish(&accepted)?;
    let [host] = url.hosts() else {
        return Err(url.invalid("PostgreSQL takes exactly one host"));
    };
    let mut connect = PgConnectOptions::new_without_pgpass()
        .host(&host.host)
        .port(host.port.unwrap_or(5432))
        .username(url.username().unwrap_or("postgres"))
        .application_name("dlock");
    if let Some(p) = url.password() {
        connect = connect.password(p.expose());
    }
    if let Some(db) = &opts.database {
        connect = connect.database(db);
    }
    if let Some(mode) = sslmode {
        let m = PgSslMode::from_str(&mode).map_err(|_| {
            url.invalid(&format!(
                "sslmode={mode:?} is not one of disable, prefer, require, verify-ca, verify-full"
            ))
        })?;
        connect = connect.ssl_mode(m);
    }
    if let Some(ca) = &opts.ssl_ca {
        connect = connect.ssl_root_cert(ca);
    }
    // One direct connection first: a refused or unreachable server is said at once
    // (the pool would retry until its timeout and only say that it timed out).
    let mut probe = timed(BACKEND, opts.timeout, PgConnection::connect_with(&connect)).await?;
    // The server's own limit for idle sessions (PostgreSQL 14 and later, in ms; 0 =
    // none; set server-, database- or role-wide), as connections like the probe get
    // it: the pool's and the lease statements' own idle connections are dropped well
    // before it. Read once, at open; unreadable counts as none.
    let server_idle_ms: Option<String> = timed(
        BACKEND,
        opts.timeout,
        sqlx::query_scalar("SELECT setting FROM pg_settings WHERE name = 'idle_session_timeout'")
            .fetch_optional(&mut probe),
    )
    .await
    .ok()
    .flatten();
    let own_idle = own_idle_limit(server_idle_ms.and_then(|ms| ms.parse().ok()));
    let _ = probe.close().await;
    let pool = super::pool_options::<sqlx::Postgres>(opts.pool.max(2), own_idle, opts.timeout)
        .connect_lazy_with(connect.clone());
    // The limit on an attempt's hold of its name's gate (the module documentation).
    let sql = Statements::new(
        &opts.prefix,
        opts.lock_delay,
        opts.timeout.saturating_mul(2),
    );
    timed(
        BACKEND,
        opts.timeout,
        create_schema(&pool, &sql, opts.mode == Mode::Row),
    )
    .await?;
    let durable = timed(
        BACKEND,
        opts.timeout,
        sqlx::query_scalar::<_, bool>(
            "SELECT current_setting('fsync') = 'on' AND current_setting('synchronous_commit') <> 'off'",
        )
        .fetch_one(&pool),
    )
    .await?;
    let hub = Arc::new(WakeOne::default());
    let mut listener = timed(BACKEND, opts.timeout, PgListener::connect_with(&pool)).await?;
    timed(BACKEND, opts.timeout, listener.listen(&sql.channel)).await?;
    let listener = tokio::spawn(listen(listener, Arc::clone(&hub), opts.poll));
    let marks = marks::Marks::start(connect.clone(), Arc::clone(&hub), opts.timeout);
    // Session connections ask the server to probe a silent client (TCP keepalives)
    // and, on PostgreSQL 14 or later, to end a session that sends nothing for five
    // heartbeats, so a cut-off holder's session (and lock) ends in seconds, not
    // hours — after the holder's own heartbeat has declared the loss.
    let version: i32 = timed(
        BACKEND,
        opts.timeout,
        sqlx::query_scalar("SELECT current_setting('server_version_num')::int").fetch_one(&pool),
    )
    .await?;
    let silent = (opts.heartbeat * 5).max(Duration::from_secs(5));
    let silent_ms = silent.as_millis().to_string();
    // The keep-alive probes give up on a silent client (a paused host, a cut network)
    // as soon as the idle limit would, not sooner: idle + 3 probes a second apart.
    // (At most what Linux takes for TCP_KEEPIDLE.)
    let keepalive_idle = silent.as_secs().saturating_sub(3).clamp(2, 32_767);
    let mut session_options = vec![
        ("tcp_keepalives_idle", keepalive_idle.to_string()),
        ("tcp_keepalives_interval", "1".to_owned()),
        ("tcp_keepalives_count", "3".to_owned()),
    ];
    // What a holder may count on: the shorter of the two limits.
    let silent = silent.min(Duration::from_secs(keepalive_idle + 3));
    if version >= 140_000 {
        session_options.push(("idle_session_timeout", silent_ms.clone()));
    }
    session_options.push(("idle_in_transaction_session_timeout", silent_ms));
    let dialect = Postgres {
        pool,
        own: OwnConns::new(opts.pool.max(2), own_idle),
        shared_own: OwnConns::new(opts.pool.max(2), own_idle),
        plain: connect.clone(),
        connect: connect.options(session_options),
        sql,
        advisory_key,
        row_mode: opts.mode == Mode::Row,
        timeout: opts.timeout,
        silent,
        listener,
        marks,
    };
    // An idle session connection is dropped well before the server ends it for
    // silence (one the server ended would fail the next acquisition that took it),
    // and after 5 min at most.
    let session_idle = (silent / 2).min(Duration::from_secs(300));
    Ok(Arc::new(SqlBackend::new(
        dialect,
        opts,
        hub,
        durable,
        session_idle,
    )))
}

/// PostgreSQL's statements and errors.
struct Postgres {
    pool: PgPool,
    /// The lease and row-token statements' connections (see `own_conns`).
    own: OwnConns<PgConnection>,
    /// The connections of semaphore and read-write lock attempts (see `own_conns`):
    /// a crowd waiting for one name's gate must not take every place the lease
    /// statements and the renewals need.
    shared_own: OwnConns<PgConnection>,
    /// The options of both sets: the pool's, without the session connections' idle
    /// limits (an attempt's transaction sets its own, `SET LOCAL`).
    plain: PgConnectOptions,
    /// Session connections' options (with the server-side idle limits).
    connect: PgConnectOptions,
    sql: Statements,
    advisory_key: AdvisoryKey,
    /// Row mode: session connections prepare its statements when made (advisory
    /// mode's keep their `backend_start` instead).
    row_mode: bool,
    timeout: Duration,
    /// How long a session connection may send nothing before the server ends it.
    silent: Duration,
    listener: tokio::task::JoinHandle<()>,
    /// This process's marks on the keys it waits for: releases notify only those.
    marks: marks::Marks,
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the connect options: they hold the password.
        f.debug_struct("Postgres")
            .field("advisory_key", &self.advisory_key)
            .finish_non_exhaustive()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl Postgres {
    /// A connection for one lease or row-token statement: put it back after a
    /// statement that succeeded (`self.own.put`), drop it otherwise.
    async fn own_conn(&self) -> Result<OwnConn<PgConnection>> {
        self.conn_from(&self.own).await
    }

    /// A connection for a semaphore's or read-write lock's attempt: ended with
    /// `self.shared_own.end`, dropped otherwise.
    async fn shared_conn(&self) -> Result<OwnConn<PgConnection>> {
        self.conn_from(&self.shared_own).await
    }

    /// A connection of `set`, made with the plain options when none is idle.
    async fn conn_from(&self, set: &OwnConns<PgConnection>) -> Result<OwnConn<PgConnection>> {
        set.get(BACKEND, self.timeout, || {
            timed(
                BACKEND,
                self.timeout,
                PgConnection::connect_with(&self.plain),
            )
        })
        .await
    }

    /// Whether the semaphore and read-write lock tables exist (made on first use).
    async fn shared_tables(&self) -> Result<bool> {
        timed(
            BACKEND,
            self.timeout,
            sqlx::query_scalar::<_, bool>(AssertSqlSafe(&*self.sql.shared.tables))
                .fetch_one(&self.pool),
        )
        .await
    }
}

/// How long a lease statement's connection may stay idle: half the server's limit for
/// idle sessions (`idle_session_timeout`, ms, 0 = none) and at most 5 min.
fn own_idle_limit(server_idle_ms: Option<u64>) -> Duration {
    let most = Duration::from_secs(300);
    match server_idle_ms {
        Some(ms) if ms > 0 => (Duration::from_millis(ms) / 2).min(most),
        _ => most,
    }
}

/// A token as PostgreSQL stores it (`bigint`).
fn fence_i64(fence: u64) -> i64 {
    i64::try_from(fence).unwrap_or(i64::MAX)
}

/// A token as read back (a sequence value is never negative).
fn fence_u64(fence: i64) -> u64 {
    u64::try_from(fence).unwrap_or(0)
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

#[async_trait]
impl Dialect for Postgres {
    type Conn = PgSession;
    type SessionKey = i64;
    const BACKEND: &'static str = BACKEND;
    const PRODUCT: &'static str = "PostgreSQL";
    const SESSION: &'static str = "backend pid";
    const NATIVE_WAIT: bool = true;
    const POLL_JITTER: bool = false;

    fn session_silence(&self) -> Duration {
        self.silent
    }

    async fn lease_acquire(&self, req: &AcquireRequest, key: &[u8; 32]) -> Result<LeaseAnswer> {
        let mut c = self.own_conn().await?;
        let meta = metadata_json(&req.metadata);
        let (name, owner) = (req.name.as_str(), req.owner.as_str());
        let args = reserved::<PgArguments>(&[key.len(), name.len(), owner.len(), 8, meta.len(), 8]);
        let fence = timed(
            BACKEND,
            self.timeout,
            sqlx::query_scalar_with::<_, i64, _>(AssertSqlSafe(&*self.sql.acquire), args)
                .bind(&key[..])
                .bind(name)
                .bind(owner)
                .bind(micros(req.ttl))
                .bind(meta)
                .bind(micros(super::grant_budget(self.timeout)))
                .fetch_optional(&mut c.conn),
        )
        .await?;
        self.own.put(c);
        Ok(fence.map_or(LeaseAnswer::Busy, |f| LeaseAnswer::Granted(fence_u64(f))))
    }

    async fn lease_busy_left(&self, key: &[u8; 32]) -> Result<Option<Duration>> {
        let mut c = self.own_conn().await?;
        let left = timed(
            BACKEND,
            self.timeout,
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(&*self.sql.busy_left))
                .bind(&key[..])
                .fetch_optional(&mut c.conn),
        )
        .await?;
        self.own.put(c);
        Ok(left.map(|ms| Duration::from_millis(ms.max(1).unsigned_abs())))
    }

    async fn lease_renew(&self, hold: &Hold, ttl: Duration) -> Result<bool> {
        let mut c = self.own_conn().await?;
        let args = reserved::<PgArguments>(&[hold.key.len(), hold.owner.as_str().len(), 8, 8]);
        let renewed = timed(
            BACKEND,
            self.timeout,
            sqlx::query_scalar_with::<_, i32, _>(AssertSqlSafe(&*self.sql.renew), args)
                .bind(&hold.key[..])
                .bind(hold.owner.as_str())
                .bind(fence_i64(hold.fence))
                .bind(micros(ttl))
                .fetch_optional(&mut c.conn),
        )
        .await?;
        self.own.put(c);
        Ok(renewed.is_some())
    }

    async fn lease_renew_many(&self, holds: &[Arc<Hold>], ttl: Duration) -> Result<Vec<bool>> {
        if let [one] = holds {
            return Ok(vec![self.lease_renew(one, ttl).await?]);
        }
        let keys: Vec<&[u8]> = holds.iter().map(|h| &h.key[..]).collect();
        let owners: Vec<&str> = holds.iter().map(|h| h.owner.as_str()).collect();
        let fences: Vec<i64> = holds.iter().map(|h| fence_i64(h.fence)).collect();
        let mut c = self.own_conn().await?;
        let renewed: Vec<(Vec<u8>, i64)> = timed(
            BACKEND,
            self.timeout,
            sqlx::query_as(AssertSqlSafe(&*self.sql.renew_many))
                .bind(&keys)
                .bind(&owners)
                .bind(&fences)
                .bind(micros(ttl))
                .fetch_all(&mut c.conn),
        )
        .await?;
        self.own.put(c);
        let renewed: std::collections::HashSet<(Vec<u8>, i64)> = renewed.into_iter().collect();
        Ok(holds
            .iter()
            .map(|h| renewed.contains(&(h.key.to_vec(), fence_i64(h.fence))))
            .collect())
    }

    async fn lease_break(&self, key: &[u8; 32], fence: u64) -> Result<bool> {
        let broke = timed(
            BACKEND,
            self.timeout,
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(&*self.sql.break_lease))
                .bind(&key[..])
                .bind(fence_i64(fence))
                .bind(&*self.sql.channel)
                .bind(super::hex(key))
                .fetch_one(&self.pool),
        )
        .await?;
        Ok(broke > 0)
    }

    async fn lease_release(&self, hold: &Hold) -> Result<LeaseReleased> {
        let mut c = self.own_conn().await?;
        let args = reserved::<PgArguments>(&[
            hold.key.len(),
            hold.owner.as_str().len(),
            8,
            self.sql.channel.len(),
            hold.key_hex.len(),
        ]);
        let holds = timed(
            BACKEND,
            self.timeout,
            sqlx::query_scalar_with::<_, i32, _>(AssertSqlSafe(&*self.sql.release), args)
                .bind(&hold.key[..])
                .bind(hold.owner.as_str())
                .bind(fence_i64(hold.fence))
                .bind(&*self.sql.channel)
                .bind(&hold.key_hex)
                .fetch_optional(&mut c.conn),
        )
        .await?;
        self.own.put(c);
        Ok(match holds {
            Some(0) => LeaseReleased::Free,
            Some(_) => LeaseReleased::StillHeld,
            None => LeaseReleased::NotHeld,
        })
    }

    async fn connect_session(&self) -> Result<PgSession> {
        timed(BACKEND, self.timeout, async {
            let mut conn = PgConnection::connect_with(&self.connect).await?;
            let started = if self.row_mode {
                conn.execute(sqlx::raw_sql(AssertSqlSafe(&*self.sql.row_prepare)))
                    .await?;
                None
            } else {
                // NULL where the server hides it from the session's current role (a
                // role set after login that lacks the login role's privileges): the
                // record then names the session by its pid alone, as `inspect` reads it.
                sqlx::query_scalar::<_, Option<BackendStart>>(AssertSqlSafe(
                    &*self.sql.advisory_session,
                ))
                .fetch_optional(&mut conn)
                .await?
                .flatten()
            };
            Ok(PgSession { conn, started })
        })
        .await
    }

    fn session_key(&self, name: &LockName, key: &[u8; 32]) -> Result<i64> {
        self.advisory_key.key_of(name, key)
    }

    async fn session_lock(
        &self,
        conn: &mut PgSession,
        req: &AcquireRequest,
        key: &[u8; 32],
        akey: &i64,
    ) -> Result<Option<u64>> {
        let meta = metadata_json(&req.metadata);
        let (name, owner) = (req.name.as_str(), req.owner.as_str());
        let args = reserved::<PgArguments>(&[8, key.len(), name.len(), owner.len(), meta.len(), 8]);
        let fence =
            sqlx::query_scalar_with::<_, i64, _>(AssertSqlSafe(&*self.sql.advisory_acquire), args)
                .bind(*akey)
                .bind(&key[..])
                .bind(name)
                .bind(owner)
                .bind(meta)
                .bind(conn.started)
                .fetch_optional(&mut conn.conn)
                .await
                .map_err(|e| db_err(BACKEND, &e))?;
        Ok(fence.map(fence_u64))
    }

    async fn session_unlock(
        &self,
        conn: &mut PgSession,
        akey: &i64,
        hold: &Hold,
    ) -> std::result::Result<(), sqlx::Error> {
        let (channel, key_hex) = (&*self.sql.channel, &hold.key_hex);
        let args = reserved::<PgArguments>(&[8, channel.len(), key_hex.len()]);
        sqlx::query_with(AssertSqlSafe(&*self.sql.advisory_release), args)
            .bind(*akey)
            .bind(channel)
            .bind(key_hex)
            .execute(&mut conn.conn)
            .await
            .map(drop)
    }

    async fn row_lock(&self, session: &mut PgSession, key: &[u8; 32]) -> Result<RowLock> {
        let conn = &mut session.conn;
        let batch = self.sql.row_lock_batch(key);
        let locked = sqlx::raw_sql(AssertSqlSafe(batch))
            .fetch_optional(&mut *conn)
            .await;
        let found = match locked {
            Ok(Some(row)) => {
                return Ok(RowLock::Locked {
                    session: row.try_get(0).map_err(|e| db_err(BACKEND, &e))?,
                    xact: Some(row.try_get(1).map_err(|e| db_err(BACKEND, &e))?),
                });
            }
            Ok(None) => RowLock::Missing,
            // lock_not_available: NOWAIT found the row locked.
            Err(e) if has_code(&e, &["55P03"]) => RowLock::Busy,
            Err(e) => return Err(db_err(BACKEND, &e)),
        };
        conn.execute("ROLLBACK")
            .await
            .map_err(|e| db_err(BACKEND, &e))?;
        Ok(found)
    }

    async fn row_ensure(&self, _conn: &mut PgSession, key: &[u8; 32]) -> Result<()> {
        timed(
            BACKEND,
            self.timeout,
            sqlx::query(AssertSqlSafe(&*self.sql.row_ensure))
                .bind(&key[..])
                .execute(&self.pool),
        )
        .await
        .map(drop)
    }

    async fn row_holder(
        &self,
        req: &AcquireRequest,
        key: &[u8; 32],
        session: i64,
        xact: Option<i64>,
    ) -> Result<u64> {
        let mut c = self.own_conn().await?;
        let meta = metadata_json(&req.metadata);
        let (name, owner) = (req.name.as_str(), req.owner.as_str());
        let args = reserved::<PgArguments>(&[key.len(), name.len(), owner.len(), meta.len(), 4, 8]);
        let token =
            sqlx::query_scalar_with::<_, i64, _>(AssertSqlSafe(&*self.sql.row_holder), args)
                .bind(&key[..])
                .bind(name)
                .bind(owner)
                .bind(meta)
                .bind(i32::try_from(session).unwrap_or(0))
                .bind(xact.unwrap_or(0))
                .fetch_one(&mut c.conn);
        let fence = match tokio::time::timeout(self.timeout, token).await {
            Ok(Ok(fence)) => fence,
            Ok(Err(e)) if has_code(&e, &["22P02"]) => {
                // The statement failed cleanly: its connection is as good as before.
                self.own.put(c);
                return Err(Error::connection(
                    BACKEND,
                    "the session holding the row lock ended while its token was taken",
                ));
            }
            Ok(Err(e)) => return Err(db_err(BACKEND, &e)),
            Err(_) => return Err(super::no_answer(BACKEND, self.timeout)),
        };
        self.own.put(c);
        Ok(fence_u64(fence))
    }

    async fn row_unlock(
        &self,
        conn: &mut PgSession,
        hold: &Hold,
    ) -> std::result::Result<(), sqlx::Error> {
        let batch = self.sql.row_release_batch(&hold.key);
        conn.conn
            .execute(sqlx::raw_sql(AssertSqlSafe(batch)))
            .await
            .map(drop)
    }

    fn mark_waiting(&self, key: &[u8; 32]) -> Option<Box<dyn std::any::Any + Send + Sync>> {
        Some(Box::new(self.marks.mark(key)))
    }

    async fn names(&self, mode: Mode, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let sql = if mode == Mode::Lease {
            &self.sql.names_lease
        } else {
            &self.sql.names_session
        };
        timed(
            BACKEND,
            self.timeout,
            sqlx::query_scalar::<_, String>(AssertSqlSafe(&**sql))
                .bind(prefix)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&self.pool),
        )
        .await
    }

    type SharedTx = OwnConn<PgConnection>;

    async fn shared_schema(&self) -> Result<()> {
        let sql = &self.sql.shared;
        let create = async {
            let present: bool = sqlx::query_scalar(AssertSqlSafe(&*sql.tables))
                .fetch_one(&self.pool)
                .await?;
            if present {
                return Ok(());
            }
            // Serialized as create_schema is (concurrent CREATE IF NOT EXISTS can fail).
            let mut tx = self.pool.begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock(7022505437620437858)")
                .execute(&mut *tx)
                .await?;
            tx.execute(sqlx::raw_sql(AssertSqlSafe(&*sql.schema)))
                .await?;
            tx.commit().await
        };
        timed(BACKEND, self.timeout, create).await
    }

    async fn shared_begin(&self, at: &SharedKey) -> Result<(Self::SharedTx, u64, Vec<SharedRow>)> {
        let mut c = self.shared_conn().await?;
        let batch = fill_in(&self.sql.shared.begin, at);
        let rows = timed(
            BACKEND,
            self.timeout,
            sqlx::raw_sql(AssertSqlSafe(batch)).fetch_all(&mut c.conn),
        )
        .await?;
        // The gate's token, then the live rows.
        let mut rows = rows.into_iter();
        let fence: i64 = rows
            .next()
            .ok_or_else(|| Error::backend(BACKEND, "the gate row was not returned"))?
            .try_get(0)
            .map_err(|e| db_err(BACKEND, &e))?;
        let live = rows
            .map(|r| {
                Ok(SharedRow {
                    kind: r.try_get(0)?,
                    owner: r.try_get(1)?,
                    acquisition: r.try_get(2)?,
                    remaining_ms: r.try_get(3)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| db_err(BACKEND, &e))?;
        Ok((c, fence_u64(fence), live))
    }

    async fn shared_put(
        &self,
        tx: &mut Self::SharedTx,
        req: &AcquireRequest,
        at: &SharedKey,
        kind: EntryKind,
        fence: u64,
        ttl: Duration,
    ) -> Result<()> {
        timed(
            BACKEND,
            self.timeout,
            sqlx::query(AssertSqlSafe(&*self.sql.shared.put))
                .bind(&at.key[..])
                .bind(at.family)
                .bind(at.acquisition)
                .bind(req.name.as_str())
                .bind(req.owner.as_str())
                .bind(kind.as_str())
                .bind(fence_i64(fence))
                .bind(micros(ttl))
                .bind(metadata_json(&req.metadata))
                .execute(&mut tx.conn),
        )
        .await?;
        Ok(())
    }

    async fn shared_commit(&self, tx: Self::SharedTx) -> Result<()> {
        self.shared_own
            .end(tx, BACKEND, self.timeout, "COMMIT")
            .await
    }

    async fn shared_rollback(&self, tx: Self::SharedTx) -> Result<()> {
        self.shared_own
            .end(tx, BACKEND, self.timeout, "ROLLBACK")
            .await
    }

    async fn shared_renew(&self, at: &SharedKey, fence: u64, ttl: Duration) -> Result<bool> {
        let mut c = self.own_conn().await?;
        let done = timed(
            BACKEND,
            self.timeout,
            sqlx::query(AssertSqlSafe(&*self.sql.shared.renew))
                .bind(&at.key[..])
                .bind(at.family)
                .bind(at.acquisition)
                .bind(fence_i64(fence))
                .bind(micros(ttl))
                .execute(&mut c.conn),
        )
        .await?;
        self.own.put(c);
        Ok(done.rows_affected() > 0)
    }

    async fn shared_remove(&self, at: &SharedKey, what: SharedRemove) -> Result<bool> {
        let (selector, fence) = what.parts();
        let mut c = self.own_conn().await?;
        let removed: i64 = timed(
            BACKEND,
            self.timeout,
            sqlx::query_scalar(AssertSqlSafe(&*self.sql.shared.remove))
                .bind(&at.key[..])
                .bind(at.family)
                .bind(at.acquisition)
                .bind(selector)
                .bind(fence)
                .bind(&*self.sql.channel)
                .bind(&at.key_hex)
                .fetch_one(&mut c.conn),
        )
        .await?;
        self.own.put(c);
        Ok(removed > 0)
    }

    async fn shared_holders(
        &self,
        at: &SharedKey,
    ) -> Result<Vec<(String, String, u64, i64, String)>> {
        if !self.shared_tables().await? {
            return Ok(Vec::new());
        }
        let rows = timed(
            BACKEND,
            self.timeout,
            sqlx::query_as::<_, (String, String, i64, i64, String)>(AssertSqlSafe(
                &*self.sql.shared.holders,
            ))
            .bind(&at.key[..])
            .bind(at.family)
            .fetch_all(&self.pool),
        )
        .await?;
        Ok(rows
            .into_iter()
            .map(|(k, o, f, left, m)| (k, o, fence_u64(f), left, m))
            .collect())
    }

    async fn inspect(
        &self,
        mode: Mode,
        name: &LockName,
        key: &[u8; 32],
    ) -> Result<Option<HolderRow>> {
        let t = self.timeout;
        let query = match mode {
            Mode::Lease => {
                let row = timed(
                    BACKEND,
                    t,
                    sqlx::query(AssertSqlSafe(&*self.sql.inspect_lease))
                        .bind(&key[..])
                        .fetch_optional(&self.pool),
                )
                .await?;
                return Ok(row.map(|r| HolderRow {
                    owner: r.get(1),
                    holds: u32::try_from(r.get::<i32, _>(2)).unwrap_or(0),
                    fence: fence_u64(r.get(3)),
                    metadata: r.get(4),
                    remaining: Some(Duration::from_millis(
                        u64::try_from(r.get::<i64, _>(5)).unwrap_or(0),
                    )),
                    session: 0,
                }));
            }
            Mode::Advisory => sqlx::query(AssertSqlSafe(&*self.sql.inspect_advisory))
                .bind(&key[..])
                .bind(self.advisory_key.key_of(name, key)?),
            _ => sqlx::query(AssertSqlSafe(&*self.sql.inspect_row)).bind(&key[..]),
        };
        let row = timed(BACKEND, t, query.fetch_optional(&self.pool)).await?;
        Ok(row.map(|r| HolderRow {
            owner: r.get(1),
            holds: 1,
            fence: fence_u64(r.get(2)),
            metadata: r.get(3),
            remaining: None,
            session: i64::from(r.try_get::<i32, _>(4).unwrap_or(0)),
        }))
    }
}

/// The listener loop: wake this process's waiters of each released key; on a lost
/// connection (notifications may be missed) wake every waiter.
async fn listen(mut listener: PgListener, hub: Arc<WakeOne<[u8; 32]>>, poll: Duration) {
    loop {
        match listener.try_recv().await {
            Ok(Some(n)) => match parse_key(n.payload()) {
                Some(key) => hub.wake(&key),
                None => hub.wake_all(),
            },
            Ok(None) => hub.wake_all(),
            Err(e) => {
                tracing::debug!(error = %e, "postgres listener: reconnecting");
                hub.wake_all();
                tokio::time::sleep(poll).await;
            }
        }
    }
}

fn parse_key(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Create the tables and sequence unless they exist. Creators are serialized by a
/// transaction-scoped advisory lock, since concurrent `CREATE … IF NOT EXISTS` can
/// fail on PostgreSQL's catalog unique index.
/// Row mode (`row`) also needs the holder records' `xact` column, which tables of an
/// earlier dlock lack: it is added then (by the tables' owner). The other modes work
/// without it, so a role that may not alter the tables goes on using them. What is
/// missing is asked again under the creators' lock, so an opener that waited for
/// another's creation does nothing.
async fn create_schema(
    pool: &PgPool,
    sql: &Statements,
    row: bool,
) -> std::result::Result<(), sqlx::Error> {
    /// (the tables are missing, the column is missing and needed)
    async fn missing(
        on: &mut PgConnection,
        sql: &Statements,
        row: bool,
    ) -> std::result::Result<(bool, bool), sqlx::Error> {
        let tables: bool = sqlx::query_scalar(AssertSqlSafe(&*sql.tables))
            .fetch_one(&mut *on)
            .await?;
        if !tables || !row {
            return Ok((!tables, false));
        }
        let column: bool = sqlx::query_scalar(AssertSqlSafe(&*sql.holders_xact))
            .fetch_one(&mut *on)
            .await?;
        Ok((false, !column))
    }
    if missing(&mut *pool.acquire().await?, sql, row).await? == (false, false) {
        return Ok(());
    }
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(7022505437620437858)")
        .execute(&mut *tx)
        .await?;
    match missing(&mut tx, sql, row).await? {
        // New tables have the column.
        (true, _) => {
            tx.execute(sqlx::raw_sql(AssertSqlSafe(&*sql.schema)))
                .await?;
        }
        (false, true) => {
            tx.execute(sqlx::raw_sql(AssertSqlSafe(&*sql.add_xact)))
                .await?;
        }
        (false, false) => {}
    }
    tx.commit().await
}

/// Capabilities in the default mode (lease) on a server that flushes every commit
/// (`durable`), or not.
pub(crate) fn capabilities_with(durable: bool) -> Capabilities {
    super::capabilities(
        Mode::Lease,
        Postgres::NATIVE_WAIT,
        durable,
        Duration::from_secs(1),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::{Connection, PgConnection};

    use super::AdvisoryKey;
    use super::statements::Statements;
    use crate::name::LockName;

    /// Row mode's token statement answers a token only while the transaction that
    /// locked the row is open: once it has ended, it fails (22P02) and writes no record
    /// (a later holder's record stays).
    #[tokio::test(flavor = "current_thread")]
    async fn row_token_only_while_the_locking_transaction_is_open() {
        let Some(pg) = dlock_testkit::PgServer::start() else {
            return;
        };
        let url = format!("{}?mode=row", pg.url());
        // The schema (holders table, token sequence) comes with the first lock.
        let locker = crate::Locker::connect(&url).await.expect("connect");
        drop(locker.lock("schema").await.expect("lock"));
        let sql = Statements::new("dlock", Duration::ZERO, Duration::from_secs(5)).row_holder;
        let mut locking = PgConnection::connect(&pg.url()).await.expect("connect");
        let mut other = PgConnection::connect(&pg.url()).await.expect("connect");
        sqlx::query("BEGIN")
            .execute(&mut locking)
            .await
            .expect("begin");
        let xact: i64 = sqlx::query_scalar("SELECT txid_current()")
            .fetch_one(&mut locking)
            .await
            .expect("xact");
        let key = [7u8; 32];
        let token = |owner: &'static str| {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.clone()))
                .bind(&key[..])
                .bind("row-token")
                .bind(owner)
                .bind("{}")
                .bind(1_i32)
                .bind(xact)
        };
        let open = token("first")
            .fetch_one(&mut other)
            .await
            .expect("token while open");
        sqlx::query("COMMIT")
            .execute(&mut locking)
            .await
            .expect("commit");
        let ended = token("second").fetch_one(&mut other).await;
        let code = ended
            .as_ref()
            .err()
            .and_then(|e| e.as_database_error())
            .and_then(|e| e.code().map(|c| c.into_owned()));
        assert_eq!(code.as_deref(), Some("22P02"), "{ended:?}");
        let (owner, fence): (String, i64) =
            sqlx::query_as("SELECT owner, fence FROM dlock_holders WHERE lock_key = $1")
                .bind(&key[..])
                .fetch_one(&mut other)
                .await
                .expect("record");
        assert_eq!((owner.as_str(), fence), ("first", open));
    }

    /// One lock, one name: only the canonical spelling of a number is a key.
    #[test]
    fn number_keys_take_only_the_canonical_spelling() {
        let key = |n: &str| AdvisoryKey::Number.key(&LockName::new(n).expect("name"));
        assert_eq!(key("42").expect("42"), 42);
        assert_eq!(key("-7").expect("-7"), -7);
        for other in ["042", "+42", "-0", " 42", "4.2", "abc"] {
            assert!(key(other).is_err(), "{other:?} was taken as a key");
        }
    }
}
