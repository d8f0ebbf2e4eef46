//! `dlock run` never leaves its command running without the lock: a SIGKILLed dlock
//! takes its command (and, off a terminal, the command's own children) with it, on
//! every backend; and when renewals fail, the command is stopped before the lease can
//! end on the server.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use dlock_testkit::{Fault, FaultProxy, Matrix, RedisServer};

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

fn spawn(args: &[&str]) -> Child {
    Command::new(DLOCK)
        .args(args)
        .env_remove("DLOCK_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dlock")
}

fn wait_for_file(path: &Path, within: Duration) -> String {
    let end = Instant::now() + within;
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && text.ends_with('\n')
        {
            return text.trim().to_owned();
        }
        assert!(Instant::now() < end, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn alive(pid: i32) -> bool {
    // A zombie counts as gone: it runs nothing.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().to_owned())
        })
        .is_some_and(|rest| !rest.starts_with('Z'))
}

fn wait_gone(pid: i32, within: Duration) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    !alive(pid)
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let end = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return s;
        }
        assert!(Instant::now() < end, "dlock did not exit within {within:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `dlock ARGS… -- sh -c SCRIPT`, where the command starts a child (`sleep 60`) and
/// writes both pids to files in `dir` (named after `tag`): dlock, the command's pid and
/// its child's.
fn run_with_a_child(args: &[&str], dir: &Path, tag: &str) -> (Child, i32, i32) {
    let (child_pid, grand_pid) = (dir.join(format!("c{tag}")), dir.join(format!("g{tag}")));
    let script = format!(
        "sleep 60 & echo $! > {g}.tmp && mv {g}.tmp {g}; echo $$ > {c}.tmp && mv {c}.tmp {c}; wait",
        g = grand_pid.display(),
        c = child_pid.display()
    );
    let mut all = args.to_vec();
    all.extend(["--", "sh", "-c", &script]);
    let run = spawn(&all);
    let command: i32 = wait_for_file(&child_pid, Duration::from_secs(20))
        .parse()
        .expect("pid");
    let grandchild: i32 = wait_for_file(&grand_pid, Duration::from_secs(5))
        .parse()
        .expect("pid");
    (run, command, grandchild)
}

/// dlock SIGKILLed while its command runs: the command and the child the command
/// started are gone at once (the kernel's parent-death signal, then the reaper), long
/// before the next holder can get the lock — on every backend.
#[test]
fn a_killed_dlock_takes_its_command_and_its_children_along() {
    let Some(m) = Matrix::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    for (i, t) in m.targets.iter().enumerate() {
        let name = format!("run-kill-{i}");
        let (mut run, command, grandchild) = run_with_a_child(
            &["run", "--url", &t.url, "--ttl", "2s", &name],
            dir.path(),
            &i.to_string(),
        );
        let killed_at = Instant::now();
        run.kill().expect("SIGKILL dlock");
        let _ = run.wait();
        assert!(
            wait_gone(command, Duration::from_secs(1)),
            "{}: the command outlived dlock",
            t.label
        );
        assert!(
            wait_gone(grandchild, Duration::from_secs(1)),
            "{}: the command's child outlived dlock",
            t.label
        );
        let gone_after = killed_at.elapsed();
        // The next holder comes only after the lease (or session) ends: both were gone
        // well before.
        let next = Command::new(DLOCK)
            .args(["run", "--url", &t.url, "--wait", "20s", &name, "--", "true"])
            .stdin(Stdio::null())
            .output()
            .expect("next dlock run");
        assert_eq!(
            next.status.code(),
            Some(0),
            "{}: {}",
            t.label,
            String::from_utf8_lossy(&next.stderr)
        );
        eprintln!(
            "figure: {}: SIGKILLed dlock → command and its child gone after {gone_after:?}; next holder after {:?}",
            t.label,
            killed_at.elapsed()
        );
    }
}

/// The reaper is forked before the arguments are parsed, on a guess made from the raw
/// arguments: whatever comes before or after the command (`--log` with its value, in
/// either spelling) and for `elect` as for `run`, a SIGKILLed dlock still takes its command's
/// children along — and a command that is not one of those two runs no reaper at all.
#[test]
fn the_early_reaper_covers_every_spelling_of_run_and_elect() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let spellings: [&[&str]; 5] = [
        &["run", "--url", &url, "a"],
        &["--log", "warn", "run", "--url", &url, "b"],
        &["--log=warn", "run", "--url", &url, "c"],
        &["run", "--log", "warn", "--url", &url, "d"],
        &["elect", "--url", &url, "e"],
    ];
    for (i, args) in spellings.iter().enumerate() {
        let (mut run, command, grandchild) = run_with_a_child(args, dir.path(), &i.to_string());
        run.kill().expect("SIGKILL dlock");
        let _ = run.wait();
        assert!(
            wait_gone(command, Duration::from_secs(2)),
            "{args:?}: the command outlived dlock"
        );
        assert!(
            wait_gone(grandchild, Duration::from_secs(2)),
            "{args:?}: the command's child outlived dlock (no reaper covered it)"
        );
    }
    // `dlock leader --watch` (not a command that runs anything) forks no reaper: its
    // only child would be one.
    let mut watcher = spawn(&["leader", "--url", &url, "--watch", "e"]);
    std::thread::sleep(Duration::from_millis(500));
    let children = children_of(watcher.id());
    assert!(
        watcher.try_wait().expect("try_wait").is_none(),
        "dlock leader --watch exited"
    );
    watcher.kill().expect("kill dlock leader");
    let _ = watcher.wait();
    assert!(
        children.is_empty(),
        "dlock leader forked a child: {children:?}"
    );
}

fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("clock")
        .as_nanos()
}

/// Renewals fail (the server is blackholed behind a proxy): the command gets SIGTERM
/// at the local deadline minus the grace and, if it ignores it, SIGKILL at the
/// deadline — before the lease can end on the server and another client get the lock.
#[test]
fn failing_renewals_stop_the_command_before_the_lease_ends() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let proxy = rt
        .block_on(FaultProxy::start(server.addr()))
        .expect("proxy");
    let through = format!("redis://{}?timeout=300ms", proxy.addr());
    let direct = server.url();
    let dir = tempfile::tempdir().expect("temp dir");
    for (label, trap) in [
        ("polite", "date +%s%N > {t}; exit 143"),
        ("stubborn", "date +%s%N > {t}"),
    ] {
        proxy.set(Fault::None);
        let term = dir.path().join(format!("{label}.term"));
        let started = dir.path().join(format!("{label}.started"));
        let beat = dir.path().join(format!("{label}.alive"));
        let script = format!(
            "trap '{}' TERM; echo $$ > {s}.tmp && mv {s}.tmp {s}; while :; do date +%s%N > {b}.tmp && mv {b}.tmp {b}; sleep 0.02; done",
            trap.replace("{t}", &term.display().to_string()),
            s = started.display(),
            b = beat.display()
        );
        let name = format!("renew-fail-{label}");
        let mut run = spawn(&[
            "run", "--url", &through, "--ttl", "2s", "--grace", "500ms", &name, "--", "sh", "-c",
            &script,
        ]);
        let command: i32 = wait_for_file(&started, Duration::from_secs(10))
            .parse()
            .expect("pid");
        // Let a renewal or two succeed, then cut the server off.
        std::thread::sleep(Duration::from_millis(800));
        let cut_ns = wall_ns();
        let cut = Instant::now();
        proxy.set(Fault::Blackhole);
        // Another client, directly on the server, takes the lock once the lease ends.
        let next = Command::new(DLOCK)
            .args([
                "run",
                "--url",
                &direct,
                "--wait",
                "10s",
                &name,
                "--",
                "sh",
                "-c",
                "date +%s%N",
            ])
            .stdin(Stdio::null())
            .output()
            .expect("next holder");
        assert_eq!(
            next.status.code(),
            Some(0),
            "{label}: {}",
            String::from_utf8_lossy(&next.stderr)
        );
        let next_ns: u128 = String::from_utf8_lossy(&next.stdout)
            .trim()
            .parse()
            .expect("next holder's time");
        let status = wait_exit(&mut run, Duration::from_secs(10));
        assert_eq!(status.code(), Some(76), "{label}: dlock's exit status");
        let term_ns: u128 = wait_for_file(&term, Duration::from_secs(1))
            .parse()
            .expect("SIGTERM time");
        assert!(!alive(command), "{label}: the command still runs");
        let term_after = Duration::from_nanos(u64::try_from(term_ns - cut_ns).unwrap_or(u64::MAX));
        let next_after = Duration::from_nanos(u64::try_from(next_ns - cut_ns).unwrap_or(u64::MAX));
        eprintln!(
            "figure: {label} command, lease 2 s, grace 500 ms, server cut off: SIGTERM after {term_after:?}, next holder after {next_after:?} (dlock exited 76 after {:?})",
            cut.elapsed()
        );
        // The last renewal that got through was at most 2/3 s before the cut: the
        // deadline is at most 2 s after it, SIGTERM half a second before that.
        assert!(
            term_after < Duration::from_millis(1600),
            "{label}: SIGTERM after {term_after:?}"
        );
        let last_beat: u128 = wait_for_file(&beat, Duration::from_secs(1))
            .parse()
            .expect("last sign of life");
        assert!(
            term_ns < next_ns && last_beat < next_ns,
            "{label}: the command was still running when the next holder started"
        );
    }
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // Field 4 of /proc/PID/stat, after the parenthesized command name.
        let parent = std::fs::read_to_string(format!("/proc/{child}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1).map(str::to_owned))
            })
            .and_then(|p| p.parse::<u32>().ok());
        if parent == Some(pid) {
            found.push(child);
        }
    }
    found
}

/// A command never starts without the reaper that would end its process group if
/// dlock died: when that reaper is gone (killed while dlock waited for the lock), the
/// run ends with 126 and a message that says so, and the command did not run.
#[test]
fn no_command_starts_once_its_reaper_is_gone() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let held = dir.path().join("held");
    let ran = dir.path().join("ran");
    let mut holder = spawn(&[
        "run",
        "--url",
        &url,
        "n",
        "--",
        "sh",
        "-c",
        &format!(
            "echo x > {h}.tmp && mv {h}.tmp {h}; exec sleep 30",
            h = held.display()
        ),
    ]);
    wait_for_file(&held, Duration::from_secs(20));
    let mut waiter = spawn(&[
        "run",
        "--url",
        &url,
        "--wait",
        "20s",
        "n",
        "--",
        "touch",
        ran.to_str().expect("utf-8 path"),
    ]);
    // The waiter's reaper is forked before it asks for the lock; it is its only child
    // while it waits.
    let end = Instant::now() + Duration::from_secs(10);
    let reaper = loop {
        let children = children_of(waiter.id());
        if let [one] = children[..] {
            break one;
        }
        assert!(
            Instant::now() < end,
            "the waiting dlock has no reaper: {children:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(reaper),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the reaper");
    // Gone (a zombie has closed its end of the pipe) before the lock can come free.
    if !wait_gone(reaper, Duration::from_secs(10)) {
        let _ = holder.kill();
        let _ = waiter.kill();
        panic!("the killed reaper {reaper} is still running");
    }
    // The holder stops: the waiter gets the lock, and must not start its command.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(holder.id()).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("stop the holder");
    let _ = wait_exit(&mut holder, Duration::from_secs(20));
    let status = wait_exit(&mut waiter, Duration::from_secs(20));
    let mut stderr = String::new();
    if let Some(mut e) = waiter.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    assert_eq!(status.code(), Some(126), "{stderr}");
    assert!(stderr.contains("reaper"), "{stderr}");
    assert!(!ran.exists(), "the command ran without its reaper");
}

/// A reaper killed while the command runs is replaced: dlock SIGKILLed after that still
/// takes the command's own child along.
#[test]
fn a_reaper_killed_while_the_command_runs_is_replaced() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let (mut run, command, grandchild) =
        run_with_a_child(&["run", "--url", &url, "n"], dir.path(), "");
    // dlock's children: the command and the reaper.
    let other_child = |not: &[i32]| {
        children_of(run.id())
            .into_iter()
            .find(|p| !not.contains(p) && alive(*p))
    };
    let end = Instant::now() + Duration::from_secs(10);
    let reaper = loop {
        if let Some(r) = other_child(&[command]) {
            break r;
        }
        assert!(Instant::now() < end, "dlock has no reaper");
        std::thread::sleep(Duration::from_millis(5));
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(reaper),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the reaper");
    let end = Instant::now() + Duration::from_secs(10);
    let replaced = loop {
        if let Some(r) = other_child(&[command, reaper]) {
            break r;
        }
        if Instant::now() >= end {
            let _ = run.kill();
            panic!("the killed reaper {reaper} was not replaced");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    // The new reaper was told the group before it was forked: dlock can die at once.
    run.kill().expect("SIGKILL dlock");
    let _ = run.wait();
    assert!(
        wait_gone(command, Duration::from_secs(2)),
        "the command outlived dlock"
    );
    assert!(
        wait_gone(grandchild, Duration::from_secs(2)),
        "the command's child outlived dlock (reaper {replaced} did not cover it)"
    );
}
