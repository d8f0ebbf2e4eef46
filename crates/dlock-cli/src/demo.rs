//! `dlock demo flash-sale`: the classic oversell, then the same sale under dlock.
//!
//! The stock lives in its own small SQLite "inventory" file (the protected resource).
//! Every buyer does a deliberately racy read-check-write: read the stock, think, write
//! back stock − 1. Worker *processes* run the buyers, first unprotected, then with the
//! read-check-write inside a dlock lock.

use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

use dlock::Locker;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqlitePool};

use crate::args::{DemoWorkerArgs, FlashSaleArgs, Strategy};
use crate::exit::Failure;
use crate::fleet::{Fleet, emit, numbers};
use crate::stats::{Latency, micros, show_us};

async fn inventory(path: &Path) -> Result<SqlitePool, Failure> {
    let opts = SqliteConnectOptions::from_str("sqlite://inventory")
        .map_err(|e| Failure::internal(e.to_string()))?
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Off)
        .busy_timeout(Duration::from_secs(30));
    SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(opts)
        .await
        .map_err(|e| Failure::internal(format!("inventory: {e}")))
}

fn db(e: sqlx::Error) -> Failure {
    Failure::internal(format!("inventory: {e}"))
}

async fn read_stock(pool: &SqlitePool) -> Result<i64, Failure> {
    let row = sqlx::query("SELECT qty FROM stock WHERE id = 1")
        .fetch_one(pool)
        .await
        .map_err(db)?;
    Ok(row.get(0))
}

struct Outcome {
    strategy: Strategy,
    sold: u64,
    final_stock: i64,
    elapsed: Duration,
    waits: Latency,
}

pub async fn flash_sale(args: FlashSaleArgs) -> Result<i32, Failure> {
    let dir = tempfile::tempdir().map_err(|e| Failure::internal(e.to_string()))?;
    let lock_url = crate::exit::scratch_url(args.url.as_deref(), dir.path(), "locks.db");
    // Fail early, with a clear message, on a bad URL.
    let locker = Locker::connect(&lock_url).await?;
    let inventory_path = dir.path().join("inventory.db");
    let pool = inventory(&inventory_path).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS stock (id INTEGER PRIMARY KEY, qty INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .map_err(db)?;

    println!(
        "flash sale: {} items, {} buyers, {} worker processes, lock at {}",
        args.stock,
        args.buyers,
        args.workers,
        locker.url()
    );
    let lock_name = format!("flash-sale:{}", dlock::Owner::random());
    let mut outcomes = Vec::new();
    for strategy in [Strategy::None, Strategy::Dlock] {
        sqlx::query("INSERT OR REPLACE INTO stock (id, qty) VALUES (1, ?1)")
            .bind(i64::from(args.stock))
            .execute(&pool)
            .await
            .map_err(db)?;
        outcomes.push(
            run_phase(
                &args,
                strategy,
                &lock_url,
                &inventory_path,
                &lock_name,
                &pool,
            )
            .await?,
        );
    }

    println!();
    println!(
        "{:<10} {:>6} {:>9} {:>12} {:>10} {:>12} {:>12}",
        "strategy", "sold", "oversold", "final stock", "buyers/s", "p50 wait", "p99 wait"
    );
    let expected = u64::from(args.stock.min(args.buyers));
    for o in &outcomes {
        let label = match o.strategy {
            Strategy::None => "none",
            Strategy::Dlock => "dlock",
        };
        let (p50, p99) = match o.strategy {
            Strategy::None => ("-".to_owned(), "-".to_owned()),
            Strategy::Dlock => (show_us(o.waits.p50_us), show_us(o.waits.p99_us)),
        };
        println!(
            "{:<10} {:>6} {:>9} {:>12} {:>10.0} {:>12} {:>12}",
            label,
            o.sold,
            o.sold.saturating_sub(u64::from(args.stock)),
            o.final_stock,
            f64::from(args.buyers) / o.elapsed.as_secs_f64(),
            p50,
            p99
        );
    }
    let locked = outcomes
        .iter()
        .find(|o| o.strategy == Strategy::Dlock)
        .ok_or_else(|| Failure::internal("no locked phase"))?;
    let consistent = locked.sold == expected
        && locked.final_stock == i64::from(args.stock) - i64::try_from(locked.sold).unwrap_or(0);
    println!();
    if consistent {
        println!(
            "under dlock: exactly {} sold, stock consistent. Without a lock, a read-check-write \
             from several processes oversells.",
            locked.sold
        );
        Ok(0)
    } else {
        println!(
            "UNEXPECTED: under dlock {} sold (expected {expected})",
            locked.sold
        );
        Ok(1)
    }
}

async fn run_phase(
    args: &FlashSaleArgs,
    strategy: Strategy,
    lock_url: &str,
    inventory_path: &Path,
    lock_name: &str,
    pool: &SqlitePool,
) -> Result<Outcome, Failure> {
    let label = match strategy {
        Strategy::None => "no lock",
        Strategy::Dlock => "dlock  ",
    };
    let bar = ProgressBar::new(u64::from(args.buyers));
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} buyers {msg}")
            .map_err(|e| Failure::internal(e.to_string()))?
            .progress_chars("=> "),
    );
    bar.set_prefix(label);
    let mut arg_lists = Vec::new();
    for w in 0..args.workers {
        let share = args.buyers / args.workers + u32::from(w < args.buyers % args.workers);
        arg_lists.push(vec![
            "demo-worker".to_owned(),
            "--url".to_owned(),
            lock_url.to_owned(),
            "--inventory".to_owned(),
            inventory_path.display().to_string(),
            "--strategy".to_owned(),
            match strategy {
                Strategy::None => "none".to_owned(),
                Strategy::Dlock => "dlock".to_owned(),
            },
            "--buyers".to_owned(),
            share.to_string(),
            "--lock-name".to_owned(),
            lock_name.to_owned(),
            "--think".to_owned(),
            format!("{}us", args.think.as_micros()),
        ]);
    }
    let start = Instant::now();
    let mut fleet = Fleet::spawn(arg_lists)?;
    let mut sold = 0u64;
    let mut waits = Vec::new();
    while let Some((_, event)) = fleet.next().await {
        match event["t"].as_str() {
            Some("buyer") => {
                bar.inc(1);
                if event["sold"].as_bool() == Some(true) {
                    sold += 1;
                    bar.set_message(format!("{sold} sold"));
                }
            }
            Some("done") => waits.extend(numbers(&event["waits_us"])),
            _ => {}
        }
    }
    fleet.wait().await?;
    let elapsed = start.elapsed();
    bar.finish();
    Ok(Outcome {
        strategy,
        sold,
        final_stock: read_stock(pool).await?,
        elapsed,
        waits: Latency::of(&waits),
    })
}

/// One worker process: `buyers` racy read-check-writes, optionally under the lock.
pub async fn worker(args: DemoWorkerArgs) -> Result<i32, Failure> {
    let pool = inventory(&args.inventory).await?;
    let locker = match args.strategy {
        Strategy::Dlock => Some(Locker::connect(&args.url).await?),
        Strategy::None => None,
    };
    let mut waits = Vec::new();
    for _ in 0..args.buyers {
        let t0 = Instant::now();
        let guard = match &locker {
            Some(l) => Some(l.lock(&args.lock_name).await?),
            None => None,
        };
        if guard.is_some() {
            waits.push(micros(t0.elapsed()));
        }
        // The racy part: read, decide, think, write back an absolute value.
        let qty = read_stock(&pool).await?;
        let sold = qty > 0;
        if sold {
            tokio::time::sleep(args.think).await;
            sqlx::query("UPDATE stock SET qty = ?1 WHERE id = 1")
                .bind(qty - 1)
                .execute(&pool)
                .await
                .map_err(db)?;
        }
        if let Some(g) = guard {
            g.release().await?;
        }
        emit(&json!({"t": "buyer", "sold": sold}));
    }
    emit(&json!({"t": "done", "waits_us": waits}));
    Ok(0)
}
