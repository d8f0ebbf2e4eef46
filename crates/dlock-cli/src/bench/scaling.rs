//! The scaling scenario of `dlock bench`: how the cost of one lock grows with what else
//! the backend and the client keep. Two series, through one `Locker`:
//!
//! - **held names**: with N other distinct locks held (`--scale-held`, default 1,
//!   1,000 and 100,000; auto-renewed, taken by 64 tasks), `--cycles` (at most 1,000)
//!   acquire + release cycles of one more lock: the acquire's and the release's latency,
//!   and the client's resident memory per held lock.
//! - **waiters**: with W tasks waiting on one name behind its holder (`--scale-waiters`,
//!   default 1, 10, 100 and 1,000; the hand-off run with W + 1 tasks for `--duration`):
//!   hand-offs per second and their latency (release → next grant), the requests per
//!   grant the server counted where it counts them, and the client's CPU per grant.
//!
//! A level that cannot be reached — its locks not all taken within [`FILL_LIMIT`] (on
//! SQLite, renewing that many locks every third of their lease takes more commits
//! than the file can do), one of them lost before its cycles ended, its cycles not
//! done within [`CYCLES_LIMIT`], or an error (a backend that pins a connection per
//! held lock runs out of them) — ends its series with the reason; the levels measured
//! before it stay. The waiters series runs first, since the held one ends with its locks given
//! back for [`GIVE_BACK_LIMIT`](crate::bench::hold::GIVE_BACK_LIMIT) at most.

use std::time::{Duration, Instant};

use dlock::{LockOptions, Locker};
use serde::Serialize;

use crate::bench::handoff::Waiting;
use crate::bench::hold::{cpu_seconds, give_back, take_many, trimmed_rss_bytes};
use crate::bench::raw_sql::SqlConn;
use crate::bench::skips::{Skipped, Skips};
use crate::bench::stats::{Latency, micros};
use crate::exit::Failure;

/// How long one level of held names may take to fill.
const FILL_LIMIT: Duration = Duration::from_secs(60);
/// How long the timed cycles of one level may take.
const CYCLES_LIMIT: Duration = Duration::from_secs(60);
/// The most cycles timed at each level of held names.
const MAX_CYCLES: u32 = 1000;
/// Below this many held locks, memory per lock is noise and not reported.
const MEMORY_FROM: u64 = 1000;

/// The two series.
#[derive(Debug, Serialize)]
pub struct Scaling {
    pub held: Vec<HeldLevel>,
    /// Why the held series ended before its last level.
    pub held_stopped: Option<String>,
    pub waiters: Vec<WaitersLevel>,
    /// Why the waiters series ended before its last level.
    pub waiters_stopped: Option<String>,
    /// What the server counted as requests (`requests_per_grant`): `None` where it
    /// keeps no such count the bench reads.
    pub requests_counted: Option<&'static str>,
}

/// One level of the held series.
#[derive(Debug, Serialize)]
pub struct HeldLevel {
    /// Other locks held while the cycles ran.
    pub held: u64,
    /// How long taking the locks added at this level took.
    pub fill_seconds: f64,
    pub acquire: Latency,
    pub release: Latency,
    /// Resident memory now less before the first level, per held lock (from
    /// [`MEMORY_FROM`] locks on; with glibc both are read after the allocator gave
    /// back its free pages, so what the waiters series freed hides nothing).
    pub rss_per_held_lock_bytes: Option<f64>,
    /// Cycles stepped over on a retryable error, in the acquire or the release: not
    /// timed, so fewer than `--cycles` are (`skips.rs`).
    pub skipped: Skipped,
}

/// One level of the waiters series.
#[derive(Debug, Serialize)]
pub struct WaitersLevel {
    pub waiters: u32,
    pub grants: u64,
    /// Grants to any task, the holder's own re-takes included.
    pub grants_per_sec: f64,
    pub handoffs_per_sec: f64,
    /// Release → next grant to a different task.
    pub handoff: Latency,
    pub requests_per_grant: Option<f64>,
    pub client_cpu_us_per_grant: f64,
    /// Retryable errors stepped over (`skips.rs`): failed acquisitions are not counted.
    pub skipped: Skipped,
}

/// What the scenario runs with.
#[derive(Debug, Clone)]
pub struct Shape {
    pub held: Vec<u64>,
    pub waiters: Vec<u32>,
    pub cycles: u32,
    pub duration: Duration,
}

/// A running count of client requests the server keeps.
enum Counter {
    /// The lock commands' calls (`INFO commandstats`).
    Redis(String),
    /// The store's revision: one per write.
    Etcd(dlock::etcd::RawClient),
    /// `Questions`: statements clients sent (the count's own reads among them).
    Mysql(SqlConn),
}

impl Counter {
    async fn for_url(url: &str) -> Result<Option<Self>, Failure> {
        if let Some(bare) = crate::bench::raw_redis::bare_url(url) {
            return Ok(Some(Counter::Redis(bare)));
        }
        if let Some(client) = crate::bench::floor::etcd_client(url).await? {
            return Ok(Some(Counter::Etcd(client)));
        }
        if let Some((scheme, _)) = crate::bench::raw_sql::target(url)
            && !scheme.starts_with("postgres")
        {
            return Ok(Some(Counter::Mysql(SqlConn::connect(url).await?)));
        }
        Ok(None)
    }

    fn what(&self) -> &'static str {
        match self {
            Counter::Redis(_) => "commands (EVALSHA, EVAL, SUBSCRIBE, UNSUBSCRIBE)",
            Counter::Etcd(_) => "writes (revisions)",
            Counter::Mysql(_) => "statements (`Questions`)",
        }
    }

    async fn read(&mut self) -> Result<u64, Failure> {
        match self {
            Counter::Redis(u) => {
                crate::bench::raw_redis::command_calls(u, crate::bench::handoff::LOCK_COMMANDS)
                    .await
            }
            Counter::Etcd(c) => crate::bench::floor::etcd_revision(c, "dlock-bench-scaling")
                .await
                .map(|r| u64::try_from(r).unwrap_or(0)),
            Counter::Mysql(c) => c
                .one_i64(
                    "SELECT $1::int8",
                    "SELECT CAST(VARIABLE_VALUE AS SIGNED) + ? FROM information_schema.GLOBAL_STATUS \
                     WHERE VARIABLE_NAME = 'QUESTIONS'",
                    0,
                )
                .await
                .map(|q| u64::try_from(q.unwrap_or(0)).unwrap_or(0)),
        }
    }

    /// The clients' requests between two reads.
    fn between(&self, before: u64, after: u64) -> u64 {
        match self {
            // The second read counts itself (the first one counted before its value).
            Counter::Mysql(_) => after.saturating_sub(before).saturating_sub(1),
            _ => after.saturating_sub(before),
        }
    }
}

/// Run both series on `locker` under names beginning with `prefix`.
pub async fn run(
    locker: &Locker,
    url: &str,
    prefix: &str,
    opts: &LockOptions,
    shape: Shape,
) -> Result<Scaling, Failure> {
    // The waiters first: the held series leaves its locks behind it, giving back what
    // it can within [`GIVE_BACK_LIMIT`].
    // Without the server's count the series still runs (its requests are then `None`).
    let mut counter = Counter::for_url(url).await.ok().flatten();
    let mut waiters = Vec::new();
    let mut waiters_stopped = None;
    for (i, &w) in shape.waiters.iter().enumerate() {
        match waiters_level(
            locker,
            &format!("{prefix}:wait:{i}"),
            opts,
            w,
            &shape,
            &mut counter,
        )
        .await
        {
            Ok(level) => waiters.push(level),
            Err(e) => {
                waiters_stopped = Some(format!("at {w} waiters: {}", e.message));
                break;
            }
        }
    }
    let (held, held_stopped) = held_series(locker, prefix, opts, &shape).await;
    Ok(Scaling {
        held,
        held_stopped,
        waiters,
        waiters_stopped,
        requests_counted: counter.as_ref().map(Counter::what),
    })
}

/// The held series: fill to each level, then time cycles of one more lock.
async fn held_series(
    locker: &Locker,
    prefix: &str,
    opts: &LockOptions,
    shape: &Shape,
) -> (Vec<HeldLevel>, Option<String>) {
    let rss_before = trimmed_rss_bytes();
    let mut guards = Vec::new();
    let mut levels = Vec::new();
    let mut wanted = shape.held.clone();
    wanted.sort_unstable();
    let mut stopped = None;
    for &n in &wanted {
        match held_level(locker, prefix, opts, shape, (n, rss_before), &mut guards).await {
            Ok(level) => levels.push(level),
            Err(why) => {
                stopped = Some(format!("at {n} held: {why}"));
                break;
            }
        }
    }
    give_back(guards).await;
    (levels, stopped)
}

/// Fill `guards` up to `n` held locks, then time the cycles.
async fn held_level(
    locker: &Locker,
    prefix: &str,
    opts: &LockOptions,
    shape: &Shape,
    (n, rss_before): (u64, u64),
    guards: &mut Vec<dlock::LockGuard>,
) -> Result<HeldLevel, String> {
    let have = guards.len() as u64;
    let started = Instant::now();
    let range = have..n.max(have);
    let more = take_many(
        locker,
        opts,
        &format!("{prefix}:held"),
        range,
        Some(started + FILL_LIMIT),
    )
    .await
    .map_err(|e| e.message)?;
    guards.extend(more);
    if (guards.len() as u64) < n {
        return Err(format!(
            "{} taken in {} s",
            guards.len(),
            FILL_LIMIT.as_secs()
        ));
    }
    let fill_seconds = started.elapsed().as_secs_f64();
    let rss = trimmed_rss_bytes();
    let (acquire, release, skipped) =
        cycles(locker, &format!("{prefix}:probe"), opts, shape.cycles)
            .await
            .map_err(|e| e.message)?;
    // The level counts only if every one of its locks was held throughout.
    let lost = guards.iter().filter(|g| !g.is_held()).count();
    if lost > 0 {
        return Err(format!(
            "{lost} of the {n} held locks lost by the end of the cycles (their renewals fell behind)"
        ));
    }
    Ok(HeldLevel {
        held: n,
        fill_seconds,
        acquire,
        release,
        rss_per_held_lock_bytes: (n >= MEMORY_FROM)
            .then(|| rss.saturating_sub(rss_before) as f64 / n as f64),
        skipped,
    })
}

/// Timed acquire + release cycles of `name`: the acquire's and the release's latency,
/// and what was stepped over (a cycle with an error in either is not timed; one whose
/// release failed leaves the lock taken until its lease ends, and the next cycle's
/// acquire waits for that).
async fn cycles(
    locker: &Locker,
    name: &str,
    opts: &LockOptions,
    cycles: u32,
) -> Result<(Latency, Latency, Skipped), Failure> {
    let skips = Skips::default();
    let n = cycles.clamp(1, MAX_CYCLES) as usize;
    let (mut acquire, mut release) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let until = Instant::now() + CYCLES_LIMIT;
    for done in 0..n {
        if Instant::now() >= until {
            return Err(Failure::internal(format!(
                "{done} of {n} cycles in {} s ({} timed, {} stepped over)",
                CYCLES_LIMIT.as_secs(),
                acquire.len(),
                skips.tally().count
            )));
        }
        let t0 = Instant::now();
        let g = match locker.lock_with(name, opts).await {
            Ok(g) => g,
            Err(e) => {
                skips.step_over(e)?;
                continue;
            }
        };
        let t1 = Instant::now();
        if let Err(e) = g.release().await {
            skips.step_over(e)?;
            continue;
        }
        acquire.push(micros(t1 - t0));
        release.push(micros(t1.elapsed()));
    }
    Ok((Latency::of(&acquire), Latency::of(&release), skips.tally()))
}

async fn waiters_level(
    locker: &Locker,
    name: &str,
    opts: &LockOptions,
    waiters: u32,
    shape: &Shape,
    counter: &mut Option<Counter>,
) -> Result<WaitersLevel, Failure> {
    let before = match counter {
        Some(c) => Some(c.read().await?),
        None => None,
    };
    let cpu = cpu_seconds();
    let tasks = waiters.saturating_add(1);
    let run = crate::bench::handoff::tasks_on_one_lock(
        locker,
        name,
        opts,
        (tasks, shape.duration, Waiting::Notified),
    )
    .await?;
    let cpu = cpu_seconds() - cpu;
    let grants = run.acquisitions.max(1) as f64;
    let requests_per_grant = match (counter, before) {
        (Some(c), Some(b)) => {
            let after = c.read().await?;
            Some(c.between(b, after) as f64 / grants)
        }
        _ => None,
    };
    Ok(WaitersLevel {
        waiters,
        grants: run.acquisitions,
        grants_per_sec: run.acquisitions as f64 / run.seconds.max(1e-9),
        handoffs_per_sec: run.handoffs_per_sec,
        handoff: run.handoff,
        requests_per_grant,
        client_cpu_us_per_grant: cpu * 1e6 / grants,
        skipped: run.skipped,
    })
}
