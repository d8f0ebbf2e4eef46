//! `dlock check`'s CI tier: short runs of every scenario on every backend, plus
//! Redlock minority and majority node loss. Each run must end with no hard guarantee
//! broken (exit 0); the figures are printed for the record.

use std::path::{Path, PathBuf};

use dlock_testkit::{Matrix, SCENARIOS, Scenario, Target, lock_server, run_check};
use serde_json::Value;

fn dlock() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dlock"))
}

const KEYS: [&str; 10] = [
    "ops",
    "overlaps",
    "stale_accepted",
    "stale_rejected",
    "token_inversions",
    "duplicate_tokens",
    "lost_updates",
    "orphans",
    "recovery_ms_p99",
    "loss_notice_ms_p99",
];

/// Critical sections per run: 300 (the CI tier, which has about a quarter of an hour
/// on two cores), or `DLOCK_CHECK_OPS` (the long tier, e.g. 100000).
fn tier_ops() -> u32 {
    std::env::var("DLOCK_CHECK_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

fn summary(t: &Target, s: Scenario, r: &Value) -> String {
    format!(
        "figure: check {} · {} · {}: ops {} overlaps {} stale accepted {} rejected {} inversions {} duplicates {} lost updates {} orphans {} recovery p99 {} ms loss notice p99 {} ms",
        t.label,
        s.fault,
        if s.fenced { "fenced" } else { "unfenced" },
        r["ops"],
        r["overlaps"],
        r["stale_accepted"],
        r["stale_rejected"],
        r["token_inversions"],
        r["duplicate_tokens"],
        r["lost_updates"],
        r["orphans"],
        r["recovery_ms_p99"],
        r["loss_notice_ms_p99"]
    )
}

/// Failures of the tier, collected so every run finishes and all of them are told at
/// the end (one line each, with the run's report).
type Failures = std::sync::Mutex<Vec<String>>;

/// The single workload, then the crowd (several tasks per worker process sharing
/// owners, with re-entries, short waits and cancellations) with half the operations.
fn check_target(dlock: &Path, t: &Target, failures: &Failures) {
    for (workload, ops) in [("single", tier_ops()), ("crowd", tier_ops() / 2)] {
        check_target_with(dlock, t, workload, ops, failures);
    }
}

/// What one run showed.
enum Outcome {
    Ok,
    /// Too little happened to judge the run (a busy machine): run it again once.
    Thin(String),
    /// A guarantee broke, or the report is wrong: never run again to hide it.
    Broken(String),
}

fn check_target_with(dlock: &Path, t: &Target, workload: &str, ops: u32, failures: &Failures) {
    for s in SCENARIOS {
        // Redis without persistence differs from the persistent Redis only in what a
        // restart forgets: in the CI tier the other scenarios run on that one.
        let forgetful =
            t.label.contains("no persistence") && std::env::var_os("DLOCK_CHECK_OPS").is_none();
        if !s.applies(t) || (forgetful && s.fault != "restart-server") {
            continue;
        }
        // A run too thin to judge gets a second one, with faults placed elsewhere.
        for seed in ["1", "2"] {
            let started = std::time::Instant::now();
            let run = std::panic::catch_unwind(|| {
                run_check(dlock, t, s, ops, &["--workload", workload, "--seed", seed])
            });
            let outcome = match run {
                Ok((code, r)) => {
                    eprintln!(
                        "{} · workload {workload} · seed {seed} · {:.1} s",
                        summary(t, s, &r),
                        started.elapsed().as_secs_f64()
                    );
                    judge(t, s, workload, ops, code, &r)
                }
                Err(_) => Outcome::Broken("dlock check printed no report (above)".into()),
            };
            let why = match outcome {
                Outcome::Ok => break,
                Outcome::Thin(why) if seed == "1" => {
                    eprintln!(
                        "{} {s:?} {workload}: too little to judge, once more: {why}",
                        t.label
                    );
                    continue;
                }
                Outcome::Thin(why) | Outcome::Broken(why) => why,
            };
            let line = format!(
                "{} · {} · fenced {} · {workload} · seed {seed}: {why}",
                t.label, s.fault, s.fenced
            );
            eprintln!("CHECK FAILED: {line}");
            failures
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(line);
            break;
        }
    }
}

/// The hard guarantees first (never excused), then whether enough happened to judge.
fn judge(t: &Target, s: Scenario, workload: &str, ops: u32, code: i32, r: &Value) -> Outcome {
    let broken = |what: &str| Outcome::Broken(format!("{what}: {r}"));
    for k in KEYS {
        if r.get(k).is_none() {
            return broken(&format!("no {k} in the report"));
        }
    }
    if code != 0 || r["verdict"] != "ok" {
        return broken(&format!("a guarantee broke (exit {code})"));
    }
    if r["workload"] != workload {
        return broken("the report names another workload");
    }
    let zero = |k: &str| r[k].as_u64() == Some(0);
    if r["fencing"] == "durable" && !(zero("duplicate_tokens") && zero("token_inversions")) {
        return broken("durable fencing repeated or reversed a token");
    }
    if !zero("orphans") {
        return broken("a lock stayed held after every worker was gone");
    }
    if s.fenced && !(zero("stale_accepted") && zero("lost_updates")) {
        return broken("the fenced store accepted a stale write");
    }
    if s.fault == "none" && !(zero("overlaps") && zero("stale_rejected")) {
        return broken("two holders overlapped with no fault");
    }
    if s.fault == "restart-server"
        && t.label.contains("no persistence")
        && zero("duplicate_tokens")
        && zero("token_inversions")
    {
        // The restarted server forgot its token counter: reported, not hidden — unless
        // the restart fell where no token was handed out again.
        return Outcome::Thin(format!("a forgetful restart showed no repeated token: {r}"));
    }
    // The crowd reports re-entries apart from grants: fewer grants per section.
    if r["ops"].as_u64().unwrap_or(0) < u64::from(ops / 3) {
        return Outcome::Thin(format!("fewer than {} grants: {r}", ops / 3));
    }
    if s.fault != "none" {
        if r["faults_injected"].as_u64().unwrap_or(0) == 0 {
            return Outcome::Thin(format!("no fault was injected: {r}"));
        }
        if !r["recovery_ms_p99"].is_u64() {
            return Outcome::Thin(format!("no recovery measured: {r}"));
        }
    }
    Outcome::Ok
}

#[test]
fn short_tier_on_every_backend() {
    let Some(m) = Matrix::start_apart() else {
        return;
    };
    let dlock = dlock();
    // DLOCK_CHECK_ONLY=etcd,zookeeper: only those targets (for debugging one backend).
    let only = std::env::var("DLOCK_CHECK_ONLY").ok();
    // Targets that share a server (none with `start_apart`, but Redlock's faulted node
    // is its own) run one after the other: a server fault of one run would hit the
    // others. Four lanes at a time: a run (4 worker processes and a server) keeps
    // about half a core busy, and the machine has two.
    let mut groups: Vec<Vec<&Target>> = Vec::new();
    for t in m.targets.iter().filter(|t| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|l| t.label.starts_with(l)))
    }) {
        let same = |g: &Vec<&Target>| match (&g[0].server, &t.server) {
            (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
            _ => false,
        };
        match groups.iter_mut().find(|g| same(g)) {
            Some(g) => g.push(t),
            None => groups.push(vec![t]),
        }
    }
    // Popped longest first, so the shared-server groups do not finish last.
    groups.sort_by_key(Vec::len);
    let queue = std::sync::Mutex::new(groups);
    let failures = Failures::default();
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                loop {
                    let next = queue
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .pop();
                    let Some(group) = next else { break };
                    for t in group {
                        check_target(&dlock, t, &failures);
                    }
                }
            });
        }
    });
    let failures = failures
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    assert!(
        failures.is_empty(),
        "{} run(s) of the tier failed:\n{}",
        failures.len(),
        failures.join("\n")
    );

    // Redlock: a minority of nodes lost changes nothing; a majority lost in the middle
    // of a run makes the later acquires fail (NoQuorum) and nothing is granted twice.
    let url = m.redlock_url.clone();
    let target = Target::new("redlock", url.clone());
    for i in [0, 3] {
        lock_server(&m.redlock_nodes[i]).process().kill();
    }
    let none = SCENARIOS[0];
    let (code, r) = run_check(&dlock, &target, none, 300, &[]);
    eprintln!("figure: check redlock with 2 of 5 nodes killed: {r}");
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["overlaps"], 0);
    // Each acquire needs all three live nodes: on a busy machine one may miss its
    // validity time now and then (a failed acquire, never a second holder).
    assert!(r["ops"].as_u64().unwrap_or(0) >= 285, "{r}");
    let redlock = &m.redlock_nodes;
    let (code, r) = std::thread::scope(|scope| {
        let run = scope.spawn(|| run_check(&dlock, &target, none, 4000, &["--max-time", "30s"]));
        std::thread::sleep(std::time::Duration::from_secs(2));
        lock_server(&redlock[1]).process().kill();
        run.join().expect("check run")
    });
    eprintln!("figure: check redlock, a third node of 5 killed during the run: {r}");
    assert_eq!(code, 0, "{r}");
    assert!(r["failed_acquires"].as_u64().unwrap_or(0) >= 1, "{r}");
    assert_eq!(r["overlaps"], 0, "{r}");
    assert_eq!(r["duplicate_tokens"], 0, "{r}");
    // Without a quorum a fresh client cannot even connect, and says why.
    let out = std::process::Command::new(&dlock)
        .args(["status", "--url", &url, "x"])
        .output()
        .expect("status");
    assert_ne!(out.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("quorum"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The Chubby/Consul lock-delay on the SQLite default, unfenced store, a holder paused
/// past its 1 s lease: without a delay its stale read and write are accepted after the
/// next holder's; with `lock_delay=2s` a 1.5 s pause ends before anyone else is granted
/// (nothing stale); a 4 s pause outlasts lease + delay and the stale operations are
/// back. The delay narrows the window; only fencing closes it.
#[test]
fn lock_delay_narrows_but_does_not_close_the_unfenced_window() {
    let dlock = dlock();
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("locks.db");
    let unfenced = Scenario {
        fault: "pause-holder",
        fenced: false,
    };
    let run = |url: String, pause: &str| {
        let t = Target::new("sqlite", url);
        let (code, r) = run_check(&dlock, &t, unfenced, 300, &["--pause", pause]);
        eprintln!("figure: check {} · pause {pause}: {r}", t.url);
        assert_eq!(code, 0, "{r}");
        assert_eq!(r["faults_injected"], 2, "{r}");
        r["stale_accepted"].as_u64().expect("stale_accepted")
    };
    let plain = format!("sqlite://{}", db.display());
    let delayed = format!("{plain}?lock_delay=2s");
    assert!(run(plain, "1500ms") > 0, "a 1.5 s pause past a 1 s lease");
    assert_eq!(run(delayed.clone(), "1500ms"), 0, "lock_delay=2s covers it");
    assert!(run(delayed, "4s") > 0, "a pause longer than lease + delay");
}

/// `--primitive semaphore`: with a holder SIGKILLed, never more than the permits inside
/// at once (counted over every worker's cell on the store's clock), the permits all in
/// use at some point, and nothing left held; `--primitive rwlock` (a holder SIGKILLed):
/// no writer beside anyone, readers together; `--primitive election`: one leader at a
/// time. On SQLite, Redis, etcd and ZooKeeper (short sessions, so a dead holder's
/// permit frees within the run).
#[test]
fn semaphore_and_election_checks() {
    let (Some(redis), Some(etcd), Some(zk)) = (
        dlock_testkit::RedisServer::start(),
        dlock_testkit::EtcdServer::start(),
        dlock_testkit::ZkServer::start(),
    ) else {
        return;
    };
    let urls = [
        None,
        Some(redis.url()),
        Some(format!("{}?session_ttl=2s", etcd.url())),
        Some(format!("{}?session_timeout=2s", zk.url())),
    ];
    for url in &urls {
        for (primitive, fault) in [
            ("semaphore", "kill-holder"),
            ("rwlock", "kill-holder"),
            ("election", "none"),
        ] {
            let mut cmd = std::process::Command::new(dlock());
            cmd.args([
                "check",
                "--json",
                "--primitive",
                primitive,
                "--permits",
                "2",
            ])
            .args(["--workers", "5", "--ops", "150", "--ttl", "1s"])
            .args(["--fault", fault, "--faults", "1"]);
            if let Some(u) = url {
                cmd.args(["--url", u]);
            }
            let out = cmd.output().expect("dlock check");
            let r: Value = serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
            println!("figure: check {primitive} {fault} {url:?}: {r}");
            assert_eq!(out.status.code(), Some(0), "{url:?} {primitive}: {r}");
            assert_eq!(r["overlaps"], 0, "{url:?} {primitive}: {r}");
            assert_eq!(r["orphans"], 0, "{url:?} {primitive}: {r}");
            // (a killed worker does not finish its share)
            assert!(r["ops"].as_u64() >= Some(100), "{url:?} {primitive}: {r}");
            if primitive == "semaphore" {
                // Never beyond the permits; whether two store spans meet is timing (on
                // ZooKeeper, grants pass one at a time through the semaphore's mutex).
                let most = r["most_at_once"].as_u64().unwrap_or(0);
                assert!((1..=2).contains(&most), "{url:?}: {r}");
            }
            if primitive == "rwlock" {
                assert!(
                    r["most_at_once"].as_u64() >= Some(2),
                    "readers never together: {r}"
                );
            }
            if fault != "none" {
                assert_eq!(r["faults_injected"], 1, "{url:?}: {r}");
            }
        }
    }
}
