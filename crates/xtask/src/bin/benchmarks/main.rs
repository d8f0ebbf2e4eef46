//! Writes BENCHMARKS.md: `dlock bench` on every backend (servers started here, on
//! loopback) next to the raw floor measured by the same client in the same run, the
//! peers that install here (bench/peers/), and the CLI against `flock`, `redis-cli`
//! and `etcdctl lock`. Run through `scripts/benchmarks`.
//!
//! Usage: `benchmarks DLOCK_BINARY PEERS_DIR OUTPUT.md [--only-primitives |
//! --only-scaling]`; with `--only-primitives`, only the last section (the primitives
//! beyond the mutex) is measured again and replaces that section of OUTPUT.md; with
//! `--only-scaling`, only the scaling section and its plot.

mod callgrind;
mod primitives;
mod repeats;
mod scaling;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use dlock_testkit::{Matrix, Target, find_binary};
use repeats::{RUNS, Spread};
use serde_json::Value;

/// The client pinned to one CPU when `taskset` exists (single-client figures swing
/// 7–8× on this machine otherwise); servers inherit this process's CPUs (CPU 0 when
/// run by `scripts/benchmarks`).
fn pinned(program: &Path) -> Command {
    match find_binary("taskset") {
        Some(taskset) => {
            let mut c = Command::new(taskset);
            c.args(["-c", "1"]).arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// This process's allowed CPUs, as the kernel lists them (`0`, `0-1`).
fn own_cpus() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_owned())
}

fn json_line(out: &std::process::Output) -> Option<Value> {
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&text).ok().or_else(|| {
        text.lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
    })
}

/// `dlock bench --url URL --json ARGS`, pinned to the client CPU and without
/// `DLOCK_URL`: its JSON report, or `None` (said on stderr) when it failed.
fn dlock_bench(dlock: &Path, url: &str, args: &[&str]) -> Option<Value> {
    let out = pinned(dlock)
        .args(["bench", "--url", url, "--json"])
        .args(args)
        .env_remove("DLOCK_URL")
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "benchmarks: dlock bench {} on {url} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let report = json_line(&out)?;
    log_skipped(&report, &format!("dlock bench {} on {url}", args.join(" ")));
    Some(report)
}

/// Log every part of a report that stepped over cycles on an error, with the first one.
fn log_skipped(v: &Value, run: &str) {
    match v {
        Value::Object(fields) => {
            if let (Some(n @ 1..), Some(first)) = (
                v["skipped"]["count"].as_u64(),
                v["skipped"]["first"].as_str(),
            ) {
                eprintln!("benchmarks: {run}: {n} cycles stepped over, the first on: {first}");
            }
            fields.values().for_each(|f| log_skipped(f, run));
        }
        Value::Array(items) => items.iter().for_each(|i| log_skipped(i, run)),
        _ => {}
    }
}

/// `dlock bench --json` on `url`: the main table's scenarios.
fn bench(dlock: &Path, url: &str, extra: &[&str]) -> Option<Value> {
    let mut args = vec!["--cycles", "3000", "--processes", "8", "--waiters", "50"];
    args.extend(["--tasks", "64", "--duration", "3s"]);
    args.extend(extra);
    dlock_bench(dlock, url, &args)
}

/// A peer script (Python, or Node for `.js`): one JSON line with `ops_per_sec`,
/// `p50_us`, `p99_us`.
fn peer(script: &Path, target: &str, cycles: u32) -> Option<Value> {
    peer_script(script, &[target, &cycles.to_string()])
}

/// `bench/peers/handoff.py PEER TARGET 50 3`: a peer's contended hand-off figures.
fn handoff_peer(script: &Path, peer: &str, target: &str) -> Option<Value> {
    peer_script(script, &[peer, target, "50", "3"])
}

/// Run a peer script pinned to the client CPU; its last JSON line.
fn peer_script(script: &Path, args: &[&str]) -> Option<Value> {
    let interpreter = if script.extension().is_some_and(|e| e == "js") {
        "node"
    } else {
        "python3"
    };
    let Some(interpreter) = find_binary(interpreter) else {
        eprintln!("benchmarks: no {interpreter}: {} skipped", script.display());
        return None;
    };
    let out = pinned(&interpreter).arg(script).args(args).output().ok()?;
    if !out.status.success() {
        eprintln!(
            "benchmarks: {} {args:?} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    json_line(&out)
}

/// Runs of `cmd` per second over `n` runs (each must succeed).
fn runs_per_sec(n: u32, mut cmd: impl FnMut() -> Command) -> Option<f64> {
    let start = Instant::now();
    for i in 0..n {
        let mut c = cmd();
        let out = c.output().ok()?;
        if !out.status.success() {
            eprintln!(
                "benchmarks: run {i} of {c:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            return None;
        }
    }
    Some(f64::from(n) / start.elapsed().as_secs_f64())
}

/// Runs per second of each command, `n` rounds of one run each in turn, each round
/// starting one command further on (a change in the machine's speed lands on all of
/// them); `None` for a command that failed.
fn alternating_runs_per_sec(n: u32, cmds: &mut [&mut dyn FnMut() -> Command]) -> Vec<Option<f64>> {
    let mut spent = vec![Some(Duration::ZERO); cmds.len()];
    let k = cmds.len();
    for i in 0..n {
        // Each round starts one command further on: none always follows the same one.
        for j in 0..k {
            let at = (j + usize::try_from(i).unwrap_or(0)) % k;
            let (cmd, total) = (&mut cmds[at], &mut spent[at]);
            let Some(sum) = total else { continue };
            let mut c = cmd();
            let start = Instant::now();
            match c.output() {
                Ok(out) if out.status.success() => *sum += start.elapsed(),
                other => {
                    eprintln!("benchmarks: run {i} of {c:?} failed: {other:?}");
                    *total = None;
                }
            }
        }
    }
    spent
        .into_iter()
        .map(|t| t.map(|d| f64::from(n) / d.as_secs_f64()))
        .collect()
}

/// A command-line row's three figures: our runs/s, the tool's, and the tool's runs/s
/// over ours (our time over the tool's), "failed"/"–" where one is missing.
fn cli_cells(ours: Option<f64>, tool: Option<f64>) -> [String; 3] {
    let rate = |r: Option<f64>| r.map_or("failed".to_owned(), |v| format!("{v:.0}"));
    let ratio = tool
        .zip(ours)
        .filter(|(_, o)| *o > 0.0)
        .map_or("–".to_owned(), |(t, o)| format!("{:.2}×", t / o));
    [rate(ours), rate(tool), ratio]
}

fn row<'a>(report: &'a Value, scenario: &str) -> Option<&'a Value> {
    report["scenarios"]
        .as_array()?
        .iter()
        .find(|r| r["scenario"].as_str() == Some(scenario))
}

/// A scenario's name, and how many cycles its run stepped over on an error, if any.
fn scenario_cell(s: &Value) -> String {
    format!(
        "{}{}",
        s["scenario"].as_str().unwrap_or("?"),
        stepped_over(s)
    )
}

/// `" (N stepped over)"` when a scenario row's run stepped over N > 0 cycles on an
/// error, else nothing.
fn stepped_over(s: &Value) -> String {
    match s["skipped"].as_u64() {
        Some(n @ 1..) => format!(" ({n} stepped over)"),
        _ => String::new(),
    }
}

fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(f) if f >= 100.0 => format!("{f:.0}"),
        Some(f) => format!("{f:.2}"),
        None => "–".to_owned(),
    }
}

/// `host:port` of a testkit URL (`zk://127.0.0.1:2181/root` → `127.0.0.1:2181`).
fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    rest.split(['/', '?']).next().unwrap_or("").to_owned()
}

/// A hand-off run's latency figure (`p50_us`, `p99_us`), "–" when it had no hand-off.
fn handoff_latency(run: &Value, key: &str) -> String {
    if run["handoff"]["count"].as_u64() == Some(0) {
        "–".to_owned()
    } else {
        num(&run["handoff"][key])
    }
}

fn verdict(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "met",
        Some(false) => "**missed**",
        None => "not measured",
    }
}

#[allow(clippy::too_many_lines)]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dlock), Some(peers), Some(out)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("usage: benchmarks DLOCK_BINARY PEERS_DIR OUTPUT.md");
        std::process::exit(2);
    };
    let (dlock, peers) = (PathBuf::from(dlock), PathBuf::from(peers));
    // Every server is started from this thread: killed by a signal, the generator
    // leaves none running.
    dlock_testkit::servers_die_with_this_thread();
    // The servers' own memory sizes: the test kit's small ones measure MariaDB's
    // checkpoints at 100,000 held names more than dlock.
    dlock_testkit::sql_servers_at_default_sizes();
    if args.get(4).map(String::as_str) == Some("--only-scaling") {
        let section = scaling::section(&dlock, &scaling::plot_path(out));
        if let Err(e) =
            xtask::replace_section(out, scaling::HEADING, Some(primitives::HEADING), &section)
        {
            eprintln!("cannot write {out}: {e}");
            std::process::exit(1);
        }
        eprintln!("benchmarks: wrote the scaling section of {out}");
        return;
    }
    let Some(matrix) = Matrix::start() else {
        eprintln!("a server is missing (scripts/install-servers)");
        std::process::exit(1);
    };
    if args.get(4).map(String::as_str) == Some("--only-primitives") {
        let section = primitives::section(&dlock, &matrix);
        if let Err(e) = xtask::replace_section(out, primitives::HEADING, None, &section) {
            eprintln!("cannot write {out}: {e}");
            std::process::exit(1);
        }
        eprintln!("benchmarks: wrote the primitives section of {out}");
        return;
    }

    // 1. dlock bench on every backend configuration. A run that fails is made once
    // more (one worker's error ends a run: Redlock's `NoQuorum` under a loaded CPU,
    // say); a configuration that fails twice gets a row that says so.
    let mut reports: Vec<(&Target, Value)> = Vec::new();
    let mut failed = String::new();
    for t in &matrix.targets {
        eprintln!("benchmarks: dlock bench on {}", t.label);
        let extra: &[&str] = if t.label == "redis (no persistence)" {
            &["--hold", "100000", "--hold-for", "10s"]
        } else {
            &[]
        };
        let run = bench(&dlock, &t.url, extra).or_else(|| {
            eprintln!("benchmarks: dlock bench on {} once more", t.label);
            bench(&dlock, &t.url, extra)
        });
        match run {
            Some(r) => reports.push((t, r)),
            None => {
                let _ = writeln!(
                    failed,
                    "| {} | (failed twice: the generator's log says why) | | | | | | |",
                    t.label
                );
            }
        }
    }
    let url_of = |label: &str| {
        matrix
            .targets
            .iter()
            .find(|t| t.label == label)
            .map(|t| t.url.clone())
            .unwrap_or_default()
    };
    let report_of = |label: &str| {
        reports
            .iter()
            .find(|(t, _)| t.label == label)
            .map(|(_, r)| r)
    };
    // The targets read medians over runs of their own (repeats.rs).
    let rounds = repeats::Rounds::measure(&matrix.targets, |url, args| bench(&dlock, url, args));
    let runs_of = |label: &str| rounds.of(label);
    let targets_skipped = match rounds.skipped() {
        0 => "These runs stepped over no cycle on an error (see *Every backend*).".to_owned(),
        n => format!(
            "These runs stepped over {n} cycles on an error between them (see *Every \
             backend*; the generator's log names each run and its first error)."
        ),
    };
    let mut table = String::new();
    for (t, r) in &reports {
        for s in r["scenarios"].as_array().into_iter().flatten() {
            let _ = writeln!(
                table,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                t.label,
                scenario_cell(s),
                num(&s["ops_per_sec"]),
                num(&s["floor_ops_per_sec"]),
                num(&s["ratio"]),
                num(&s["p50_us"]),
                num(&s["p99_us"]),
                num(&s["p999_us"]),
            );
        }
    }
    table.push_str(&failed);

    // Waiting by notification against polling, from the same reports.
    let mut waiting_rows = String::new();
    let pct = |v: &Value| {
        v["reacquired_pct"]
            .as_f64()
            .map_or("–".into(), |p| format!("{p:.1} %"))
    };
    let jain_of = |v: &Value| {
        v["jain_fairness"]
            .as_f64()
            .map_or("–".into(), |j| format!("{j:.3}"))
    };
    for (t, r) in &reports {
        let (n, p) = (&r["handoff"]["dlock"], &r["polling"]);
        if n.is_null() || p.is_null() {
            continue;
        }
        let _ = writeln!(
            waiting_rows,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            t.label,
            num(&n["handoffs_per_sec"]),
            pct(n),
            jain_of(n),
            handoff_latency(n, "p99_us"),
            num(&p["handoffs_per_sec"]),
            pct(p),
            jain_of(p),
            handoff_latency(p, "p99_us"),
        );
    }
    // SQLite's fair mode: the same hand-off run with `--fair`.
    let sqlite_url = url_of("sqlite");
    eprintln!("benchmarks: dlock bench --fair on sqlite");
    let sqlite_fair = bench(&dlock, &sqlite_url, &["--fair", "--scenario", "handoff"]);

    // 2. Peers, against the floor of the same backend from step 1.
    let redis = report_of("redis (no persistence)");
    let redis_url = url_of("redis (no persistence)");
    let zk_host = host_port(&url_of("zookeeper"));
    let mut peer_rows = String::new();
    let mut peer_ratio = |label: &str, backend: &str, floor: Option<f64>, r: Option<Value>| {
        let Some(r) = r else {
            let _ = writeln!(peer_rows, "| {label} | {backend} | failed | | | |");
            return;
        };
        let ops = r["ops_per_sec"].as_f64().unwrap_or(0.0);
        let ratio = floor.filter(|f| *f > 0.0).map(|f| ops / f);
        let _ = writeln!(
            peer_rows,
            "| {label} | {backend} | {ops:.0} | {} | {} | {} |",
            ratio.map_or("–".to_owned(), |r| format!("{r:.2}")),
            num(&r["p50_us"]),
            num(&r["p99_us"]),
        );
    };
    let floor_of = |r: Option<&Value>| {
        r.and_then(|r| row(r, "uncontended-1-task"))
            .and_then(|s| s["floor_ops_per_sec"].as_f64())
    };
    let redis_floor = floor_of(redis);
    eprintln!("benchmarks: peers");
    peer_ratio(
        "dlock",
        "Redis",
        redis_floor,
        redis.and_then(|r| row(r, "uncontended-1-task").cloned()),
    );
    for (label, script) in [
        ("node `redlock` (ioredis)", "node/node_redlock.js"),
        ("redis-py `Lock`", "redis_py_lock.py"),
        ("python-redis-lock", "python_redis_lock.py"),
    ] {
        let r = peer(&peers.join(script), &redis_url, 3000);
        peer_ratio(label, "Redis", redis_floor, r);
    }
    let zk = report_of("zookeeper");
    peer_ratio(
        "dlock",
        "ZooKeeper",
        floor_of(zk),
        zk.and_then(|r| row(r, "uncontended-1-task").cloned()),
    );
    let r = peer(&peers.join("kazoo_lock.py"), &zk_host, 1000);
    peer_ratio("kazoo `Lock`", "ZooKeeper", floor_of(zk), r);

    let etcd_url = url_of("etcd");
    let endpoint = host_port(&etcd_url);

    // 2b. Peers under contention: 50 threads of one process on one lock, against
    // dlock's hand-off run (50 tasks of one process) on the same server.
    eprintln!("benchmarks: peers under contention");
    let mut contended_rows = String::new();
    let mut contended_p50 = std::collections::HashMap::new();
    for (label, backend, peer_name, target) in [
        ("dlock", "redis (no persistence)", None, ""),
        (
            "redis-py `Lock`",
            "redis (no persistence)",
            Some("redis-py"),
            redis_url.as_str(),
        ),
        (
            "python-redis-lock",
            "redis (no persistence)",
            Some("python-redis-lock"),
            redis_url.as_str(),
        ),
        ("dlock", "zookeeper", None, ""),
        ("kazoo `Lock`", "zookeeper", Some("kazoo"), zk_host.as_str()),
        ("dlock", "etcd", None, ""),
        (
            "etcd3gw `Lock` (tries every 10 ms)",
            "etcd",
            Some("etcd3gw"),
            endpoint.as_str(),
        ),
    ] {
        let run = match peer_name {
            None => report_of(backend).map(|r| r["handoff"]["dlock"].clone()),
            Some(name) => handoff_peer(&peers.join("handoff.py"), name, target),
        };
        let Some(run) = run.filter(|r| !r.is_null()) else {
            let _ = writeln!(contended_rows, "| {label} | {backend} | failed | | | | | |");
            continue;
        };
        if let Some(p50) = run["handoff"]["p50_us"].as_f64() {
            contended_p50.insert((backend, peer_name), p50);
        }
        let _ = writeln!(
            contended_rows,
            "| {label} | {backend} | {} | {} | {} | {} | {} | {} |",
            num(&run["handoffs_per_sec"]),
            handoff_latency(&run, "p50_us"),
            handoff_latency(&run, "p99_us"),
            handoff_latency(&run, "p999_us"),
            pct(&run),
            jain_of(&run),
        );
    }
    // How many times dlock's p50 hand-off is better than the peer's.
    let better_than = |backend: &str, peer: &str| {
        contended_p50
            .get(&(backend, Some(peer)))
            .zip(contended_p50.get(&(backend, None)))
            .filter(|(_, d)| **d > 0.0)
            .map(|(p, d)| p / d)
    };
    let zk_vs_kazoo = better_than("zookeeper", "kazoo");
    let etcd_vs_etcd3gw = better_than("etcd", "etcd3gw");

    // 3. The CLI: one locked `true` against one bare tool call.
    eprintln!("benchmarks: command line");
    let mut cli_rows = String::new();
    let dir = tempfile::tempdir().expect("temp dir");
    let sqlite = format!("sqlite://{}", dir.path().join("cli.db").display());
    let flock_file = dir.path().join("flock");
    let dlock_run = |url: String| {
        let dlock = dlock.clone();
        move || {
            let mut c = Command::new(&dlock);
            c.args(["run", "--url", &url, "bench-cli", "--", "true"])
                .env_remove("DLOCK_URL");
            c
        }
    };
    // SQLite: flock, the limit and dlock in turn, each on its own file.
    let limit_bin = std::env::current_exe()
        .ok()
        .map(|e| e.with_file_name("sqlite-run-limit"))
        .filter(|p| p.exists());
    let limit_db = dir.path().join("limit.db");
    // A missing tool only leaves its own figure out.
    let flock_bin = find_binary("flock");
    let mut flock_cmd = || {
        let mut c = Command::new(flock_bin.as_deref().unwrap_or(Path::new("flock")));
        c.arg(&flock_file).arg("true");
        c
    };
    let mut limit_cmd = || {
        let mut c = Command::new(
            limit_bin
                .as_deref()
                .unwrap_or(Path::new("sqlite-run-limit")),
        );
        c.arg(&limit_db).arg("true");
        c
    };
    let mut ours_cmd = dlock_run(sqlite.clone());
    let mut cmds: Vec<&mut dyn FnMut() -> Command> = vec![&mut ours_cmd];
    if flock_bin.is_some() {
        cmds.push(&mut flock_cmd);
    }
    if limit_bin.is_some() {
        cmds.push(&mut limit_cmd);
    } else {
        eprintln!(
            "benchmarks: sqlite-run-limit is missing (cargo build --release -p xtask --bins)"
        );
    }
    let measured = alternating_runs_per_sec(200, &mut cmds);
    let ours_sqlite = measured[0];
    let flock = flock_bin.is_some().then(|| measured[1]).flatten();
    let limit = limit_bin
        .is_some()
        .then(|| measured[measured.len() - 1])
        .flatten();
    let vs_flock = flock
        .zip(ours_sqlite)
        .filter(|(_, o)| *o > 0.0)
        .map(|(t, o)| t / o);
    let vs_limit = limit
        .zip(ours_sqlite)
        .filter(|(l, _)| *l > 0.0)
        .map(|(l, o)| o / l);
    let [ours_cell, flock_cell, ratio_cell] = cli_cells(ours_sqlite, flock);
    let _ = writeln!(
        cli_rows,
        "| `dlock run` on SQLite | {ours_cell} | `flock FILE true`: {flock_cell} | {ratio_cell} (dlock's runs/s {} the limit's) | {} |",
        vs_limit.map_or("–".to_owned(), |r| format!("{r:.2}×")),
        verdict(vs_flock.map(|r| r <= 2.0 || vs_limit.is_some_and(|l| l >= 0.95))),
    );
    let mut cli = |what: &str, tool: Option<f64>, tool_label: &str, ours: Option<f64>| {
        let ratio = tool.zip(ours).filter(|(_, o)| *o > 0.0).map(|(t, o)| t / o);
        let [ours_cell, tool_cell, ratio_cell] = cli_cells(ours, tool);
        let _ = writeln!(
            cli_rows,
            "| {what} | {ours_cell} | {tool_label}: {tool_cell} | {ratio_cell} | {} |",
            verdict(ratio.map(|r| r <= 2.0)),
        );
    };
    // Where that time goes: the binary's start alone, then the start with the
    // database opened and read once (no lock taken, no command run; `list` exits 0).
    // Rows placed under the SQLite row once the table is complete.
    let mut breakdown = String::new();
    let [limit_cell, flock_cell, ratio_cell] = cli_cells(limit, flock);
    let _ = writeln!(
        breakdown,
        "| the limit on SQLite, `sqlite-run-limit` (start, open, a synced grant, the command, an unsynced release) | {limit_cell} | `flock FILE true`: {flock_cell} | {ratio_cell} | (limit) |",
    );
    for (what, args) in [
        (
            "of which: `dlock --version` (start only)",
            vec!["--version"],
        ),
        (
            "of which: `dlock list` on SQLite (start, open, one read)",
            vec!["list", "--url", sqlite.as_str()],
        ),
    ] {
        let ours = runs_per_sec(200, || {
            let mut c = Command::new(&dlock);
            c.args(&args).env_remove("DLOCK_URL");
            c
        });
        let [ours_cell, flock_cell, ratio_cell] = cli_cells(ours, flock);
        let _ = writeln!(
            breakdown,
            "| {what} | {ours_cell} | `flock FILE true`: {flock_cell} | {ratio_cell} | (breakdown) |",
        );
    }
    let redis_port = redis_url.rsplit(':').next().unwrap_or("6379").to_owned();
    let redis_cli = find_binary("redis-cli").and_then(|r| {
        runs_per_sec(200, || {
            let mut c = Command::new(&r);
            c.args(["-p", &redis_port, "SET", "bench-cli-raw", "1"]);
            c
        })
    });
    cli(
        "`dlock run` on Redis",
        redis_cli,
        "`redis-cli SET`",
        runs_per_sec(200, dlock_run(redis_url.clone())),
    );
    let etcdctl = find_binary("etcdctl").and_then(|e| {
        runs_per_sec(100, || {
            let mut c = Command::new(&e);
            c.env("ETCDCTL_API", "3").args([
                "--endpoints",
                &endpoint,
                "lock",
                "bench-cli-etcdctl",
                "true",
            ]);
            c
        })
    });
    cli(
        "`dlock run` on etcd",
        etcdctl,
        "`etcdctl lock NAME true`",
        runs_per_sec(100, dlock_run(etcd_url)),
    );

    if let Some(first) = cli_rows.find('\n') {
        cli_rows.insert_str(first + 1, &breakdown);
    }

    // Instructions per uncontended Redis cycle, dlock's and the floor's (callgrind).
    eprintln!("benchmarks: callgrind on dlock bench --scenario uncontended (redis)");
    let instructions = callgrind::per_cycle(&dlock, &redis_url);

    // 4. Targets from the issue, with the measured value beside each.
    let mut targets = String::new();
    let mut target = |what: &str, measured: String, ok: Option<bool>| {
        let _ = writeln!(targets, "| {what} | {measured} | {} |", verdict(ok));
    };
    let ratio_of =
        |r: Option<&Value>, s: &str| r.and_then(|r| row(r, s)).and_then(|s| s["ratio"].as_f64());
    // Where the bare floor is not a fenced lock, the rule: the ratio to the
    // measured limit (the least a fenced lock does) must be ≥ 0.95×.
    let limit_of = |r: Option<&Value>| r.and_then(|r| r["uncontended"]["limit"]["ratio"].as_f64());
    let limit_what = |r: Option<&Value>| {
        r.and_then(|r| r["uncontended"]["limit"]["what"].as_str())
            .unwrap_or("the least a fenced lock does here")
            .to_owned()
    };
    let redis_runs = runs_of("redis (no persistence)");
    let over =
        |runs: &[&Value], scenario: &str| Spread::over(runs, |r| ratio_of(Some(r), scenario));
    let limit_over = |runs: &[&Value]| Spread::over(runs, |r| limit_of(Some(r)));
    let r1 = over(&redis_runs, "uncontended-1-task");
    let l1 = limit_over(&redis_runs);
    target(
        &format!(
            "Redis uncontended, one task: ≥ 0.95× the floor (never below 0.90×), or ≥ 0.95× \
             the limit: {}",
            limit_what(redis)
        ),
        r1.map_or("–".into(), |r| {
            let floor = if r.median >= 0.90 { "above" } else { "below" };
            let limit = l1.map_or(String::new(), |l| format!("; {} the limit", l.ratio()));
            format!("{} the floor ({floor} 0.90×){limit}", r.ratio())
        }),
        Spread::judge(r1, |r| {
            r >= 0.90 && (r >= 0.95 || l1.is_some_and(|l| l.complete() && l.median >= 0.95))
        }),
    );
    // Counted by the server over a separate run (`requests_per_cycle`).
    let per_cycle =
        |r: Option<&Value>| r.and_then(|r| r["uncontended"]["requests_per_cycle"].as_f64());
    let rc = Spread::over(&redis_runs, |r| per_cycle(Some(r)));
    target(
        "Redis uncontended: exactly 2 commands per cycle (client commands the server saw, MONITOR)",
        rc.map_or("–".into(), |c| c.show(2, "")),
        Spread::judge(rc, |c| (c - 2.0).abs() < 0.005),
    );
    target(
        "Redis uncontended: client instructions per cycle ≤ 1.3× the floor's (callgrind, `scripts/benchmarks`' two runs)",
        match &instructions {
            Ok((d, f)) => format!("{d:.0} vs the floor's {f:.0}: {:.2}×", d / f),
            Err(why) => format!("not measured: {why}"),
        },
        instructions.as_ref().ok().map(|(d, f)| d / f <= 1.3),
    );
    let r64 = over(&redis_runs, "uncontended-64-tasks");
    // The least fenced lock (the one-task limit's script) from as many tasks on the
    // same shared connection, in the same run.
    let l64 = Spread::over(&redis_runs, |r| r["parallel"]["ratio_to_limit"].as_f64());
    // The least fenced lock in Redisson's layout (dlock's default, for interop) that
    // knows its holds by acquisition, from as many tasks in the same run: the honest
    // limit of the default layout.
    let h64 = Spread::over(&redis_runs, |r| {
        r["parallel"]["ratio_to_layout_limit"].as_f64()
    });
    // What a cycle costs the server, by its own statistics (`server_us_per_cycle`): with
    // many tasks the server's time per cycle weighs in full.
    let server = |k: &str| {
        Spread::over(&redis_runs, |r| {
            r["parallel"]["server_us_per_cycle"][k].as_f64()
        })
    };
    let server_time = match (
        server("dlock_us"),
        server("limit_us"),
        server("layout_limit_us"),
    ) {
        (Some(d), Some(l), Some(h)) => format!(
            "; the server's time per cycle (`INFO commandstats`, same runs): dlock {}, \
             the limit {}, the layout limit {}",
            d.show(1, " µs"),
            l.show(1, " µs"),
            h.show(1, " µs"),
        ),
        _ => String::new(),
    };
    target(
        "Redis uncontended, 64 tasks: ≥ 0.90× the shared-connection floor, or ≥ 0.95× the \
         limit: the least fenced lock from as many tasks, or ≥ 0.95× the layout limit: \
         the least fenced lock in Redisson's layout (dlock's default, for interop: hold \
         count and token in a hash with a lease, the token stored with the acquisition's \
         nonce, so that a retry after a lost reply finds its own grant and a release sent \
         twice gives back no other task's hold of the same owner; the release checks \
         both, deletes the hash and publishes the unlock message)",
        r64.map_or("–".into(), |r| {
            let limit = l64.map_or(String::new(), |l| format!("; {} the limit", l.ratio()));
            let layout = h64.map_or(String::new(), |l| {
                format!("; {} the layout limit", l.ratio())
            });
            format!("{} the floor{limit}{layout}{server_time}", r.ratio())
        }),
        Spread::judge(r64, |r| {
            r >= 0.90
                || l64.is_some_and(|l| l.complete() && l.median >= 0.95)
                || h64.is_some_and(|l| l.complete() && l.median >= 0.95)
        }),
    );
    // Each run's own ratio of dlock's hand-off latency to the floor's (a run without a
    // hand-off on either side gives none).
    let handoff_ratio = |k: &str| {
        Spread::over(&redis_runs, |r| {
            let (d, f) = (
                &r["handoff"]["dlock"]["handoff"],
                &r["handoff"]["floor"]["handoff"],
            );
            let latency = |h: &Value| h[k].as_f64().filter(|_| h["count"].as_u64() > Some(0));
            latency(d).zip(latency(f)).map(|(a, b)| a / b)
        })
    };
    let (p50, p99) = (handoff_ratio("p50_us"), handoff_ratio("p99_us"));
    target(
        "Redis contended hand-off p50 / p99 within 1.2× a bare BLPOP hand-off",
        format!(
            "{} / {}",
            p50.map_or("–".into(), |r| r.ratio()),
            p99.map_or("–".into(), |r| r.ratio())
        ),
        Spread::judge(p50, |a| a <= 1.2)
            .zip(Spread::judge(p99, |b| b <= 1.2))
            .map(|(a, b)| a && b),
    );
    let handoff_figure = |k: &str| Spread::over(&redis_runs, |r| r["handoff"]["dlock"][k].as_f64());
    let jain = handoff_figure("jain_fairness");
    target(
        "Redis contended fairness (Jain) ≥ 0.95",
        jain.map_or("–".into(), |j| j.show(3, "")),
        Spread::judge(jain, |j| j >= 0.95),
    );
    let rate = handoff_figure("handoffs_per_sec");
    target(
        "Redis ≥ 3,000 real hand-offs/s with 50 waiters",
        rate.map_or("–".into(), |r| r.show(0, "/s")),
        Spread::judge(rate, |r| r >= 3000.0),
    );
    let cmds = handoff_figure("commands_per_acquisition");
    target(
        "Redis ≤ 3 commands per acquisition (contended)",
        cmds.map_or("–".into(), |c| c.show(3, "")),
        Spread::judge(cmds, |c| c <= 3.0),
    );
    let ec = per_cycle(report_of("etcd"));
    target(
        "etcd: 2 writes per uncontended cycle (store revisions per cycle)",
        ec.map_or("–".into(), |c| format!("{c:.2}")),
        ec.map(|c| (c - 2.0).abs() < 0.005),
    );
    let zk_runs = runs_of("zookeeper");
    let zr = over(&zk_runs, "uncontended-1-task");
    let z_rate = Spread::over(&zk_runs, |r| {
        row(r, "uncontended-1-task").and_then(|s| s["ops_per_sec"].as_f64())
    });
    let with_limit = |floor: Option<Spread>, limit: Option<Spread>, extra: String| {
        let limit = limit.map_or(String::new(), |l| format!("; {} the limit", l.ratio()));
        floor.map_or("–".into(), |f| {
            format!("{} the floor{limit}{extra}", f.ratio())
        })
    };
    let met = |floor: Option<Spread>, want: f64, limit: Option<Spread>| {
        Spread::judge(floor, |f| {
            f >= want || limit.is_some_and(|l| l.complete() && l.median >= 0.95)
        })
    };
    let zl = limit_over(&zk_runs);
    target(
        &format!(
            "ZooKeeper ≥ 0.9× the bare create+delete floor, or ≥ 0.95× the limit: {}",
            limit_what(report_of("zookeeper"))
        ),
        with_limit(
            zr,
            zl,
            z_rate.map_or(String::new(), |c| format!("; {}", c.show(0, " cycles/s"))),
        ),
        met(zr, 0.9, zl),
    );
    target(
        "ZooKeeper contended hand-off p50 at least 2× better than kazoo's (same run)",
        zk_vs_kazoo.map_or("–".into(), |r| format!("{r:.1}× better (one run each)")),
        zk_vs_kazoo.map(|r| r >= 2.0),
    );
    target(
        "etcd contended hand-off p50 at least 5× better than etcd3gw's (same run; \
         python-etcd3 does not install here)",
        etcd_vs_etcd3gw.map_or("–".into(), |r| format!("{r:.1}× better (one run each)")),
        etcd_vs_etcd3gw.map(|r| r >= 5.0),
    );
    for label in [
        "postgres lease",
        "postgres advisory",
        "postgres row",
        "mariadb lease",
        "mariadb named",
        "mariadb row",
    ] {
        let runs = runs_of(label);
        let r = over(&runs, "uncontended-1-task");
        let l = limit_over(&runs);
        let what = if l.is_some() {
            // What the limit is, in the bench's own words (one source).
            let limit_what = limit_what(report_of(label));
            format!("{label}: ≥ 0.9× the bare-statement floor, or ≥ 0.95× the limit: {limit_what}")
        } else {
            format!("{label}: ≥ 0.9× the bare-statement floor")
        };
        target(&what, with_limit(r, l, String::new()), met(r, 0.9, l));
    }
    for (lease, native, within) in [
        ("postgres lease", "postgres advisory", 2.0),
        ("mariadb lease", "mariadb named", 1.5),
    ] {
        // The two modes run one after the other in each round: each round's ratio.
        let p50 = |r: &Value| row(r, "handoff-50-waiters").and_then(|s| s["p50_us"].as_f64());
        let ratio = Spread::of(
            rounds
                .paired(lease, native)
                .into_iter()
                .filter_map(|(a, b)| p50(a).zip(p50(b)).map(|(a, b)| a / b)),
        );
        // Or, where the lease's own commits make that out of reach: ≥ 0.95× the speed
        // of the hand-off limit measured in the same run (`dlock bench`'s handoff
        // scenario: bare release, in-process wake, bare grant).
        let of_limit = Spread::over(&runs_of(lease), |r| {
            let p50 = |who: &str| r["handoff"][who]["handoff"]["p50_us"].as_f64();
            p50("limit").zip(p50("dlock")).map(|(l, d)| l / d)
        });
        let ok = match (
            Spread::judge(ratio, |r| r <= within),
            Spread::judge(of_limit, |r| r >= 0.95),
        ) {
            (Some(true), _) | (_, Some(true)) => Some(true),
            (None, None) => None,
            _ => Some(false),
        };
        target(
            &format!(
                "{lease} hand-off p50 within {within}× of {native} (each round's ratio), or \
                 ≥ 0.95× the speed of the lease hand-off limit (bare release, in-process \
                 wake, bare grant; same run)"
            ),
            format!(
                "{} of {native}; {} of the limit's speed",
                ratio.map_or("–".into(), |r| r.ratio()),
                of_limit.map_or("–".into(), |r| r.ratio())
            ),
            ok,
        );
    }
    let hold = redis.map(|r| &r["hold"]).filter(|h| !h.is_null());
    let hold_rows = hold.map_or_else(
        || "| (the hold run failed) | |\n".to_owned(),
        |h| {
            // A figure with its unit; counts (locks, lost) as whole numbers.
            let f = |k: &str, unit: &str| match (h[k].as_u64(), h[k].is_f64()) {
                (Some(n), false) => format!("{n} {unit}").trim_end().to_owned(),
                _ if h[k].is_null() => "–".to_owned(),
                _ => format!("{} {unit}", num(&h[k])).trim_end().to_owned(),
            };
            let mb = |k: &str| {
                h[k].as_f64()
                    .map_or("–".into(), |b| format!("{:.1} MB", b / 1e6))
            };
            format!(
                "| locks held | {} |\n\
                 | TTL (renewed every third of it) | {} |\n\
                 | time to acquire them all | {} |\n\
                 | held for | {} |\n\
                 | renewals asked for by the keepers | {} |\n\
                 | renew commands the server ran (batched) | {} |\n\
                 | client CPU while holding | {} |\n\
                 | RSS before / all acquired / end of hold | {} / {} / {} |\n\
                 | RSS per held lock (the larger, less the baseline) | {} |\n\
                 | locks lost | {} |\n",
                f("locks", ""),
                f("ttl_ms", "ms"),
                f("acquire_seconds", "s"),
                f("hold_seconds", "s"),
                f("renewals_per_sec", "/s"),
                f("renew_commands_per_sec", "/s"),
                f("cpu_percent_while_holding", "%"),
                mb("rss_before_bytes"),
                mb("rss_held_bytes"),
                mb("rss_end_bytes"),
                f("rss_per_lock_bytes", "bytes"),
                f("lost", ""),
            )
        },
    );
    let per_lock = hold.and_then(|h| h["rss_per_lock_bytes"].as_f64());
    target(
        "100,000 auto-renewed Redis locks: ≤ 300 bytes of RSS per held lock",
        per_lock.map_or("–".into(), |b| format!("{b:.0} B (one run)")),
        per_lock.map(|b| b <= 300.0),
    );
    let unfair = report_of("sqlite").map(|r| &r["handoff"]["dlock"]);
    let fair = sqlite_fair.as_ref().map(|r| &r["handoff"]["dlock"]);
    let took_back = |v: Option<&Value>| v.and_then(|v| v["reacquired_pct"].as_f64());
    let fair_jain = fair.and_then(|v| v["jain_fairness"].as_f64());
    target(
        "SQLite default, fair mode actually fair (50 waiters): releaser takes the lock back, Jain",
        format!(
            "fair: {} , Jain {} (without fair: {})",
            took_back(fair).map_or("–".into(), |p| format!("{p:.1} %")),
            fair_jain.map_or("–".into(), |j| format!("{j:.3}")),
            took_back(unfair).map_or("–".into(), |p| format!("{p:.1} %")),
        ),
        took_back(fair)
            .zip(fair_jain)
            .map(|(p, j)| p <= 5.0 && j >= 0.95),
    );
    if let Some(f) = fair {
        let _ = writeln!(
            waiting_rows,
            "| sqlite, `--fair` | {} | {} | {} | {} | | | | |",
            num(&f["handoffs_per_sec"]),
            pct(f),
            jain_of(f),
            handoff_latency(f, "p99_us"),
        );
    }
    let sr = ratio_of(report_of("sqlite"), "uncontended-1-task");
    target(
        "SQLite uncontended (not an issue target; for the record)",
        sr.map_or("–".into(), |r| format!("{r:.2}× its floor")),
        None,
    );

    let machine = xtask::cpu_model();
    // Not available_parallelism: under `taskset -c 0` that says 1.
    let cores = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.lines().filter(|l| l.starts_with("processor")).count())
        .unwrap_or(0);
    let servers = if own_cpus().as_deref() == Some("0") {
        "the servers (which inherit this generator's CPU, since `scripts/benchmarks` runs it \
         under `taskset -c 0`) and the command-line comparisons run on CPU 0, so every \
         client-server round trip crosses CPUs"
    } else {
        "the servers run where the scheduler puts them"
    };
    let sql_settings = dlock_testkit::sql_server_settings();
    // What each limit is, as `dlock bench` says it (one source).
    let mut limits: Vec<(Vec<&str>, &str)> = Vec::new();
    for (t, r) in &reports {
        let Some(what) = r["uncontended"]["limit"]["what"].as_str() else {
            continue;
        };
        match limits.iter_mut().find(|(_, w)| *w == what) {
            Some((labels, _)) => labels.push(&t.label),
            None => limits.push((vec![&t.label], what)),
        }
    }
    let limits = limits
        .iter()
        .map(|(labels, what)| format!("{}: {what}", labels.join(", ")))
        .collect::<Vec<_>>()
        .join("; ");
    let primitive_section = primitives::section(&dlock, &matrix);
    // The scaling runs start servers of their own: these stop first.
    drop(matrix);
    let scaling_section = scaling::section(&dlock, &scaling::plot_path(out));
    let doc = format!(
        "# Benchmarks\n\n\
         Generated by `scripts/benchmarks` (do not edit by hand) on {machine}, {cores} \
         cores, every server on loopback started for the run ({sql_settings}). The client (`dlock bench`, \
         the peers) is pinned to CPU 1 with `taskset`; {servers}. Every ratio is against a floor measured by the same client \
         in the same run: the bare commands one lock cycle needs (Redis `SET NX PX` + \
         `EVALSHA` compare-and-delete; etcd put-with-lease + delete; ZooKeeper create \
         ephemeral + delete; SQL the bare insert/delete statements of the mode; SQLite a synced \
         insert and an unsynced delete, as dlock's grant and release; Redlock: the same cycles on one of its nodes). Where that \
         floor is not itself a fenced lock, `dlock bench` also measures a *limit*, the \
         least a fenced lock does there, against dlock in a second alternating run; in \
         its own words: {limits}. This machine's \
         loopback round trip swings 7–8× between same-CPU and cross-CPU: compare ratios, \
         not absolute figures.\n\n\
         ## Targets\n\n\
         A figure with a range in brackets is the median of {RUNS} runs of `dlock bench` \
         made for the targets alone, with the lowest and highest: after the tables' runs, \
         {RUNS} rounds, each running the Redis (no persistence), ZooKeeper, PostgreSQL and \
         MariaDB configurations in turn with the flags of *Every backend* but only the \
         scenarios the targets read. A ratio is taken within each run (lease against \
         native hand-off: within each round), then its median. A figure that fewer than \
         {RUNS} runs gave says how many, and its target is not judged. The other figures \
         are one run (callgrind's row: its two counting runs); so are the tables below, \
         but for the scaling and primitives sections, which say how they take theirs. \
         {targets_skipped}\n\n\
         | target | measured | |\n|---|---|---|\n{targets}\n\
         ## Every backend\n\n\
         `dlock bench --cycles 3000 --processes 8 --waiters 50 --tasks 64 --duration 3s` \
         (Redis without persistence also `--hold 100000 --hold-for 10s`). Scenarios: \
         `uncontended-1-task` (acquire + release, one lock, one task); \
         `uncontended-64-tasks` (64 tasks each cycling its own lock; floor: the same \
         client's bare cycles from 64 tasks; on Redis also a limit, the least fenced lock \
         from 64 tasks, and a layout limit, the least fenced lock in Redisson's layout that \
         knows its holds by acquisition; \
         the sides take turns over three rounds of 1 s, and the server's own statistics \
         give each side's server time per cycle); \
         `contended-8-processes` (8 processes on one \
         lock; percentiles = wait); `handoff-50-waiters` (50 tasks on one lock: real hand-offs \
         to a different waiter per second, percentiles release → next grant; floor where \
         there is one: a bare hand-written hand-off, e.g. BLPOP on a signal list); \
         `polling-50-waiters` (the same with polling waiters, below); \
         `redlock-vs-one-node`. An acquisition that fails on an error trying again may \
         mend (Redlock's `NoQuorum`, a dropped connection) is not counted, a release that \
         does is, and the run goes on (a lock whose release failed stays taken until its \
         lease ends, and the waits behind it are measured as they are); a scenario that \
         stepped over any says how many here and in the primitives and scaling sections, \
         with the first error in the generator's log. Each loop steps over at most 100 (\
         the uncontended run with its limit, counted and single-node runs, a contended \
         worker process, a scaling level, a hand-off or parallel run; after a release \
         that failed, the uncontended loop goes on on a fresh name); any \
         other error ends the run.\n\n\
         | backend | scenario | ops/s | floor ops/s | ratio | p50 µs | p99 µs | p99.9 µs |\n\
         |---|---|---|---|---|---|---|---|\n{table}\n\
         ## Holding many locks\n\n\
         `--hold 100000 --hold-for 10s` on Redis without persistence: 100,000 distinct \
         locks acquired with automatic renewal by one process (one `Locker`), then held. \
         Renewals are counted as the renew script calls the server ran (`INFO \
         commandstats`); RSS from `/proc/self/statm`.\n\n\
         | what | measured |\n|---|---|\n{hold_rows}\n\
         ## Waiting: notification against polling\n\n\
         The hand-off run (50 tasks of one process looping on one lock for 3 s) twice: \
         waiters that wait as dlock does (notification where the backend has one), and \
         waiters that poll (`try_lock`, then 10 ms sleep when busy — redis-py's `Lock` \
         sleeps 100 ms). *Taken back*: share of acquisitions by the task that had just \
         released; real hand-offs/s count only grants to a different task.\n\n\
         | backend | waiting: hand-offs/s | taken back | Jain | p99 µs | polling: hand-offs/s | taken back | Jain | p99 µs |\n\
         |---|---|---|---|---|---|---|---|---|\n{waiting_rows}\n\
         ## Peers (uncontended cycles, same floor)\n\n\
         | client | backend | cycles/s | × floor | p50 µs | p99 µs |\n\
         |---|---|---|---|---|---|\n{peer_rows}\n\
         ## Peers under contention\n\n\
         50 threads of one process loop on one lock for 3 s (`bench/peers/handoff.py`), \
         next to dlock's hand-off run (50 tasks of one process) on the same server. \
         Hand-offs/s count only grants to a different thread; percentiles from release to \
         the next grant; *taken back* as above.\n\n\
         | client | backend | hand-offs/s | p50 µs | p99 µs | p99.9 µs | taken back | Jain |\n\
         |---|---|---|---|---|---|---|---|\n{contended_rows}\n\
         ## The command line\n\n\
         Runs per second of one locked `true` against one bare tool call (process start \
         included; 200 runs, etcd 100). On SQLite a fenced lock must also write its token \
         to disk before the command starts, which `flock` does not: the *limit* \
         (`sqlite-run-limit`, crates/xtask) is the least a fenced lock's command-line tool \
         does there, through the same client crates — start, open the file as dlock does, \
         a synced insert, the command, an unsynced delete — and the SQLite row counts as \
         met within 2× `flock` or at ≥ 0.95× the limit; flock, the limit and dlock run in \
         turn, 200 rounds.\n\n\
         | command | dlock runs/s | bare tool runs/s | dlock time / tool time | within 2× (SQLite: or ≥ 0.95× the limit) |\n\
         |---|---|---|---|---|\n{cli_rows}\n{scaling_section}{primitive_section}"
    );
    if let Err(e) = std::fs::write(out, doc) {
        eprintln!("cannot write {out}: {e}");
        std::process::exit(1);
    }
    eprintln!("benchmarks: wrote {out}");
}
