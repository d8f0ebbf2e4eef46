//! The contended hand-off scenario of `dlock bench`: many tasks of one process loop on
//! one lock. A hand-off is *real* when the lock passes to a different task; its latency
//! is from the moment the previous holder starts releasing to the next grant.
//!
//! The same run with polling waiters (`try_lock`, then a fixed sleep when busy — how
//! clients without notifications wait) shows what waiting by notification is worth.
//!
//! The floor, for `redis://`, is a bare hand-written hand-off in the same run: as many
//! tasks, each on its own connection, blocked in `BLPOP` on one list; the holder passes
//! on by `LPUSH`ing the token back. Redis serves blocked clients first come, first
//! served, so this is what a fair, notified hand-off costs with nothing else around it.
//!
//! For a SQL lease URL, a *limit* in the same run: the least a lease hand-off does —
//! the lease limit's owner-checked `UPDATE` that frees the row, an in-process wake of
//! the next task in line (first come, first served), and that task's upsert that takes
//! the freed row and draws its next token ([`crate::bench::raw_sql::lease_limit_take`]),
//! both on one connection that passes from task to task. Each hand-off is two committed
//! writes and two round trips, one after the other, whatever the client.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::{LockOptions, Locker, Wait};
use serde::Serialize;

use crate::bench::skips::{Skipped, Skips};
use crate::bench::stats::{Latency, jain, micros};
use crate::exit::Failure;

#[derive(Debug, Clone, Copy)]
struct Event {
    task: u32,
    granted: Instant,
    releasing: Instant,
}

/// Figures of one hand-off run.
#[derive(Debug, Serialize)]
pub struct HandoffRun {
    pub waiters: u32,
    pub seconds: f64,
    pub acquisitions: u64,
    pub real_handoffs: u64,
    pub handoffs_per_sec: f64,
    pub handoff: Latency,
    pub jain_fairness: f64,
    /// Share of acquisitions (after the first) by the task that held the lock just
    /// before: 100 % means the releaser always took it straight back.
    pub reacquired_pct: f64,
    /// Redis only: client commands (EVALSHA/EVAL/SUBSCRIBE/UNSUBSCRIBE) per acquisition.
    pub commands_per_acquisition: Option<f64>,
    /// Retryable errors stepped over (`skips.rs`): failed acquisitions are not counted
    /// (their commands are, in `commands_per_acquisition`).
    pub skipped: Skipped,
}

/// dlock's run and, where there is one, the floor's and the limit's.
#[derive(Debug, Serialize)]
pub struct Handoff {
    pub dlock: HandoffRun,
    pub floor: Option<HandoffRun>,
    /// SQL lease mode: the least a lease hand-off does (the module docs).
    pub limit: Option<HandoffRun>,
}

/// Note a grant by `task`, released at once.
fn record(events: &Mutex<Vec<Event>>, task: u32) {
    let granted = Instant::now();
    let releasing = Instant::now();
    if let Ok(mut ev) = events.lock() {
        ev.push(Event {
            task,
            granted,
            releasing,
        });
    }
}

fn summarize(mut events: Vec<Event>, waiters: u32, seconds: f64) -> HandoffRun {
    events.sort_by_key(|e| e.granted);
    let mut per_task = vec![0u64; waiters as usize];
    let mut latencies = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if let Some(c) = per_task.get_mut(e.task as usize) {
            *c += 1;
        }
        if i > 0 && events[i - 1].task != e.task {
            latencies.push(micros(
                e.granted.saturating_duration_since(events[i - 1].releasing),
            ));
        }
    }
    HandoffRun {
        waiters,
        seconds,
        acquisitions: events.len() as u64,
        real_handoffs: latencies.len() as u64,
        handoffs_per_sec: latencies.len() as f64 / seconds.max(1e-9),
        handoff: Latency::of(&latencies),
        jain_fairness: jain(&per_task),
        reacquired_pct: 100.0 * (events.len().saturating_sub(1) - latencies.len()) as f64
            / events.len().saturating_sub(1).max(1) as f64,
        commands_per_acquisition: None,
        skipped: Skipped::default(),
    }
}

/// How the waiters of a hand-off run wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// `lock_with`: dlock's notified waiting.
    Notified,
    /// `try_lock_with`, then this sleep while busy.
    Polling(Duration),
}

/// dlock's hand-off run and, for `Waiting::Notified` on Redis, the BLPOP floor.
pub async fn run(
    locker: &Locker,
    url: &str,
    name: &str,
    opts: &LockOptions,
    (waiters, duration, waiting): (u32, Duration, Waiting),
) -> Result<Handoff, Failure> {
    let redis_url = crate::bench::raw_redis::bare_url(url);
    let before = match &redis_url {
        Some(u) => Some(crate::bench::raw_redis::command_calls(u, LOCK_COMMANDS).await?),
        None => None,
    };
    let mut dlock_run = tasks_on_one_lock(locker, name, opts, (waiters, duration, waiting)).await?;
    if let (Some(u), Some(before)) = (&redis_url, before) {
        let after = crate::bench::raw_redis::command_calls(u, LOCK_COMMANDS).await?;
        dlock_run.commands_per_acquisition =
            Some(after.saturating_sub(before) as f64 / dlock_run.acquisitions.max(1) as f64);
    }
    let floor = match (&redis_url, waiting) {
        (Some(u), Waiting::Notified) => Some(blpop_floor(u, name, waiters, duration).await?),
        _ => None,
    };
    let lease = crate::bench::raw_sql::target(url).is_some_and(|(_, mode)| mode == "lease");
    let limit = if lease && waiting == Waiting::Notified {
        Some(lease_limit(url, waiters, duration).await?)
    } else {
        None
    };
    Ok(Handoff {
        dlock: dlock_run,
        floor,
        limit,
    })
}

/// The lease hand-off limit (the module docs): `waiters` tasks take turns on the lease
/// limit's row for `duration`, through one bare connection, which passes to the next
/// task in line (first come, first served: tokio's mutex queues fairly) once the
/// holder's release has returned. Every grant must find the row free.
async fn lease_limit(url: &str, waiters: u32, duration: Duration) -> Result<HandoffRun, Failure> {
    use crate::bench::raw_sql::{SqlConn, lease_limit_free, lease_limit_table, lease_limit_take};
    let mut conn = bounded(SqlConn::connect(url)).await?;
    bounded(lease_limit_table(&mut conn)).await?;
    let turn = Arc::new(tokio::sync::Mutex::new(conn));
    let events = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let deadline = start + duration;
    let mut set = tokio::task::JoinSet::new();
    for task in 0..waiters {
        let (turn, events) = (Arc::clone(&turn), Arc::clone(&events));
        set.spawn(async move {
            let owner = i64::from(task) + 1;
            while Instant::now() < deadline {
                let mut conn = turn.lock().await;
                if Instant::now() >= deadline {
                    break;
                }
                if !bounded(lease_limit_take(&mut conn, owner)).await? {
                    return Err(Failure::internal(
                        "bare SQL client: the lease hand-off limit found its row held",
                    ));
                }
                record(&events, task);
                bounded(lease_limit_free(&mut conn, owner)).await?;
            }
            Ok::<(), Failure>(())
        });
    }
    crate::bench::tasks::join_or_stop(set).await?;
    let seconds = start.elapsed().as_secs_f64();
    let events = std::mem::take(&mut *events.lock().map_err(|_| Failure::internal("poisoned"))?);
    Ok(summarize(events, waiters, seconds))
}

/// A bare statement of the limit, given up after 30 s (as dlock's acquisitions here):
/// a stalled server fails the run instead of hanging it.
async fn bounded<T>(
    statement: impl std::future::Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    tokio::time::timeout(Duration::from_secs(30), statement)
        .await
        .map_err(|_| Failure::internal("bare SQL client: no answer within 30s"))?
}

/// `waiters` tasks of this process loop on `name` for `duration` (each acquisition
/// gives up after 30 s): the hand-offs between them, nothing counted on the server.
pub async fn tasks_on_one_lock(
    locker: &Locker,
    name: &str,
    opts: &LockOptions,
    (waiters, duration, waiting): (u32, Duration, Waiting),
) -> Result<HandoffRun, Failure> {
    // Every acquisition gives up after 30 s (a stuck hand-off fails the run).
    let opts = opts.clone().wait(Wait::Timeout(Duration::from_secs(30)));
    let events = Arc::new(Mutex::new(Vec::new()));
    let skips = Skips::default();
    let start = Instant::now();
    let deadline = start + duration;
    let mut set = tokio::task::JoinSet::new();
    for task in 0..waiters {
        let (locker, name, events, opts, skips) = (
            locker.clone(),
            name.to_owned(),
            Arc::clone(&events),
            opts.clone(),
            skips.clone(),
        );
        set.spawn(async move {
            while Instant::now() < deadline {
                let got = match waiting {
                    Waiting::Notified => locker.lock_with(&name, &opts).await.map(Some),
                    Waiting::Polling(every) => {
                        let mut got = Ok(None);
                        while matches!(got, Ok(None)) && Instant::now() < deadline {
                            got = locker.try_lock_with(&name, &opts).await;
                            if matches!(got, Ok(None)) {
                                tokio::time::sleep(every).await;
                            }
                        }
                        got
                    }
                };
                let g = match got {
                    Ok(Some(g)) => g,
                    Ok(None) => break,
                    Err(e) => {
                        skips.step_over(e)?;
                        continue;
                    }
                };
                record(&events, task);
                skips.release(g).await?;
            }
            Ok::<(), dlock::Error>(())
        });
    }
    // On the first failure the other tasks are stopped (and waited for), so none goes on
    // taking the lock behind the caller's back.
    crate::bench::tasks::join_or_stop(set).await?;
    let seconds = start.elapsed().as_secs_f64();
    let events = std::mem::take(&mut *events.lock().map_err(|_| Failure::internal("poisoned"))?);
    let mut run = summarize(events, waiters, seconds);
    run.skipped = skips.tally();
    Ok(run)
}

/// The client commands dlock issues for locks (scripts and subscriptions).
pub const LOCK_COMMANDS: &[&str] = &["evalsha", "eval", "subscribe", "unsubscribe"];

async fn blpop_floor(
    url: &str,
    name: &str,
    waiters: u32,
    duration: Duration,
) -> Result<HandoffRun, Failure> {
    let client = redis::Client::open(url).map_err(crate::bench::raw_redis::err)?;
    let key = format!("dlock-bench-handoff:{name}");
    let mut setup = client
        .get_multiplexed_async_connection()
        .await
        .map_err(crate::bench::raw_redis::err)?;
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut setup)
        .await
        .map_err(crate::bench::raw_redis::err)?;
    let events = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::new();
    for task in 0..waiters {
        // BLPOP blocks its connection: one connection per waiter.
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(crate::bench::raw_redis::err)?;
        let (key, events) = (key.clone(), Arc::clone(&events));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let got: Option<(String, String)> = redis::cmd("BLPOP")
                    .arg(&key)
                    .arg(0.5)
                    .query_async(&mut conn)
                    .await?;
                if got.is_none() {
                    continue;
                }
                record(&events, task);
                let _: () = redis::cmd("LPUSH")
                    .arg(&key)
                    .arg("token")
                    .query_async(&mut conn)
                    .await?;
            }
            Ok::<(), redis::RedisError>(())
        }));
    }
    let _: () = redis::cmd("LPUSH")
        .arg(&key)
        .arg("token")
        .query_async(&mut setup)
        .await
        .map_err(crate::bench::raw_redis::err)?;
    for t in tasks {
        t.await
            .map_err(|e| Failure::internal(e.to_string()))?
            .map_err(crate::bench::raw_redis::err)?;
    }
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut setup)
        .await
        .map_err(crate::bench::raw_redis::err)?;
    let seconds = start.elapsed().as_secs_f64();
    let events = std::mem::take(&mut *events.lock().map_err(|_| Failure::internal("poisoned"))?);
    Ok(summarize(events, waiters, seconds))
}
