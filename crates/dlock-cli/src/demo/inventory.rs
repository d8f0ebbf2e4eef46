//! The flash-sale demo's protected resource: one stock row (quantity and version), in
//! a small SQLite file by default, or in the PostgreSQL / MySQL database the lock URL
//! names (table `dlock_demo_stock`, one row per demo run).

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::mysql::MySqlConnection;
use sqlx::postgres::PgConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, Executor, Row, SqlitePool};

use crate::bench::raw_sql::SqlConn;
use crate::exit::Failure;

/// One connection to the stock.
pub enum Inventory {
    Sqlite(SqlitePool),
    Pg(PgConnection, i64),
    My(MySqlConnection, i64),
}

fn db(e: sqlx::Error) -> Failure {
    Failure::internal(format!("inventory: {e}"))
}

impl Inventory {
    /// Open the stock at `spec`: an SQLite file path, or a `postgres://` / `mysql://` /
    /// `mariadb://` URL with the run's row id.
    pub async fn open(spec: &str, id: i64) -> Result<Self, Failure> {
        if crate::bench::raw_sql::target(spec).is_some() {
            let create = "CREATE TABLE IF NOT EXISTS dlock_demo_stock \
                          (id BIGINT PRIMARY KEY, qty BIGINT NOT NULL, version BIGINT NOT NULL)";
            return Ok(match SqlConn::connect(spec).await? {
                SqlConn::Pg(mut c) => {
                    c.execute(create).await.map_err(db)?;
                    Inventory::Pg(c, id)
                }
                SqlConn::My(mut c) => {
                    c.execute(create).await.map_err(db)?;
                    Inventory::My(c, id)
                }
            });
        }
        let opts = SqliteConnectOptions::from_str("sqlite://inventory")
            .map_err(db)?
            .filename(Path::new(spec))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Off)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(opts)
            .await
            .map_err(db)?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS stock \
             (id INTEGER PRIMARY KEY, qty INTEGER NOT NULL, version INTEGER NOT NULL)",
        )
        .execute(&pool)
        .await
        .map_err(db)?;
        Ok(Inventory::Sqlite(pool))
    }

    /// Whether this stock lives in a database server (row locks are offered).
    pub fn is_server(&self) -> bool {
        !matches!(self, Inventory::Sqlite(_))
    }

    /// Put `qty` items in stock (version 0).
    pub async fn reset(&mut self, qty: i64) -> Result<(), Failure> {
        match self {
            Inventory::Sqlite(p) => {
                sqlx::query("INSERT OR REPLACE INTO stock (id, qty, version) VALUES (1, ?1, 0)")
                    .bind(qty)
                    .execute(&*p)
                    .await
                    .map(drop)
            }
            Inventory::Pg(c, id) => sqlx::query(
                "INSERT INTO dlock_demo_stock (id, qty, version) VALUES ($1, $2, 0) \
                 ON CONFLICT (id) DO UPDATE SET qty = excluded.qty, version = 0",
            )
            .bind(*id)
            .bind(qty)
            .execute(&mut *c)
            .await
            .map(drop),
            Inventory::My(c, id) => {
                sqlx::query("REPLACE INTO dlock_demo_stock (id, qty, version) VALUES (?, ?, 0)")
                    .bind(*id)
                    .bind(qty)
                    .execute(&mut *c)
                    .await
                    .map(drop)
            }
        }
        .map_err(db)
    }

    /// Remove this run's row from a database server (the SQLite file goes with its
    /// temp dir).
    pub async fn remove(&mut self) -> Result<(), Failure> {
        match self {
            Inventory::Sqlite(_) => Ok(()),
            Inventory::Pg(c, id) => sqlx::query("DELETE FROM dlock_demo_stock WHERE id = $1")
                .bind(*id)
                .execute(&mut *c)
                .await
                .map(drop)
                .map_err(db),
            Inventory::My(c, id) => sqlx::query("DELETE FROM dlock_demo_stock WHERE id = ?")
                .bind(*id)
                .execute(&mut *c)
                .await
                .map(drop)
                .map_err(db),
        }
    }

    /// Quantity and version.
    pub async fn read(&mut self) -> Result<(i64, i64), Failure> {
        let row = match self {
            Inventory::Sqlite(p) => {
                let r = sqlx::query("SELECT qty, version FROM stock WHERE id = 1")
                    .fetch_one(&*p)
                    .await
                    .map_err(db)?;
                (r.get(0), r.get(1))
            }
            Inventory::Pg(c, id) => {
                let r = sqlx::query("SELECT qty, version FROM dlock_demo_stock WHERE id = $1")
                    .bind(*id)
                    .fetch_one(&mut *c)
                    .await
                    .map_err(db)?;
                (r.get(0), r.get(1))
            }
            Inventory::My(c, id) => {
                let r = sqlx::query("SELECT qty, version FROM dlock_demo_stock WHERE id = ?")
                    .bind(*id)
                    .fetch_one(&mut *c)
                    .await
                    .map_err(db)?;
                (r.get(0), r.get(1))
            }
        };
        Ok(row)
    }

    /// Write `qty` back; with `version`, only if the version is still that (optimistic
    /// concurrency: `… SET qty = ?, version = version + 1 WHERE id = ? AND version = ?`).
    /// Returns whether the row was written.
    pub async fn write(&mut self, qty: i64, version: Option<i64>) -> Result<bool, Failure> {
        let v = version.unwrap_or(-1);
        let done = match self {
            Inventory::Sqlite(p) => sqlx::query(
                "UPDATE stock SET qty = ?1, version = version + 1 \
                 WHERE id = 1 AND (?2 < 0 OR version = ?2)",
            )
            .bind(qty)
            .bind(v)
            .execute(&*p)
            .await
            .map(|r| r.rows_affected()),
            Inventory::Pg(c, id) => sqlx::query(
                "UPDATE dlock_demo_stock SET qty = $1, version = version + 1 \
                 WHERE id = $2 AND ($3 < 0 OR version = $3)",
            )
            .bind(qty)
            .bind(*id)
            .bind(v)
            .execute(&mut *c)
            .await
            .map(|r| r.rows_affected()),
            Inventory::My(c, id) => sqlx::query(
                "UPDATE dlock_demo_stock SET qty = ?, version = version + 1 \
                 WHERE id = ? AND (? < 0 OR version = ?)",
            )
            .bind(qty)
            .bind(*id)
            .bind(v)
            .bind(v)
            .execute(&mut *c)
            .await
            .map(|r| r.rows_affected()),
        };
        Ok(done.map_err(db)? == 1)
    }

    /// The pessimistic sale: `SELECT … FOR UPDATE` in a transaction, think, write,
    /// commit. Returns whether an item was sold.
    pub async fn sell_under_row_lock(&mut self, think: Duration) -> Result<bool, Failure> {
        macro_rules! sale {
            ($c:expr, $select:expr, $update:expr, $id:expr) => {{
                let mut tx = $c.begin().await.map_err(db)?;
                let qty: i64 = sqlx::query_scalar($select)
                    .bind($id)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(db)?;
                let sold = qty > 0;
                if sold {
                    tokio::time::sleep(think).await;
                    sqlx::query($update)
                        .bind(qty - 1)
                        .bind($id)
                        .execute(&mut *tx)
                        .await
                        .map_err(db)?;
                }
                tx.commit().await.map_err(db)?;
                Ok(sold)
            }};
        }
        match self {
            Inventory::Sqlite(_) => Err(Failure::internal(
                "row locks need a database server (postgres:// or mysql://)",
            )),
            Inventory::Pg(c, id) => sale!(
                c,
                "SELECT qty FROM dlock_demo_stock WHERE id = $1 FOR UPDATE",
                "UPDATE dlock_demo_stock SET qty = $1, version = version + 1 WHERE id = $2",
                *id
            ),
            Inventory::My(c, id) => sale!(
                c,
                "SELECT qty FROM dlock_demo_stock WHERE id = ? FOR UPDATE",
                "UPDATE dlock_demo_stock SET qty = ?, version = version + 1 WHERE id = ?",
                *id
            ),
        }
    }
}
