//! The parallel scenario of `dlock bench`: many tasks of one process cycling locks,
//! sharing the backend's connections — by default each its own lock (uncontended); with
//! `--keys K` below the task count, task `t` cycles lock `t mod K`. The floor for
//! `redis://` (own locks only) is as many tasks issuing the bare `SET NX PX` + `EVALSHA`
//! compare-and-delete on one shared multiplexed connection, its limit as many tasks
//! cycling the least fenced lock on it, and its layout limit the least fenced lock in
//! Redisson's layout, dlock's default, that knows its holds by acquisition; the four
//! sides take turns over [`ROUNDS`] rounds of the same run.

use std::time::{Duration, Instant};

use dlock::{LockOptions, Locker};
use serde::Serialize;

use crate::bench::raw_redis::Counted;
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
    /// With the limit: as many tasks cycling the least fenced lock in Redisson's layout
    /// (`raw_redis::hash_fenced_cycle`), in the same run.
    pub layout_limit_cycles_per_sec: Option<f64>,
    /// dlock's cycles per second over the layout limit's.
    pub ratio_to_layout_limit: Option<f64>,
    /// Where there is a limit: what one cycle of each side cost the server in this
    /// run, by its own statistics.
    pub server_us_per_cycle: Option<ServerTime>,
    /// Retryable errors stepped over (`skips.rs`): failed acquisitions are not counted.
    pub skipped: Skipped,
}

/// Server microseconds per cycle of each side, from `INFO commandstats` read before and
/// after each side's turn: the time the server counts for the commands the side sends
/// (a script's includes the calls it makes). With many tasks the server's time per
/// cycle weighs in full, so this says how much of a gap to the limit is the server's.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ServerTime {
    /// dlock's cycle: its acquire and release scripts.
    pub dlock_us: f64,
    /// The floor's: `SET NX PX` and the compare-and-delete.
    pub floor_us: f64,
    /// The limit's: its grant script and the compare-and-delete.
    pub limit_us: f64,
    /// The layout limit's: its grant and release scripts.
    pub layout_limit_us: f64,
}

/// What the sides send: dlock's and the limit's cycles are scripts; the floor's a `SET`
/// and a script (no script of any side makes a top-level `SET`).
const SCRIPTS: &[&str] = &["evalsha", "eval"];
const FLOOR_COMMANDS: &[&str] = &["set", "evalsha", "eval"];

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

/// Cycles done, the time they took, and what the server counted for them, summed over
/// rounds.
#[derive(Default)]
struct Tally {
    cycles: u64,
    elapsed: Duration,
    server: Counted,
}

impl Tally {
    fn add(&mut self, (cycles, elapsed): (u64, Duration), server: Counted) {
        self.cycles += cycles;
        self.elapsed += elapsed;
        self.server = self.server + server;
    }

    fn per_sec(&self) -> f64 {
        self.cycles as f64 / self.elapsed.as_secs_f64().max(f64::MIN_POSITIVE)
    }

    fn server_us(&self) -> f64 {
        self.server.usec as f64 / self.cycles.max(1) as f64
    }
}

/// [`Counted`] for `commands` on the bare connection; nothing without one.
async fn server_stats(
    conn: Option<&redis::aio::ConnectionManager>,
    commands: &[&str],
) -> Result<Counted, Failure> {
    match conn {
        Some(conn) => crate::bench::raw_redis::command_stats(&mut conn.clone(), commands).await,
        None => Ok(Counted::default()),
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
    let (mut ours, mut floor) = (Tally::default(), Tally::default());
    let (mut limit, mut layout_limit) = (Tally::default(), Tally::default());
    for _ in 0..ROUNDS {
        let before = server_stats(bare.as_ref(), SCRIPTS).await?;
        let burst = dlock_burst(locker, name, opts, shape, share, &skips).await?;
        ours.add(burst, server_stats(bare.as_ref(), SCRIPTS).await? - before);
        if let Some(conn) = &bare {
            for (side, commands, sum) in [
                (Bare::Floor, FLOOR_COMMANDS, &mut floor),
                (Bare::Limit, SCRIPTS, &mut limit),
                (Bare::LayoutLimit, SCRIPTS, &mut layout_limit),
            ] {
                let before = server_stats(Some(conn), commands).await?;
                let burst = bare_burst(conn, name, shape.tasks, share, side).await?;
                sum.add(burst, server_stats(Some(conn), commands).await? - before);
            }
        }
    }
    if let Some(conn) = &bare {
        forget_limit_counters(conn, name, shape.tasks).await;
    }
    let cycles_per_sec = ours.per_sec();
    let floor_rate = bare.as_ref().map(|_| floor.per_sec());
    let limit_rate = bare.as_ref().map(|_| limit.per_sec());
    let layout_rate = bare.as_ref().map(|_| layout_limit.per_sec());
    Ok(Parallel {
        tasks: shape.tasks,
        keys: shape.keys,
        cycles_per_sec,
        floor_cycles_per_sec: floor_rate,
        ratio_to_floor: floor_rate.map(|f| cycles_per_sec / f),
        limit_cycles_per_sec: limit_rate,
        ratio_to_limit: limit_rate.map(|l| cycles_per_sec / l),
        layout_limit_cycles_per_sec: layout_rate,
        ratio_to_layout_limit: layout_rate.map(|l| cycles_per_sec / l),
        server_us_per_cycle: bare.as_ref().map(|_| ServerTime {
            dlock_us: ours.server_us(),
            floor_us: floor.server_us(),
            limit_us: limit.server_us(),
            layout_limit_us: layout_limit.server_us(),
        }),
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
    /// `raw_redis::hash_fenced_cycle`: the least fenced lock in Redisson's layout.
    LayoutLimit,
}

/// The limit's (`side` "limit") or the layout limit's ("layout-limit") key of task `t`.
fn limit_key(side: &str, name: &str, t: u32) -> String {
    format!("dlock-bench-{side}:{name}:{t}")
}

/// Its token counter.
fn limit_counter(side: &str, name: &str, t: u32) -> String {
    format!("{}:token", limit_key(side, name, t))
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
            Bare::Limit => (limit_key("limit", name, t), limit_counter("limit", name, t)),
            Bare::LayoutLimit => (
                limit_key("layout-limit", name, t),
                limit_counter("layout-limit", name, t),
            ),
        };
        let channel = format!("{key}:channel");
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
                    Bare::LayoutLimit => {
                        // A nonce per acquisition (unique on its key while the round
                        // runs), as long as dlock's.
                        let nonce = format!("{t:016x}{n:016x}");
                        crate::bench::raw_redis::hash_fenced_cycle(
                            &mut conn,
                            &key,
                            &counter,
                            &channel,
                            owner.as_str(),
                            &nonce,
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

/// Delete the limits' token counters (each cycle deletes its lock key itself).
async fn forget_limit_counters(conn: &redis::aio::ConnectionManager, name: &str, tasks: u32) {
    let mut conn = conn.clone();
    let mut del = redis::cmd("DEL");
    for t in 0..tasks {
        del.arg(limit_counter("limit", name, t));
        del.arg(limit_counter("layout-limit", name, t));
    }
    let _: redis::RedisResult<i64> = del.query_async(&mut conn).await;
}
