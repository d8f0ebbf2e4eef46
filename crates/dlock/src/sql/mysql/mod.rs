//! `mysql://user[:password]@host[:port]/database` and `mariadb://…`: MySQL and MariaDB.
//!
//! # Modes
//! - `mode=lease` (default): a lease row per name in `<prefix>_locks`; expiry by the
//!   server's clock (`UTC_TIMESTAMP(6)`); the row is the name's fencing counter
//!   (`LAST_INSERT_ID(fence + 1)`). One autocommitted single-row statement per acquire,
//!   renew and release (see [`statements`](self) for why that cannot deadlock). Reentrant
//!   for the same owner.
//! - `mode=named`: `GET_LOCK(name, 0)` on a pinned connection. The server-side name is
//!   the 64 hex digits of SHA-256 of the dlock name: it fits MySQL's 64-character limit
//!   (MariaDB allows 192) and no server's case folding or trailing-space rules can
//!   merge two names.
//! - `mode=row`: `SELECT … FOR UPDATE NOWAIT` on the name's row in `<prefix>_rows`, in a
//!   transaction held open on a pinned connection (MySQL 8 / MariaDB 10.3 or later).
//!
//! Session modes record the holder in `<prefix>_holders` (token counter, owner,
//! metadata, connection id) for `inspect`; `inspect` in row mode reads
//! `information_schema.INNODB_TRX`, which needs the PROCESS privilege. Pinned connections
//! set `wait_timeout` to 5 heartbeats (at least 5 s) so the server drops a cut-off
//! holder's session; the heartbeat (`heartbeat`, default 1 s) makes the holder declare
//! the loss first.
//!
//! # Waiting
//! MySQL has no notifications: waiters poll every `poll` (default 10 ms, jittered 50–100 %);
//! a release in this process wakes this process's waiters at once.
//!
//! # Options
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `mode` | `lease` | how the lock is held (above) |
//! | `table_prefix` | `dlock` | prefix of dlock's tables (a plain identifier) |
//! | `lock_delay` | none | lease mode: a lease that ran out without a release keeps the lock from other owners this much longer (at most 1 h) |
//! | `poll` | `10ms` (jittered) | waiting: re-poll interval |
//! | `timeout` | `5s` | connecting, and per statement |
//! | `heartbeat` | `1s` | session modes: ping interval of the pinned connection (a failed ping fires `lost()`) |
//! | `pool` | `10` | connections for lease statements |
//! | `sessions` | `100` | idle pinned connections kept for session modes |
//! | `ssl_mode` | `preferred` | `disabled`, `preferred`, `required`, `verify_ca`, `verify_identity` |
//! | `ssl_ca` | none | PEM file of the CA that signs the server |
//!
//! `inspect` asks the server what the acquire asks (`IS_USED_LOCK`): a named lock held
//! outside dlock is reported held, with no token (0). Least privilege (tested): once the
//! tables exist, `SELECT, INSERT, UPDATE` on them are enough (row-mode `inspect` also
//! needs `PROCESS`). Not yet: fair (FIFO) mode, waiting by notification.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::mysql::{
    MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlPoolOptions, MySqlSslMode,
};
use sqlx::{AssertSqlSafe, Connection, Executor, Row};
use tokio_util::sync::CancellationToken;

use super::{
    COMMON_OPTIONS, IdleConns, Mode, Pinned, Session, SqlOptions, SqlWaiter, db_err, hex, lock_key,
    metadata_from, metadata_json, no_answer, timed,
};
use crate::backend::{AcquireRequest, Attempt, Backend, Capabilities, HeldLock, LockInfo, Waiter};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::WakeOne;
use crate::options::Owner;
use crate::url::ConnectUrl;

mod statements;
use statements::Statements;

const BACKEND: &str = "mysql";

/// Our sessions read committed data only, so InnoDB takes no gap locks.
const READ_COMMITTED: &str = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

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

/// The MySQL/MariaDB backend.
pub struct MysqlBackend {
    pool: MySqlPool,
    connect: MySqlConnectOptions,
    opts: SqlOptions,
    sql: Arc<Statements>,
    hub: Arc<WakeOne<[u8; 32]>>,
    idle: Arc<IdleConns<MySqlConnection>>,
    durable: bool,
}

impl std::fmt::Debug for MysqlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the connect options: they hold the password.
        f.debug_struct("MysqlBackend")
            .field("mode", &self.opts.mode)
            .field("prefix", &self.opts.prefix)
            .finish_non_exhaustive()
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
        match tokio::time::timeout(timeout, op()).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) if tries < 5 && has_number(&e, &RETRYABLE) => {
                tries += 1;
                tracing::debug!(error = %e, "mysql: retrying after a deadlock");
                tokio::time::sleep(Duration::from_micros(fastrand::u64(100..2000))).await;
            }
            Ok(Err(e)) => return Err(db_err(BACKEND, &e)),
            Err(_) => return Err(no_answer(BACKEND, timeout)),
        }
    }
}

impl MysqlBackend {
    /// Connect and create the tables if missing.
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
            &[("named", Mode::Named), ("row", Mode::Row)],
            Duration::from_millis(10),
        )?;
        let ssl_mode = url.take_param("ssl_mode");
        let ssl_ca = url.take_param("ssl_ca");
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
        if let Some(ca) = ssl_ca {
            if !std::path::Path::new(&ca).is_file() {
                return Err(url.invalid(&format!("ssl_ca file {ca:?} not found")));
            }
            connect = connect.ssl_ca(ca);
        }
        let pool = MySqlPoolOptions::new()
            .max_connections(opts.pool)
            .acquire_timeout(opts.timeout)
            // A ping before every statement would double the round trips; a broken
            // connection shows up as a connection error on the statement instead.
            .test_before_acquire(false)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute(READ_COMMITTED).await?;
                    Ok(())
                })
            })
            .connect_lazy_with(connect.clone());
        let sql = Arc::new(Statements::new(&opts.prefix, opts.lock_delay));
        timed(BACKEND, opts.timeout, create_schema(&pool, &sql)).await?;
        let durable: bool = timed(
            BACKEND,
            opts.timeout,
            sqlx::query_scalar::<_, i64>("SELECT @@innodb_flush_log_at_trx_commit = 1")
                .fetch_one(&pool),
        )
        .await?
            == 1;
        Ok(Arc::new(MysqlBackend {
            pool,
            connect,
            idle: Arc::new(IdleConns::new(
                opts.sessions,
                Duration::from_secs(wait_timeout(opts.heartbeat) / 2),
            )),
            opts,
            sql,
            hub: Arc::new(WakeOne::default()),
            durable,
        }))
    }

    async fn session_conn(&self) -> Result<MySqlConnection> {
        if let Some(c) = self.idle.pop() {
            return Ok(c);
        }
        let mut conn = timed(
            BACKEND,
            self.opts.timeout,
            MySqlConnection::connect_with(&self.connect),
        )
        .await?;
        let set = format!(
            "SET SESSION wait_timeout = {}",
            wait_timeout(self.opts.heartbeat)
        );
        timed(BACKEND, self.opts.timeout, async {
            conn.execute(AssertSqlSafe(set)).await?;
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
            conn.execute(READ_COMMITTED).await
        })
        .await?;
        Ok(conn)
    }

    fn session(&self, conn: MySqlConnection, name: &LockName) -> Session<MySqlConnection> {
        Session {
            pinned: Pinned::new(conn, self.opts.heartbeat),
            idle: Arc::clone(&self.idle),
            hub: Arc::clone(&self.hub),
            key: lock_key(name),
            name: name.as_str().to_owned(),
            timeout: self.opts.timeout,
            backend: BACKEND,
        }
    }

    fn held_base(&self, req: &AcquireRequest, fence: u64) -> HeldBase {
        HeldBase {
            pool: self.pool.clone(),
            sql: Arc::clone(&self.sql),
            hub: Arc::clone(&self.hub),
            key: lock_key(&req.name),
            owner: req.owner.clone(),
            fence,
            timeout: self.opts.timeout,
        }
    }

    async fn acquire_lease(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = lock_key(&req.name);
        let ttl_us = i64::try_from(req.ttl.as_micros()).unwrap_or(i64::MAX);
        let meta = metadata_json(&req.metadata);
        let (name, owner) = (req.name.as_str(), req.owner.as_str().as_bytes());
        let done = retrying(self.opts.timeout, || {
            sqlx::query(AssertSqlSafe(&*self.sql.acquire))
                .bind(&key[..])
                .bind(name)
                .bind(owner)
                .bind(ttl_us)
                .bind(&meta)
                .bind(owner)
                .bind(owner)
                .bind(owner)
                .bind(owner)
                .bind(owner)
                .bind(&meta)
                .bind(owner)
                .bind(name)
                .bind(owner)
                .bind(owner)
                .bind(owner)
                .bind(ttl_us)
                .execute(&self.pool)
        })
        .await?;
        match done.last_insert_id() {
            0 => Ok(Attempt::Busy { retry_after: None }),
            fence => Ok(Attempt::Acquired(Box::new(LeaseHeld {
                base: self.held_base(req, fence),
            }))),
        }
    }

    async fn acquire_named(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = lock_key(&req.name);
        let server_name = hex(&key);
        let meta = metadata_json(&req.metadata);
        let (name, owner) = (req.name.as_str(), req.owner.as_str().as_bytes());
        let mut conn = self.session_conn().await?;
        // No timeout: a statement cut off mid-flight could leave GET_LOCK taken on a
        // connection nobody tracks. On error the connection is dropped (session ends).
        let done = sqlx::query(AssertSqlSafe(&*self.sql.named_acquire))
            .bind(&key[..])
            .bind(name)
            .bind(owner)
            .bind(&meta)
            .bind(&server_name)
            .bind(name)
            .bind(owner)
            .bind(&meta)
            .execute(&mut conn)
            .await
            .map_err(|e| db_err(BACKEND, &e))?;
        match done.last_insert_id() {
            0 => {
                self.idle.put(conn);
                Ok(Attempt::Busy { retry_after: None })
            }
            fence => Ok(Attempt::Acquired(Box::new(SessionHeld {
                base: self.held_base(req, fence),
                session: self.session(conn, &req.name),
                release: SessionRelease::Named(server_name),
            }))),
        }
    }

    async fn acquire_row(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = lock_key(&req.name);
        let meta = metadata_json(&req.metadata);
        let (name, owner) = (req.name.as_str(), req.owner.as_str().as_bytes());
        let mut conn = self.session_conn().await?;
        for _ in 0..2 {
            conn.execute("BEGIN")
                .await
                .map_err(|e| db_err(BACKEND, &e))?;
            let locked = sqlx::query(AssertSqlSafe(&*self.sql.row_lock))
                .bind(&key[..])
                .fetch_optional(&mut conn)
                .await;
            match locked {
                Ok(Some(row)) => {
                    let conn_id: u64 = row.get(0);
                    let done = retrying(self.opts.timeout, || {
                        sqlx::query(AssertSqlSafe(&*self.sql.row_holder))
                            .bind(&key[..])
                            .bind(name)
                            .bind(owner)
                            .bind(&meta)
                            .bind(conn_id)
                            .bind(name)
                            .bind(owner)
                            .bind(&meta)
                            .bind(conn_id)
                            .execute(&self.pool)
                    })
                    .await?;
                    return Ok(Attempt::Acquired(Box::new(SessionHeld {
                        base: self.held_base(req, done.last_insert_id()),
                        session: self.session(conn, &req.name),
                        release: SessionRelease::Row,
                    })));
                }
                Ok(None) => {
                    // First use of this name: create its row, then try again.
                    conn.execute("ROLLBACK")
                        .await
                        .map_err(|e| db_err(BACKEND, &e))?;
                    // On the pinned connection, whose lock waits give up at once (1 s
                    // on MySQL): INSERT IGNORE waits for the lock on a row another
                    // session has just created and locked — for that holder's whole
                    // hold (seen: statement timeouts under contention on fresh names).
                    // A lock wait (or deadlock) means the row exists: try the locking
                    // read again.
                    let created = tokio::time::timeout(
                        self.opts.timeout,
                        sqlx::query(AssertSqlSafe(&*self.sql.row_ensure))
                            .bind(&key[..])
                            .execute(&mut conn),
                    )
                    .await;
                    match created {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) if has_number(&e, &RETRYABLE) => {}
                        Ok(Err(e)) => return Err(db_err(BACKEND, &e)),
                        Err(_) => return Err(no_answer(BACKEND, self.opts.timeout)),
                    }
                }
                Err(e) if has_number(&e, &NOWAIT_BUSY) => {
                    conn.execute("ROLLBACK")
                        .await
                        .map_err(|e| db_err(BACKEND, &e))?;
                    self.idle.put(conn);
                    return Ok(Attempt::Busy { retry_after: None });
                }
                Err(e) => return Err(db_err(BACKEND, &e)),
            }
        }
        Err(Error::backend(
            BACKEND,
            "the lock row vanished while locking it",
        ))
    }
}

/// `wait_timeout` of pinned connections, in seconds: five heartbeats, at least 5 s.
fn wait_timeout(heartbeat: Duration) -> u64 {
    (heartbeat.as_secs() * 5).max(5)
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

#[async_trait]
impl Backend for MysqlBackend {
    fn scheme(&self) -> &'static str {
        "mysql"
    }

    fn capabilities(&self) -> Capabilities {
        super::capabilities(self.opts.mode, false, self.durable, self.opts.heartbeat)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        if req.fair {
            return Err(Error::Unsupported(
                "fair (FIFO) mode is not offered by the MySQL backend yet".into(),
            ));
        }
        match self.opts.mode {
            Mode::Named => self.acquire_named(req).await,
            Mode::Row => self.acquire_row(req).await,
            _ => self.acquire_lease(req).await,
        }
    }

    async fn subscribe(&self, req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        Ok(Box::new(SqlWaiter {
            watch: self.hub.watch(&lock_key(&req.name)),
            poll: self.opts.poll,
            jitter: true,
        }))
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let key = lock_key(name);
        let t = self.opts.timeout;
        let owner_of = |r: &sqlx::mysql::MySqlRow| {
            String::from_utf8_lossy(&r.get::<Vec<u8>, _>(1)).into_owned()
        };
        let row = match self.opts.mode {
            Mode::Named => {
                timed(
                    BACKEND,
                    t,
                    sqlx::query(AssertSqlSafe(&*self.sql.inspect_named))
                        .bind(hex(&key))
                        .bind(&key[..])
                        .fetch_optional(&self.pool),
                )
                .await?
            }
            Mode::Row => {
                timed(
                    BACKEND,
                    t,
                    sqlx::query(AssertSqlSafe(&*self.sql.inspect_row))
                        .bind(&key[..])
                        .fetch_optional(&self.pool),
                )
                .await?
            }
            _ => {
                let row = timed(
                    BACKEND,
                    t,
                    sqlx::query(AssertSqlSafe(&*self.sql.inspect_lease))
                        .bind(&key[..])
                        .fetch_optional(&self.pool),
                )
                .await?;
                return Ok(row.map(|r| {
                    let mut info = LockInfo::new(
                        name,
                        owner_of(&r),
                        u32::try_from(r.get::<i32, _>(2)).unwrap_or(0),
                        u64::try_from(r.get::<i64, _>(3)).unwrap_or(0),
                    );
                    info.metadata = metadata_from(&r.get::<String, _>(4));
                    info.remaining = Some(Duration::from_micros(
                        u64::try_from(r.get::<i64, _>(5)).unwrap_or(0),
                    ));
                    info
                }));
            }
        };
        Ok(row.map(|r| {
            let owner = owner_of(&r);
            if owner.is_empty() && self.opts.mode == Mode::Named {
                let conn: u64 = r.try_get(4).unwrap_or(0);
                return super::foreign_holder(name, format!("MySQL connection {conn}"));
            }
            let mut info = LockInfo::new(
                name,
                owner,
                1,
                u64::try_from(r.get::<i64, _>(2)).unwrap_or(0),
            );
            info.metadata = metadata_from(&r.get::<String, _>(3));
            info
        }))
    }
}

/// Capabilities in the default mode (lease) on a server that flushes every commit
/// (`durable`), or not.
pub(crate) fn capabilities_with(durable: bool) -> Capabilities {
    super::capabilities(Mode::Lease, false, durable, Duration::from_secs(1))
}

/// What every held MySQL lock knows.
#[derive(Debug)]
struct HeldBase {
    pool: MySqlPool,
    sql: Arc<Statements>,
    hub: Arc<WakeOne<[u8; 32]>>,
    key: [u8; 32],
    owner: Owner,
    fence: u64,
    timeout: Duration,
}

/// A lease-mode hold.
#[derive(Debug)]
struct LeaseHeld {
    base: HeldBase,
}

#[async_trait]
impl HeldLock for LeaseHeld {
    fn fencing_token(&self) -> u64 {
        self.base.fence
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let b = &self.base;
        let ttl_us = i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX);
        let done = retrying(b.timeout, || {
            sqlx::query(AssertSqlSafe(&*b.sql.renew))
                .bind(ttl_us)
                .bind(&b.key[..])
                .bind(b.owner.as_str().as_bytes())
                .bind(b.fence)
                .execute(&b.pool)
        })
        .await?;
        if done.rows_affected() == 0 {
            return Err(Error::NotOwner {
                name: String::new(),
            });
        }
        Ok(())
    }

    async fn release(&self) -> Result<()> {
        let b = &self.base;
        retrying(b.timeout, || {
            sqlx::query(AssertSqlSafe(&*b.sql.release))
                .bind(&b.key[..])
                .bind(b.owner.as_str().as_bytes())
                .bind(b.fence)
                .execute(&b.pool)
        })
        .await?;
        b.hub.wake(&b.key);
        Ok(())
    }

    fn keeps_lock_delay(&self) -> bool {
        !self.base.sql.lock_delay.is_zero()
    }
}

/// How a session hold lets go.
#[derive(Debug)]
enum SessionRelease {
    /// `RELEASE_LOCK` of this server-side name.
    Named(String),
    Row,
}

/// A hold in a session mode: the lock lives as long as the pinned connection's session.
#[derive(Debug)]
struct SessionHeld {
    base: HeldBase,
    session: Session<MySqlConnection>,
    release: SessionRelease,
}

#[async_trait]
impl HeldLock for SessionHeld {
    fn fencing_token(&self) -> u64 {
        self.base.fence
    }

    async fn renew(&self, _ttl: Duration) -> Result<()> {
        self.session.renew().await
    }

    async fn release(&self) -> Result<()> {
        let b = &self.base;
        match &self.release {
            SessionRelease::Named(server_name) => {
                self.session
                    .end(|mut conn| async move {
                        let r = sqlx::query("SELECT RELEASE_LOCK(?)")
                            .bind(server_name)
                            .execute(&mut conn)
                            .await;
                        (conn, r.map(drop))
                    })
                    .await
            }
            SessionRelease::Row => {
                self.session
                    .end(|mut conn| async move {
                        let r = async {
                            conn.execute("COMMIT").await?;
                            sqlx::query(AssertSqlSafe(&*b.sql.row_release))
                                .bind(&b.key[..])
                                .bind(b.fence)
                                .execute(&b.pool)
                                .await
                        }
                        .await;
                        (conn, r.map(drop))
                    })
                    .await
            }
        }
    }

    fn loss_signal(&self) -> Option<CancellationToken> {
        Some(self.session.loss_signal())
    }
}
