//! `dlock demo flash-sale`: the classic oversell, then the same sale protected.
//!
//! The stock (quantity and version) lives in a small SQLite "inventory" file, or, when
//! the lock URL is `postgres://` / `mysql://` / `mariadb://`, in a row of that database.
//! Every buyer does a deliberately racy read-check-write: read the stock, think, write
//! back stock − 1. Worker *processes* run the buyers under each strategy in turn: none,
//! an optimistic version-checked write, `SELECT … FOR UPDATE` on the stock row (database
//! servers only), and a dlock lock.

mod inventory;

use std::time::{Duration, Instant};

use dlock::Locker;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::args::{DemoWorkerArgs, FlashSaleArgs, Strategy};
use crate::bench::stats::{Latency, micros, show_us};
use crate::demo::inventory::Inventory;
use crate::exit::Failure;
use crate::fleet::{Fleet, emit, numbers};
use crate::output::outln;

/// An optimistic buyer gives up after this many conflicts in a row.
const MAX_CONFLICTS: u64 = 100_000;

struct Outcome {
    strategy: Strategy,
    sold: u64,
    final_stock: i64,
    elapsed: Duration,
    waits: Latency,
    conflicts: u64,
}

pub async fn flash_sale(args: FlashSaleArgs) -> Result<i32, Failure> {
    let dir = tempfile::tempdir().map_err(|e| Failure::internal(e.to_string()))?;
    let lock_url = crate::exit::scratch_url(args.url.as_deref(), dir.path(), "locks.db");
    // Fail early, with a clear message, on a bad URL.
    let locker = Locker::connect(&lock_url).await?;
    let spec = if crate::bench::raw_sql::target(&lock_url).is_some() {
        lock_url.clone()
    } else {
        dir.path().join("inventory.db").display().to_string()
    };
    // This run's stock row (databases may hold other runs' rows).
    let stock_id = i64::from_str_radix(&dlock::Owner::random().as_str()[..15], 16).unwrap_or(1);
    let mut inventory = Inventory::open(&spec, stock_id).await?;
    let strategies: &[Strategy] = if inventory.is_server() {
        &[
            Strategy::None,
            Strategy::Optimistic,
            Strategy::RowLock,
            Strategy::Dlock,
        ]
    } else {
        &[Strategy::None, Strategy::Optimistic, Strategy::Dlock]
    };
    outln!(
        "flash sale: {} items, {} buyers, {} worker processes, lock at {}, stock in {}",
        args.stock,
        args.buyers,
        args.workers,
        locker.url(),
        if inventory.is_server() {
            "that database"
        } else {
            "an SQLite file"
        }
    );
    let lock_name = format!("flash-sale:{}", dlock::Owner::random());
    let mut outcomes = Vec::new();
    for &strategy in strategies {
        inventory.reset(i64::from(args.stock)).await?;
        let phase = Phase {
            args: &args,
            strategy,
            lock_url: &lock_url,
            spec: &spec,
            stock_id,
            lock_name: &lock_name,
        };
        outcomes.push(phase.run(&mut inventory).await?);
    }
    inventory.remove().await?;

    outln!();
    outln!(
        "{:<11} {:>6} {:>9} {:>12} {:>10} {:>10} {:>10} {:>10}",
        "strategy",
        "sold",
        "oversold",
        "final stock",
        "buyers/s",
        "p50 wait",
        "p99 wait",
        "conflicts"
    );
    let expected = u64::from(args.stock.min(args.buyers));
    let mut all_exact = true;
    for o in &outcomes {
        let (p50, p99) = match o.strategy {
            Strategy::Dlock => (show_us(o.waits.p50_us), show_us(o.waits.p99_us)),
            _ => ("-".to_owned(), "-".to_owned()),
        };
        outln!(
            "{:<11} {:>6} {:>9} {:>12} {:>10.0} {:>10} {:>10} {:>10}",
            o.strategy.name(),
            o.sold,
            o.sold.saturating_sub(u64::from(args.stock)),
            o.final_stock,
            f64::from(args.buyers) / o.elapsed.as_secs_f64(),
            p50,
            p99,
            o.conflicts
        );
        let exact = o.sold == expected
            && o.final_stock == i64::from(args.stock) - i64::try_from(o.sold).unwrap_or(0);
        if o.strategy != Strategy::None && !exact {
            all_exact = false;
            outln!(
                "UNEXPECTED: {} sold {} (expected {expected})",
                o.strategy.name(),
                o.sold
            );
        }
    }
    outln!();
    if !all_exact {
        return Ok(1);
    }
    outln!(
        "every protected strategy sold exactly {expected}, stock consistent. Without \
         protection, a read-check-write from several processes oversells."
    );
    Ok(0)
}

/// One strategy's run.
struct Phase<'a> {
    args: &'a FlashSaleArgs,
    strategy: Strategy,
    lock_url: &'a str,
    spec: &'a str,
    stock_id: i64,
    lock_name: &'a str,
}

impl Phase<'_> {
    async fn run(&self, inventory: &mut Inventory) -> Result<Outcome, Failure> {
        let (args, strategy) = (self.args, self.strategy);
        let bar = ProgressBar::new(u64::from(args.buyers));
        bar.set_style(
            ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} buyers {msg}")
                .map_err(|e| Failure::internal(e.to_string()))?
                .progress_chars("=> "),
        );
        bar.set_prefix(format!("{:<10}", strategy.name()));
        let mut arg_lists = Vec::new();
        for w in 0..args.workers {
            let share = args.buyers / args.workers + u32::from(w < args.buyers % args.workers);
            arg_lists.push(vec![
                "demo-worker".to_owned(),
                "--url".to_owned(),
                self.lock_url.to_owned(),
                "--inventory".to_owned(),
                self.spec.to_owned(),
                "--stock-id".to_owned(),
                self.stock_id.to_string(),
                "--strategy".to_owned(),
                strategy.name().to_owned(),
                "--buyers".to_owned(),
                share.to_string(),
                "--lock-name".to_owned(),
                self.lock_name.to_owned(),
                "--think".to_owned(),
                format!("{}us", args.think.as_micros()),
            ]);
        }
        let start = Instant::now();
        let mut fleet = Fleet::spawn(arg_lists)?;
        let mut sold = 0u64;
        let mut conflicts = 0u64;
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
                Some("done") => {
                    waits.extend(numbers(&event["waits_us"]));
                    conflicts += event["conflicts"].as_u64().unwrap_or(0);
                }
                _ => {}
            }
        }
        fleet.wait().await?;
        let elapsed = start.elapsed();
        bar.finish();
        Ok(Outcome {
            strategy,
            sold,
            final_stock: inventory.read().await?.0,
            elapsed,
            waits: Latency::of(&waits),
            conflicts,
        })
    }
}

/// One worker process: `buyers` racy read-check-writes, optionally under the lock.
pub async fn worker(args: DemoWorkerArgs) -> Result<i32, Failure> {
    let mut inventory = Inventory::open(&args.inventory, args.stock_id).await?;
    let locker = match args.strategy {
        Strategy::Dlock => Some(Locker::connect(&args.url).await?),
        _ => None,
    };
    let mut waits = Vec::new();
    let mut conflicts = 0u64;
    for _ in 0..args.buyers {
        let sold = match args.strategy {
            Strategy::RowLock => inventory.sell_under_row_lock(args.think).await?,
            Strategy::Optimistic => {
                let mut in_a_row = 0u64;
                loop {
                    let (qty, version) = inventory.read().await?;
                    if qty <= 0 {
                        break false;
                    }
                    tokio::time::sleep(args.think).await;
                    if inventory.write(qty - 1, Some(version)).await? {
                        break true;
                    }
                    conflicts += 1;
                    in_a_row += 1;
                    if in_a_row >= MAX_CONFLICTS {
                        return Err(Failure::internal("optimistic buyer: too many conflicts"));
                    }
                }
            }
            Strategy::None | Strategy::Dlock => {
                let t0 = Instant::now();
                let guard = match &locker {
                    Some(l) => Some(l.lock(&args.lock_name).await?),
                    None => None,
                };
                if guard.is_some() {
                    waits.push(micros(t0.elapsed()));
                }
                // The racy part: read, decide, think, write back an absolute value.
                let (qty, _) = inventory.read().await?;
                let sold = qty > 0;
                if sold {
                    tokio::time::sleep(args.think).await;
                    inventory.write(qty - 1, None).await?;
                }
                if let Some(g) = guard {
                    g.release().await?;
                }
                sold
            }
        };
        emit(&json!({"t": "buyer", "sold": sold}));
    }
    emit(&json!({"t": "done", "waits_us": waits, "conflicts": conflicts}));
    Ok(0)
}
