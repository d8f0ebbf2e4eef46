//! The CLI's own bare PostgreSQL / MySQL connections, made from a dlock URL: the bench's
//! floor (the bare statements of one lock cycle in the URL's mode, through the same
//! client crate) and the flash-sale demo's inventory table.

use dlock::url::ConnectUrl;
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Executor, Row};

use crate::bench::take::Shape;
use crate::exit::Failure;

/// A bare connection to the database a dlock SQL URL names.
pub enum SqlConn {
    Pg(PgConnection),
    My(MySqlConnection),
}

fn err(e: sqlx::Error) -> Failure {
    Failure::internal(format!("bare SQL client: {e}"))
}

/// Where a `postgres://` / `mysql://` / `mariadb://` URL points, and its `mode`
/// (`None` for other schemes).
pub fn target(url: &str) -> Option<(String, String)> {
    let parsed = ConnectUrl::parse(url).ok()?;
    let scheme = parsed.scheme();
    if !matches!(scheme, "postgres" | "postgresql" | "mysql" | "mariadb") {
        return None;
    }
    let mode = url
        .split_once('?')
        .and_then(|(_, q)| q.split('&').find_map(|kv| kv.strip_prefix("mode=")))
        .unwrap_or("lease");
    Some((scheme.to_owned(), mode.to_owned()))
}

impl SqlConn {
    /// Connect to the database of `url` (host, user, password, database; dlock's own
    /// query options are ignored).
    pub async fn connect(url: &str) -> Result<Self, Failure> {
        let mut parsed = ConnectUrl::parse(url)?;
        let Some(host) = parsed.hosts().first().cloned() else {
            return Err(Failure::internal("no host in the URL"));
        };
        let db = parsed.path().trim_start_matches('/').to_owned();
        let password = parsed.password().map(|p| p.expose().to_owned());
        let user = parsed.username().map(str::to_owned);
        let _ = parsed.take_param("mode");
        if parsed.scheme().starts_with("postgres") {
            let mut o = PgConnectOptions::new_without_pgpass()
                .host(&host.host)
                .port(host.port.unwrap_or(5432))
                .username(user.as_deref().unwrap_or("postgres"));
            if let Some(p) = &password {
                o = o.password(p);
            }
            if !db.is_empty() {
                o = o.database(&db);
            }
            Ok(SqlConn::Pg(
                PgConnection::connect_with(&o).await.map_err(err)?,
            ))
        } else {
            let mut o = MySqlConnectOptions::new()
                .host(&host.host)
                .port(host.port.unwrap_or(3306))
                .username(user.as_deref().unwrap_or("root"))
                .database(&db);
            if let Some(p) = &password {
                o = o.password(p);
            }
            Ok(SqlConn::My(
                MySqlConnection::connect_with(&o).await.map_err(err)?,
            ))
        }
    }

    /// Run one statement (no binds, no rows wanted).
    pub async fn exec(&mut self, sql: &'static str) -> Result<(), Failure> {
        match self {
            SqlConn::Pg(c) => c.execute(sql).await.map(drop).map_err(err),
            SqlConn::My(c) => c.execute(sql).await.map(drop).map_err(err),
        }
    }

    /// One round trip with no statement (the protocol's ping).
    pub async fn ping(&mut self) -> Result<(), Failure> {
        match self {
            SqlConn::Pg(c) => c.ping().await.map_err(err),
            SqlConn::My(c) => c.ping().await.map_err(err),
        }
    }

    /// Run several statements in one round trip (a simple query: no binds), each
    /// result read.
    pub async fn batch(&mut self, pg: &'static str, my: &'static str) -> Result<(), Failure> {
        match self {
            SqlConn::Pg(c) => c.execute(sqlx::raw_sql(pg)).await.map(drop).map_err(err),
            SqlConn::My(c) => c.execute(sqlx::raw_sql(my)).await.map(drop).map_err(err),
        }
    }

    /// [`SqlConn::batch`], answering the first column (an i64) of the first row any of
    /// its statements returned, if one did.
    pub async fn batch_i64(
        &mut self,
        pg: &'static str,
        my: &'static str,
    ) -> Result<Option<i64>, Failure> {
        let row = match self {
            SqlConn::Pg(c) => sqlx::raw_sql(pg)
                .fetch_optional(&mut *c)
                .await
                .and_then(|r| r.map(|r| r.try_get::<i64, _>(0)).transpose()),
            SqlConn::My(c) => sqlx::raw_sql(my)
                .fetch_optional(&mut *c)
                .await
                .and_then(|r| r.map(|r| r.try_get::<i64, _>(0)).transpose()),
        };
        row.map_err(err)
    }

    /// Run `sql` with one i64 bound (`$1` on PostgreSQL, `?` on MySQL) and return the
    /// first column of the first row as i64, if any.
    pub async fn one_i64(
        &mut self,
        pg: &'static str,
        my: &'static str,
        v: i64,
    ) -> Result<Option<i64>, Failure> {
        match self {
            SqlConn::Pg(c) => sqlx::query_scalar::<_, i64>(pg)
                .bind(v)
                .fetch_optional(&mut *c)
                .await
                .map_err(err),
            SqlConn::My(c) => sqlx::query_scalar::<_, i64>(my)
                .bind(v)
                .fetch_optional(&mut *c)
                .await
                .map_err(err),
        }
    }

    /// Run `sql` with i64 binds; the number of rows it changed.
    pub async fn change(
        &mut self,
        pg: &'static str,
        my: &'static str,
        binds: &[i64],
    ) -> Result<u64, Failure> {
        match self {
            SqlConn::Pg(c) => binds
                .iter()
                .fold(sqlx::query(pg), |q, v| q.bind(*v))
                .execute(&mut *c)
                .await
                .map(|r| r.rows_affected())
                .map_err(err),
            SqlConn::My(c) => binds
                .iter()
                .fold(sqlx::query(my), |q, v| q.bind(*v))
                .execute(&mut *c)
                .await
                .map(|r| r.rows_affected())
                .map_err(err),
        }
    }
}

/// The lease mode's limit (see [`SqlFloor::limit`]): one statement takes row 1 when it
/// is free or its lease has ended, for `owner`, drawing the row's next token; the
/// release frees it if `owner` still holds it. An acquisition that grants nothing is
/// an error: every cycle of the limit must take the lock, or its rate says nothing.
async fn lease_limit_cycle(conn: &mut SqlConn, owner: i64) -> Result<(), Failure> {
    if !lease_limit_take(conn, owner).await? {
        return Err(Failure::internal(
            "bare SQL client: the lease limit's acquisition found its row held",
        ));
    }
    lease_limit_free(conn, owner).await
}

/// The lease limit's table, its row free (its owner and token start afresh).
pub async fn lease_limit_table(conn: &mut SqlConn) -> Result<(), Failure> {
    conn.batch(
        "CREATE TABLE IF NOT EXISTS dlock_bench_floor_lease (id BIGINT PRIMARY KEY, \
         owner BIGINT NOT NULL, fence BIGINT NOT NULL, expires_at TIMESTAMPTZ NOT NULL)",
        "CREATE TABLE IF NOT EXISTS dlock_bench_floor_lease (id BIGINT PRIMARY KEY, \
         owner BIGINT NOT NULL, fence BIGINT NOT NULL, expires_at DATETIME(6) NOT NULL)",
    )
    .await?;
    conn.exec("DELETE FROM dlock_bench_floor_lease").await
}

/// The lease limit's acquisition: whether `owner` took row 1 (free, or its lease
/// ended), drawing the row's next token, in one statement.
pub async fn lease_limit_take(conn: &mut SqlConn, owner: i64) -> Result<bool, Failure> {
    Ok(match conn {
        SqlConn::Pg(c) => sqlx::query_scalar::<_, i64>(
            "INSERT INTO dlock_bench_floor_lease AS l (id, owner, fence, expires_at) \
             VALUES (1, $1, 1, statement_timestamp() + interval '30 seconds') \
             ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, fence = l.fence + 1, \
                expires_at = excluded.expires_at \
             WHERE l.expires_at <= statement_timestamp() \
             RETURNING l.fence",
        )
        .bind(owner)
        .fetch_optional(&mut *c)
        .await
        .map_err(err)?
        .is_some(),
        // The first assignment decides, into a variable the later ones read, whether
        // the row is free; no assignment reads a column an earlier one changed, so the
        // statement means the same whether assignments see earlier ones (MariaDB's
        // default) or not (`SIMULTANEOUS_ASSIGNMENT`). `LAST_INSERT_ID` carries the
        // token in the reply, and is 0 when nothing was granted.
        SqlConn::My(c) => {
            sqlx::query(
                "INSERT INTO dlock_bench_floor_lease (id, owner, fence, expires_at) \
                 VALUES (1, ?, LAST_INSERT_ID(1), UTC_TIMESTAMP(6) + INTERVAL 30 SECOND) \
                 ON DUPLICATE KEY UPDATE \
                    fence = IF(@dlock_floor_free := (expires_at <= UTC_TIMESTAMP(6)), \
                               LAST_INSERT_ID(fence + 1), fence + LAST_INSERT_ID(0)), \
                    owner = IF(@dlock_floor_free, VALUES(owner), owner), \
                    expires_at = IF(@dlock_floor_free, VALUES(expires_at), expires_at)",
            )
            .bind(owner)
            .execute(&mut *c)
            .await
            .map_err(err)?
            .last_insert_id()
                > 0
        }
    })
}

/// The lease limit's release: row 1 freed if `owner` still holds it.
pub async fn lease_limit_free(conn: &mut SqlConn, owner: i64) -> Result<(), Failure> {
    conn.change(
        "UPDATE dlock_bench_floor_lease SET expires_at = '-infinity' WHERE id = 1 AND owner = $1",
        "UPDATE dlock_bench_floor_lease SET expires_at = '1970-01-02' WHERE id = 1 AND owner = ?",
        &[owner],
    )
    .await
    .map(drop)
}

/// One bare cycle of `mode`'s statements, `i` distinguishing cycles.
async fn floor_cycle(conn: &mut SqlConn, mode: &str, i: i64) -> Result<(), Failure> {
    match (mode, &mut *conn) {
        ("advisory", SqlConn::Pg(_)) => {
            conn.one_i64("SELECT pg_try_advisory_lock($1)::int::int8", "", 77_001)
                .await?;
            conn.one_i64("SELECT pg_advisory_unlock($1)::int::int8", "", 77_001)
                .await?;
        }
        ("named", SqlConn::My(_)) => {
            conn.one_i64("", "SELECT GET_LOCK(CONCAT('dlock-floor-', ?), 0)", 1)
                .await?;
            conn.one_i64("", "SELECT RELEASE_LOCK(CONCAT('dlock-floor-', ?))", 1)
                .await?;
        }
        ("row", _) => {
            row_lock(conn).await?;
            conn.exec("COMMIT").await?;
        }
        _ => {
            conn.change(
                "INSERT INTO dlock_bench_floor (id, expires) VALUES ($1, $2)",
                "INSERT INTO dlock_bench_floor (id, expires) VALUES (?, ?)",
                &[1, i],
            )
            .await?;
            conn.change(
                "DELETE FROM dlock_bench_floor WHERE id = $1 AND expires = $2",
                "DELETE FROM dlock_bench_floor WHERE id = ? AND expires = ?",
                &[1, i],
            )
            .await?;
        }
    }
    Ok(())
}

/// Row mode's transaction and locking read in one round trip, as the least client
/// does (PostgreSQL: the read prepared at connect, `SqlFloor::connect`). The locked
/// row's answer: PostgreSQL the transaction's id, which the token's statement asks
/// about; MySQL the row's id. A missing row is an error, the transaction rolled back.
async fn row_lock(conn: &mut SqlConn) -> Result<i64, Failure> {
    let locked = conn
        .batch_i64(
            "BEGIN; EXECUTE dlock_bench_floor_lock",
            "BEGIN; SELECT id FROM dlock_bench_floor_row WHERE id = 1 FOR UPDATE NOWAIT",
        )
        .await;
    let cause = match locked {
        Ok(Some(answer)) => return Ok(answer),
        Ok(None) => Failure::internal("bare SQL client: the row limit's row is missing"),
        Err(e) => e,
    };
    // The BEGIN may have run: leave no transaction open behind the error.
    let _ = conn.exec("ROLLBACK").await;
    Err(cause)
}

/// Row mode's fencing token, drawn on `counter` while `conn`'s transaction holds the
/// row, and the proof a correct lock needs before the token counts: that the
/// transaction still held the row after the token was drawn (else a later holder may
/// have drawn a lower one). PostgreSQL: the token's statement reads the status of the
/// transaction `xact` (from [`row_lock`]); MySQL, which shows another session's
/// transaction only to `PROCESS`: one more round trip on the locking session.
async fn row_token(conn: &mut SqlConn, counter: &mut SqlConn, xact: i64) -> Result<(), Failure> {
    let alive = match counter {
        SqlConn::Pg(c) => sqlx::query_scalar::<_, bool>(
            "UPDATE dlock_bench_floor_fence SET v = v + 1 WHERE id = 1 \
             RETURNING txid_status($1) = 'in progress'",
        )
        .bind(xact)
        .fetch_one(&mut *c)
        .await
        .map_err(err)?,
        SqlConn::My(_) => {
            counter
                .change(
                    "",
                    "UPDATE dlock_bench_floor_fence SET v = LAST_INSERT_ID(v + 1) WHERE id = ?",
                    &[1],
                )
                .await?;
            conn.ping().await.is_ok()
        }
    };
    if alive {
        Ok(())
    } else {
        Err(Failure::internal(
            "bare SQL client: the row limit's transaction ended while its token was drawn",
        ))
    }
}

/// One bare counted grant and its release, in every mode (dlock's semaphores and
/// read-write locks keep rows in every mode): insert a row only while fewer than
/// `limit` rows are there, in one statement, then delete it.
async fn counted_cycle(conn: &mut SqlConn, i: i64, limit: u32) -> Result<(), Failure> {
    conn.change(
        "INSERT INTO dlock_bench_floor_counted (id, expires) SELECT $1::int8, $2::int8 \
         WHERE (SELECT count(*) FROM dlock_bench_floor_counted) < $3",
        "INSERT INTO dlock_bench_floor_counted (id, expires) SELECT ?, ? FROM DUAL \
         WHERE (SELECT COUNT(*) FROM dlock_bench_floor_counted) < ?",
        &[i, i, i64::from(limit)],
    )
    .await?;
    conn.change(
        "DELETE FROM dlock_bench_floor_counted WHERE id = $1 AND expires = $2",
        "DELETE FROM dlock_bench_floor_counted WHERE id = ? AND expires = ?",
        &[i, i],
    )
    .await?;
    Ok(())
}

/// The bare-statement floor for a SQL URL in its mode (`None` for other backends):
/// lease → insert + owner-checked delete of a row; advisory → `pg_try_advisory_lock` +
/// `pg_advisory_unlock`; named → `GET_LOCK` + `RELEASE_LOCK`; row → `BEGIN` and
/// `SELECT … FOR UPDATE NOWAIT` in one round trip, then `COMMIT`; a counted grant (a permit, a read, a
/// write) → a row inserted while fewer than the limit are there, then deleted. Tables
/// made, cycles not yet run.
pub struct SqlFloor {
    conn: SqlConn,
    mode: String,
    /// Row mode: a second connection for the fencing counter, which the locking
    /// transaction cannot commit while it holds the row.
    counter: Option<SqlConn>,
}

impl SqlFloor {
    pub async fn connect(url: &str) -> Result<Option<Self>, Failure> {
        let Some((_, mode)) = target(url) else {
            return Ok(None);
        };
        let mut conn = SqlConn::connect(url).await?;
        conn.exec("CREATE TABLE IF NOT EXISTS dlock_bench_floor (id BIGINT PRIMARY KEY, expires BIGINT NOT NULL)")
            .await?;
        conn.exec("CREATE TABLE IF NOT EXISTS dlock_bench_floor_row (id BIGINT PRIMARY KEY)")
            .await?;
        conn.exec("CREATE TABLE IF NOT EXISTS dlock_bench_floor_counted (id BIGINT PRIMARY KEY, expires BIGINT NOT NULL)")
            .await?;
        conn.exec("CREATE TABLE IF NOT EXISTS dlock_bench_floor_fence (id BIGINT PRIMARY KEY, v BIGINT NOT NULL)")
            .await?;
        if mode == "lease" {
            // The lease limit's row (`lease_limit_cycle`).
            lease_limit_table(&mut conn).await?;
        }
        conn.exec("DELETE FROM dlock_bench_floor_fence").await?;
        conn.exec("INSERT INTO dlock_bench_floor_fence (id, v) VALUES (1, 0)")
            .await?;
        conn.exec("DELETE FROM dlock_bench_floor").await?;
        conn.exec("DELETE FROM dlock_bench_floor_counted").await?;
        conn.exec("DELETE FROM dlock_bench_floor_row").await?;
        conn.exec("INSERT INTO dlock_bench_floor_row (id) VALUES (1)")
            .await?;
        if let (SqlConn::Pg(_), "row") = (&conn, mode.as_str()) {
            conn.batch(
                "PREPARE dlock_bench_floor_lock AS \
                 SELECT txid_current() FROM dlock_bench_floor_row WHERE id = 1 FOR UPDATE NOWAIT",
                "",
            )
            .await?;
        }
        let counter = if mode == "row" {
            Some(SqlConn::connect(url).await?)
        } else {
            None
        };
        Ok(Some(SqlFloor {
            conn,
            mode,
            counter,
        }))
    }

    /// One bare cycle of `shape`, `i` distinguishing cycles.
    pub async fn cycle(&mut self, i: i64, shape: Shape) -> Result<(), Failure> {
        match (shape, self.mode.as_str(), &self.conn) {
            (Shape::Exclusive, ..) => floor_cycle(&mut self.conn, &self.mode, i).await,
            (Shape::Counted(limit), ..) => counted_cycle(&mut self.conn, i, limit).await,
            // The limits `limit` names; elsewhere the floor is the least.
            (Shape::Fenced, "named", SqlConn::My(_)) => {
                self.conn
                    .change(
                        "",
                        "UPDATE dlock_bench_floor_fence SET v = LAST_INSERT_ID(v + 1) \
                         WHERE id = 1 AND GET_LOCK(CONCAT('dlock-floor-', ?), 0) = 1",
                        &[1],
                    )
                    .await?;
                self.conn
                    .one_i64("", "SELECT RELEASE_LOCK(CONCAT('dlock-floor-', ?))", 1)
                    .await?;
                Ok(())
            }
            (Shape::Fenced, "advisory", SqlConn::Pg(_)) => {
                self.conn
                    .one_i64(
                        "WITH g AS (SELECT pg_try_advisory_lock($1) AS ok) \
                         UPDATE dlock_bench_floor_fence SET v = v + 1 \
                         WHERE id = 1 AND (SELECT ok FROM g) RETURNING v",
                        "",
                        77_001,
                    )
                    .await?;
                self.conn
                    .one_i64("SELECT pg_advisory_unlock($1)::int::int8", "", 77_001)
                    .await?;
                Ok(())
            }
            (Shape::Fenced, "lease", _) => lease_limit_cycle(&mut self.conn, i).await,
            (Shape::Fenced, "row", _) => {
                let Some(counter) = self.counter.as_mut() else {
                    return floor_cycle(&mut self.conn, &self.mode, i).await;
                };
                let xact = row_lock(&mut self.conn).await?;
                // Never leave the row locked: the run's next cycles would all fail.
                if let Err(e) = row_token(&mut self.conn, counter, xact).await {
                    // The token's failure is the cause, whatever the rollback answers.
                    let _ = self.conn.exec("ROLLBACK").await;
                    return Err(e);
                }
                self.conn.exec("COMMIT").await
            }
            (Shape::Fenced, ..) => floor_cycle(&mut self.conn, &self.mode, i).await,
        }
    }

    /// The session modes' fencing token is a write the bare lock functions do not
    /// make. Both servers can take a lock function's lock and count the token in one
    /// statement: that statement and the unlock are the mode's limit
    /// (`Shape::Fenced`). A row lock's transaction cannot commit the token while it
    /// holds the row: the limit is the floor's statements with the counter's increment
    /// on a second connection between the lock and the commit, and the proof that the
    /// transaction still held the row after it ([`row_token`]). A lease's token is a
    /// write the bare insert and delete do not make either: its limit takes a free or
    /// ended lease and draws the row's next token in one statement, then frees it.
    pub fn limit(&self) -> Option<&'static str> {
        match (self.mode.as_str(), &self.conn) {
            ("lease", _) => Some(
                "one upsert that takes the name's row when it is free or its lease has \
                 ended and draws the row's next token, returning it, then an \
                 owner-checked UPDATE that frees the row",
            ),
            ("advisory", SqlConn::Pg(_)) => Some(
                "pg_try_advisory_lock and a fencing counter's increment in one statement \
                 (a one-row UPDATE), then pg_advisory_unlock",
            ),
            ("named", SqlConn::My(_)) => Some(
                "GET_LOCK and a fencing counter's increment in one statement (a one-row \
                 UPDATE … LAST_INSERT_ID), then RELEASE_LOCK",
            ),
            ("row", SqlConn::Pg(_)) => Some(
                "BEGIN and SELECT … FOR UPDATE NOWAIT in one round trip, a fencing \
                 counter's increment (a one-row UPDATE) committed on a second connection \
                 that also reads whether the locking transaction is still in progress \
                 (txid_status: else a later holder may have drawn a lower token), COMMIT",
            ),
            ("row", _) => Some(
                "BEGIN and SELECT … FOR UPDATE NOWAIT in one round trip, a fencing \
                 counter's increment (a one-row UPDATE) committed on a second connection, \
                 a ping on the locking session to prove it still held the row after that \
                 (else a later holder may have drawn a lower token; MySQL shows another \
                 session's transaction only to PROCESS), COMMIT",
            ),
            _ => None,
        }
    }
}
