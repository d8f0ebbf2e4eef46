//! `dlock check`: worker processes take the lock, read a fenced store with their token,
//! write value + 1, release — while faults are injected — and an offline checker counts
//! what went wrong (`dlock_check::check`).
//!
//! The parent is the collector: it stamps every worker event with its own monotonic
//! clock when it arrives, so a paused or skewed worker cannot bend the history. Faults
//! are placed deterministically: a worker told `--fault-at K` announces its K-th
//! critical section and then sleeps (kill-holder: the parent SIGKILLs it there) or
//! stops itself (pause-holder: SIGSTOP; the parent sends SIGCONT after TTL + 0.5 s), and
//! then carries on with its now stale token.

mod crowd;

use std::io::Write;
use std::time::{Duration, Instant};

use dlock::{LockOptions, Locker, Wait};
use dlock_check::{Fault, FaultProxy, FencedStore, Findings, Grant, StoreClient, StoreReply};
use serde_json::{Value, json};

use crate::args::{CheckArgs, CheckFault, CheckPrimitive, CheckWorkerArgs, CheckWorkload};
use crate::exit::Failure;
use crate::fleet::{Fleet, emit};
use crate::output::outln;

/// The report `--json` prints.
#[derive(Debug, serde::Serialize)]
struct Report {
    backend: String,
    fault: &'static str,
    workload: &'static str,
    primitive: &'static str,
    /// A semaphore's permits, and the most of its holders inside at once.
    permits: Option<u32>,
    most_at_once: Option<u64>,
    fenced: bool,
    /// The backend's fencing capability: `durable` or `best-effort`.
    fencing: &'static str,
    workers: u32,
    ops: u64,
    failed_acquires: u64,
    faults_injected: u64,
    #[serde(flatten)]
    findings: Findings,
    orphans: u64,
    orphan_check: String,
    recovery_ms_p50: Option<u64>,
    recovery_ms_p99: Option<u64>,
    loss_notice_ms_p99: Option<i64>,
    final_value: u64,
    accepted_writes: u64,
    history: String,
    verdict: &'static str,
}

fn percentile<T: Copy + Ord>(v: &mut [T], p: f64) -> Option<T> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).copied()
}

/// A fault proxy in front of `url`'s one server, and the URL that goes through it.
async fn proxy_for(url: &str) -> Result<(std::sync::Arc<FaultProxy>, String), Failure> {
    let parsed = dlock::url::ConnectUrl::parse(url)?;
    let usage = |why: &str| {
        Failure::new(
            crate::exit::USAGE,
            format!("--fault partition/latency: {why}"),
        )
    };
    let [host] = parsed.hosts() else {
        return Err(usage("needs a URL with exactly one host:port"));
    };
    let Some(port) = host.port else {
        return Err(usage("needs an explicit port in the URL"));
    };
    let upstream = tokio::net::lookup_host((host.host.as_str(), port))
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| usage("cannot resolve the host"))?;
    let proxy = FaultProxy::start(upstream)
        .await
        .map_err(|e| Failure::internal(format!("fault proxy: {e}")))?;
    let through = url.replacen(
        &host.to_string(),
        &format!("127.0.0.1:{}", proxy.addr().port()),
        1,
    );
    Ok((std::sync::Arc::new(proxy), through))
}

/// `pid` and every process below it (PostgreSQL serves each connection from a child of
/// the postmaster: pausing only the parent would pause nothing that matters).
fn process_tree(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            // /proc/PID/stat: "pid (comm) state ppid …"; comm may hold spaces.
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parents.push((p, ppid));
            }
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    tree
}

fn signal_tree(pid: Option<u32>, sig: nix::sys::signal::Signal) {
    for p in pid.map(process_tree).unwrap_or_default() {
        signal(Some(p), sig);
    }
}

fn signal(pid: Option<u32>, sig: nix::sys::signal::Signal) {
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
    }
}

/// Start the server-side fault `fault` now, for `window`; it ends by itself.
fn server_fault(
    fault: CheckFault,
    proxy: Option<&std::sync::Arc<FaultProxy>>,
    server_pid: Option<u32>,
    window: Duration,
    seed: u64,
) {
    use nix::sys::signal::Signal;
    match (fault, proxy) {
        (CheckFault::RestartServer, _) => signal_tree(server_pid, Signal::SIGKILL),
        (CheckFault::Reset, Some(p)) => {
            let p = std::sync::Arc::clone(p);
            tokio::spawn(async move {
                let end = tokio::time::Instant::now() + window;
                let mut rng = seed.max(1);
                let mut next = |bound: u64| {
                    // xorshift: where the resets fall, reproducible from the seed.
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    Duration::from_millis(rng % bound)
                };
                while tokio::time::Instant::now() < end {
                    tokio::time::sleep(next(40) + Duration::from_millis(10)).await;
                    p.set(Fault::DropReplies);
                    tokio::time::sleep(next(10)).await;
                    p.reset_all();
                    p.set(Fault::None);
                }
            });
        }
        (CheckFault::Partition | CheckFault::Latency, Some(p)) => {
            let p = std::sync::Arc::clone(p);
            p.set(if fault == CheckFault::Latency {
                Fault::Delay(Duration::from_millis(100))
            } else {
                Fault::Blackhole
            });
            tokio::spawn(async move {
                tokio::time::sleep(window).await;
                p.set(Fault::None);
                if fault == CheckFault::Partition {
                    // A blackhole leaves half-sent requests behind: connections time
                    // out and are made again.
                    p.reset_all();
                }
            });
        }
        _ => {
            signal_tree(server_pid, Signal::SIGSTOP);
            tokio::spawn(async move {
                tokio::time::sleep(window).await;
                signal_tree(server_pid, Signal::SIGCONT);
            });
        }
    }
}

/// How long after its holder dies a lock must be free: the TTL, or the session
/// timeout where that is longer.
fn release_bound(locker: &Locker, ttl: Duration) -> Duration {
    locker
        .capabilities()
        .session_timeout
        .map_or(ttl, |s| s.max(ttl))
}

pub async fn check(args: CheckArgs) -> Result<i32, Failure> {
    if args.primitive != CheckPrimitive::Lock && args.workload != CheckWorkload::Single {
        return Err(Failure::new(
            crate::exit::USAGE,
            "--primitive election|semaphore|rwlock runs with --workload single",
        ));
    }
    let dir = tempfile::tempdir().map_err(|e| Failure::internal(e.to_string()))?;
    let url = crate::exit::scratch_url(args.url.as_deref(), dir.path(), "check.db");
    let locker = Locker::connect(&url).await?;
    let fenced = !args.unfenced;
    let store = FencedStore::start(fenced)
        .await
        .map_err(|e| Failure::internal(format!("fenced store: {e}")))?;
    let lock_name = format!("check:{}", dlock::Owner::random());
    let per_worker = args.ops.div_ceil(args.workers);
    let tasks = match args.workload {
        CheckWorkload::Single => 0,
        CheckWorkload::Crowd => args.tasks,
    };
    // Where a fault falls is counted in the faulty task's own critical sections.
    let per_task = per_worker.div_ceil(tasks.max(1));
    let faults = match args.fault {
        CheckFault::KillHolder | CheckFault::PauseHolder => {
            args.faults.min(args.workers.saturating_sub(1))
        }
        _ => 0,
    };
    // partition / latency / reset: workers connect through a loopback fault proxy.
    let proxy = match args.fault {
        CheckFault::Partition | CheckFault::Latency | CheckFault::Reset => {
            Some(proxy_for(&url).await?)
        }
        _ => None,
    };
    let worker_url = proxy
        .as_ref()
        .map_or_else(|| url.clone(), |(_, u)| u.clone());
    let mut arg_lists = Vec::new();
    for w in 0..args.workers {
        let mut a = vec![
            "check-worker".to_owned(),
            "--url".to_owned(),
            worker_url.clone(),
            "--store".to_owned(),
            store.addr().to_string(),
            "--lock-name".to_owned(),
            lock_name.clone(),
            "--worker".to_owned(),
            w.to_string(),
            "--ops".to_owned(),
            per_worker.to_string(),
            "--ttl".to_owned(),
            format!("{}ms", args.ttl.as_millis()),
            "--think".to_owned(),
            format!("{}us", args.think.as_micros()),
            "--tasks".to_owned(),
            tasks.to_string(),
            "--seed".to_owned(),
            args.seed.wrapping_add(u64::from(w)).to_string(),
            "--primitive".to_owned(),
            args.primitive.name().to_owned(),
            "--permits".to_owned(),
            args.permits.to_string(),
        ];
        if w < faults {
            // Spread the faults over the run, deterministically from the seed.
            let at = (u64::from(per_task) / 4
                + (args.seed.wrapping_mul(31).wrapping_add(u64::from(w) * 7))
                    % (u64::from(per_task) / 2).max(1))
            .min(u64::from(per_task).saturating_sub(1));
            a.extend(["--fault-at".to_owned(), at.to_string()]);
            if args.fault == CheckFault::KillHolder {
                a.push("--kill-me".to_owned());
            }
        }
        arg_lists.push(a);
    }
    let history_path = args.history.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("dlock-check-{}.jsonl", std::process::id()))
    });
    let mut history =
        std::io::BufWriter::new(std::fs::File::create(&history_path).map_err(|e| {
            Failure::new(
                crate::exit::CANT_CREATE,
                format!(
                    "cannot create the history file {}: {e}",
                    history_path.display()
                ),
            )
        })?);
    let started = Instant::now();
    let mut fleet = Fleet::spawn(arg_lists)?;
    let pids: Vec<Option<u32>> = (0..args.workers as usize).map(|i| fleet.pid(i)).collect();
    let mut grants = Vec::new();
    // Whether each grant was a write (a read-write lock's reads excepted, all are).
    let mut writes: Vec<bool> = Vec::new();
    let mut failed = 0u64;
    let mut injected = 0u64;
    // The fault being recovered from: (worker, at), and its recovery once another
    // worker is granted: (worker, next grant at).
    let mut pending: Vec<(usize, Instant)> = Vec::new();
    let mut recovered: Vec<(usize, Instant)> = Vec::new();
    let mut recovery_ms = Vec::new();
    let mut notice_ms: Vec<i64> = Vec::new();
    // Faulty holders whose lost() came while their fault was still unrecovered.
    let mut early_loss: Vec<(usize, Instant)> = Vec::new();
    let deadline = tokio::time::Instant::now() + args.max_time;
    // Server-side faults start a third of the way into the run (counted in grants).
    let server_fault_after = matches!(
        args.fault,
        CheckFault::PauseServer
            | CheckFault::RestartServer
            | CheckFault::Partition
            | CheckFault::Latency
            | CheckFault::Reset
    )
    .then(|| u64::from(args.ops / 3).max(1));
    let mut server_faulted = false;
    loop {
        let next = tokio::time::timeout_at(deadline, fleet.next()).await;
        let Ok(Some((w, event))) = next else { break };
        let now = Instant::now();
        let at_ns = u64::try_from(now.duration_since(started).as_nanos()).unwrap_or(u64::MAX);
        let mut line = json!({"at_ns": at_ns, "worker": w});
        if let (Value::Object(l), Value::Object(e)) = (&mut line, &event) {
            l.extend(e.clone());
        }
        let _ = writeln!(history, "{line}");
        match event["t"].as_str() {
            Some("grant") => {
                let token = event["token"].as_u64().unwrap_or(0);
                writes.push(event["write"].as_bool().unwrap_or(true));
                grants.push(Grant {
                    at_ns,
                    worker: u32::try_from(w).unwrap_or(u32::MAX),
                    token,
                });
                let mut still = Vec::new();
                for (fw, at) in pending.drain(..) {
                    // A grant reported within 20 ms of a server pause was made before it.
                    let before_pause =
                        fw == usize::MAX && now.duration_since(at) < Duration::from_millis(20);
                    if fw == w || before_pause {
                        still.push((fw, at));
                        continue;
                    }
                    recovery_ms.push(
                        u64::try_from(now.duration_since(at).as_millis()).unwrap_or(u64::MAX),
                    );
                    match early_loss.iter().position(|(lw, _)| *lw == fw) {
                        // The faulty holder heard of its loss before this grant.
                        Some(pos) => {
                            let (_, lost_at) = early_loss.remove(pos);
                            notice_ms.push(
                                -i64::try_from(now.duration_since(lost_at).as_millis())
                                    .unwrap_or(i64::MAX),
                            );
                        }
                        None => recovered.push((fw, now)),
                    }
                }
                pending = still;
                if !server_faulted && server_fault_after.is_some_and(|n| grants.len() as u64 >= n) {
                    server_faulted = true;
                    injected += 1;
                    // No worker is at fault: any next grant is the recovery.
                    pending.push((usize::MAX, Instant::now()));
                    let window = args.ttl + Duration::from_secs(1);
                    server_fault(
                        args.fault,
                        proxy.as_ref().map(|(p, _)| p),
                        args.server_pid,
                        window,
                        args.seed,
                    );
                }
            }
            Some("fail") => failed += 1,
            Some("holding") => {
                signal(pids[w], nix::sys::signal::Signal::SIGKILL);
                injected += 1;
                pending.push((w, now));
            }
            Some("pausing") => {
                injected += 1;
                pending.push((w, now));
                let pause = args.pause.unwrap_or(args.ttl + Duration::from_millis(500));
                let pid = pids[w];
                tokio::spawn(async move {
                    tokio::time::sleep(pause).await;
                    signal(pid, nix::sys::signal::Signal::SIGCONT);
                });
            }
            Some("lost") => {
                if pending.iter().any(|(fw, _)| *fw == w) {
                    early_loss.push((w, now));
                } else if let Some(pos) = recovered.iter().position(|(fw, _)| *fw == w) {
                    let (_, next_grant) = recovered.remove(pos);
                    let ms = if now >= next_grant {
                        i64::try_from(now.duration_since(next_grant).as_millis())
                            .unwrap_or(i64::MAX)
                    } else {
                        -i64::try_from(next_grant.duration_since(now).as_millis())
                            .unwrap_or(i64::MAX)
                    };
                    notice_ms.push(ms);
                }
            }
            _ => {}
        }
    }
    let _ = history.flush();
    fleet.kill_all().await;
    // Whatever a dead worker held must be free after its lease — or, where locks end
    // with a session (etcd, ZooKeeper), after the server gives up on the session.
    // A crowd task may ask for a longer lease than `--ttl`.
    let longest_lease = match args.workload {
        CheckWorkload::Single => args.ttl,
        CheckWorkload::Crowd => args.ttl * crowd::LONGEST_LEASE,
    };
    tokio::time::sleep(release_bound(&locker, longest_lease) + Duration::from_millis(500)).await;
    // A backend that cannot answer (e.g. Redlock without a quorum) cannot have handed
    // the lock to anyone either; say that the check could not run.
    // A connection broken by the fault may fail the first command: try a few times.
    let semaphore = (args.primitive == CheckPrimitive::Semaphore)
        .then(|| locker.semaphore(&lock_name, args.permits));
    let rwlock = (args.primitive == CheckPrimitive::Rwlock).then(|| locker.rwlock(&lock_name));
    let left = async || match (&semaphore, &rwlock) {
        (Some(s), _) => s.holders().await.map(|h| h.len() as u64),
        (_, Some(rw)) => rw.holders().await.map(|h| h.len() as u64),
        _ => locker
            .inspect(&lock_name)
            .await
            .map(|held| u64::from(held.is_some())),
    };
    let mut inspected = left().await;
    for _ in 0..5 {
        if inspected.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        inspected = left().await;
    }
    let (orphans, orphan_check) = match inspected {
        Ok(held) => (held, "done".to_owned()),
        Err(e) => (0, format!("not possible: {e}")),
    };
    let log = store.log();
    let mut findings = dlock_check::check(&grants, &log);
    // A semaphore's holders each keep a cell of their own: inside together is allowed
    // up to the permits, and the overlaps are the entries beyond them.
    let most_at_once = if semaphore.is_some() {
        let (most, over) = dlock_check::concurrency(&log, &lock_name, u64::from(args.permits));
        findings.overlaps = over;
        Some(most)
    } else if rwlock.is_some() {
        // Readers keep cells of their own, writers the lock's: a writer beside anyone
        // is an overlap. Reads granted together may be told in either order; a write's
        // token must be above every token granted before it.
        findings.overlaps = dlock_check::writer_overlaps(&log, &lock_name);
        findings.token_inversions = write_inversions(&grants, &writes);
        Some(dlock_check::concurrency(&log, &lock_name, u64::MAX).0)
    } else {
        None
    };
    let final_value = match &semaphore {
        Some(_) => (0..args.workers)
            .map(|w| store.cell(&format!("{lock_name}#{w}")).0)
            .sum(),
        None => store.cell(&lock_name).0,
    };
    let accepted_writes = log.iter().filter(|o| o.write && o.accepted).count() as u64;
    let durable = locker.capabilities().fencing == dlock::Fencing::Durable;
    // A token source that is not durable may repeat or go back after a server restart:
    // its capabilities say so, and the check reports it without calling it broken.
    let broken = (findings.duplicate_tokens > 0 && (durable || args.fault == CheckFault::None))
        || orphans > 0
        // Permits granted together may be reported in either order (their tokens are
        // unique, and not ordered among holders inside together).
        || (durable && findings.token_inversions > 0 && semaphore.is_none())
        || (fenced && durable && (findings.stale_accepted > 0 || findings.lost_updates > 0))
        || (args.fault == CheckFault::None && findings.overlaps > 0);
    let report = Report {
        backend: locker.url().to_owned(),
        fault: args.fault.name(),
        workload: args.workload.name(),
        primitive: args.primitive.name(),
        permits: semaphore.is_some().then_some(args.permits),
        most_at_once,
        fenced,
        fencing: if durable { "durable" } else { "best-effort" },
        workers: args.workers,
        ops: grants.len() as u64,
        failed_acquires: failed,
        faults_injected: injected,
        findings,
        orphans,
        orphan_check,
        recovery_ms_p50: percentile(&mut recovery_ms.clone(), 0.5),
        recovery_ms_p99: percentile(&mut recovery_ms, 0.99),
        loss_notice_ms_p99: percentile(&mut notice_ms, 0.99),
        final_value,
        accepted_writes,
        history: history_path.display().to_string(),
        verdict: if broken { "broken" } else { "ok" },
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string(&report).map_err(|e| Failure::internal(e.to_string()))?
        );
    } else {
        print_report(&report);
    }
    Ok(i32::from(broken))
}

/// Write grants (in the collector's time order) whose token is below an earlier
/// grant's, read or write.
fn write_inversions(grants: &[Grant], writes: &[bool]) -> u64 {
    let mut order: Vec<usize> = (0..grants.len()).collect();
    order.sort_by_key(|&i| (grants[i].at_ns, grants[i].token));
    let mut highest = 0;
    let mut inversions = 0;
    for i in order {
        if writes.get(i).copied().unwrap_or(true) && grants[i].token < highest {
            inversions += 1;
        }
        highest = highest.max(grants[i].token);
    }
    inversions
}

fn print_report(r: &Report) {
    let opt = |v: Option<u64>| v.map_or("-".to_owned(), |v| format!("{v} ms"));
    outln!(
        "dlock check: {} · fault {} · workload {} · {}{} · {} · {} workers",
        r.backend,
        r.fault,
        r.workload,
        r.primitive,
        r.permits
            .map_or(String::new(), |n| format!(" of {n} permits")),
        if r.fenced {
            "fenced store"
        } else {
            "unfenced store"
        },
        r.workers
    );
    let f = &r.findings;
    for (what, value) in [
        ("grants (ops)", r.ops.to_string()),
        ("failed acquires", r.failed_acquires.to_string()),
        ("faults injected", r.faults_injected.to_string()),
        (
            if r.permits.is_some() {
                "entries beyond the permits"
            } else {
                "overlapping critical sections"
            },
            f.overlaps.to_string(),
        ),
        (
            "most inside at once",
            r.most_at_once.map_or("-".to_owned(), |m| m.to_string()),
        ),
        ("stale operations accepted", f.stale_accepted.to_string()),
        (
            "stale operations rejected (fence)",
            f.stale_rejected.to_string(),
        ),
        ("token inversions", f.token_inversions.to_string()),
        ("duplicate tokens", f.duplicate_tokens.to_string()),
        ("lost updates", f.lost_updates.to_string()),
        (
            "orphans after the longest lease (or session timeout) + 0.5 s",
            format!("{} (check {})", r.orphans, r.orphan_check),
        ),
        (
            "recovery p50 / p99",
            format!("{} / {}", opt(r.recovery_ms_p50), opt(r.recovery_ms_p99)),
        ),
        (
            "holder's lost() after the next grant, p99",
            r.loss_notice_ms_p99
                .map_or("-".to_owned(), |v| format!("{v} ms")),
        ),
        (
            "final value / accepted writes",
            format!("{} / {}", r.final_value, r.accepted_writes),
        ),
        ("history (JSONL)", r.history.clone()),
        ("verdict", r.verdict.to_owned()),
    ] {
        outln!("  {what:<42} {value}");
    }
}

/// One worker process (hidden `check-worker`).
pub async fn worker(args: CheckWorkerArgs) -> Result<i32, Failure> {
    if args.tasks > 0 {
        return crate::check::crowd::worker(args).await;
    }
    let locker = Locker::connect(&args.url).await?;
    let addr = args
        .store
        .parse()
        .map_err(|e| Failure::internal(format!("store address: {e}")))?;
    let mut store = StoreClient::connect(addr, args.worker)
        .await
        .map_err(|e| Failure::internal(format!("store: {e}")))?;
    let opts = LockOptions::new()
        .ttl(args.ttl)
        .wait(Wait::Timeout(Duration::from_secs(30)));
    let io = |e: std::io::Error| Failure::internal(format!("store: {e}"));
    // A semaphore's holders are inside together: each keeps its own cell.
    let cell = match args.primitive {
        CheckPrimitive::Semaphore => format!("{}#{}", args.lock_name, args.worker),
        _ => args.lock_name.clone(),
    };
    let semaphore = locker.semaphore(&args.lock_name, args.permits);
    let election = locker.election(&args.lock_name);
    let rwlock = locker.rwlock(&args.lock_name);
    let value = format!("worker {}", args.worker);
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let reader_cell = format!("{}#{}", args.lock_name, args.worker);
    for i in 0..args.ops {
        // A read-write lock's reader reads its own cell (twice: its section's span).
        // The holder a fault falls on is a writer: others must wait out its hold.
        let reads = args.primitive == CheckPrimitive::Rwlock
            && rng.u8(0..3) > 0
            && args.fault_at != Some(u64::from(i));
        let taken = match args.primitive {
            CheckPrimitive::Lock => locker.lock_with(&args.lock_name, &opts).await,
            CheckPrimitive::Semaphore => semaphore.acquire_with(&opts).await,
            CheckPrimitive::Rwlock if reads => rwlock.read_with(&opts).await,
            CheckPrimitive::Rwlock => rwlock.write_with(&opts).await,
            CheckPrimitive::Election => election
                .campaign_with(&value, &opts)
                .await
                .map(dlock::Leadership::into_guard),
        };
        let guard = match taken {
            Ok(g) => g,
            Err(e) => {
                emit(&json!({"t": "fail", "error": e.to_string()}));
                // A server that is down answers at once: do not burn the run on it.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let token = guard.fencing_token();
        emit(&json!({"t": "grant", "token": token, "write": !reads}));
        let lost = guard.lost_token();
        let watcher = tokio::spawn(async move {
            lost.cancelled().await;
            emit(&json!({"t": "lost"}));
        });
        if args.fault_at == Some(u64::from(i)) {
            if args.kill_me {
                emit(&json!({"t": "holding"}));
                tokio::time::sleep(Duration::from_secs(3600)).await;
            } else {
                emit(&json!({"t": "pausing"}));
                let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
            }
        }
        if reads {
            let read = store.read(&reader_cell, token).await.map_err(io)?;
            emit(&json!({"t": "read", "stale": matches!(read, StoreReply::Stale { .. })}));
            if !args.think.is_zero() {
                tokio::time::sleep(args.think).await;
            }
            let _ = store.read(&reader_cell, token).await.map_err(io)?;
            let released = guard.release().await.is_ok();
            watcher.abort();
            emit(&json!({"t": "release", "ok": released}));
            continue;
        }
        let read = store.read(&cell, token).await.map_err(io)?;
        emit(&json!({"t": "read", "stale": matches!(read, StoreReply::Stale { .. })}));
        if let StoreReply::Ok { value, version } = read {
            if !args.think.is_zero() {
                tokio::time::sleep(args.think).await;
            }
            let wrote = store
                .write(&cell, token, version, value + 1)
                .await
                .map_err(io)?;
            emit(&json!({"t": "write", "stale": matches!(wrote, StoreReply::Stale { .. })}));
        }
        let released = guard.release().await.is_ok();
        watcher.abort();
        emit(&json!({"t": "release", "ok": released}));
    }
    Ok(0)
}
