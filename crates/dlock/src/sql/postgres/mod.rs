//! `postgres://user[:password]@host[:port]/database`: PostgreSQL.
//!
//! # Modes
//! - `mode=lease` (default): a lease row per name in `<prefix>_locks`; expiry by the
//!   server's clock (`statement_timestamp()`); the fencing token is `nextval` of the
//!   sequence `<prefix>_fence`, committed by the statement that grants it. One
//!   autocommitted statement per acquire, renew and release: works through transaction
//!   poolers (PgBouncer). Reentrant for the same owner.
//! - `mode=advisory`: a session `pg_try_advisory_lock(key)` on a pinned connection;
//!   `key` is the first 8 bytes of SHA-256 of the name (`advisory_key=sha256`, default)
//!   or the name itself read as a decimal int8 (`advisory_key=number`, to share locks
//!   with code that calls `pg_advisory_lock(42)`).
//! - `mode=row`: `SELECT … FOR UPDATE NOWAIT` on the name's row in `<prefix>_rows`, in a
//!   transaction held open on a pinned connection; the lock ends at commit or when the
//!   connection dies.
//!
//! In session modes the holder (owner, token, metadata, backend pid) is recorded in
//! `<prefix>_holders` for `inspect`. A heartbeat pings the pinned connection every
//! `heartbeat` (default 1 s) and closes it when a ping fails or takes longer than that,
//! firing `lost()`. The server is asked to end a session silent for five heartbeats (at
//! least 5 s; `idle_session_timeout` needs PostgreSQL 14, `idle_in_transaction_session_timeout`
//! covers row mode) and to probe a silent client with TCP keepalives (idle 2 s,
//! interval 1 s, 3 probes): a cut-off holder declares the loss after one to two
//! heartbeats, seconds before the server frees the lock.
//!
//! # Waiting
//! Every release sends `NOTIFY <prefix>_released, '<key hex>'`; one listener connection
//! per backend wakes the waiters of that key in this process. A lease that ends without
//! a release is re-polled at its expiry; a session that dies without a release is found
//! by the fallback re-poll every `poll` (default 100 ms).
//!
//! # Options
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `mode` | `lease` | how the lock is held (above) |
//! | `table_prefix` | `dlock` | prefix of dlock's tables (a plain identifier) |
//! | `lock_delay` | none | lease mode: a lease that ran out without a release keeps the lock from other owners this much longer (at most 1 h) |
//! | `poll` | `100ms` (a fallback: releases notify) | waiting: re-poll interval |
//! | `timeout` | `5s` | connecting, and per statement |
//! | `heartbeat` | `1s` | session modes: ping interval of the pinned connection (a failed ping fires `lost()`) |
//! | `pool` | `10` | connections for lease statements |
//! | `sessions` | `100` | idle pinned connections kept for session modes |
//! | `advisory_key` | `sha256` | advisory mode: `sha256` (first 8 bytes of the name's SHA-256) or `number` (the name as a decimal int8) |
//! | `sslmode` | `prefer` | `disable`, `prefer`, `require`, `verify-ca`, `verify-full` |
//! | `ssl_ca` | none | PEM file of the CA that signs the server |
//!
//! `inspect` asks the server what the acquire asks (`pg_locks` for the advisory key):
//! a key held outside dlock — or by dlock under another spelling of the same number — is
//! reported held, with no token (0). Least privilege (tested): once the tables exist,
//! `SELECT, INSERT, UPDATE` on them and `USAGE` on the sequence are enough in every mode;
//! a user that cannot create the tables gets a clear permission error.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{
    PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgSslMode,
};
use sqlx::{AssertSqlSafe, Connection, Executor, Row};
use tokio_util::sync::CancellationToken;

use super::{
    COMMON_OPTIONS, IdleConns, Mode, Pinned, Session, SqlOptions, SqlWaiter, db_err, has_code, hex,
    lock_key, metadata_from, metadata_json, timed,
};
use crate::backend::{AcquireRequest, Attempt, Backend, Capabilities, HeldLock, LockInfo, Waiter};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::WakeOne;
use crate::options::Owner;
use crate::url::ConnectUrl;

mod statements;
use statements::Statements;

const BACKEND: &str = "postgres";

/// How a name becomes a PostgreSQL advisory lock key (`mode=advisory`).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdvisoryKey {
    /// The first 8 bytes of SHA-256 of the name, big-endian, as an int8.
    Sha256,
    /// The name is a decimal int8 (`"42"` → `pg_advisory_lock(42)`).
    Number,
}

impl AdvisoryKey {
    /// The int8 key of `name`.
    ///
    /// # Errors
    /// [`Error::InvalidName`] when `Number` is asked for and the name is not an int8.
    pub fn key(self, name: &LockName) -> Result<i64> {
        match self {
            AdvisoryKey::Sha256 => {
                let k = lock_key(name);
                let mut b = [0u8; 8];
                b.copy_from_slice(&k[..8]);
                Ok(i64::from_be_bytes(b))
            }
            AdvisoryKey::Number => name
                .as_str()
                .parse::<i64>()
                .map_err(|_| Error::InvalidName {
                    name: name.as_str().to_owned(),
                    reason: "advisory_key=number needs a decimal int8 name".into(),
                }),
        }
    }
}

/// The PostgreSQL backend.
pub struct PostgresBackend {
    pool: PgPool,
    connect: PgConnectOptions,
    opts: SqlOptions,
    sql: Arc<Statements>,
    hub: Arc<WakeOne<[u8; 32]>>,
    idle: Arc<IdleConns<PgConnection>>,
    advisory_key: AdvisoryKey,
    listener: tokio::task::JoinHandle<()>,
    /// The server flushes every commit (`fsync=on`, `synchronous_commit` not off).
    durable: bool,
}

impl std::fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the connect options: they hold the password.
        f.debug_struct("PostgresBackend")
            .field("mode", &self.opts.mode)
            .field("prefix", &self.opts.prefix)
            .finish_non_exhaustive()
    }
}

impl Drop for PostgresBackend {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl PostgresBackend {
    /// Connect, create the tables if missing, and start listening for releases.
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
        let ssl_ca = url.take_param("ssl_ca");
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
        if let Some(ca) = ssl_ca {
            if !std::path::Path::new(&ca).is_file() {
                return Err(url.invalid(&format!("ssl_ca file {ca:?} not found")));
            }
            connect = connect.ssl_root_cert(ca);
        }
        let pool = PgPoolOptions::new()
            .max_connections(opts.pool.max(2))
            .acquire_timeout(opts.timeout)
            // A ping before every statement would double the round trips; a broken
            // connection shows up as a connection error on the statement instead.
            .test_before_acquire(false)
            .connect_lazy_with(connect.clone());
        let sql = Arc::new(Statements::new(&opts.prefix, opts.lock_delay));
        timed(BACKEND, opts.timeout, create_schema(&pool, &sql)).await?;
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
        // Session connections ask the server to probe a silent client (TCP keepalives)
        // and, on PostgreSQL 14 or later, to end a session that sends nothing for five
        // heartbeats, so a cut-off holder's session (and lock) ends in seconds, not
        // hours — after the holder's own heartbeat has declared the loss.
        let version: i32 = timed(
            BACKEND,
            opts.timeout,
            sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
                .fetch_one(&pool),
        )
        .await?;
        let silent_ms = (opts.heartbeat * 5)
            .max(Duration::from_secs(5))
            .as_millis()
            .to_string();
        let mut session_options = vec![
            ("tcp_keepalives_idle", "2".to_owned()),
            ("tcp_keepalives_interval", "1".to_owned()),
            ("tcp_keepalives_count", "3".to_owned()),
        ];
        if version >= 140_000 {
            session_options.push(("idle_session_timeout", silent_ms.clone()));
        }
        session_options.push(("idle_in_transaction_session_timeout", silent_ms));
        let connect = connect.options(session_options);
        Ok(Arc::new(PostgresBackend {
            pool,
            connect,
            idle: Arc::new(IdleConns::new(opts.sessions, Duration::from_secs(300))),
            opts,
            sql,
            hub,
            advisory_key,
            listener,
            durable,
        }))
    }

    /// The mode this backend locks in.
    #[must_use]
    pub fn mode(&self) -> Mode {
        self.opts.mode
    }

    async fn session_conn(&self) -> Result<PgConnection> {
        if let Some(c) = self.idle.pop() {
            return Ok(c);
        }
        timed(
            BACKEND,
            self.opts.timeout,
            PgConnection::connect_with(&self.connect),
        )
        .await
    }

    fn session(&self, conn: PgConnection, name: &LockName) -> Session<PgConnection> {
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

    fn held_base(&self, req: &AcquireRequest, fence: i64) -> HeldBase {
        let key = lock_key(&req.name);
        HeldBase {
            pool: self.pool.clone(),
            sql: Arc::clone(&self.sql),
            hub: Arc::clone(&self.hub),
            key,
            key_hex: hex(&key),
            owner: req.owner.clone(),
            fence,
            timeout: self.opts.timeout,
        }
    }

    async fn acquire_lease(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = lock_key(&req.name);
        let ttl_us = i64::try_from(req.ttl.as_micros()).unwrap_or(i64::MAX);
        let row = timed(
            BACKEND,
            self.opts.timeout,
            sqlx::query_as::<_, (Option<i64>, Option<i64>)>(AssertSqlSafe(&*self.sql.acquire))
                .bind(&key[..])
                .bind(req.name.as_str())
                .bind(req.owner.as_str())
                .bind(ttl_us)
                .bind(metadata_json(&req.metadata))
                .fetch_optional(&self.pool),
        )
        .await?;
        match row {
            Some((Some(fence), _)) => Ok(Attempt::Acquired(Box::new(LeaseHeld {
                base: self.held_base(req, fence),
            }))),
            Some((None, remaining)) => Ok(Attempt::Busy {
                retry_after: remaining.map(|ms| Duration::from_millis(ms.max(1).unsigned_abs())),
            }),
            None => Ok(Attempt::Busy { retry_after: None }),
        }
    }

    async fn acquire_advisory(&self, req: &AcquireRequest) -> Result<Attempt> {
        let akey = self.advisory_key.key(&req.name)?;
        let key = lock_key(&req.name);
        let mut conn = self.session_conn().await?;
        // No timeout here: a statement cut off mid-flight could leave the lock taken on
        // a connection nobody tracks. The connection is dropped (session ended) on error.
        let fence = sqlx::query_scalar::<_, i64>(AssertSqlSafe(&*self.sql.advisory_acquire))
            .bind(akey)
            .bind(&key[..])
            .bind(req.name.as_str())
            .bind(req.owner.as_str())
            .bind(metadata_json(&req.metadata))
            .fetch_optional(&mut conn)
            .await
            .map_err(|e| db_err(BACKEND, &e))?;
        match fence {
            Some(fence) => Ok(Attempt::Acquired(Box::new(SessionHeld {
                base: self.held_base(req, fence),
                session: self.session(conn, &req.name),
                release: SessionRelease::Advisory(akey),
            }))),
            None => {
                self.idle.put(conn);
                Ok(Attempt::Busy { retry_after: None })
            }
        }
    }

    async fn acquire_row(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = lock_key(&req.name);
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
                    let pid: i32 = row.get(0);
                    let fence = timed(
                        BACKEND,
                        self.opts.timeout,
                        sqlx::query_scalar::<_, i64>(AssertSqlSafe(&*self.sql.row_holder))
                            .bind(&key[..])
                            .bind(req.name.as_str())
                            .bind(req.owner.as_str())
                            .bind(metadata_json(&req.metadata))
                            .bind(pid)
                            .fetch_one(&self.pool),
                    )
                    .await?;
                    return Ok(Attempt::Acquired(Box::new(SessionHeld {
                        base: self.held_base(req, fence),
                        session: self.session(conn, &req.name),
                        release: SessionRelease::Row,
                    })));
                }
                Ok(None) => {
                    // First use of this name: create its row, then try again.
                    conn.execute("ROLLBACK")
                        .await
                        .map_err(|e| db_err(BACKEND, &e))?;
                    timed(
                        BACKEND,
                        self.opts.timeout,
                        sqlx::query(AssertSqlSafe(&*self.sql.row_ensure))
                            .bind(&key[..])
                            .execute(&self.pool),
                    )
                    .await?;
                }
                Err(e) if has_code(&e, &["55P03"]) => {
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
async fn create_schema(pool: &PgPool, sql: &Statements) -> std::result::Result<(), sqlx::Error> {
    let present: bool = sqlx::query_scalar(AssertSqlSafe(&*sql.tables))
        .fetch_one(pool)
        .await?;
    if present {
        return Ok(());
    }
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(7022505437620437858)")
        .execute(&mut *tx)
        .await?;
    tx.execute(sqlx::raw_sql(AssertSqlSafe(&*sql.schema)))
        .await?;
    tx.commit().await
}

#[async_trait]
impl Backend for PostgresBackend {
    fn scheme(&self) -> &'static str {
        "postgres"
    }

    fn capabilities(&self) -> Capabilities {
        super::capabilities(self.opts.mode, true, self.durable, self.opts.heartbeat)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        if req.fair {
            return Err(Error::Unsupported(
                "fair (FIFO) mode is not offered by the PostgreSQL backend yet".into(),
            ));
        }
        match self.opts.mode {
            Mode::Advisory => self.acquire_advisory(req).await,
            Mode::Row => self.acquire_row(req).await,
            _ => self.acquire_lease(req).await,
        }
    }

    async fn subscribe(&self, req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        Ok(Box::new(SqlWaiter {
            watch: self.hub.watch(&lock_key(&req.name)),
            poll: self.opts.poll,
            jitter: false,
        }))
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let key = lock_key(name);
        let t = self.opts.timeout;
        let row = match self.opts.mode {
            Mode::Advisory => {
                let akey = self.advisory_key.key(name)?;
                timed(
                    BACKEND,
                    t,
                    sqlx::query(AssertSqlSafe(&*self.sql.inspect_advisory))
                        .bind(&key[..])
                        .bind(akey)
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
                        r.get::<String, _>(1),
                        u32::try_from(r.get::<i32, _>(2)).unwrap_or(0),
                        u64::try_from(r.get::<i64, _>(3)).unwrap_or(0),
                    );
                    info.metadata = metadata_from(&r.get::<String, _>(4));
                    info.remaining = Some(Duration::from_millis(
                        u64::try_from(r.get::<i64, _>(5)).unwrap_or(0),
                    ));
                    info
                }));
            }
        };
        Ok(row.map(|r| {
            let owner = r.get::<String, _>(1);
            if owner.is_empty() && self.opts.mode == Mode::Advisory {
                let pid: i32 = r.try_get(4).unwrap_or(0);
                return super::foreign_holder(name, format!("PostgreSQL backend pid {pid}"));
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
    super::capabilities(Mode::Lease, true, durable, Duration::from_secs(1))
}

/// What every held PostgreSQL lock knows.
#[derive(Debug)]
struct HeldBase {
    pool: PgPool,
    sql: Arc<Statements>,
    hub: Arc<WakeOne<[u8; 32]>>,
    key: [u8; 32],
    key_hex: String,
    owner: Owner,
    fence: i64,
    timeout: Duration,
}

impl HeldBase {
    fn token(&self) -> u64 {
        u64::try_from(self.fence).unwrap_or(0)
    }
}

/// A lease-mode hold.
#[derive(Debug)]
struct LeaseHeld {
    base: HeldBase,
}

#[async_trait]
impl HeldLock for LeaseHeld {
    fn fencing_token(&self) -> u64 {
        self.base.token()
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let b = &self.base;
        let done = timed(
            BACKEND,
            b.timeout,
            sqlx::query(AssertSqlSafe(&*b.sql.renew))
                .bind(&b.key[..])
                .bind(b.owner.as_str())
                .bind(b.fence)
                .bind(i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX))
                .execute(&b.pool),
        )
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
        let holds = timed(
            BACKEND,
            b.timeout,
            sqlx::query_scalar::<_, i32>(AssertSqlSafe(&*b.sql.release))
                .bind(&b.key[..])
                .bind(b.owner.as_str())
                .bind(b.fence)
                .bind(&*b.sql.channel)
                .bind(&b.key_hex)
                .fetch_optional(&b.pool),
        )
        .await?;
        if holds == Some(0) {
            b.hub.wake(&b.key);
        }
        Ok(())
    }

    fn keeps_lock_delay(&self) -> bool {
        !self.base.sql.lock_delay.is_zero()
    }
}

/// How a session hold lets go.
#[derive(Debug)]
enum SessionRelease {
    Advisory(i64),
    Row,
}

/// A hold in a session mode: the lock lives as long as the pinned connection's session.
#[derive(Debug)]
struct SessionHeld {
    base: HeldBase,
    session: Session<PgConnection>,
    release: SessionRelease,
}

#[async_trait]
impl HeldLock for SessionHeld {
    fn fencing_token(&self) -> u64 {
        self.base.token()
    }

    async fn renew(&self, _ttl: Duration) -> Result<()> {
        self.session.renew().await
    }

    async fn release(&self) -> Result<()> {
        let b = &self.base;
        match self.release {
            SessionRelease::Advisory(akey) => {
                self.session
                    .end(|mut conn| async move {
                        let r = sqlx::query(AssertSqlSafe(&*b.sql.advisory_release))
                            .bind(akey)
                            .bind(&*b.sql.channel)
                            .bind(&b.key_hex)
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
                                .bind(&*b.sql.channel)
                                .bind(&b.key_hex)
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
