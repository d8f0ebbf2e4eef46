//! The parallel scenario of `dlock bench`: many tasks of one process cycling locks,
//! sharing the backend's connections — by default each its own lock (uncontended); with
//! `--keys K` below the task count, task `t` cycles lock `t mod K`. The floor for
//! `redis://` (own locks only) is as many tasks issuing the bare `SET NX PX` + `EVALSHA`
//! compare-and-delete on one shared multiplexed connection, in the same run.

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

pub async fn run(
    locker: &Locker,
    url: &str,
    name: &str,
    opts: &LockOptions,
    shape: Shape,
) -> Result<Parallel, Failure> {
    let Shape {
        tasks,
        keys,
        duration,
    } = shape;
    let start = Instant::now();
    let deadline = start + duration;
    let mut joins = Vec::new();
    let skips = Skips::default();
    for t in 0..tasks {
        let key = format!("{name}:{}", u64::from(t) % keys.max(1));
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
    let cycles_per_sec = total as f64 / start.elapsed().as_secs_f64();
    let floor = match crate::bench::raw_redis::bare_url(url) {
        Some(bare) if keys >= u64::from(tasks) => {
            Some(redis_floor(&bare, name, tasks, duration).await?)
        }
        _ => None,
    };
    Ok(Parallel {
        tasks,
        keys,
        cycles_per_sec,
        floor_cycles_per_sec: floor,
        ratio_to_floor: floor.map(|f| cycles_per_sec / f),
        skipped: skips.tally(),
    })
}

async fn redis_floor(
    url: &str,
    name: &str,
    tasks: u32,
    duration: Duration,
) -> Result<f64, Failure> {
    let conn = crate::bench::raw_redis::connect(url).await?;
    let start = Instant::now();
    let deadline = start + duration;
    let mut joins = Vec::new();
    for t in 0..tasks {
        let mut conn = conn.clone();
        let key = format!("dlock-bench-floor:{name}:{t}");
        let owner = dlock::Owner::random();
        joins.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                crate::bench::raw_redis::floor_cycle(&mut conn, &key, owner.as_str()).await?;
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
    Ok(total as f64 / start.elapsed().as_secs_f64())
}
