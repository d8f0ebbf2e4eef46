//! `dlock check`'s CI tier: short runs of every scenario on every backend, plus
//! Redlock minority and majority node loss. Each run must end with no hard guarantee
//! broken (exit 0); the figures are printed for the record.

use std::path::{Path, PathBuf};

use dlock_testkit::{Matrix, SCENARIOS, Scenario, Target, run_check};
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

fn check_target(dlock: &Path, t: &Target) {
    for s in SCENARIOS {
        if !s.applies(t) {
            continue;
        }
        let (code, r) = run_check(dlock, t, s, 600, &[]);
        eprintln!("{}", summary(t, s, &r));
        for k in KEYS {
            assert!(r.get(k).is_some(), "{}: no {k} in {r}", t.label);
        }
        assert_eq!(code, 0, "{} {s:?}: a guarantee broke: {r}", t.label);
        assert_eq!(r["verdict"], "ok");
        assert!(r["ops"].as_u64().unwrap_or(0) >= 300, "{}: {r}", t.label);
        assert_eq!(r["duplicate_tokens"], 0, "{}: {r}", t.label);
        assert_eq!(r["orphans"], 0, "{}: {r}", t.label);
        if s.fenced {
            assert_eq!(r["stale_accepted"], 0, "{} {s:?}: {r}", t.label);
            assert_eq!(r["lost_updates"], 0, "{} {s:?}: {r}", t.label);
        }
        if s.fault == "none" {
            assert_eq!(r["overlaps"], 0, "{}: {r}", t.label);
            assert_eq!(r["stale_rejected"], 0, "{}: {r}", t.label);
        } else {
            assert!(r["faults_injected"].as_u64().unwrap_or(0) >= 1, "{r}");
            assert!(
                r["recovery_ms_p99"].is_u64(),
                "{}: no recovery measured: {r}",
                t.label
            );
        }
    }
}

#[test]
fn short_tier_on_every_backend() {
    let Some(mut m) = Matrix::start() else {
        return;
    };
    let dlock = dlock();
    // Three backends at a time: two cores, and every run starts 4 worker processes.
    for chunk in m.targets.chunks(3) {
        std::thread::scope(|scope| {
            for t in chunk {
                let dlock = &dlock;
                scope.spawn(move || check_target(dlock, t));
            }
        });
    }

    // Redlock: a minority of nodes lost changes nothing; a majority lost in the middle
    // of a run makes the later acquires fail (NoQuorum) and nothing is granted twice.
    let url = m.redlock.url();
    let target = Target {
        label: "redlock".into(),
        url: url.clone(),
        server_pid: None,
    };
    for i in [0, 3] {
        m.redlock.node(i).process().kill();
    }
    let none = SCENARIOS[0];
    let (code, r) = run_check(&dlock, &target, none, 300, &[]);
    eprintln!("figure: check redlock with 2 of 5 nodes killed: {r}");
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["overlaps"], 0);
    assert!(r["ops"].as_u64().unwrap_or(0) >= 297, "{r}");
    let redlock = &mut m.redlock;
    let (code, r) = std::thread::scope(|scope| {
        let run = scope.spawn(|| run_check(&dlock, &target, none, 4000, &["--max-time", "30s"]));
        std::thread::sleep(std::time::Duration::from_secs(2));
        redlock.node(1).process().kill();
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
