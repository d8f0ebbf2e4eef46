//! `mysql://user[:password]@host[:port]/database` and `mariadb://…`: MySQL and MariaDB.
//!
//! # Modes
//! - `mode=lease` (default): a lease row per name in `<prefix>_locks`; expiry by the
//!   server's clock (`UTC_TIMESTAMP(6)`); the row is the name's fencing counter
//!   (`LAST_INSERT_ID(fence + 1)`). One autocommitted single-row statement per acquire
//!   and release, and renewals batched (one statement per TTL for those waiting
//!   together; see [`statements`](self) for why that cannot deadlock). Reentrant for the same owner.
//!   An acquire that waited for the name's row longer than four fifths of `timeout`
//!   grants nothing (its client has given up, and the server does not notice) — except
//!   the very first acquire of a name, whose insert of the row has its values
//!   computed before it waits (for another client's uncommitted insert of the same
//!   key, or a metadata lock such as a DDL's): abandoned past `timeout`, it may grant
//!   a lease no one holds, which keeps the name taken for a TTL. The statements mean
//!   the same under MariaDB's `SIMULTANEOUS_ASSIGNMENT` sql_mode. A server started
//!   with `--sysdate-is-now` judges by the statement's start instead: an acquire that
//!   waited for the row while its owner's lease ended may re-enter it (same token)
//!   instead of taking a new grant, and the budget above is not kept.
//! - `mode=named`: `GET_LOCK(name, 0)` on a pinned connection. The server-side name is
//!   the 64 hex digits of SHA-256 of the dlock name: it fits MySQL's 64-character limit
//!   (MariaDB allows 192) and no server's case folding or trailing-space rules can
//!   merge two names.
//! - `mode=row`: `SELECT … FOR UPDATE NOWAIT` on the name's row in `<prefix>_rows`, in a
//!   transaction held open on a pinned connection (MySQL 8 / MariaDB 10.3 or later).
//!
//! Session modes record the holder in `<prefix>_holders` (token counter, owner,
//! metadata, connection id) for `inspect`. `inspect` in row mode asks what the acquire
//! asks — can the row be locked? — with a shared `NOWAIT` lock for one statement, then
//! reads the record; an acquire at that very instant finds the row busy (a waiter
//! polls again; a `try_lock` answers busy). A row held with no record (a transaction
//! outside dlock, or a holder between its lock and its record) is reported held with
//! token 0. A release clears the record in the transaction it commits, and an attempt
//! that fails once it locked the row (its token's statement, or the ping after it)
//! clears the record it may have written, by its session's id and owner (best effort:
//! after a token's statement the server is still running, not after one that reaches
//! it later), so neither is shown for the next holder. A holder whose connection died
//! leaves its record, which is shown for the next holder until that one writes its own
//! (one statement; without `PROCESS` the server gives no way to see whether a recorded
//! connection lives). Every connection sets `autocommit=1` and READ COMMITTED, whatever
//! the server's defaults. Pinned connections
//! set `wait_timeout` to 5 heartbeats (at least 5 s) so the server drops a cut-off
//! holder's session; the heartbeat (`heartbeat`, default 1 s) makes the holder declare
//! the loss first.
//!
//! # Waiting
//! MySQL has no notifications: waiters poll every `poll` (default 10 ms, jittered 50–100 %),
//! one per name (and kind of hold) in a process's backend — the others wait for a
//! release in this process, which wakes one of them at once, and poll only every `poll`
//! times their number. A process's waiters thus meet other processes' as one: a name
//! released elsewhere goes to the first poll, whatever the number of waiters behind it.
//!
//! # Options
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `mode` | `lease` | how the lock is held (above) |
//! | `table_prefix` | `dlock` | prefix of dlock's tables (a plain identifier) |
//! | `lock_delay` | none | lease mode: a lease that ran out without a release keeps the lock from other owners this much longer (at most 1 h) |
//! | `poll` | `10ms` (jittered) | waiting: re-poll interval |
//! | `timeout` | `5s` | connecting, and per statement (twice it: how long a semaphore's or read-write lock's attempt may leave its name's gate taken, below) |
//! | `heartbeat` | `1s` | session modes: ping interval of the pinned connection (a failed ping fires `lost()`) |
//! | `pool` | `10` | connections for lease statements and row mode's tokens, as many for semaphores and read-write locks, and as many for the rest (`inspect`, `list`, `break`) |
//! | `sessions` | `100` | idle pinned connections kept for session modes |
//! | `ssl_mode` | `preferred` | `disabled`, `preferred`, `required`, `verify_ca`, `verify_identity` |
//! | `ssl_ca` | none | PEM file of the CA that signs the server |
//!
//! `inspect` asks the server what the acquire asks (`IS_USED_LOCK`, the row's lock): a
//! lock held outside dlock is reported held, with no token (0). Least privilege
//! (tested): once the tables exist, `SELECT, INSERT, UPDATE` on them are enough, for
//! `inspect` too. Semaphores and read-write locks use two tables of their own
//! (`<prefix>_shared_gate`, `<prefix>_shared`), made on first use: they also need
//! `DELETE` on `<prefix>_shared`, and `CREATE` unless they exist already; on MariaDB
//! they need 10.3 or later. An attempt at one holds its name's gate row in a short
//! transaction: the server ends it when its client goes silent inside it for twice
//! `timeout` in whole seconds (MariaDB by `idle_transaction_timeout` and its write and
//! read-only kin; MySQL by the attempts' connections' `wait_timeout`, so there such a
//! connection idle for about `timeout` is made anew), and gives up its wait for the
//! gate by then (`innodb_lock_wait_timeout`, never raised above the server's, at least
//! 1 s) — the server does not see a client leave while a statement waits.
//! Not yet: fair (FIFO) mode, waiting by notification.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::TryStreamExt as _;
use sqlx::mysql::{MySqlArguments, MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlSslMode};
use sqlx::{Arguments as _, AssertSqlSafe, Connection, Executor, Row};

use super::dialect::{Dialect, Hold, HolderRow, LeaseAnswer, LeaseReleased, RowLock};
use super::engine::SqlBackend;
use super::own_conns::{OwnConn, OwnConns};
use super::shared::{SharedKey, SharedRemove, SharedRow, fill_in};
use super::{
    COMMON_OPTIONS, Mode, SqlOptions, db_err, hex, metadata_json, no_answer, reserved, timed,
};
use crate::backend::{AcquireRequest, Backend, Capabilities};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::WakeOne;
use crate::options::Owner;
use crate::shared_holds::EntryKind;
use crate::url::ConnectUrl;

mod statements;
use statements::Statements;

const BACKEND: &str = "mysql";

/// Every connection's setup. Our sessions read committed data only, so InnoDB takes no
/// gap locks; and each statement commits itself whatever the server's default (with
/// `autocommit=0` set server-wide, the row probe's shared lock would stay held on an
/// idle pool connection, and every acquire of that row would find it busy). `SYSDATE`
/// (the lease acquire's clock once the row is locked) reads UTC, as `UTC_TIMESTAMP`;
/// the tables hold `DATETIME`s, which no time zone converts.
const SESSION_SETUP: &str = "SET SESSION autocommit = 1; \
     SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; SET SESSION time_zone = '+00:00'";

/// Deadlock (1213) and lock wait timeout (1205): retried a few times.
const RETRYABLE: [u16; 2] = [1213, 1205];

/// NOWAIT could not lock: MariaDB reports 1205, MySQL 8 reports 3572.
const NOWAIT_BUSY: [u16; 2] = [1205, 3572];

/// Whether `e` is a server error whose number is one of `numbers`.
fn has_number(e: &sqlx::Error, numbers: &[u16]) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|m| numbers.contains(&m.number())),
        _ => false,
    }
}

/// Run one statement, retrying InnoDB's deadlock / lock-wait errors a few times.
async fn retrying<T, F, Fut>(timeout: Duration, mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
{
    let mut tries = 0;
    loop {
        let answer = tokio::time::timeout(timeout, op()).await;
        if let Some(v) = settle(answer, &mut tries, timeout).await? {
            return Ok(v);
        }
    }
}

/// One try of [`retrying`]'s loop (and of `Mysql::own_execute`'s): the answer,
/// `None` after a deadlock or lock wait timeout worth another try (slept already), or
/// the error.
async fn settle<T>(
    answer: std::result::Result<std::result::Result<T, sqlx::Error>, tokio::time::error::Elapsed>,
    tries: &mut u32,
    timeout: Duration,
) -> Result<Option<T>> {
    match answer {
        Ok(Ok(v)) => Ok(Some(v)),
        Ok(Err(e)) if *tries < 5 && has_number(&e, &RETRYABLE) => {
            *tries += 1;
            tracing::debug!(error = %e, "mysql: retrying after a deadlock or lock wait timeout");
            tokio::time::sleep(Duration::from_micros(fastrand::u64(100..2000))).await;
            Ok(None)
        }
        Ok(Err(e)) => Err(db_err(BACKEND, &e)),
        Err(_) => Err(no_answer(BACKEND, timeout)),
    }
}

/// Connect and create the tables if missing — what [`crate::Locker::connect`] does for
/// a `mysql://` or `mariadb://` URL.
///
/// # Errors
/// [`crate::Error::InvalidUrl`] for a bad URL or option; connection errors; a
/// permission error when the tables are missing and the user may not create them.
///
/// # Cancel safety
/// Cancel safe: nothing is held until it returns (a table creation that already ran
/// stays, which is harmless).
pub async fn open(mut url: ConnectUrl) -> Result<Arc<dyn Backend>> {
    let opts = SqlOptions::take(
        &mut url,
        &[("named", Mode::Named), ("row", Mode::Row)],
        Duration::from_millis(10),
    )?;
    let ssl_mode = url.take_param("ssl_mode");
    let mut accepted = COMMON_OPTIONS.to_vec();
    accepted.push("ssl_mode");
    url.finish(&accepted)?;
    let [host] = url.hosts() else {
        return Err(url.invalid("MySQL takes exactly one host"));
    };
    let Some(database) = opts.database.clone() else {
        return Err(url.invalid("name the database in the path: mysql://host/DATABASE"));
    };
    let mut connect = MySqlConnectOptions::new()
        .host(&host.host)
        .port(host.port.unwrap_or(3306))
        .username(url.username().unwrap_or("root"))
        .database(&database);
    if let Some(p) = url.password() {
        connect = connect.password(p.expose());
    }
    if let Some(mode) = ssl_mode {
        let m = MySqlSslMode::from_str(&mode).map_err(|_| {
            url.invalid(&format!(
                "ssl_mode={mode:?} is not one of disabled, preferred, required, verify_ca, verify_identity"
            ))
        })?;
        connect = connect.ssl_mode(m);
    }
    if let Some(ca) = &opts.ssl_ca {
        connect = connect.ssl_ca(ca);
    }
    // One direct connection first: a refused or unreachable server is said at once
    // (the pool would retry until its timeout and only say that it timed out).
    let mut probe = timed(
        BACKEND,
        opts.timeout,
        MySqlConnection::connect_with(&connect),
    )
    .await?;
    // The server's idle limit for connections like the lease statements' own: they
    // are dropped well before it (at most 5 min idle).
    // And which server it is (one round trip on the connection already open).
    // And its lock wait limit, which the attempts' connections only ever lower.
    let (server_wait, version, server_lock_wait) = timed(
        BACKEND,
        opts.timeout,
        sqlx::query_as::<_, (i64, String, i64)>(
            "SELECT CAST(@@wait_timeout AS SIGNED), VERSION(), \
             CAST(@@innodb_lock_wait_timeout AS SIGNED)",
        )
        .fetch_one(&mut probe),
    )
    .await?;
    // Half of it in ms, never zero (an idle timeout of zero would make the pool's
    // sweep spin).
    let own_idle = Duration::from_millis(server_wait.unsigned_abs().saturating_mul(500).max(1))
        .min(Duration::from_secs(300));
    let _ = probe.close().await;
    let pool = super::pool_options::<sqlx::MySql>(opts.pool, own_idle, opts.timeout)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(sqlx::raw_sql(SESSION_SETUP)).await?;
                Ok(())
            })
        })
        .connect_lazy_with(connect.clone());
    let mut sql = Statements::new(
        &opts.prefix,
        opts.lock_delay,
        super::grant_budget(opts.timeout),
    );
    if version.contains("MariaDB") {
        // The release clears the record on the pinned connection, whose lock waits give
        // up at once on MariaDB: a record write in flight (a failed attempt's) may hold
        // the record's lock for an instant.
        sql.row_release = format!(
            "SET STATEMENT innodb_lock_wait_timeout = 5 FOR {}",
            sql.row_release
        );
    } else {
        // MySQL 8 has no NOWAIT on `LOCK IN SHARE MODE`.
        sql.row_probe = sql
            .row_probe
            .replace("LOCK IN SHARE MODE NOWAIT", "FOR SHARE NOWAIT");
    }
    timed(BACKEND, opts.timeout, create_schema(&pool, &sql)).await?;
    let durable: bool = timed(
        BACKEND,
        opts.timeout,
        sqlx::query_scalar::<_, i64>("SELECT @@innodb_flush_log_at_trx_commit = 1")
            .fetch_one(&pool),
    )
    .await?
        == 1;
    let wait_timeout = wait_timeout(opts.heartbeat);
    let (shared_setup, shared_idle) = shared_setup(
        opts.timeout,
        version.contains("MariaDB"),
        server_lock_wait.unsigned_abs(),
    );
    let dialect = Mysql {
        pool,
        // At least 2: renewal batches take at most half (`sql::renewer::in_flight`).
        own: OwnConns::new(opts.pool.max(2), own_idle),
        shared_own: OwnConns::new(opts.pool.max(2), own_idle.min(shared_idle)),
        shared_setup,
        connect,
        sql,
        timeout: opts.timeout,
        wait_timeout,
        mariadb: version.contains("MariaDB"),
    };
    Ok(Arc::new(SqlBackend::new(
        dialect,
        opts,
        Arc::new(WakeOne::default()),
        durable,
        Duration::from_secs(wait_timeout / 2),
    )))
}

/// MySQL's and MariaDB's statements and errors.
struct Mysql {
    pool: MySqlPool,
    /// The lease and row-token statements' connections (see `own_conns`), set up as
    /// the pool's.
    own: OwnConns<MySqlConnection>,
    /// The connections of semaphore and read-write lock attempts, set up alike: a
    /// crowd waiting for one name's gate must not take every place the lease
    /// statements and the renewals need.
    shared_own: OwnConns<MySqlConnection>,
    /// How `shared_own`'s connections are set up ([`shared_setup`]).
    shared_setup: String,
    connect: MySqlConnectOptions,
    sql: Statements,
    timeout: Duration,
    /// `wait_timeout` of pinned connections, in seconds.
    wait_timeout: u64,
    /// The server is MariaDB (its idle-transaction limits exist).
    mariadb: bool,
}

impl std::fmt::Debug for Mysql {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the connect options: they hold the password.
        f.debug_struct("Mysql").finish_non_exhaustive()
    }
}

/// `wait_timeout` of pinned connections, in seconds: five heartbeats, at least 5 s.
fn wait_timeout(heartbeat: Duration) -> u64 {
    (heartbeat.as_secs() * 5).max(5)
}

/// The setup of the semaphore and read-write lock attempts' connections, and how
/// long one of them may stay idle in the client's set: the limits the module
/// documentation states, `lock_wait` being the server's own lock wait limit.
fn shared_setup(timeout: Duration, mariadb: bool, lock_wait: u64) -> (String, Duration) {
    // Whole seconds, at least 1 and at most what `wait_timeout` takes (a year).
    let twice = timeout.saturating_mul(2);
    let limit = twice
        .as_secs()
        .saturating_add(u64::from(twice.subsec_nanos() > 0))
        .clamp(1, 31_536_000);
    let lock_wait = limit.min(lock_wait.max(1));
    let (idle, drop_after) = if mariadb {
        // The write and read-only limits, when set, take precedence.
        (
            format!(
                "idle_transaction_timeout = {limit}, idle_write_transaction_timeout = {limit}, \
                 idle_readonly_transaction_timeout = {limit}"
            ),
            Duration::MAX,
        )
    } else {
        (
            format!("wait_timeout = {limit}"),
            Duration::from_millis(limit * 500),
        )
    };
    (
        format!("{SESSION_SETUP}; SET SESSION {idle}, innodb_lock_wait_timeout = {lock_wait}"),
        drop_after,
    )
}

impl Mysql {
    /// A connection for one lease or row-token statement: put it back after a
    /// statement that succeeded (`self.own.put`), drop it otherwise.
    async fn own_conn(&self) -> Result<OwnConn<MySqlConnection>> {
        self.conn_from(&self.own, SESSION_SETUP).await
    }

    /// A connection of `set` (the lease statements' or the shared ones'), made as
    /// the pool's, then set up by `setup`, when none is idle.
    async fn conn_from(
        &self,
        set: &OwnConns<MySqlConnection>,
        setup: &str,
    ) -> Result<OwnConn<MySqlConnection>> {
        set.get(BACKEND, self.timeout, || async {
            // The pool's settings, not a session connection's (whose lock waits
            // give up at once: a lease statement may wait for another's row).
            let mut conn = timed(
                BACKEND,
                self.timeout,
                MySqlConnection::connect_with(&self.connect),
            )
            .await?;
            timed(
                BACKEND,
                self.timeout,
                conn.execute(sqlx::raw_sql(AssertSqlSafe(setup.to_owned()))),
            )
            .await?;
            Ok(conn)
        })
        .await
    }

    /// Run the statement `build` makes on a connection of the backend's own, as
    /// [`retrying`] does on the pool: each try under the timeout, deadlocks and lock
    /// wait timeouts tried again (the statement rolled back, the connection is clean).
    /// A timeout is never tried again: the statement may still run on the server.
    async fn own_execute<'q>(
        &self,
        build: impl Fn() -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<sqlx::mysql::MySqlQueryResult> {
        let mut c = self.own_conn().await?;
        let done = Self::execute_on(&mut c, self.timeout, build).await?;
        self.own.put(c);
        Ok(done)
    }

    /// [`Mysql::own_execute`] on the connection `c` (given back by the caller, after a
    /// success only).
    async fn execute_on<'q>(
        c: &mut OwnConn<MySqlConnection>,
        timeout: Duration,
        build: impl Fn() -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<sqlx::mysql::MySqlQueryResult> {
        let mut tries = 0;
        loop {
            let answer = tokio::time::timeout(timeout, build().execute(&mut c.conn)).await;
            if let Some(done) = settle(answer, &mut tries, timeout).await? {
                return Ok(done);
            }
        }
    }

    /// Whether the semaphore and read-write lock tables exist (made on first use).
    async fn shared_tables(&self) -> Result<bool> {
        let present = timed(
            BACKEND,
            self.timeout,
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(&*self.sql.shared.tables))
                .fetch_one(&self.pool),
        )
        .await?;
        Ok(present == 2)
    }
}

/// The arguments of a statement over `holds` padded to `size` (see
/// `statements::held_among`): the ttl first when given, the keys, then each hold's key,
/// owner and token. Padding repeats the last hold, which changes nothing: a row is
/// found once however often the list names it.
fn held_args(
    holds: &[Arc<Hold>],
    size: usize,
    ttl: Option<Duration>,
) -> std::result::Result<MySqlArguments, sqlx::error::BoxDynError> {
    let mut args = MySqlArguments::default();
    let Some(last) = holds.last() else {
        return Ok(args);
    };
    let hold = |i: usize| holds.get(i).unwrap_or(last);
    if let Some(ttl) = ttl {
        args.add(micros(ttl))?;
    }
    for i in 0..size {
        args.add(&hold(i).key[..])?;
    }
    for i in 0..size {
        let h = hold(i);
        args.add(&h.key[..])?;
        args.add(h.owner.as_str().as_bytes())?;
        args.add(h.fence)?;
    }
    Ok(args)
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// A token read back (a counter is never negative).
fn fence_u64(fence: i64) -> u64 {
    u64::try_from(fence).unwrap_or(0)
}

impl super::session::SessionConn for MySqlConnection {
    fn ping(&mut self) -> impl Future<Output = std::result::Result<(), sqlx::Error>> + Send + '_ {
        sqlx::Connection::ping(self)
    }
}

#[async_trait]
impl Dialect for Mysql {
    type Conn = MySqlConnection;
    /// The `GET_LOCK` name: 64 hex digits of the name's key.
    type SessionKey = String;
    const BACKEND: &'static str = BACKEND;
    const PRODUCT: &'static str = "MySQL";
    const SESSION: &'static str = "connection";
    const NATIVE_WAIT: bool = false;
    const POLL_JITTER: bool = true;
    const ROW_FORGET: bool = true;

    fn session_silence(&self) -> Duration {
        Duration::from_secs(self.wait_timeout)
    }

    async fn lease_acquire(&self, req: &AcquireRequest, key: &[u8; 32]) -> Result<LeaseAnswer> {
        let (ttl_us, meta) = (micros(req.ttl), metadata_json(&req.metadata));
        let (name, owner) = (req.name.as_str(), req.owner.as_str().as_bytes());
        let (n, o, m) = (name.len(), owner.len(), meta.len());
        let lens = [key.len(), n, o, 8, m, o, o, o, m, o, o, 8];
        let done = self
            .own_execute(|| {
                sqlx::query_with(
                    AssertSqlSafe(&*self.sql.acquire),
                    reserved::<MySqlArguments>(&lens),
                )
                .bind(&key[..])
                .bind(name)
                .bind(owner)
                .bind(ttl_us)
                .bind(&meta)
                .bind(owner)
                .bind(owner)
                .bind(owner)
                .bind(&meta)
                .bind(owner)
                .bind(owner)
                .bind(ttl_us)
            })
            .await?;
        Ok(match done.last_insert_id() {
            0 => LeaseAnswer::Busy,
            fence => LeaseAnswer::Granted(fence),
        })
    }

    async fn lease_renew(&self, hold: &Hold, ttl: Duration) -> Result<bool> {
        let lens = [8, hold.key.len(), hold.owner.as_str().len(), 8];
        let done = self
            .own_execute(|| {
                sqlx::query_with(
                    AssertSqlSafe(&*self.sql.renew),
                    reserved::<MySqlArguments>(&lens),
                )
                .bind(micros(ttl))
                .bind(&hold.key[..])
                .bind(hold.owner.as_str().as_bytes())
                .bind(hold.fence)
            })
            .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn lease_renew_many(&self, holds: &[Arc<Hold>], ttl: Duration) -> Result<Vec<bool>> {
        if holds.len() < 2 {
            let mut flags = Vec::with_capacity(holds.len());
            for h in holds {
                flags.push(self.lease_renew(h, ttl).await?);
            }
            return Ok(flags);
        }
        let (Some((size, renew)), Some((_, held))) = (
            self.sql.renew_many.iter().find(|(n, _)| *n >= holds.len()),
            self.sql
                .held_of_many
                .iter()
                .find(|(n, _)| *n >= holds.len()),
        ) else {
            return Err(crate::Error::backend(
                BACKEND,
                "renewal batch larger than the largest statement",
            ));
        };
        let bad = |e| crate::Error::backend(BACKEND, format!("renewal arguments: {e}"));
        let renew_args = held_args(holds, *size, Some(ttl)).map_err(bad)?;
        let mut c = self.own_conn().await?;
        let done = Self::execute_on(&mut c, self.timeout, || {
            sqlx::query_with(AssertSqlSafe(renew.as_str()), renew_args.clone())
        })
        .await?;
        if done.rows_affected() == super::renewer::distinct(holds) as u64 {
            self.own.put(c);
            return Ok(vec![true; holds.len()]);
        }
        // One or more are no longer held: read which still are (one held now was
        // renewed by the statement above), on the statement's connection (a plain
        // read takes no lock: nothing to retry).
        let held_args = held_args(holds, *size, None).map_err(bad)?;
        let rows: Vec<(Vec<u8>, i64)> = timed(
            BACKEND,
            self.timeout,
            sqlx::query_as_with(AssertSqlSafe(held.as_str()), held_args).fetch_all(&mut c.conn),
        )
        .await?;
        self.own.put(c);
        Ok(holds
            .iter()
            .map(|h| {
                rows.iter()
                    .any(|(k, f)| k[..] == h.key[..] && u64::try_from(*f) == Ok(h.fence))
            })
            .collect())
    }

    async fn lease_break(&self, key: &[u8; 32], fence: u64) -> Result<bool> {
        let done = retrying(self.timeout, || {
            sqlx::query(AssertSqlSafe(&*self.sql.break_lease))
                .bind(&key[..])
                .bind(fence)
                .execute(&self.pool)
        })
        .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn lease_release(&self, hold: &Hold) -> Result<LeaseReleased> {
        let lens = [hold.key.len(), hold.owner.as_str().len(), 8];
        // Sent again only after a deadlock or a lock wait timeout, which roll the
        // statement back: its answer is the one send's.
        let done = self
            .own_execute(|| {
                sqlx::query_with(
                    AssertSqlSafe(&*self.sql.release),
                    reserved::<MySqlArguments>(&lens),
                )
                .bind(&hold.key[..])
                .bind(hold.owner.as_str().as_bytes())
                .bind(hold.fence)
            })
            .await?;
        // No notifications between processes, nor a count of the holds left: this
        // process's waiters are woken either way. (The matched row always changes:
        // `holds` goes down.)
        Ok(if done.rows_affected() > 0 {
            LeaseReleased::Free
        } else {
            LeaseReleased::NotHeld
        })
    }

    async fn connect_session(&self) -> Result<MySqlConnection> {
        let mut conn = timed(
            BACKEND,
            self.timeout,
            MySqlConnection::connect_with(&self.connect),
        )
        .await?;
        // MariaDB's idle-transaction limits, which a server may set lower, would end a
        // row-mode session (its transaction idles while the lock is held) before the
        // holder counts it lost (`session_silence`): no lower than `wait_timeout`.
        // (They exist from MariaDB 10.3; an older server has only `wait_timeout`.)
        let w = self.wait_timeout;
        let idle = format!(
            "SET SESSION wait_timeout = {w}, idle_transaction_timeout = {w}, \
             idle_write_transaction_timeout = {w}, idle_readonly_transaction_timeout = {w}"
        );
        let set = format!("SET SESSION wait_timeout = {w}");
        timed(BACKEND, self.timeout, async {
            if !self.mariadb || conn.execute(AssertSqlSafe(idle)).await.is_err() {
                conn.execute(AssertSqlSafe(set)).await?;
            }
            // Row mode creates a lock's row on this connection: a lock wait there means
            // the row is held, so it must not last (NOWAIT reads never wait anyway).
            // MariaDB takes 0 (do not wait); MySQL's least is 1 s.
            if conn
                .execute("SET SESSION innodb_lock_wait_timeout = 0")
                .await
                .is_err()
            {
                conn.execute("SET SESSION innodb_lock_wait_timeout = 1")
                    .await?;
            }
            conn.execute(sqlx::raw_sql(SESSION_SETUP)).await
        })
        .await?;
        Ok(conn)
    }

    fn session_key(&self, _name: &LockName, key: &[u8; 32]) -> Result<String> {
        Ok(hex(key))
    }

    async fn session_lock(
        &self,
        conn: &mut MySqlConnection,
        req: &AcquireRequest,
        key: &[u8; 32],
        server_name: &String,
    ) -> Result<Option<u64>> {
        let meta = metadata_json(&req.metadata);
        let (name, owner) = (req.name.as_str(), req.owner.as_str().as_bytes());
        let (n, o, m) = (name.len(), owner.len(), meta.len());
        let lens = [key.len(), n, o, m, server_name.len(), n, o, m];
        let done = sqlx::query_with(
            AssertSqlSafe(&*self.sql.named_acquire),
            reserved::<MySqlArguments>(&lens),
        )
        .bind(&key[..])
        .bind(name)
        .bind(owner)
        .bind(&meta)
        .bind(server_name)
        .bind(name)
        .bind(owner)
        .bind(&meta)
        .execute(conn)
        .await
        .map_err(|e| db_err(BACKEND, &e))?;
        Ok(match done.last_insert_id() {
            0 => None,
            fence => Some(fence),
        })
    }

    async fn session_unlock(
        &self,
        conn: &mut MySqlConnection,
        server_name: &String,
        _hold: &Hold,
    ) -> std::result::Result<(), sqlx::Error> {
        sqlx::query_with(
            "SELECT RELEASE_LOCK(?)",
            reserved::<MySqlArguments>(&[server_name.len()]),
        )
        .bind(server_name)
        .execute(conn)
        .await
        .map(drop)
    }

    async fn row_lock(&self, conn: &mut MySqlConnection, key: &[u8; 32]) -> Result<RowLock> {
        // The transaction and the locking read in one round trip.
        let locked = sqlx::raw_sql(AssertSqlSafe(self.sql.row_lock_batch(key)))
            .fetch_optional(&mut *conn)
            .await;
        let found = match locked {
            Ok(Some(row)) => {
                let id: u64 = row.get(0);
                return Ok(RowLock::Locked {
                    session: i64::try_from(id).unwrap_or(i64::MAX),
                    xact: None,
                });
            }
            Ok(None) => RowLock::Missing,
            Err(e) if has_number(&e, &NOWAIT_BUSY) => RowLock::Busy,
            Err(e) => return Err(db_err(BACKEND, &e)),
        };
        conn.execute("ROLLBACK")
            .await
            .map_err(|e| db_err(BACKEND, &e))?;
        Ok(found)
    }

    async fn row_ensure(&self, conn: &mut MySqlConnection, key: &[u8; 32]) -> Result<()> {
        // On the pinned connection, whose lock waits give up at once (1 s on MySQL):
        // INSERT IGNORE waits for the lock on a row another session has just created
        // and locked — for that holder's whole hold (seen: statement timeouts under
        // contention on fresh names). A lock wait (or deadlock) means the row exists:
        // the locking read is tried again.
        let created = tokio::time::timeout(
            self.timeout,
            sqlx::query(AssertSqlSafe(&*self.sql.row_ensure))
                .bind(&key[..])
                .execute(conn),
        )
        .await;
        match created {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) if has_number(&e, &RETRYABLE) => Ok(()),
            Ok(Err(e)) => Err(db_err(BACKEND, &e)),
            Err(_) => Err(no_answer(BACKEND, self.timeout)),
        }
    }

    async fn row_holder(
        &self,
        req: &AcquireRequest,
        key: &[u8; 32],
        session: i64,
        _xact: Option<i64>,
    ) -> Result<u64> {
        let meta = metadata_json(&req.metadata);
        let (name, owner) = (req.name.as_str(), req.owner.as_str().as_bytes());
        let conn_id = u64::try_from(session).unwrap_or(0);
        // On a connection of the backend's own: sqlx's pool would test the connection
        // it gets back with one more round trip, every cycle.
        let done = self
            .own_execute(|| {
                let (n, o, m) = (name.len(), owner.len(), meta.len());
                sqlx::query_with(
                    AssertSqlSafe(&*self.sql.row_holder),
                    reserved::<MySqlArguments>(&[key.len(), n, o, m, 8, n, o, m, 8]),
                )
                .bind(&key[..])
                .bind(name)
                .bind(owner)
                .bind(&meta)
                .bind(conn_id)
                .bind(name)
                .bind(owner)
                .bind(&meta)
                .bind(conn_id)
            })
            .await?;
        Ok(done.last_insert_id())
    }

    async fn row_forget(&self, key: &[u8; 32], session: i64, owner: &Owner) {
        // By the session's id, which no other session of this server run has, and the
        // owner.
        let Ok(conn_id) = u64::try_from(session) else {
            return;
        };
        let forget = sqlx::query(AssertSqlSafe(&*self.sql.row_forget))
            .bind(&key[..])
            .bind(conn_id)
            .bind(owner.as_str().as_bytes())
            .execute(&self.pool);
        let _ = tokio::time::timeout(self.timeout, forget).await;
    }

    async fn row_unlock(
        &self,
        conn: &mut MySqlConnection,
        hold: &Hold,
    ) -> std::result::Result<(), sqlx::Error> {
        // The record stops naming this connection before the commit unlocks the row,
        // in one round trip: `inspect` never sees the row held by a new holder while
        // the record still names this one.
        let batch = self.sql.row_release_batch(&hold.key, hold.fence);
        conn.execute(sqlx::raw_sql(AssertSqlSafe(batch)))
            .await
            .map(drop)
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
                .bind(prefix)
                .bind(u64::try_from(limit).unwrap_or(u64::MAX))
                .fetch_all(&self.pool),
        )
        .await
    }

    type SharedTx = OwnConn<MySqlConnection>;

    async fn shared_schema(&self) -> Result<()> {
        let sql = &self.sql.shared;
        let create = async {
            let present: i64 = sqlx::query_scalar(AssertSqlSafe(&*sql.tables))
                .fetch_one(&self.pool)
                .await?;
            if present < 2 {
                // CREATE TABLE IF NOT EXISTS is safe to race on MySQL.
                for table in &sql.schema {
                    self.pool.execute(AssertSqlSafe(&**table)).await?;
                }
            }
            Ok(())
        };
        timed(BACKEND, self.timeout, create).await
    }

    async fn shared_begin(&self, at: &SharedKey) -> Result<(Self::SharedTx, u64, Vec<SharedRow>)> {
        let batch = fill_in(&self.sql.shared.begin, at);
        // A deadlock (the first gate rows of a name racing) rolls the transaction back
        // and a lock wait timeout leaves it open: either way it is rolled back and
        // begun again.
        // The tries and the rollbacks between them within one timeout: a server whose
        // own lock wait limit is shorter answers 1205 early.
        let mut tries = 0;
        let mut c = self.conn_from(&self.shared_own, &self.shared_setup).await?;
        let start = tokio::time::Instant::now();
        let deadline = start.checked_add(self.timeout).unwrap_or(start);
        let (fence, rows) = loop {
            let answer = tokio::time::timeout_at(deadline, async {
                // Each statement's result, then the live rows: the gate's (the second)
                // carries the token.
                let mut results = 0;
                let (mut fence, mut rows) = (0, Vec::new());
                let mut answers =
                    sqlx::raw_sql(AssertSqlSafe(batch.clone())).fetch_many(&mut c.conn);
                while let Some(answer) = answers.try_next().await? {
                    match answer {
                        sqlx::Either::Left(done) => {
                            results += 1;
                            if results == 2 {
                                fence = done.last_insert_id();
                            }
                        }
                        sqlx::Either::Right(row) => rows.push(row),
                    }
                }
                Ok::<_, sqlx::Error>((fence, rows))
            })
            .await;
            if let Some(answer) = settle(answer, &mut tries, self.timeout).await? {
                break answer;
            }
            timed(
                BACKEND,
                deadline.saturating_duration_since(tokio::time::Instant::now()),
                c.conn.execute(sqlx::raw_sql("ROLLBACK")),
            )
            .await?;
        };
        if fence == 0 {
            return Err(Error::backend(BACKEND, "the gate's token was not returned"));
        }
        let live = rows
            .into_iter()
            .map(|r| {
                let owner: Vec<u8> = r.try_get(1)?;
                Ok(SharedRow {
                    kind: r.try_get(0)?,
                    owner: String::from_utf8_lossy(&owner).into_owned(),
                    acquisition: r.try_get(2)?,
                    remaining_ms: r.try_get(3)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| db_err(BACKEND, &e))?;
        Ok((c, fence, live))
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
                .bind(req.owner.as_str().as_bytes())
                .bind(kind.as_str())
                .bind(fence)
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
        let done = self
            .own_execute(|| {
                sqlx::query(AssertSqlSafe(&*self.sql.shared.renew))
                    .bind(micros(ttl))
                    .bind(&at.key[..])
                    .bind(at.family)
                    .bind(at.acquisition)
                    .bind(fence)
            })
            .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn shared_remove(&self, at: &SharedKey, what: SharedRemove) -> Result<bool> {
        let (selector, fence) = what.parts();
        let done = self
            .own_execute(|| {
                sqlx::query(AssertSqlSafe(&*self.sql.shared.remove))
                    .bind(&at.key[..])
                    .bind(at.family)
                    .bind(at.acquisition)
                    .bind(selector)
                    .bind(selector)
                    .bind(selector)
                    .bind(fence)
            })
            .await?;
        Ok(done.rows_affected() > 0)
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
            sqlx::query_as::<_, (String, Vec<u8>, i64, i64, String)>(AssertSqlSafe(
                &*self.sql.shared.holders,
            ))
            .bind(&at.key[..])
            .bind(at.family)
            .fetch_all(&self.pool),
        )
        .await?;
        Ok(rows
            .into_iter()
            .map(|(k, o, f, left, m)| {
                let owner = String::from_utf8_lossy(&o).into_owned();
                (k, owner, u64::try_from(f).unwrap_or(0), left, m)
            })
            .collect())
    }

    async fn inspect(
        &self,
        mode: Mode,
        _name: &LockName,
        key: &[u8; 32],
    ) -> Result<Option<HolderRow>> {
        let owner_of = |r: &sqlx::mysql::MySqlRow| {
            String::from_utf8_lossy(&r.get::<Vec<u8>, _>(1)).into_owned()
        };
        let query = match mode {
            Mode::Lease => {
                let row = timed(
                    BACKEND,
                    self.timeout,
                    sqlx::query(AssertSqlSafe(&*self.sql.inspect_lease))
                        .bind(&key[..])
                        .fetch_optional(&self.pool),
                )
                .await?;
                return Ok(row.map(|r| HolderRow {
                    owner: owner_of(&r),
                    holds: u32::try_from(r.get::<i32, _>(2)).unwrap_or(0),
                    fence: fence_u64(r.get(3)),
                    metadata: r.get(4),
                    remaining: Some(Duration::from_micros(
                        u64::try_from(r.get::<i64, _>(5)).unwrap_or(0),
                    )),
                    session: 0,
                }));
            }
            Mode::Named => sqlx::query(AssertSqlSafe(&*self.sql.inspect_named))
                .bind(hex(key))
                .bind(&key[..]),
            _ => {
                // For an instant this shares the row's lock: an acquire at that very
                // moment finds it busy and waits its poll (a `try_lock`: busy).
                let probe = tokio::time::timeout(
                    self.timeout,
                    sqlx::query(AssertSqlSafe(&*self.sql.row_probe))
                        .bind(&key[..])
                        .fetch_optional(&self.pool),
                )
                .await;
                match probe {
                    Ok(Ok(_)) => return Ok(None),
                    Ok(Err(e)) if has_number(&e, &NOWAIT_BUSY) => {}
                    Ok(Err(e)) => return Err(db_err(BACKEND, &e)),
                    Err(_) => return Err(no_answer(BACKEND, self.timeout)),
                }
                sqlx::query(AssertSqlSafe(&*self.sql.inspect_row)).bind(&key[..])
            }
        };
        let row = timed(BACKEND, self.timeout, query.fetch_optional(&self.pool)).await?;
        Ok(row.map(|r| HolderRow {
            owner: owner_of(&r),
            holds: 1,
            fence: fence_u64(r.get(2)),
            metadata: r.get(3),
            remaining: None,
            session: i64::try_from(r.try_get::<u64, _>(4).unwrap_or(0)).unwrap_or(i64::MAX),
        }))
    }
}

/// Create the tables unless they exist (`CREATE TABLE IF NOT EXISTS` is safe to race
/// on MySQL). Looks first, so a user without CREATE works once they exist.
async fn create_schema(pool: &MySqlPool, sql: &Statements) -> std::result::Result<(), sqlx::Error> {
    let present: i64 = sqlx::query_scalar(AssertSqlSafe(&*sql.tables))
        .fetch_one(pool)
        .await?;
    if present == 3 {
        return Ok(());
    }
    for table in &sql.schema {
        pool.execute(AssertSqlSafe(&**table)).await?;
    }
    Ok(())
}

/// Capabilities in the default mode (lease) on a server that flushes every commit
/// (`durable`), or not.
pub(crate) fn capabilities_with(durable: bool) -> Capabilities {
    super::capabilities(
        Mode::Lease,
        Mysql::NATIVE_WAIT,
        durable,
        Duration::from_secs(1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The attempts' limits: twice the timeout rounded up to whole seconds (at least
    /// 1, at most a year), the lock wait never above the server's (at least 1 s), and
    /// on MySQL idle connections dropped after half the limit.
    #[test]
    fn attempts_limits() {
        let ms = Duration::from_millis;
        for (timeout, mariadb, server_wait, limit, lock_wait, drop_after) in [
            (ms(300), true, 50, 1, 1, Duration::MAX),
            (ms(1200), true, 50, 3, 3, Duration::MAX),
            (ms(5000), false, 50, 10, 10, ms(5000)),
            (ms(5000), false, 4, 10, 4, ms(5000)),
            (ms(5000), true, 0, 10, 1, Duration::MAX),
            (
                Duration::from_secs(1_000_000_000),
                false,
                50,
                31_536_000,
                50,
                ms(15_768_000_000),
            ),
        ] {
            let (setup, dropped) = shared_setup(timeout, mariadb, server_wait);
            let idle = if mariadb {
                format!(
                    "idle_transaction_timeout = {limit}, idle_write_transaction_timeout = {limit}, \
                     idle_readonly_transaction_timeout = {limit}"
                )
            } else {
                format!("wait_timeout = {limit}")
            };
            assert!(
                setup.ends_with(&format!(
                    "SET SESSION {idle}, innodb_lock_wait_timeout = {lock_wait}"
                )),
                "{timeout:?} {mariadb} {server_wait}: {setup}"
            );
            assert!(setup.starts_with(SESSION_SETUP), "{setup}");
            assert_eq!(dropped, drop_after, "{timeout:?}");
        }
    }
}
