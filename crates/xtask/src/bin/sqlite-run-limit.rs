//! The least a fenced lock on SQLite must do around one command, as its own process:
//! BENCHMARKS.md's limit for `dlock run` on SQLite (`scripts/benchmarks` times it
//! beside `flock FILE true`).
//!
//! `sqlite-run-limit DB CMD [ARG…]`: open DB with the settings of dlock's default
//! (WAL, `synchronous=FULL`, the command line's `wal_autocheckpoint`), insert a lease row synced to disk (a grant whose token
//! must survive a power loss), run CMD and wait for it, delete the row written but not
//! synced (as dlock's release) — the SQLite floor of `dlock bench`, with a process
//! start, an open and a command around it. Through the same client crates as dlock
//! (tokio's current-thread runtime, sqlx); no lock wait, no renewal, no death watch.
//! Exits with CMD's code; 70 when the database fails.

use std::process::ExitCode;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{ConnectOptions, SqliteConnection};

const CREATE: &str = "CREATE TABLE IF NOT EXISTS dlock_cli_limit \
    (name TEXT PRIMARY KEY, owner TEXT NOT NULL, expires INTEGER NOT NULL) WITHOUT ROWID";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [db, command @ ..] = args.as_slice() else {
        eprintln!("usage: sqlite-run-limit DB CMD [ARG...]");
        return ExitCode::from(64);
    };
    let Some((program, rest)) = command.split_first() else {
        eprintln!("usage: sqlite-run-limit DB CMD [ARG...]");
        return ExitCode::from(64);
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sqlite-run-limit: {e}");
            return ExitCode::from(70);
        }
    };
    let code = runtime.block_on(async {
        let mut conn = open(db).await?;
        let owner = format!("{:032x}", std::process::id());
        let expires = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .saturating_add(60_000);
        let insert = "PRAGMA synchronous = FULL; \
            INSERT INTO dlock_cli_limit (name, owner, expires) VALUES ('limit', ?1, ?2)";
        let granted = sqlx::query(insert)
            .bind(&owner)
            .bind(expires)
            .execute(&mut conn)
            .await;
        if let Err(e) = granted {
            // The first run on a new file: the table, then the grant again.
            if !e.to_string().contains("no such table") {
                return Err(e);
            }
            sqlx::query(CREATE).execute(&mut conn).await?;
            sqlx::query(insert)
                .bind(&owner)
                .bind(expires)
                .execute(&mut conn)
                .await?;
        }
        let status = std::process::Command::new(program).args(rest).status();
        sqlx::query(
            "PRAGMA synchronous = NORMAL; \
             DELETE FROM dlock_cli_limit WHERE name = 'limit' AND owner = ?1",
        )
        .bind(&owner)
        .execute(&mut conn)
        .await?;
        // Left open: closing the last connection would checkpoint the WAL on the way
        // out, which dlock's connections never do (the sqlite module's docs).
        std::mem::forget(conn);
        Ok::<_, sqlx::Error>(status)
    });
    match code {
        Ok(Ok(status)) => ExitCode::from(u8::try_from(status.code().unwrap_or(1)).unwrap_or(1)),
        Ok(Err(e)) => {
            eprintln!("sqlite-run-limit: cannot run {program:?}: {e}");
            ExitCode::from(127)
        }
        Err(e) => {
            eprintln!("sqlite-run-limit: {db}: {e}");
            ExitCode::from(70)
        }
    }
}

async fn open(db: &str) -> Result<SqliteConnection, sqlx::Error> {
    SqliteConnectOptions::from_str("sqlite://limit")?
        .filename(db)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        // As `dlock run` keeps it.
        .pragma(
            "wal_autocheckpoint",
            dlock::sqlite::SHORT_LIVED_WAL_PAGES.to_string(),
        )
        .connect()
        .await
}
