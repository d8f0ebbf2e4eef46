//! `dlock bench`: uncontended cycles against the raw backend floor, and contended
//! throughput across worker processes.
//!
//! The floor (`floor`) is what the same backend does with the bare requests of a lock
//! cycle in the same run, alternating with dlock's cycles. For Redlock, the same cycles
//! on the first node alone (same layout), measured in the same run.

mod floor;
mod handoff;
mod hold;
mod parallel;
mod raw_redis;
pub(crate) mod raw_sql;
mod scaling;
mod skips;
pub(crate) mod stats;
mod take;
mod tasks;

use std::time::{Duration, Instant};

use clap::ValueEnum as _;
use dlock::{LockOptions, Locker};
use serde::Serialize;
use serde_json::json;

use crate::args::{BenchArgs, BenchPrimitive, BenchWorkerArgs, Scenario};
use crate::bench::handoff::Waiting;
use crate::bench::skips::{Skipped, Skips};
use crate::bench::stats::{Latency, Percentiles, jain, micros, show_us};
use crate::bench::take::{Shape, Take};
use crate::exit::Failure;
use crate::fleet::{Fleet, emit, numbers};
use crate::output::outln;

/// How long a polling waiter sleeps after a busy `try_lock` (redis-py's `Lock` sleeps
/// 100 ms by default; 10 ms favours polling).
const POLL_EVERY: Duration = Duration::from_millis(10);

#[derive(Debug, Serialize)]
struct Uncontended {
    cycles: u32,
    cycles_per_sec: f64,
    latency: Latency,
    floor_cycles_per_sec: Option<f64>,
    floor_latency: Option<Latency>,
    ratio_to_floor: Option<f64>,
    /// Where the floor's bare requests are not a fenced lock: what the least such lock
    /// does (`floor::Floor::limit`), measured against dlock in a second alternating
    /// run.
    limit: Option<Limit>,
    /// Redis: client commands per cycle; etcd: writes (revisions) per cycle; counted by
    /// the server over a separate run of [`counted_cycles`] cycles.
    requests_per_cycle: Option<f64>,
    /// Cycles stepped over on a retryable error (`skips.rs`), in this run, the limit's,
    /// the counted one and Redlock's single-node run together.
    skipped: Skipped,
}

/// The least a fenced lock does in dlock's layout, against dlock in the same run.
#[derive(Debug, Serialize)]
struct Limit {
    what: &'static str,
    cycles_per_sec: f64,
    latency: Latency,
    /// dlock's cycles per second in this run, over the limit's.
    ratio: f64,
}

/// Cycles of the run the server counts requests over (fewer when `--cycles` is).
const COUNTED_CYCLES: u32 = 500;

fn counted_cycles(cycles: u32) -> u32 {
    COUNTED_CYCLES.min(cycles)
}

#[derive(Debug, Serialize)]
struct Contended {
    processes: u32,
    seconds: f64,
    acquisitions: u64,
    acquisitions_per_sec: f64,
    wait: Latency,
    per_process: Vec<u64>,
    jain_fairness: f64,
    /// Cycles the workers stepped over on a retryable error (`skips.rs`).
    skipped: Skipped,
}

/// One scenario's headline figures (the `scenarios` list of `--json`).
#[derive(Debug, Serialize)]
struct ScenarioRow {
    scenario: String,
    ops_per_sec: f64,
    floor_ops_per_sec: Option<f64>,
    ratio: Option<f64>,
    #[serde(flatten)]
    latency: Percentiles,
    /// Cycles stepped over on a retryable error (`skips.rs`): 0 in a clean run.
    skipped: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    url: String,
    /// What each cycle took: `lock`, `semaphore`, `read`, `write` or `election`.
    primitive: &'static str,
    /// The semaphore's permits (`--primitive semaphore` only).
    permits: Option<u32>,
    /// Every scenario that ran, flat: what BENCHMARKS.md and scripts read.
    scenarios: Vec<ScenarioRow>,
    uncontended: Option<Uncontended>,
    contended: Option<Contended>,
    handoff: Option<crate::bench::handoff::Handoff>,
    /// The hand-off run with polling waiters.
    polling: Option<crate::bench::handoff::HandoffRun>,
    hold: Option<crate::bench::hold::HoldRun>,
    parallel: Option<crate::bench::parallel::Parallel>,
    single_node: Option<SingleNode>,
    scaling: Option<crate::bench::scaling::Scaling>,
}

/// Redlock only: the same cycles on the first node alone, same layout, same run.
#[derive(Debug, Serialize)]
struct SingleNode {
    url: String,
    cycles_per_sec: f64,
    latency: Latency,
    redlock_ratio: f64,
}

/// `redis://[userinfo@]first-host?layout=redis-py` for a `redlock://` URL.
fn first_node_url(url: &str) -> Option<String> {
    let rest = url.strip_prefix("redlock://")?;
    let authority = rest.split(['/', '?']).next()?;
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    let first = hosts.split(',').next()?;
    Some(format!("redis://{userinfo}{first}?layout=redis-py"))
}

/// Which scenarios run: the named ones, else uncontended and every one whose count is
/// not 0. A named scenario whose count is 0 is an error (except `hold`, below).
fn chosen(args: &BenchArgs) -> Result<Vec<Scenario>, Failure> {
    let counts = [
        (Scenario::Uncontended, "--cycles", 1),
        (Scenario::Parallel, "--tasks", u64::from(args.tasks)),
        (
            Scenario::Contended,
            "--processes",
            u64::from(args.processes),
        ),
        (Scenario::Handoff, "--waiters", u64::from(args.waiters)),
        (Scenario::Polling, "--waiters", u64::from(args.waiters)),
        (Scenario::Hold, "--hold", args.hold),
    ];
    // Beyond the lock, the uncontended and contended runs only.
    let offered = |s: Scenario| {
        args.primitive == BenchPrimitive::Lock
            || matches!(s, Scenario::Uncontended | Scenario::Contended)
    };
    if let Some(s) = args.scenario.iter().find(|s| !offered(**s)) {
        return Err(Failure::new(
            crate::exit::USAGE,
            format!(
                "--scenario {} runs with --primitive lock only (other primitives: uncontended, contended)",
                s.to_possible_value()
                    .map(|v| v.get_name().to_owned())
                    .unwrap_or_default()
            ),
        ));
    }
    if args.scenario.is_empty() {
        return Ok(counts
            .iter()
            .filter(|(s, _, n)| *n > 0 && offered(*s))
            .map(|(s, _, _)| *s)
            .collect());
    }
    for (s, flag, n) in counts {
        // A named hold run without --hold takes --keys, else 100,000 locks.
        if n == 0 && s != Scenario::Hold && args.scenario.contains(&s) {
            return Err(Failure::new(
                crate::exit::USAGE,
                format!(
                    "--scenario {} needs {flag} above 0",
                    s.to_possible_value()
                        .map(|v| v.get_name().to_owned())
                        .unwrap_or_default()
                ),
            ));
        }
    }
    Ok(args.scenario.clone())
}

pub async fn bench(args: BenchArgs) -> Result<i32, Failure> {
    let scenarios = chosen(&args)?;
    let runs = |s: Scenario| scenarios.contains(&s);
    let dir = tempfile::tempdir().map_err(|e| Failure::internal(e.to_string()))?;
    let url = crate::exit::scratch_url(args.url.as_deref(), dir.path(), "bench.db");
    let locker = Locker::connect(&url).await?;
    let name = format!("bench:{}", dlock::Owner::random());
    let opts = LockOptions::new().ttl(args.ttl).fair(args.fair);
    let take = Take {
        primitive: args.primitive,
        permits: args.permits,
    };
    let mut uncontended = None;
    let mut single_node = None;
    if runs(Scenario::Uncontended) {
        let skips = Skips::default();
        let mut floor = crate::bench::floor::Floor::connect(&url).await?;
        let (ours, bare) = crate::bench::floor::measure(
            &locker,
            (&name, take),
            &opts,
            floor.as_mut().map(|f| (f, take.shape())),
            (args.cycles, &skips),
        )
        .await?;
        let mut requests_per_cycle = None;
        let mut limit = None;
        if let Some(mut f) = floor {
            if let (Some(what), Shape::Exclusive) = (f.limit(), take.shape()) {
                let (ours, side) = crate::bench::floor::measure(
                    &locker,
                    (&name, take),
                    &opts,
                    Some((&mut f, Shape::Fenced)),
                    (args.cycles, &skips),
                )
                .await?;
                limit = side.map(|l| Limit {
                    what,
                    cycles_per_sec: l.per_sec,
                    latency: l.latency,
                    ratio: ours.per_sec / l.per_sec,
                });
            }
            requests_per_cycle = f
                .requests_per_cycle(
                    &locker,
                    (&name, take),
                    &opts,
                    (counted_cycles(args.cycles), &skips),
                )
                .await?;
            f.close().await;
        }
        if let Some(single) = first_node_url(&url) {
            let one = Locker::connect(&single).await?;
            let (side, _) = crate::bench::floor::measure(
                &one,
                (&format!("{name}:single"), take),
                &opts,
                None,
                (args.cycles, &skips),
            )
            .await?;
            single_node = Some(SingleNode {
                url: one.url().to_owned(),
                cycles_per_sec: side.per_sec,
                latency: side.latency,
                redlock_ratio: ours.per_sec / side.per_sec,
            });
        }
        uncontended = Some(Uncontended {
            cycles: args.cycles,
            cycles_per_sec: ours.per_sec,
            latency: ours.latency,
            floor_cycles_per_sec: bare.map(|f| f.per_sec),
            floor_latency: bare.map(|f| f.latency),
            ratio_to_floor: bare.map(|f| ours.per_sec / f.per_sec),
            limit,
            requests_per_cycle,
            skipped: skips.tally(),
        });
    }
    let contended = if runs(Scenario::Contended) {
        Some(contended(&url, &name, &args).await?)
    } else {
        None
    };
    let handoff = if runs(Scenario::Handoff) {
        let hname = format!("{name}:handoff");
        let shape = (args.waiters, args.duration, Waiting::Notified);
        Some(crate::bench::handoff::run(&locker, &url, &hname, &opts, shape).await?)
    } else {
        None
    };
    let polling = if runs(Scenario::Polling) {
        let pname = format!("{name}:polling");
        let shape = (args.waiters, args.duration, Waiting::Polling(POLL_EVERY));
        Some(
            crate::bench::handoff::run(&locker, &url, &pname, &opts, shape)
                .await?
                .dlock,
        )
    } else {
        None
    };
    let hold = if runs(Scenario::Hold) {
        let prefix = format!("{name}:held");
        let locks = match (args.keys, args.hold) {
            (Some(k), _) => k,
            (None, 0) => 100_000,
            (None, h) => h,
        };
        Some(
            crate::bench::hold::run(
                &locker,
                &url,
                &prefix,
                locks,
                args.hold_for,
                args.hold_ttl.unwrap_or(args.ttl),
            )
            .await?,
        )
    } else {
        None
    };
    let parallel = if runs(Scenario::Parallel) {
        let pname = format!("{name}:parallel");
        let shape = crate::bench::parallel::Shape {
            tasks: args.tasks,
            keys: args.keys.unwrap_or(u64::MAX).min(u64::from(args.tasks)),
            duration: args.duration,
        };
        Some(crate::bench::parallel::run(&locker, &url, &pname, &opts, shape).await?)
    } else {
        None
    };
    let scaling = if runs(Scenario::Scaling) {
        let shape = crate::bench::scaling::Shape {
            held: args.scale_held.clone(),
            waiters: args.scale_waiters.clone(),
            cycles: args.cycles,
            duration: args.duration,
        };
        let prefix = format!("{name}:scaling");
        Some(crate::bench::scaling::run(&locker, &url, &prefix, &opts, shape).await?)
    } else {
        None
    };
    let mut report = Report {
        scaling,
        primitive: args.primitive.name(),
        permits: (args.primitive == BenchPrimitive::Semaphore).then_some(args.permits),
        scenarios: Vec::new(),
        parallel,
        single_node,
        url: locker.url().to_owned(),
        uncontended,
        contended,
        handoff,
        polling,
        hold,
    };
    report.scenarios = scenario_rows(&report);
    if args.json {
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| Failure::internal(e.to_string()))?;
        outln!("{text}");
    } else {
        print_report(&report);
    }
    Ok(0)
}

/// The flat list of scenarios from a report.
fn scenario_rows(r: &Report) -> Vec<ScenarioRow> {
    let mut rows = Vec::new();
    if let Some(u) = &r.uncontended {
        rows.push(ScenarioRow {
            scenario: "uncontended-1-task".into(),
            ops_per_sec: u.cycles_per_sec,
            floor_ops_per_sec: u.floor_cycles_per_sec,
            ratio: u.ratio_to_floor,
            latency: u.latency.percentiles(),
            skipped: u.skipped.count,
        });
    }
    if let Some(p) = &r.parallel {
        rows.push(ScenarioRow {
            scenario: if p.keys == u64::from(p.tasks) {
                format!("uncontended-{}-tasks", p.tasks)
            } else {
                format!("parallel-{}-tasks-{}-keys", p.tasks, p.keys)
            },
            ops_per_sec: p.cycles_per_sec,
            floor_ops_per_sec: p.floor_cycles_per_sec,
            ratio: p.ratio_to_floor,
            latency: Percentiles::default(),
            skipped: p.skipped.count,
        });
    }
    if let Some(c) = &r.contended {
        rows.push(ScenarioRow {
            scenario: format!("contended-{}-processes", c.processes),
            ops_per_sec: c.acquisitions_per_sec,
            floor_ops_per_sec: None,
            ratio: None,
            latency: c.wait.percentiles(),
            skipped: c.skipped.count,
        });
    }
    if let Some(h) = &r.handoff {
        let floor = h.floor.as_ref().map(|f| f.handoffs_per_sec);
        rows.push(ScenarioRow {
            scenario: format!("handoff-{}-waiters", h.dlock.waiters),
            ops_per_sec: h.dlock.handoffs_per_sec,
            floor_ops_per_sec: floor,
            ratio: floor
                .filter(|f| *f > 0.0)
                .map(|f| h.dlock.handoffs_per_sec / f),
            latency: h.dlock.handoff.percentiles(),
            skipped: h.dlock.skipped.count,
        });
    }
    if let Some(p) = &r.polling {
        rows.push(ScenarioRow {
            scenario: format!("polling-{}-waiters", p.waiters),
            ops_per_sec: p.handoffs_per_sec,
            floor_ops_per_sec: None,
            ratio: None,
            latency: p.handoff.percentiles(),
            skipped: p.skipped.count,
        });
    }
    if let Some(h) = &r.hold {
        rows.push(ScenarioRow {
            scenario: format!("hold-{}-locks", h.locks),
            ops_per_sec: h.renewals_per_sec,
            floor_ops_per_sec: None,
            ratio: None,
            latency: Percentiles::default(),
            skipped: 0,
        });
    }
    if let (Some(s), Some(u)) = (&r.single_node, &r.uncontended) {
        rows.push(ScenarioRow {
            scenario: "redlock-vs-one-node".into(),
            ops_per_sec: u.cycles_per_sec,
            floor_ops_per_sec: Some(s.cycles_per_sec),
            ratio: Some(s.redlock_ratio),
            latency: u.latency.percentiles(),
            // The uncontended run's tally, which the single-node run shares (so the
            // same cycles as the `uncontended-1-task` row's, not more).
            skipped: u.skipped.count,
        });
    }
    rows
}

fn print_handoff(label: &str, h: &crate::bench::handoff::HandoffRun) {
    outln!(
        "  {label}: {} real hand-offs of {} acquisitions in {:.1}s = {:.0}/s; hand-off p50 {}, p99 {}, p99.9 {}; \
         fairness (Jain) {:.3}; releaser took it back {:.1}%{}{}",
        h.real_handoffs,
        h.acquisitions,
        h.seconds,
        h.handoffs_per_sec,
        show_us(h.handoff.p50_us),
        show_us(h.handoff.p99_us),
        show_us(h.handoff.p999_us),
        h.jain_fairness,
        h.reacquired_pct,
        h.commands_per_acquisition
            .map(|c| format!("; {c:.2} commands per acquisition"))
            .unwrap_or_default(),
        h.skipped.suffix()
    );
}

fn print_uncontended(u: &Uncontended, single: Option<&SingleNode>) {
    outln!(
        "uncontended, 1 task: {:.0} cycles/s (acquire+release), p50 {}, p99 {}{}",
        u.cycles_per_sec,
        show_us(u.latency.p50_us),
        show_us(u.latency.p99_us),
        u.skipped.suffix()
    );
    if let (Some(f), Some(fl), Some(ratio)) =
        (u.floor_cycles_per_sec, u.floor_latency, u.ratio_to_floor)
    {
        outln!(
            "  floor (the bare commands of one cycle, same client, same run, alternating): \
             {f:.0} cycles/s, p50 {}, p99 {} -> dlock at {ratio:.2}x the floor",
            show_us(fl.p50_us),
            show_us(fl.p99_us)
        );
    }
    if let Some(l) = &u.limit {
        outln!(
            "  limit (the least a fenced lock does in this layout: {}): {:.0} cycles/s, \
             p50 {}, p99 {} -> dlock at {:.2}x the limit (second alternating run)",
            l.what,
            l.cycles_per_sec,
            show_us(l.latency.p50_us),
            show_us(l.latency.p99_us),
            l.ratio
        );
    }
    if let Some(r) = u.requests_per_cycle {
        outln!(
            "  requests per cycle, counted by the server over {} more cycles: {r:.2}",
            counted_cycles(u.cycles)
        );
    }
    if let Some(s) = single {
        outln!(
            "  one of its nodes alone ({}, same run): {:.0} cycles/s, p50 {}, p99 {} -> redlock at {:.2}x",
            s.url,
            s.cycles_per_sec,
            show_us(s.latency.p50_us),
            show_us(s.latency.p99_us),
            s.redlock_ratio
        );
    }
}

fn print_report(r: &Report) {
    outln!("backend: {}", r.url);
    if r.primitive != "lock" {
        outln!(
            "each cycle takes and gives back: {}{}",
            r.primitive,
            r.permits
                .map(|p| format!(" (a permit of {p})"))
                .unwrap_or_default()
        );
    }
    if let Some(u) = &r.uncontended {
        print_uncontended(u, r.single_node.as_ref());
    }
    if let Some(p) = &r.parallel {
        outln!(
            "{} tasks cycling {} locks: {:.0} cycles/s{}{}{}",
            p.tasks,
            p.keys,
            p.cycles_per_sec,
            match (p.floor_cycles_per_sec, p.ratio_to_floor) {
                (Some(f), Some(ratio)) => format!(
                    " vs the shared-connection floor {f:.0}/s in the same run -> {ratio:.2}x"
                ),
                _ => String::new(),
            },
            match (p.limit_cycles_per_sec, p.ratio_to_limit) {
                (Some(l), Some(ratio)) => format!(
                    "; vs the least fenced lock's {l:.0}/s from as many tasks -> {ratio:.2}x"
                ),
                _ => String::new(),
            },
            p.skipped.suffix()
        );
        if let (Some(l), Some(ratio)) = (p.layout_limit_cycles_per_sec, p.ratio_to_layout_limit) {
            outln!(
                "  vs the least fenced lock in Redisson's layout (dlock's default) from as many \
                 tasks: {l:.0}/s -> {ratio:.2}x"
            );
        }
        if let Some(t) = p.server_us_per_cycle {
            outln!(
                "  server time per cycle (INFO commandstats): dlock {:.1} us, the floor {:.1} us, \
                 the limit {:.1} us, the layout limit {:.1} us",
                t.dlock_us,
                t.floor_us,
                t.limit_us,
                t.layout_limit_us
            );
        }
    }
    if let Some(c) = &r.contended {
        outln!(
            "contended, {} processes on one name for {:.1}s: {} acquisitions, {:.0}/s; wait p50 {}, p99 {}; \
             fairness (Jain) {:.3}; per process {:?}{}",
            c.processes,
            c.seconds,
            c.acquisitions,
            c.acquisitions_per_sec,
            show_us(c.wait.p50_us),
            show_us(c.wait.p99_us),
            c.jain_fairness,
            c.per_process,
            c.skipped.suffix()
        );
    }
    if let Some(h) = &r.handoff {
        outln!(
            "hand-off, {} tasks of one process on one lock:",
            h.dlock.waiters
        );
        print_handoff("dlock", &h.dlock);
        if let Some(f) = &h.floor {
            print_handoff("floor (bare BLPOP/LPUSH hand-off, same run)", f);
            outln!(
                "  dlock / floor: p50 {:.2}x, p99 {:.2}x",
                h.dlock.handoff.p50_us as f64 / f.handoff.p50_us.max(1) as f64,
                h.dlock.handoff.p99_us as f64 / f.handoff.p99_us.max(1) as f64
            );
        }
        if let Some(l) = &h.limit {
            print_handoff(
                "limit (bare release, in-process wake, bare grant; same run)",
                l,
            );
            outln!(
                "  dlock / limit: p50 {:.2}x, p99 {:.2}x",
                h.dlock.handoff.p50_us as f64 / l.handoff.p50_us.max(1) as f64,
                h.dlock.handoff.p99_us as f64 / l.handoff.p99_us.max(1) as f64
            );
        }
    }
    if let Some(p) = &r.polling {
        outln!(
            "polling, {} tasks of one process on one lock (try_lock, {} ms sleep when busy):",
            p.waiters,
            POLL_EVERY.as_millis()
        );
        print_handoff("dlock", p);
    }
    if let Some(h) = &r.hold {
        outln!(
            "held {} locks (lease {} ms, renewed every third): acquired in {:.1}s; RSS {:.1} MiB -> {:.1} MiB, \
             {:.1} MiB at the end ({:.0} bytes per lock); while holding {:.0}s: CPU {:.1}%, {} renewals/s asked{}; lost {}",
            h.locks,
            h.ttl_ms,
            h.acquire_seconds,
            h.rss_before_bytes as f64 / 1048576.0,
            h.rss_held_bytes as f64 / 1048576.0,
            h.rss_end_bytes as f64 / 1048576.0,
            h.rss_per_lock_bytes,
            h.hold_seconds,
            h.cpu_percent_while_holding,
            h.renewals_per_sec.round(),
            h.renew_commands_per_sec
                .map(|c| format!(", {c:.0} renew commands/s sent"))
                .unwrap_or_default(),
            h.lost
        );
    }
    if let Some(s) = &r.scaling {
        print_scaling(s);
    }
}

fn print_scaling(s: &crate::bench::scaling::Scaling) {
    for l in &s.held {
        outln!(
            "with {} other locks held (taken in {:.1}s): acquire p50 {} p99 {}, release p50 {} p99 {}{}{}",
            l.held,
            l.fill_seconds,
            show_us(l.acquire.p50_us),
            show_us(l.acquire.p99_us),
            show_us(l.release.p50_us),
            show_us(l.release.p99_us),
            l.rss_per_held_lock_bytes
                .map(|b| format!("; {b:.0} bytes of RSS per held lock"))
                .unwrap_or_default(),
            l.skipped.suffix()
        );
    }
    if let Some(why) = &s.held_stopped {
        outln!("held names: stopped {why}");
    }
    for l in &s.waiters {
        outln!(
            "{} waiters on one name: {:.0} grants/s, {:.0} of them hand-offs, p50 {} p99 {}; {} client CPU per grant{}{}",
            l.waiters,
            l.grants_per_sec,
            l.handoffs_per_sec,
            show_us(l.handoff.p50_us),
            show_us(l.handoff.p99_us),
            show_us(l.client_cpu_us_per_grant.round() as u64),
            match (l.requests_per_grant, s.requests_counted) {
                (Some(r), Some(what)) => format!("; {r:.1} {what} per grant"),
                _ => String::new(),
            },
            l.skipped.suffix()
        );
    }
    if let Some(why) = &s.waiters_stopped {
        outln!("waiters: stopped {why}");
    }
}

async fn contended(url: &str, name: &str, args: &BenchArgs) -> Result<Contended, Failure> {
    let lists = (0..args.processes)
        .map(|_| {
            vec![
                "bench-worker".to_owned(),
                "--url".to_owned(),
                url.to_owned(),
                "--lock-name".to_owned(),
                format!("{name}:contended"),
                "--duration".to_owned(),
                format!("{}ms", args.duration.as_millis()),
                "--max-cycles".to_owned(),
                "1000000".to_owned(),
                "--ttl".to_owned(),
                format!("{}ms", args.ttl.as_millis()),
                "--primitive".to_owned(),
                args.primitive.name().to_owned(),
                "--permits".to_owned(),
                args.permits.to_string(),
            ]
        })
        .collect();
    let mut fleet = Fleet::spawn(lists)?;
    let mut per_process = vec![0u64; args.processes as usize];
    let mut waits = Vec::new();
    let mut seconds: f64 = 0.0;
    let mut skipped = Skipped::default();
    while let Some((i, event)) = fleet.next().await {
        if event["t"].as_str() == Some("done") {
            per_process[i] = event["cycles"].as_u64().unwrap_or(0);
            seconds = seconds.max(event["seconds"].as_f64().unwrap_or(0.0));
            waits.extend(numbers(&event["waits_us"]));
            skipped.merge(Skipped {
                count: event["skipped"].as_u64().unwrap_or(0),
                first: event["first_skipped"].as_str().map(str::to_owned),
            });
        }
    }
    fleet.wait().await?;
    let acquisitions: u64 = per_process.iter().sum();
    Ok(Contended {
        processes: args.processes,
        seconds,
        acquisitions,
        acquisitions_per_sec: if seconds > 0.0 {
            acquisitions as f64 / seconds
        } else {
            0.0
        },
        wait: Latency::of(&waits),
        jain_fairness: jain(&per_process),
        per_process,
        skipped,
    })
}

/// One contended worker: lock/release as fast as it can until the time or count runs out.
pub async fn worker(args: BenchWorkerArgs) -> Result<i32, Failure> {
    let locker = Locker::connect(&args.url).await?;
    let opts = LockOptions::new()
        .ttl(args.ttl)
        .wait(dlock::Wait::Timeout(Duration::from_secs(30)));
    let mut waits = Vec::new();
    let start = Instant::now();
    let mut cycles = 0u64;
    let take = Take {
        primitive: args.primitive,
        permits: args.permits,
    };
    let skips = Skips::default();
    while start.elapsed() < args.duration && cycles < args.max_cycles {
        let t = Instant::now();
        let g = match take.take(&locker, &args.lock_name, &opts).await {
            Ok(g) => g,
            Err(e) => {
                skips.step_over(e)?;
                continue;
            }
        };
        if waits.len() < 200_000 {
            waits.push(micros(t.elapsed()));
        }
        // A cycle whose release failed still took the lock: it counts.
        skips.release(g).await?;
        cycles += 1;
    }
    let skipped = skips.tally();
    emit(&json!({
        "t": "done",
        "cycles": cycles,
        "seconds": start.elapsed().as_secs_f64(),
        "waits_us": waits,
        "skipped": skipped.count,
        "first_skipped": skipped.first,
    }));
    Ok(0)
}
