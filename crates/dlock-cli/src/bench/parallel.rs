//! The parallel scenario of `dlock bench`: many tasks of one process cycling locks,
//! sharing the backend's connections — by default each its own lock (uncontended); with
//! `--keys K` below the task count, task `t` cycles lock `t mod K`. The floor for
//! `redis://` (own locks only) is as many tasks issuing the bare `SET NX PX` + `EVALSHA`
//! compare-and-delete on one shared multiplexed connection, and its limit as many
//! tasks cycling the least fenced lock on it; the three sides take turns over
//! [`ROUNDS`] rounds of the same run.

use std::time::{Duration, Instant};

use dlock::{LockOptions, Locker};
use serde::Serialize;

use crate::bench::skips::{Skipped, Skips};
use crate::exit::Failure;

/// Figures of one parallel run.
#[derive(Debug, Serialize)]
pub struct Parallel {
    pub tasks: u32,
    /// Distinct locks the tasks cycle.
    pub keys: u64,
    pub cycles_per_sec: f64,
    pub floor_cycles_per_sec: Option<f64>,
    pub ratio_to_floor: Option<f64>,
    /// `redis://`, own locks only: as many tasks cycling the least fenced lock
    /// (`raw_redis::fenced_cycle`) on one shared connection, in the same run.
    pub limit_cycles_per_sec: Option<f64>,
    /// dlock's cycles per second over the limit's.
    pub ratio_to_limit: Option<f64>,
    /// Retryable errors stepped over (`skips.rs`): failed acquisitions are not counted.
    pub skipped: Skipped,
}

/// How many tasks, on how many locks, for how long.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub tasks: u32,
    pub keys: u64,
    pub duration: Duration,
}

/// Rounds each side runs, in turn (dlock, the floor, the limit), for a share of the
/// duration each: a server or a machine that drifts over the run weighs on every side.
const ROUNDS: u32 = 3;

/// Cycles done and the time they took, summed over rounds.
#[derive(Default)]
struct Tally {
    cycles: u64,
    elapsed: Duration,
}

impl Tally {
    fn add(&mut self, (cycles, elapsed): (u64, Duration)) {
        self.cycles += cycles;
        self.elapsed += elapsed;
    }

    fn per_sec(&self) -> f64 {
        self.cycles as f64 / self.elapsed.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

pub async fn run(
    locker: &Locker,
    url: &str,
    name: &str,
    opts: &LockOptions,
    shape: Shape,
) -> Result<Parallel, Failure> {
    let skips = Skips::default();
    // The bare sides need one lock per task, as dlock's side then has.
    let bare = match crate::bench::raw_redis::bare_url(url) {
        Some(bare) if shape.keys >= u64::from(shape.tasks) => {
            Some(crate::bench::raw_redis::connect(&bare).await?)
        }
        _ => None,
    };
    let share = shape.duration / ROUNDS;
    let (mut ours, mut floor, mut limit) = (Tally::default(), Tally::default(), Tally::default());
    for _ in 0..ROUNDS {
        ours.add(dlock_burst(locker, name, opts, shape, share, &skips).await?);
        if let Some(conn) = &bare {
            floor.add(bare_burst(conn, name, shape.tasks, share, Bare::Floor).await?);
            limit.add(bare_burst(conn, name, shape.tasks, share, Bare::Limit).await?);
        }
    }
    if let Some(conn) = &bare {
        forget_limit_counters(conn, name, shape.tasks).await;
    }
    let cycles_per_sec = ours.per_sec();
    let floor = bare.as_ref().map(|_| floor.per_sec());
    let limit = bare.as_ref().map(|_| limit.per_sec());
    Ok(Parallel {
        tasks: shape.tasks,
        keys: shape.keys,
        cycles_per_sec,
        floor_cycles_per_sec: floor,
        ratio_to_floor: floor.map(|f| cycles_per_sec / f),
        limit_cycles_per_sec: limit,
        ratio_to_limit: limit.map(|l| cycles_per_sec / l),
        skipped: skips.tally(),
    })
}

/// dlock's side for `share`: every task cycling its lock.
async fn dlock_burst(
    locker: &Locker,
    name: &str,
    opts: &LockOptions,
    shape: Shape,
    share: Duration,
    skips: &Skips,
) -> Result<(u64, Duration), Failure> {
    let start = Instant::now();
    let deadline = start + share;
    let mut joins = Vec::new();
    for t in 0..shape.tasks {
        let key = format!("{name}:{}", u64::from(t) % shape.keys.max(1));
        let (locker, opts, skips) = (locker.clone(), opts.clone(), skips.clone());
        joins.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                match locker.lock_with(&key, &opts).await {
                    Ok(g) => {
                        skips.release(g).await?;
                        n += 1;
                    }
                    Err(e) => skips.step_over(e)?,
                }
            }
            Ok::<u64, dlock::Error>(n)
        }));
    }
    let mut total = 0;
    for j in joins {
        total += j.await.map_err(|e| Failure::internal(e.to_string()))??;
    }
    Ok((total, start.elapsed()))
}

/// Which bare cycle a bare side runs.
#[derive(Debug, Clone, Copy)]
enum Bare {
    /// `raw_redis::floor_cycle`: `SET NX PX` + compare-and-delete, no token.
    Floor,
    /// `raw_redis::fenced_cycle`: the least fenced lock.
    Limit,
}

/// The limit's token counter of task `t`.
fn limit_counter(name: &str, t: u32) -> String {
    format!("dlock-bench-limit:{name}:{t}:token")
}

/// A bare side for `share`: as many tasks, each its own key, on one shared connection.
async fn bare_burst(
    conn: &redis::aio::ConnectionManager,
    name: &str,
    tasks: u32,
    share: Duration,
    bare: Bare,
) -> Result<(u64, Duration), Failure> {
    let start = Instant::now();
    let deadline = start + share;
    let mut joins = Vec::new();
    for t in 0..tasks {
        let mut conn = conn.clone();
        let (key, counter) = match bare {
            Bare::Floor => (format!("dlock-bench-floor:{name}:{t}"), String::new()),
            Bare::Limit => (
                format!("dlock-bench-limit:{name}:{t}"),
                limit_counter(name, t),
            ),
        };
        let owner = dlock::Owner::random();
        joins.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                match bare {
                    Bare::Floor => {
                        crate::bench::raw_redis::floor_cycle(&mut conn, &key, owner.as_str())
                            .await?;
                    }
                    Bare::Limit => {
                        crate::bench::raw_redis::fenced_cycle(
                            &mut conn,
                            &key,
                            &counter,
                            owner.as_str(),
                        )
                        .await?;
                    }
                }
                n += 1;
            }
            Ok::<u64, redis::RedisError>(n)
        }));
    }
    let mut total = 0;
    for j in joins {
        total += j
            .await
            .map_err(|e| Failure::internal(e.to_string()))?
            .map_err(crate::bench::raw_redis::err)?;
    }
    Ok((total, start.elapsed()))
}

/// Delete the limit's token counters (each cycle deletes its lock key itself).
async fn forget_limit_counters(conn: &redis::aio::ConnectionManager, name: &str, tasks: u32) {
    let mut conn = conn.clone();
    let mut del = redis::cmd("DEL");
    for t in 0..tasks {
        del.arg(limit_counter(name, t));
    }
    let _: redis::RedisResult<i64> = del.query_async(&mut conn).await;
}
