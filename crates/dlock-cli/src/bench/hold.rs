//! The many-held-locks scenario of `dlock bench`: acquire N distinct locks with
//! automatic renewal, hold them all for a while, and report what keeping them costs:
//! resident memory per lock, CPU while holding, and (on Redis) renewal commands per
//! second from `INFO commandstats` — batching shows as far fewer commands than locks.

use std::time::{Duration, Instant};

use dlock::{LockGuard, LockOptions, Locker};
use serde::Serialize;

use crate::exit::Failure;

/// Figures of one hold run.
#[derive(Debug, Serialize)]
pub struct HoldRun {
    pub locks: u64,
    pub ttl_ms: u64,
    pub acquire_seconds: f64,
    pub hold_seconds: f64,
    pub rss_before_bytes: u64,
    /// Right after the last lock was acquired.
    pub rss_held_bytes: u64,
    /// At the end of the hold, after the renewals.
    pub rss_end_bytes: u64,
    /// The larger of the two, less the baseline, per lock.
    pub rss_per_lock_bytes: f64,
    pub cpu_seconds_while_holding: f64,
    pub cpu_percent_while_holding: f64,
    /// Redis only: renew script calls per second while holding.
    pub renew_commands_per_sec: Option<f64>,
    /// Redis only: renewals asked for by keepers per second (locks / renew interval).
    pub renewals_per_sec: f64,
    pub lost: u64,
}

/// The commands renewals are counted by.
const SCRIPTS: &[&str] = &["evalsha", "eval"];

/// The process's resident memory.
pub fn rss_bytes() -> u64 {
    // Second field of /proc/self/statm: resident pages.
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

/// The process's resident memory after the allocator gave back the free pages it
/// keeps (glibc's `malloc_trim`; elsewhere the plain figure): what earlier work freed
/// does not hide what comes after from a comparison of two readings.
pub fn trimmed_rss_bytes() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free memory of glibc's arenas to the system;
    // it takes the arenas' locks itself.
    unsafe {
        libc::malloc_trim(0);
    }
    rss_bytes()
}

/// CPU time (user + system) this process has used.
pub fn cpu_seconds() -> f64 {
    nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).map_or(0.0, |u| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
        t(u.user_time()) + t(u.system_time())
    })
}

pub async fn run(
    locker: &Locker,
    url: &str,
    prefix: &str,
    locks: u64,
    hold_for: Duration,
    ttl: Duration,
) -> Result<HoldRun, Failure> {
    let redis_url = crate::bench::raw_redis::bare_url(url);
    let rss_before = rss_bytes();
    let opts = LockOptions::new().ttl(ttl);
    let started = Instant::now();
    let guards = take_many(locker, &opts, prefix, 0..locks, None).await?;
    let acquire_seconds = started.elapsed().as_secs_f64();
    let rss_held = rss_bytes();
    let calls_before = match &redis_url {
        Some(u) => Some(crate::bench::raw_redis::command_calls(u, SCRIPTS).await?),
        None => None,
    };
    let cpu_before = cpu_seconds();
    let hold_start = Instant::now();
    tokio::time::sleep(hold_for).await;
    let hold_seconds = hold_start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_before;
    let rss_end = rss_bytes();
    let renew_commands_per_sec = match (&redis_url, calls_before) {
        (Some(u), Some(before)) => Some(
            crate::bench::raw_redis::command_calls(u, SCRIPTS)
                .await?
                .saturating_sub(before) as f64
                / hold_seconds,
        ),
        _ => None,
    };
    let lost = guards.iter().filter(|g| !g.is_held()).count() as u64;
    // Given back before the next scenario starts: releases left to run in the
    // background as the guards drop would slow whatever the bench measures next.
    give_back(guards).await;
    Ok(HoldRun {
        locks,
        ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        acquire_seconds,
        hold_seconds,
        rss_before_bytes: rss_before,
        rss_held_bytes: rss_held,
        rss_end_bytes: rss_end,
        rss_per_lock_bytes: rss_held.max(rss_end).saturating_sub(rss_before) as f64
            / locks.max(1) as f64,
        cpu_seconds_while_holding: cpu,
        cpu_percent_while_holding: 100.0 * cpu / hold_seconds,
        renew_commands_per_sec,
        renewals_per_sec: locks as f64 / (ttl.as_secs_f64() / 3.0),
        lost,
    })
}

/// How long held locks are given back for at the end of a run.
pub const GIVE_BACK_LIMIT: Duration = Duration::from_secs(20);

/// Release `guards` from up to 64 tasks, waiting for every release, for at most
/// [`GIVE_BACK_LIMIT`]: a backend whose renewals of so many locks already take all it
/// can do would take minutes (the leases free the rest after the process ends). Past
/// the bound the tasks are aborted and the guards left release in the background as
/// they drop.
pub async fn give_back(mut guards: Vec<LockGuard>) {
    let per_task = guards.len().div_ceil(64).max(1);
    let mut set = tokio::task::JoinSet::new();
    while !guards.is_empty() {
        let part = guards.split_off(guards.len().saturating_sub(per_task));
        set.spawn(async move {
            for g in part {
                let _ = g.release().await;
            }
        });
    }
    let all = async { while set.join_next().await.is_some() {} };
    let _ = tokio::time::timeout(GIVE_BACK_LIMIT, all).await;
}

/// Acquire the locks `{prefix}:{i}` for every `i` in `range` from up to 64 tasks of
/// this process. With `until`, the tasks stop taking new ones at that instant: the
/// guards may then be fewer than the range.
pub async fn take_many(
    locker: &Locker,
    opts: &LockOptions,
    prefix: &str,
    range: std::ops::Range<u64>,
    until: Option<Instant>,
) -> Result<Vec<LockGuard>, Failure> {
    let count = range.end.saturating_sub(range.start);
    let tasks = 64u64.min(count.max(1));
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        let (locker, opts, prefix) = (locker.clone(), opts.clone(), prefix.to_owned());
        let start = range.start;
        set.spawn(async move {
            let mut guards: Vec<LockGuard> = Vec::new();
            let mut i = t;
            while i < count && until.is_none_or(|u| Instant::now() < u) {
                guards.push(
                    locker
                        .lock_with(&format!("{prefix}:{}", start + i), &opts)
                        .await?,
                );
                i += tasks;
            }
            Ok::<_, dlock::Error>(guards)
        });
    }
    // On a failure the other tasks stop; the guards they and the finished ones took
    // are given back as they drop.
    let parts = crate::bench::tasks::join_or_stop(set).await?;
    Ok(parts.into_iter().flatten().collect())
}
