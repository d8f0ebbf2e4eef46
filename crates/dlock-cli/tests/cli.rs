//! End-to-end tests of the `dlock` binary, several OS processes against one SQLite file.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Self {
        Env {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn url(&self) -> String {
        format!("sqlite://{}/locks.db", self.dir.path().display())
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(DLOCK);
        c.env("DLOCK_URL", self.url()).env_remove("DLOCK_LOG");
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().expect("run dlock")
    }

    fn spawn(&self, args: &[&str]) -> Child {
        self.cmd()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("spawn dlock")
    }

    /// Wait until `dlock status NAME` reports the lock held.
    fn wait_held(&self, name: &str) {
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            let out = self.run(&["status", "--json", name]);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("status JSON: {e}; stderr: {}", text(&out.stderr)));
            if v[0]["held"] == serde_json::Value::Bool(true) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{name} never became held");
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn wait_timeout(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let end = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return s;
        }
        assert!(
            Instant::now() < end,
            "process did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn kill_group(child: &Child, sig: nix::sys::signal::Signal) {
    let pgid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    let _ = nix::sys::signal::killpg(pgid, sig);
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

#[test]
fn run_passes_lock_env_and_exit_status() {
    let env = Env::new();
    let out = env.run(&[
        "run",
        "job:env",
        "--",
        "sh",
        "-c",
        "echo \"$DLOCK_NAME|$DLOCK_FENCING_TOKEN|$DLOCK_OWNER\"; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    let line = text(&out.stdout);
    let parts: Vec<&str> = line.trim().split('|').collect();
    assert_eq!(parts[0], "job:env");
    assert!(parts[1].parse::<u64>().expect("token") > 0);
    assert_eq!(parts[2].len(), 32, "owner is 128 random bits in hex");
    // Released afterwards.
    let st = env.run(&["status", "job:env"]);
    assert!(text(&st.stdout).contains("free"), "{}", text(&st.stdout));
}

/// Each run opens the SQLite file alone and so rebuilds the WAL index from the whole
/// WAL: the command line keeps the WAL at 64 pages, unless the URL sets its own size.
#[test]
fn runs_keep_the_sqlite_wal_short() {
    const FRAME: u64 = 4096 + 24;
    let wal_after_runs = |query: &str| {
        let env = Env::new();
        let url = format!("{}{query}", env.url());
        for _ in 0..80 {
            let out = env
                .cmd()
                .args(["run", "--url", &url, "job:wal", "--", "true"])
                .output()
                .expect("run dlock");
            assert!(out.status.success(), "{}", text(&out.stderr));
        }
        std::fs::metadata(env.path("locks.db-wal")).map_or(0, |m| m.len())
    };
    let short = wal_after_runs("");
    let long = wal_after_runs("?wal_autocheckpoint=1000");
    assert!(
        short <= 100 * FRAME,
        "the WAL grew to {short} bytes ({} frames)",
        short / FRAME
    );
    assert!(
        long > 100 * FRAME,
        "80 runs wrote only {long} bytes of WAL: too few to tell"
    );
}

#[test]
fn processes_exclude_each_other_and_tokens_increase() {
    let env = Env::new();
    let counter = env.path("counter");
    let tokens = env.path("tokens");
    std::fs::write(&counter, "0").expect("write");
    // A racy read-sleep-write of a file, and the token appended inside the lock.
    let script = format!(
        "v=$(cat {c}); sleep 0.02; echo $((v+1)) > {c}; echo $DLOCK_FENCING_TOKEN >> {t}",
        c = counter.display(),
        t = tokens.display()
    );
    let (procs, rounds) = (6, 4);
    let children: Vec<Child> = (0..procs)
        .map(|_| {
            let loop_script = format!(
                "for i in $(seq {rounds}); do {DLOCK} run --wait 60s shared -- sh -c '{script}' || exit 1; done"
            );
            Command::new("sh")
                .arg("-c")
                .arg(&loop_script)
                .env("DLOCK_URL", env.url())
                .spawn()
                .expect("spawn")
        })
        .collect();
    for mut c in children {
        let s = wait_timeout(&mut c, Duration::from_secs(120));
        assert!(s.success());
    }
    let total: u32 = std::fs::read_to_string(&counter)
        .expect("read")
        .trim()
        .parse()
        .expect("number");
    assert_eq!(
        total,
        procs * rounds,
        "updates were lost: critical sections overlapped"
    );
    let seen: Vec<u64> = std::fs::read_to_string(&tokens)
        .expect("tokens")
        .lines()
        .map(|l| l.parse().expect("token"))
        .collect();
    assert_eq!(seen.len(), (procs * rounds) as usize);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "tokens not increasing: {seen:?}"
    );
}

#[test]
fn busy_lock_gives_exit_75() {
    let env = Env::new();
    let mut holder = env.spawn(&["run", "busy", "--", "sleep", "30"]);
    env.wait_held("busy");
    let out = env.run(&["run", "--no-wait", "busy", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stderr).lines().count(),
        1,
        "{}",
        text(&out.stderr)
    );
    // It says who holds the lock, and for how long.
    let said = text(&out.stderr);
    assert!(
        said.contains("held by") && said.contains("pid") && said.contains("left"),
        "{said}"
    );
    let start = Instant::now();
    let out = env.run(&["run", "--wait", "300ms", "busy", "--", "true"]);
    assert_eq!(out.status.code(), Some(75));
    assert!(start.elapsed() >= Duration::from_millis(300));
    kill_group(&holder, nix::sys::signal::Signal::SIGTERM);
    let _ = wait_timeout(&mut holder, Duration::from_secs(10));
}

/// The habits of flock(1), `etcdctl lock` and `consul lock`: NAME CMD without `--`,
/// `-c 'shell text'`, a name that begins with `-` after `--`, `--wait`/`-w` in bare
/// seconds; `status` exits 0 held / 1 free; bad values name the valid ones.
#[test]
fn habits_of_flock_and_etcdctl() {
    let env = Env::new();
    let said = |args: &[&str]| {
        let out = env.run(args);
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let (code, out, err) = said(&["run", "job", "echo", "-n", "plain"]);
    assert_eq!((code, out.as_str()), (Some(0), "plain"), "{err}");
    let (code, out, err) = said(&["run", "job", "--", "echo", "-n", "dashes"]);
    assert_eq!((code, out.as_str()), (Some(0), "dashes"), "{err}");
    let (code, out, err) = said(&["run", "-c", "printf %s \"$DLOCK_NAME\"", "job"]);
    assert_eq!((code, out.as_str()), (Some(0), "job"), "{err}");
    for args in [
        &["run", "--", "-tmp", "printf", "%s", "neg"][..],
        &["run", "--", "-tmp", "--", "printf", "%s", "neg"][..],
    ] {
        let (code, out, err) = said(args);
        assert_eq!((code, out.as_str()), (Some(0), "neg"), "{args:?}: {err}");
    }

    let (code, out, _) = said(&["status", "job"]);
    assert_eq!(code, Some(1), "a free lock: {out}");
    let mut holder = env.spawn(&["run", "job", "sleep", "30"]);
    env.wait_held("job");
    let (code, out, err) = said(&["status", "job"]);
    assert_eq!(code, Some(0), "a held lock: {out} {err}");
    let (code, _, _) = said(&["status", "job", "other"]);
    assert_eq!(code, Some(1), "one of two free");
    let start = Instant::now();
    let (code, _, err) = said(&["run", "-w", "0.3", "job", "true"]);
    assert_eq!(code, Some(75), "{err}");
    assert!(start.elapsed() >= Duration::from_millis(300));
    let (code, _, err) = said(&["run", "--wait", "1", "free-one", "true"]);
    assert_eq!(code, Some(0), "{err}");
    kill_group(&holder, nix::sys::signal::Signal::SIGTERM);
    let _ = wait_timeout(&mut holder, Duration::from_secs(10));

    let (code, _, err) = said(&["--log", "nonsense", "status", "job"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not a log level"), "{err}");
    let (code, _, err) = said(&["bench", "--scenario", "nope"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("possible values: uncontended"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let (code, _, err) = said(&["run", "job"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("<CMD>"), "names what is missing: {err}");
}

/// A URL without a host is a usage error (no silent default address), and a refused
/// connection is said at once, naming the address tried.
#[test]
fn connection_errors_name_the_address() {
    let env = Env::new();
    for url in ["redis://", "etcd://", "redis+sentinel:///mymaster"] {
        let out = env.run(&["status", "--url", url, "x"]);
        assert_eq!(out.status.code(), Some(2), "{url}: {}", text(&out.stderr));
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    for url in [
        format!("postgres://dlock:sekrit@127.0.0.1:{port}/db"),
        format!("mysql://dlock:sekrit@127.0.0.1:{port}/db"),
        format!("redis://:sekrit@127.0.0.1:{port}"),
        format!("etcd://127.0.0.1:{port}"),
        format!("zk://:sekrit@127.0.0.1:{port}/locks"),
    ] {
        let start = Instant::now();
        let out = env.run(&["status", "--url", &url, "x"]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(69), "{url}: {err}");
        assert!(err.contains(&format!("127.0.0.1:{port}")), "{url}: {err}");
        assert!(!err.contains("sekrit"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{url}: a refused connection took {:?}",
            start.elapsed()
        );
    }
}

/// A name the URL's options refuse (a numeric advisory key that is not a number) is a
/// usage error found before any I/O: the server here does not even exist.
#[test]
fn names_the_url_refuses_are_refused_before_connecting() {
    let env = Env::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let url = format!("postgres://u@127.0.0.1:{port}/db?mode=advisory&advisory_key=number");
    for args in [
        &["status", "--url", &url, "abc"][..],
        &["status", "--url", &url, "042"],
        &["run", "--url", &url, "--no-wait", "abc", "true"],
        &["run", "--url", &url, "--also", "abc", "42", "true"],
        &["break", "--url", &url, "--yes", "abc"],
    ] {
        let out = env.run(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("advisory_key=number"), "{args:?}: {err}");
        assert!(
            !err.contains(&port.to_string()),
            "{args:?} connected: {err}"
        );
    }
    // A good name on the same URL does try to connect (and names the address).
    let out = env.run(&["status", "--url", &url, "42"]);
    assert_eq!(out.status.code(), Some(69), "{}", text(&out.stderr));
}

/// `--also`: several locks, all or none. Held together, each with its own token in
/// `DLOCK_FENCING_TOKENS`; a set whose other lock is busy exits 75 naming that lock and
/// leaves its first lock free.
#[test]
fn also_holds_several_locks_all_or_none() {
    let env = Env::new();
    let out = env.run(&[
        "run",
        "--also",
        "acct:b",
        "acct:a",
        "--",
        "sh",
        "-c",
        "echo \"$DLOCK_FENCING_TOKEN\"; echo \"$DLOCK_FENCING_TOKENS\"",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    let lines: Vec<&str> = said.lines().collect();
    assert_eq!(lines.len(), 3, "{said}");
    let a = lines[1].strip_prefix("acct:a=").expect("acct:a first");
    assert!(lines[2].starts_with("acct:b="), "{said}");
    assert_eq!(lines[0], a, "DLOCK_FENCING_TOKEN is NAME's token");

    let mut holder = env.spawn(&["run", "acct:b", "--", "sleep", "30"]);
    env.wait_held("acct:b");
    let out = env.run(&[
        "run",
        "--no-wait",
        "--also",
        "acct:b",
        "acct:a",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("\"acct:b\""),
        "{}",
        text(&out.stderr)
    );
    let out = env.run(&["run", "--no-wait", "acct:a", "--", "true"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "acct:a was left held: {}",
        text(&out.stderr)
    );
    kill_group(&holder, nix::sys::signal::Signal::SIGTERM);
    let _ = wait_timeout(&mut holder, Duration::from_secs(10));
}

#[test]
fn lost_lock_terminates_the_command_with_exit_76() {
    let env = Env::new();
    let mut run = env.spawn(&[
        "run",
        "--ttl",
        "600ms",
        "--grace",
        "300ms",
        "lost",
        "--",
        "sh",
        "-c",
        "trap '' TERM; sleep 30",
    ]);
    env.wait_held("lost");
    // Steal the lock behind dlock's back: its next renewal finds another owner.
    steal(&env.path("locks.db"));
    let start = Instant::now();
    let status = wait_timeout(&mut run, Duration::from_secs(10));
    assert_eq!(status.code(), Some(76), "{}", stderr_of(&mut run));
    // Renewal every 200 ms, then SIGTERM (ignored), SIGKILL after the 300 ms grace.
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    kill_group(&run, nix::sys::signal::Signal::SIGKILL);
}

fn steal(db: &Path) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let url = format!("sqlite://{}", db.display());
        let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&url)
            .await
            .expect("open");
        sqlx::query("UPDATE dlock_locks SET owner = 'thief'")
            .execute(&mut conn)
            .await
            .expect("steal");
    });
}

#[test]
fn killed_holder_frees_within_ttl() {
    let env = Env::new();
    let mut holder = env.spawn(&["run", "--ttl", "1s", "crash", "--", "sleep", "30"]);
    env.wait_held("crash");
    let killed_at = Instant::now();
    kill_group(&holder, nix::sys::signal::Signal::SIGKILL);
    let _ = wait_timeout(&mut holder, Duration::from_secs(5));
    let out = env.run(&["run", "--wait", "10s", "crash", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let took = killed_at.elapsed();
    // TTL + 0.5 s, plus process start-up of the second dlock.
    assert!(
        took < Duration::from_millis(2000),
        "next holder after {took:?}"
    );
}

#[test]
fn sigterm_is_forwarded_to_the_command() {
    let env = Env::new();
    let ready = env.path("ready");
    let script = format!(
        "trap 'exit 3' TERM; touch {}; sleep 30 & wait",
        ready.display()
    );
    let mut run = env.spawn(&["run", "fwd", "--", "sh", "-c", &script]);
    env.wait_held("fwd");
    // Signal only once the command has installed its trap.
    let end = Instant::now() + Duration::from_secs(10);
    while !ready.exists() {
        assert!(Instant::now() < end, "the command never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(run.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("kill");
    let status = wait_timeout(&mut run, Duration::from_secs(10));
    assert_eq!(status.code(), Some(3), "{}", stderr_of(&mut run));
    kill_group(&run, nix::sys::signal::Signal::SIGKILL);
    let st = env.run(&["status", "fwd"]);
    assert!(text(&st.stdout).contains("free"));
}

#[test]
fn usage_errors_are_one_line_and_exit_2() {
    let env = Env::new();
    for args in [
        &["run", "name"][..],
        &["run", "--ttl", "30", "n", "--", "true"],
        &["run", "--ttl", "0s", "n", "--", "true"],
        &["run", "--wait", "1x", "n", "--", "true"],
        &["run", "--wait", "1s", "--no-wait", "n", "--", "true"],
        &["run", "--url", "bogus://x", "n", "--", "true"],
        &[
            "run",
            "--url",
            "sqlite:///tmp/x.db?nope=1",
            "n",
            "--",
            "true",
        ],
        &["run", "", "--", "true"],
        &["run", "--owner", "bad owner", "n", "--", "true"],
        &["status"],
        &["frobnicate"],
        &["bench", "--cycles", "0"],
        &["bench", "--scenario", "bogus"],
        &["bench", "--scenario", "parallel", "--tasks", "0"],
        &["bench", "--scenario", "polling", "--waiters", "0"],
        &["bench", "--keys", "0"],
        &["bench", "--ttl", "0s"],
        &["check", "--fault", "pause-server"],
        &["check", "--fenced", "--unfenced"],
        &["check", "--workers", "0"],
        &["check", "--fault", "explode"],
    ] {
        let out = env.run(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn missing_command_is_127() {
    let env = Env::new();
    let out = env.run(&["run", "n", "--", "/nonexistent/dlock-test-cmd"]);
    assert_eq!(out.status.code(), Some(127), "{}", text(&out.stderr));
    // A bare name is looked up in PATH, directory by directory, as execvp does.
    let out = env
        .cmd()
        .env("PATH", "/nonexistent-dir")
        .args(["run", "n", "--", "dlock-test-cmd"])
        .output()
        .expect("run dlock");
    assert_eq!(out.status.code(), Some(127), "{}", text(&out.stderr));
    let out = env.run(&["run", "n", "--", ""]);
    assert_eq!(out.status.code(), Some(127), "{}", text(&out.stderr));
    // Nothing ran without the lock, and nothing holds it now.
    let out = env.run(&["run", "--no-wait", "n", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

#[test]
fn command_lookup_and_unexecutable_file() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let bin = env.path("bin");
    std::fs::create_dir(&bin).expect("bin dir");
    // A file that is not executable: 126, as a shell says.
    let plain = bin.join("plain");
    std::fs::write(&plain, "#!/bin/sh\nexit 3\n").expect("write");
    let out = env.run(&["run", "n", "--", plain.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(126), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("cannot run"),
        "{}",
        text(&out.stderr)
    );
    // The same name found through PATH once it is executable, after a directory
    // that does not hold it; its arguments and exit status come through.
    let script = bin.join("dlock-found");
    std::fs::write(&script, "#!/bin/sh\nexit \"$1\"\n").expect("write");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = format!("/nonexistent-dir:{}", bin.display());
    let out = env
        .cmd()
        .env("PATH", &path)
        .args(["run", "n", "--", "dlock-found", "9"])
        .output()
        .expect("run dlock");
    assert_eq!(out.status.code(), Some(9), "{}", text(&out.stderr));
    // An executable file without `#!` runs through /bin/sh, as execvp runs it.
    let bare = bin.join("no-shebang");
    std::fs::write(&bare, "exit \"$1\"\n").expect("write");
    std::fs::set_permissions(&bare, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = env.run(&["run", "n", "--", bare.to_str().expect("utf-8"), "5"]);
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
}

/// The command starts with the signal state `std::process::Command` gives a child:
/// nothing blocked, and only what the caller ignored still ignored (dlock's own
/// handlers and its ignored SIGPIPE do not leak into it). Signals 32 and 33 are
/// glibc's own (thread cancellation, set*id) and left out. The command reads its own
/// status, with no shell between: a shell waiting for a child blocks every signal for
/// a moment (dash does), and a status read from outside could catch it then.
#[test]
fn command_starts_with_a_clean_signal_state() {
    let env = Env::new();
    let show = ["grep", "-E", "^Sig(Blk|Ign|Cgt):", "/proc/self/status"];
    let masks = |out: &[u8]| -> Vec<(String, u64)> {
        let glibc = (1u64 << 31) | (1u64 << 32);
        text(out)
            .lines()
            .map(|l| {
                let (k, v) = l.split_once(':').expect("status line");
                let bits = u64::from_str_radix(v.trim(), 16).expect("hex mask");
                (k.to_owned(), bits & !glibc)
            })
            .collect()
    };
    let bare = Command::new(show[0])
        .args(&show[1..])
        .output()
        .expect("run grep");
    let out = env.run(&[&["run", "n", "--"][..], &show[..]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let ours = masks(&out.stdout);
    assert_eq!(ours.len(), 3, "{}", text(&out.stdout));
    assert_eq!(ours, masks(&bare.stdout));
    assert_eq!(ours[0], ("SigBlk".to_owned(), 0));
    // SIGPIPE (13) is back to its default in the command.
    assert_eq!(ours[1].1 & (1 << 12), 0, "{}", text(&out.stdout));
}

/// Signals ignored when dlock starts (`nohup`, a shell's background job) stay ignored:
/// the command inherits them ignored, and dlock does not act on them (a SIGHUP to a
/// `nohup`ed dlock neither ends its wait nor reaches the command).
#[test]
fn signals_ignored_at_start_stay_ignored() {
    let env = Env::new();
    let ignoring = |args: &[&str]| {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("trap '' HUP INT; exec \"$0\" \"$@\"")
            .arg(DLOCK)
            .args(args)
            .env("DLOCK_URL", env.url())
            .env_remove("DLOCK_LOG");
        c
    };
    let out = ignoring(&["run", "n", "--", "grep", "^SigIgn:", "/proc/self/status"])
        .output()
        .expect("run dlock");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let mask = text(&out.stdout)
        .trim()
        .strip_prefix("SigIgn:")
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .expect("the command's SigIgn");
    assert_eq!(
        mask & 0b11,
        0b11,
        "SIGHUP and SIGINT ignored in the command"
    );
    // dlock itself: a SIGHUP while the command runs changes nothing.
    let mut child = ignoring(&["run", "n", "--", "sleep", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dlock");
    env.wait_held("n");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("SIGHUP");
    let status = wait_timeout(&mut child, Duration::from_secs(20));
    assert_eq!(status.code(), Some(0), "the command ran to its end");
}

#[test]
fn passwords_never_printed() {
    let env = Env::new();
    for url in [
        "redis://user:s3cretMARKER@127.0.0.1:1",
        "redis://user:s3cretMARKER@127.0.0.1:99999",
        "postgres://u:s3cretMARKER@127.0.0.1:1/db?bogus=1",
    ] {
        for args in [
            vec!["status", "--url", url, "n"],
            vec!["--log", "trace", "run", "--url", url, "n", "--", "true"],
        ] {
            let out = env.run(&args);
            let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
            assert!(!all.contains("s3cretMARKER"), "{args:?}: {all}");
            assert_ne!(out.status.code(), Some(0));
        }
    }
}

/// Refused credentials are their own exit status (77), with the server's words and
/// none of the driver's internals (PostgreSQL's "at line N" of its C source), and
/// never the password.
#[test]
fn refused_credentials_exit_77() {
    let (Some(pg), Some(maria), Some(redis)) = (
        dlock_testkit::PgServer::start(),
        dlock_testkit::MariaDbServer::start(),
        dlock_testkit::RedisServer::start(),
    ) else {
        return;
    };
    // A password from now on (the server had to answer a plain PING to count as up).
    let port = redis.addr().port().to_string();
    let set = Command::new("redis-cli")
        .args(["-p", &port, "CONFIG", "SET", "requirepass", "right-one"])
        .output()
        .expect("redis-cli");
    assert!(set.status.success(), "{}", text(&set.stderr));
    let env = Env::new();
    for url in [
        pg.url().replace(dlock_testkit::PG_PASSWORD, "wrongMARKER"),
        maria.url().replace("root@", "nobody:wrongMARKER@"),
        redis.url().replace("redis://", "redis://:wrongMARKER@"),
    ] {
        let out = env.run(&["status", "--url", &url, "x"]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(77), "{url}: {err}");
        assert!(err.contains("refused access"), "{err}");
        assert!(
            !err.contains("wrongMARKER") && !err.contains("at line"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// A history file that cannot be created is a clear error with its own status (73),
/// before any worker starts.
#[test]
fn unwritable_history_exits_73() {
    let env = Env::new();
    let out = env.run(&[
        "check",
        "--ops",
        "10",
        "--history",
        "/nonexistent-dir/history.jsonl",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(73), "{err}");
    assert!(err.contains("/nonexistent-dir/history.jsonl"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn status_json_and_backends() {
    let env = Env::new();
    let mut holder = env.spawn(&["run", "--note", "nightly", "st", "--", "sleep", "30"]);
    env.wait_held("st");
    let out = env.run(&["status", "--json", "st", "other"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v[0]["held"], true);
    assert_eq!(v[0]["metadata"]["note"], "nightly");
    assert!(v[0]["fencing_token"].as_u64().expect("token") > 0);
    assert!(v[0]["remaining_ms"].as_u64().expect("remaining") <= 30_000);
    assert_eq!(v[1]["held"], false);
    kill_group(&holder, nix::sys::signal::Signal::SIGTERM);
    let _ = wait_timeout(&mut holder, Duration::from_secs(10));

    let out = env.run(&["backends", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let sqlite = v
        .as_array()
        .expect("array")
        .iter()
        .find(|b| b["scheme"] == "sqlite")
        .expect("sqlite listed");
    assert_eq!(sqlite["available"], true);
    assert_eq!(sqlite["capabilities"]["fencing"], "durable");
}

#[test]
fn flash_sale_demo_sells_exactly_the_stock_under_dlock() {
    let env = Env::new();
    let out = env
        .cmd()
        .env_remove("DLOCK_URL")
        .args([
            "demo",
            "flash-sale",
            "--buyers",
            "160",
            "--stock",
            "20",
            "--workers",
            "4",
        ])
        .output()
        .expect("demo");
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    let row = stdout
        .lines()
        .find(|l| l.starts_with("dlock "))
        .expect("dlock row");
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[1], "20", "{row}");
    assert_eq!(cols[2], "0", "{row}");
    assert!(stdout.lines().any(|l| l.starts_with("none ")));
}

#[test]
fn bench_reports_figures() {
    let env = Env::new();
    let out = env
        .cmd()
        .env_remove("DLOCK_URL")
        .args([
            "bench",
            "--cycles",
            "50",
            "--processes",
            "2",
            "--duration",
            "500ms",
            "--json",
        ])
        .output()
        .expect("bench");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(v["uncontended"]["cycles_per_sec"].as_f64().expect("rate") > 0.0);
    assert!(v["uncontended"]["ratio_to_floor"].as_f64().expect("ratio") > 0.0);
    // The flat scenario list: every row has the keys BENCHMARKS.md reads.
    let rows = v["scenarios"].as_array().expect("scenarios");
    let names: Vec<&str> = rows.iter().filter_map(|r| r["scenario"].as_str()).collect();
    assert!(names.contains(&"uncontended-1-task"), "{names:?}");
    assert!(names.contains(&"contended-2-processes"), "{names:?}");
    for r in rows {
        for k in [
            "scenario",
            "ops_per_sec",
            "floor_ops_per_sec",
            "ratio",
            "p50_us",
            "p99_us",
        ] {
            assert!(r.get(k).is_some(), "no {k} in {r}");
        }
    }
    assert!(rows[0]["ratio"].as_f64().expect("ratio") > 0.0);
    assert!(v["contended"]["acquisitions"].as_u64().expect("count") > 0);
}

/// `dlock bench --json` on Redlock (three nodes, `node_timeout=20ms`) with `args`,
/// two of its nodes frozen for 400 ms once its cycles are seen running (scripts counted
/// on the third node, which only the Redlock cycles use), however long it took to
/// start; the report, once it exited 0. `None` without the servers.
fn bench_through_lost_quorum(args: &[&str]) -> Option<serde_json::Value> {
    let mut nodes = dlock_testkit::RedisNodes::start(3, &dlock_testkit::RedisOptions::default())?;
    let env = Env::new();
    let url = format!("{}?node_timeout=20ms", nodes.url());
    let child = env
        .cmd()
        .args(["bench", "--url", &url, "--json"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bench");
    let probe = redis::Client::open(nodes.node(2).url()).expect("the third node's URL");
    let mut probe = probe.get_connection().expect("the third node");
    let scripts_run = |probe: &mut redis::Connection| -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(probe)
            .unwrap_or_default();
        info.lines()
            .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
            .filter_map(|l| {
                l.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    };
    let until = Instant::now() + Duration::from_secs(30);
    while scripts_run(&mut probe) < 20 {
        assert!(Instant::now() < until, "the cycles never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    nodes.node(0).process().pause();
    nodes.node(1).process().pause();
    std::thread::sleep(Duration::from_millis(400));
    nodes.node(0).process().resume();
    nodes.node(1).process().resume();
    let out = child.wait_with_output().expect("bench output");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    Some(serde_json::from_slice(&out.stdout).expect("JSON"))
}

/// Asserts that `report` (a scenario's part of the report) stepped over some cycles on
/// "no quorum", and that the flat row counts as many.
fn assert_stepped_over(report: &serde_json::Value, row: &serde_json::Value) {
    let skipped = report["skipped"]["count"].as_u64().expect("count");
    assert!(skipped > 0, "nothing stepped over: {report}");
    let first = report["skipped"]["first"].as_str().expect("first");
    assert!(first.contains("no quorum"), "{first}");
    assert_eq!(row["skipped"].as_u64(), Some(skipped), "{row}");
}

/// A cycle that fails on an error trying again may mend is stepped over and counted,
/// not the end of the run: Redlock with two of its three nodes frozen answers
/// `NoQuorum` at once (the contended workers then cycle on when the nodes come back).
#[test]
fn bench_steps_over_retryable_errors_and_counts_them() {
    let args = [
        "--scenario",
        "contended",
        "--processes",
        "2",
        "--duration",
        "4s",
        "--ttl",
        "1s",
    ];
    let Some(v) = bench_through_lost_quorum(&args) else {
        return;
    };
    let c = &v["contended"];
    assert_stepped_over(c, &v["scenarios"][0]);
    assert!(c["acquisitions"].as_u64().expect("count") > 0, "{c}");
}

/// The uncontended one-task loop steps over such errors too: a cycle whose acquisition
/// failed is not a sample, and the run goes on to its single-node comparison.
#[test]
fn bench_uncontended_loop_steps_over_retryable_errors() {
    let args = [
        "--scenario",
        "uncontended",
        "--cycles",
        "3000",
        "--ttl",
        "1s",
    ];
    let Some(v) = bench_through_lost_quorum(&args) else {
        return;
    };
    let u = &v["uncontended"];
    assert_stepped_over(u, &v["scenarios"][0]);
    assert!(u["cycles_per_sec"].as_f64().expect("rate") > 0.0, "{u}");
    assert!(
        v["single_node"]["cycles_per_sec"].as_f64().expect("rate") > 0.0,
        "{v}"
    );
}

/// `--primitive` on every backend with a floor: each cycle takes a permit, a read, a
/// write or leadership, against the floor of its shape measured in the same run (a
/// counted grant's on every backend: the statements, script and requests of
/// `bench::floor`); a semaphore's contended run; lock-only scenarios refused with 2;
/// a lock's limit where dlock's layout needs more than the floor.
#[test]
fn bench_primitives_against_their_floors() {
    let (Some(redis), Some(etcd), Some(zk), Some(pg), Some(maria)) = (
        dlock_testkit::RedisServer::start(),
        dlock_testkit::EtcdServer::start(),
        dlock_testkit::ZkServer::start(),
        dlock_testkit::PgServer::start(),
        dlock_testkit::MariaDbServer::start(),
    ) else {
        return;
    };
    let env = Env::new();
    let dir = tempfile::tempdir().expect("temp dir");
    let sqlite = format!("sqlite://{}", dir.path().join("bench.db").display());
    for url in [
        sqlite.clone(),
        redis.url(),
        etcd.url(),
        zk.url(),
        pg.url(),
        maria.url(),
    ] {
        for primitive in ["semaphore", "read", "write", "election"] {
            let out = env.run(&[
                "bench",
                "--url",
                &url,
                "--primitive",
                primitive,
                "--cycles",
                "30",
                "--scenario",
                "uncontended",
                "--json",
            ]);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{primitive} on {url}: {}",
                text(&out.stderr)
            );
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
            assert_eq!(v["primitive"], primitive, "{v}");
            assert!(
                v["uncontended"]["ratio_to_floor"].as_f64().expect("ratio") > 0.0,
                "{primitive} on {url}: no floor: {v}"
            );
        }
    }
    // A lock's *limit* (the least a fenced lock does, where the floor is not one) is
    // measured on Redis (a bare SET NX PX draws no token), ZooKeeper and the SQL
    // servers' every mode (a bare insert takes no ended lease and draws no token
    // either); etcd's and SQLite's floors are already it.
    let advisory = format!("{}?mode=advisory", pg.url());
    let named = format!("{}?mode=named", maria.url());
    for (url, limited) in [
        (zk.url(), true),
        (advisory, true),
        (named, true),
        (pg.url(), true),
        (maria.url(), true),
        (format!("{}?mode=row", pg.url()), true),
        (format!("{}?mode=row", maria.url()), true),
        (redis.url(), true),
        (etcd.url(), false),
        (sqlite.clone(), false),
    ] {
        let out = env.run(&[
            "bench",
            "--url",
            &url,
            "--cycles",
            "30",
            "--scenario",
            "uncontended",
            "--json",
        ]);
        assert_eq!(out.status.code(), Some(0), "{url}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let limit = &v["uncontended"]["limit"];
        if limited {
            assert!(limit["ratio"].as_f64().expect("ratio") > 0.0, "{url}: {v}");
            assert!(
                limit["cycles_per_sec"].as_f64().expect("rate") > 0.0,
                "{url}: {v}"
            );
            assert!(
                !limit["what"].as_str().expect("what").is_empty(),
                "{url}: {v}"
            );
        } else {
            assert!(
                limit.is_null(),
                "{url}: a limit where the floor is the least: {v}"
            );
        }
    }
    // Many tasks on Redis, each its own lock: the shared-connection floor and the least
    // fenced lock from as many tasks, both measured in the same run.
    let out = env.run(&[
        "bench",
        "--url",
        &redis.url(),
        "--scenario",
        "parallel",
        "--tasks",
        "4",
        "--duration",
        "300ms",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    for k in [
        "floor_cycles_per_sec",
        "ratio_to_floor",
        "limit_cycles_per_sec",
        "ratio_to_limit",
        "layout_limit_cycles_per_sec",
        "ratio_to_layout_limit",
    ] {
        assert!(v["parallel"][k].as_f64().expect(k) > 0.0, "{k}: {v}");
    }
    // What each side's cycle cost the server, by its own statistics: a cycle runs two
    // commands, each well over 0.1 µs of the server's time and, on loopback, well
    // under 10 ms.
    for k in ["dlock_us", "floor_us", "limit_us", "layout_limit_us"] {
        let us = v["parallel"]["server_us_per_cycle"][k].as_f64().expect(k);
        assert!(us > 0.2 && us < 10_000.0, "{k}: {us}: {v}");
    }
    let out = env.run(&[
        "bench",
        "--url",
        &sqlite,
        "--primitive",
        "semaphore",
        "--permits",
        "2",
        "--cycles",
        "20",
        "--processes",
        "3",
        "--duration",
        "300ms",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["permits"].as_u64(), Some(2), "{v}");
    let names: Vec<&str> = v["scenarios"]
        .as_array()
        .expect("scenarios")
        .iter()
        .filter_map(|r| r["scenario"].as_str())
        .collect();
    // Beyond the lock, the default runs are the uncontended and contended ones.
    assert_eq!(names, ["uncontended-1-task", "contended-3-processes"]);
    assert!(v["contended"]["acquisitions"].as_u64().expect("count") > 0);
    let out = env.run(&[
        "bench",
        "--url",
        &sqlite,
        "--primitive",
        "read",
        "--scenario",
        "handoff",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--primitive lock only"),
        "{}",
        text(&out.stderr)
    );
}

/// `--scenario` runs only what it names; `--keys` and `--ttl` shape the runs.
#[test]
fn bench_runs_the_named_scenarios_only() {
    let env = Env::new();
    let out = env
        .cmd()
        .env_remove("DLOCK_URL")
        .args([
            "bench",
            "--scenario",
            "parallel,handoff",
            "--tasks",
            "6",
            "--keys",
            "2",
            "--waiters",
            "3",
            "--duration",
            "300ms",
            "--ttl",
            "5s",
            "--json",
        ])
        .output()
        .expect("bench");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(v["uncontended"].is_null(), "not asked for: {v}");
    assert!(v["contended"].is_null(), "not asked for: {v}");
    assert_eq!(v["parallel"]["keys"].as_u64(), Some(2));
    // Tasks sharing locks, on SQLite: no bare side to compare with.
    assert!(v["parallel"]["ratio_to_limit"].is_null(), "{v}");
    assert!(v["parallel"]["cycles_per_sec"].as_f64().expect("rate") > 0.0);
    assert!(
        v["handoff"]["dlock"]["acquisitions"]
            .as_u64()
            .expect("count")
            > 0
    );
    let names: Vec<&str> = v["scenarios"]
        .as_array()
        .expect("scenarios")
        .iter()
        .filter_map(|r| r["scenario"].as_str())
        .collect();
    assert_eq!(names, ["parallel-6-tasks-2-keys", "handoff-3-waiters"]);
    assert!(v["scaling"].is_null(), "run only when named: {v}");
}

/// `--scenario scaling`: both series at every level asked for, on SQLite (no server
/// count of requests) and Redis (its command count): the cycles timed at each level of
/// held names, memory per held lock from 1,000 on, grants and client CPU at each level
/// of waiters.
#[test]
fn bench_scaling_series() {
    let Some(redis) = dlock_testkit::RedisServer::start() else {
        return;
    };
    let env = Env::new();
    let dir = tempfile::tempdir().expect("temp dir");
    let sqlite = format!("sqlite://{}", dir.path().join("bench.db").display());
    for url in [sqlite, redis.url()] {
        let out = env.run(&[
            "bench",
            "--url",
            &url,
            "--scenario",
            "scaling",
            "--scale-held",
            "1000,1",
            "--scale-waiters",
            "1,5",
            "--cycles",
            "30",
            "--duration",
            "300ms",
            "--json",
        ]);
        assert_eq!(out.status.code(), Some(0), "{url}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let s = &v["scaling"];
        assert!(s["held_stopped"].is_null(), "{url}: {s}");
        assert!(s["waiters_stopped"].is_null(), "{url}: {s}");
        let held = s["held"].as_array().expect("held series");
        let levels: Vec<u64> = held.iter().filter_map(|l| l["held"].as_u64()).collect();
        assert_eq!(levels, [1, 1000], "{url}: levels in order");
        for l in held {
            assert_eq!(l["acquire"]["count"].as_u64(), Some(30), "{url}: {l}");
            assert_eq!(l["release"]["count"].as_u64(), Some(30), "{url}: {l}");
        }
        assert!(
            held[0]["rss_per_held_lock_bytes"].is_null(),
            "{url}: noise at 1"
        );
        assert!(
            held[1]["rss_per_held_lock_bytes"].as_f64().expect("memory") > 0.0,
            "{url}: {s}"
        );
        let waiters = s["waiters"].as_array().expect("waiters series");
        let counts: Vec<u64> = waiters
            .iter()
            .filter_map(|l| l["waiters"].as_u64())
            .collect();
        assert_eq!(counts, [1, 5], "{url}");
        for l in waiters {
            assert!(l["grants"].as_u64().expect("grants") > 0, "{url}: {l}");
            assert!(
                l["client_cpu_us_per_grant"].as_f64().expect("cpu") > 0.0,
                "{url}: {l}"
            );
        }
        if url.starts_with("redis") {
            assert!(s["requests_counted"].as_str().is_some(), "{s}");
            for l in waiters {
                assert!(
                    l["requests_per_grant"].as_f64().expect("requests") > 0.0,
                    "{l}"
                );
            }
        } else {
            assert!(s["requests_counted"].is_null(), "{s}");
            assert!(
                waiters.iter().all(|l| l["requests_per_grant"].is_null()),
                "{s}"
            );
        }
    }
}

/// `--fair` reaches the locks the bench takes (on SQLite the queue hands the lock to
/// the longest waiter, so the releaser does not take it straight back), and the
/// polling scenario reports the same figures as the hand-off run.
#[test]
fn bench_fair_hand_off_and_polling() {
    let env = Env::new();
    let out = env
        .cmd()
        .env_remove("DLOCK_URL")
        .args([
            "bench",
            "--fair",
            "--scenario",
            "handoff,polling",
            "--waiters",
            "4",
            "--duration",
            "1s",
            "--json",
        ])
        .output()
        .expect("bench");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let fair = &v["handoff"]["dlock"];
    assert!(fair["acquisitions"].as_u64().expect("count") > 4, "{v}");
    let took_back = fair["reacquired_pct"].as_f64().expect("share");
    assert!(
        took_back < 50.0,
        "fair mode, yet the releaser took it back {took_back}%: {v}"
    );
    assert!(
        v["polling"]["acquisitions"].as_u64().expect("count") > 0,
        "{v}"
    );
    assert!(v["polling"]["reacquired_pct"].is_f64(), "{v}");
    let names: Vec<&str> = v["scenarios"]
        .as_array()
        .expect("scenarios")
        .iter()
        .filter_map(|r| r["scenario"].as_str())
        .collect();
    assert_eq!(names, ["handoff-4-waiters", "polling-4-waiters"]);
}

#[test]
fn default_url_is_a_file_in_the_state_directory() {
    let env = Env::new();
    let home = env.path("home");
    std::fs::create_dir_all(&home).expect("home");
    let out = Command::new(DLOCK)
        .env_remove("DLOCK_URL")
        .env_remove("XDG_STATE_HOME")
        .env("HOME", &home)
        .args(["run", "default", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(home.join(".local/state/dlock/locks.db").is_file());
}

#[test]
fn redis_backend_runs_commands_the_demo_and_status() {
    let Some(redis) = dlock_testkit::RedisServer::start() else {
        return;
    };
    let env = Env::new();
    let url = redis.url();
    let out = env.run(&[
        "run",
        "--url",
        &url,
        "r:job",
        "--",
        "sh",
        "-c",
        "echo $DLOCK_FENCING_TOKEN",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).trim().parse::<u64>().expect("token") > 0);

    let mut holder = env.spawn(&["run", "--url", &url, "r:held", "--", "sleep", "30"]);
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let st = env.run(&["status", "--url", &url, "--json", "r:held"]);
        let v: serde_json::Value = serde_json::from_slice(&st.stdout).expect("JSON");
        if v[0]["held"] == true {
            break;
        }
        assert!(Instant::now() < end, "never held");
        std::thread::sleep(Duration::from_millis(20));
    }
    let busy = env.run(&["run", "--url", &url, "--no-wait", "r:held", "--", "true"]);
    assert_eq!(busy.status.code(), Some(75));
    kill_group(&holder, nix::sys::signal::Signal::SIGTERM);
    let _ = wait_timeout(&mut holder, Duration::from_secs(10));

    let demo = env
        .cmd()
        .args([
            "demo",
            "flash-sale",
            "--url",
            &url,
            "--buyers",
            "120",
            "--stock",
            "15",
            "--workers",
            "4",
        ])
        .output()
        .expect("demo");
    assert_eq!(
        demo.status.code(),
        Some(0),
        "{}{}",
        text(&demo.stdout),
        text(&demo.stderr)
    );
}

/// The bench's server-side counts: an uncontended cycle is exactly two client commands
/// on Redis (MONITOR, script calls left out) and two writes on etcd (store revisions);
/// hand-off rows carry p99.9; the hold run reports RSS at both ends.
#[test]
fn bench_counts_what_a_cycle_asks_of_the_server() {
    let (Some(redis), Some(etcd)) = (
        dlock_testkit::RedisServer::start(),
        dlock_testkit::EtcdServer::start(),
    ) else {
        return;
    };
    let env = Env::new();
    let bench = |url: &str, extra: &[&str]| {
        let mut args = vec!["bench", "--url", url, "--cycles", "60", "--json"];
        args.extend_from_slice(extra);
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("JSON")
    };
    let r = bench(
        &redis.url(),
        &[
            "--scenario",
            "uncontended,handoff,hold",
            "--waiters",
            "3",
            "--duration",
            "300ms",
            "--hold",
            "200",
            "--hold-for",
            "300ms",
        ],
    );
    assert_eq!(
        r["uncontended"]["requests_per_cycle"].as_f64(),
        Some(2.0),
        "{r}"
    );
    let handoff = r["scenarios"]
        .as_array()
        .expect("scenarios")
        .iter()
        .find(|s| s["scenario"] == "handoff-3-waiters")
        .expect("hand-off row");
    let (p99, p999) = (
        handoff["p99_us"].as_u64().expect("p99"),
        handoff["p999_us"].as_u64().expect("p99.9"),
    );
    assert!(p999 >= p99, "{handoff}");
    assert_eq!(r["hold"]["lost"].as_u64(), Some(0), "{r}");
    assert!(r["hold"]["rss_end_bytes"].as_u64().expect("rss") > 0, "{r}");

    let e = bench(&etcd.url(), &["--scenario", "uncontended"]);
    assert_eq!(
        e["uncontended"]["requests_per_cycle"].as_f64(),
        Some(2.0),
        "{e}"
    );
}

#[test]
fn many_processes_can_create_the_database_at_once() {
    for _ in 0..3 {
        let env = Env::new();
        let children: Vec<Child> = (0..8)
            .map(|i| {
                env.cmd()
                    .args(["run", &format!("first-{i}"), "--", "true"])
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn")
            })
            .collect();
        for mut c in children {
            let status = wait_timeout(&mut c, Duration::from_secs(30));
            assert!(status.success(), "{}", stderr_of(&mut c));
        }
    }
}

/// Wait until `dlock status --url URL NAME` reports the lock held.
fn wait_held_at(env: &Env, url: &str, name: &str) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let st = env.run(&["status", "--url", url, "--json", name]);
        let v: serde_json::Value = serde_json::from_slice(&st.stdout)
            .unwrap_or_else(|e| panic!("status JSON: {e}; stderr: {}", text(&st.stderr)));
        if v[0]["held"] == true {
            return;
        }
        assert!(Instant::now() < end, "{name} never became held");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A SIGKILLed holder's lock is free once the server ends its session; a holder
/// SIGSTOPped past the session's timeout loses the lock to the next one and, resumed,
/// stops its command and exits 76. Returns (killed → next, paused → next, resumed → exit).
fn session_recovery(url: &str, prefix: &str) -> (Duration, Duration, Duration) {
    let env = Env::new();
    let (crash, pause) = (format!("{prefix}:crash"), format!("{prefix}:pause"));

    let mut holder = env.spawn(&["run", "--url", url, &crash, "--", "sleep", "30"]);
    wait_held_at(&env, url, &crash);
    let killed_at = Instant::now();
    kill_group(&holder, nix::sys::signal::Signal::SIGKILL);
    let _ = wait_timeout(&mut holder, Duration::from_secs(5));
    let out = env.run(&["run", "--url", url, "--wait", "15s", &crash, "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let killed = killed_at.elapsed();

    let mut paused = env.spawn(&[
        "run", "--url", url, "--grace", "300ms", &pause, "--", "sleep", "30",
    ]);
    wait_held_at(&env, url, &pause);
    let pid = nix::unistd::Pid::from_raw(i32::try_from(paused.id()).expect("pid"));
    let paused_at = Instant::now();
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP);
    let out = env.run(&["run", "--url", url, "--wait", "15s", &pause, "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let taken_over = paused_at.elapsed();
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
    let resumed_at = Instant::now();
    let status = wait_timeout(&mut paused, Duration::from_secs(10));
    assert_eq!(status.code(), Some(76), "{}", stderr_of(&mut paused));
    let exited = resumed_at.elapsed();
    kill_group(&paused, nix::sys::signal::Signal::SIGKILL);
    (killed, taken_over, exited)
}

/// etcd: the session lease frees a dead or paused holder's lock (session_ttl 2 s).
#[test]
fn etcd_killed_or_paused_holder_frees_the_lock_after_the_session_ttl() {
    let Some(etcd) = dlock_testkit::EtcdServer::start() else {
        return;
    };
    let (killed, taken_over, exited) =
        session_recovery(&format!("{}?session_ttl=2s", etcd.url()), "e");
    eprintln!(
        "figure: etcd session_ttl 2 s: SIGKILLed holder -> next holder (incl. process start) after {killed:?}; \
         SIGSTOPped holder -> next holder after {taken_over:?}; resumed holder exited 76 after {exited:?}"
    );
    // Session TTL (2 s, etcd may round up by a second) plus start-up.
    assert!(killed < Duration::from_secs(5), "{killed:?}");
    assert!(taken_over < Duration::from_secs(5), "{taken_over:?}");
}

/// ZooKeeper: session expiry frees a dead or paused holder's lock (timeout 2 s).
#[test]
fn zookeeper_killed_or_paused_holder_frees_the_lock_after_the_session_timeout() {
    let Some(zk) = dlock_testkit::ZkServer::start() else {
        return;
    };
    let (killed, taken_over, exited) =
        session_recovery(&format!("{}/locks?session_timeout=2s", zk.url()), "z");
    eprintln!(
        "figure: ZooKeeper session_timeout 2 s: SIGKILLed holder -> next holder (incl. process start) after {killed:?}; \
         SIGSTOPped holder -> next holder after {taken_over:?}; resumed holder exited 76 after {exited:?}"
    );
    assert!(killed < Duration::from_secs(6), "{killed:?}");
    assert!(taken_over < Duration::from_secs(6), "{taken_over:?}");
}

/// A lock held outside dlock (a psql session's `pg_advisory_lock(7)`) shows as held,
/// with no fencing token ("none") and a lease that lasts as long as that session;
/// `status` exits 0 (held), and 1 once the session is gone.
#[test]
fn status_shows_a_foreign_session_holder() {
    let Some(pg) = dlock_testkit::PgServer::start() else {
        return;
    };
    let url = format!("{}?mode=advisory&advisory_key=number", pg.url());
    let env = Env::new();
    let mut psql = pg.psql_session("SELECT pg_advisory_lock(7); SELECT pg_sleep(60)");
    wait_held_at(&env, &url, "7");
    let out = env.run(&["status", "--url", &url, "7"]);
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", text(&out.stderr));
    assert!(said.contains("fencing token none"), "{said}");
    assert!(said.contains("for as long as its session lives"), "{said}");
    let out = env.run(&["status", "--url", &url, "--json", "7"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v[0]["fencing_token"], 0, "{v}");
    assert!(
        v[0]["waiters"].is_null(),
        "PostgreSQL cannot count waiters: {v}"
    );
    // (A killed psql leaves its server backend sleeping: end the session itself.)
    let ended = pg.psql(
        "SELECT pg_terminate_backend(pid) FROM pg_locks \
         WHERE locktype = 'advisory' AND objid = 7 AND granted",
    );
    assert_eq!(ended, "t", "the psql session was not found holding 7");
    let _ = psql.wait();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let out = env.run(&["status", "--url", &url, "7"]);
        if out.status.code() == Some(1) {
            assert!(
                text(&out.stdout).contains("7: free"),
                "{}",
                text(&out.stdout)
            );
            break;
        }
        assert!(Instant::now() < end, "the psql session's lock never ended");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The log is coloured only on a terminal, and never with `NO_COLOR` set.
#[test]
fn log_colour_only_on_a_terminal_and_never_with_no_color() {
    let env = Env::new();
    let args = ["--log", "debug", "status", "x"];
    // Into a pipe: no escape sequences.
    let out = env
        .cmd()
        .args(args)
        .env_remove("NO_COLOR")
        .output()
        .expect("dlock");
    let log = text(&out.stderr);
    assert!(log.contains("DEBUG"), "{log}");
    assert!(!log.contains('\u{1b}'), "colour in a pipe: {log:?}");
    // On a terminal (script(1) gives the command a pty): coloured, unless NO_COLOR.
    let Some(script) = dlock_testkit::find_binary("script") else {
        panic!("script(1) (util-linux) is needed for the terminal case");
    };
    let line = format!("{DLOCK} {}", args.join(" "));
    for (no_color, coloured) in [(None, true), (Some("1"), false)] {
        let mut cmd = Command::new(&script);
        cmd.args(["-qec", &line, "/dev/null"])
            .env("DLOCK_URL", env.url())
            .env_remove("DLOCK_LOG");
        match no_color {
            Some(v) => cmd.env("NO_COLOR", v),
            None => cmd.env_remove("NO_COLOR"),
        };
        let out = cmd.output().expect("script");
        let seen = text(&out.stdout);
        assert!(seen.contains("DEBUG"), "{seen}");
        assert_eq!(
            seen.contains('\u{1b}'),
            coloured,
            "NO_COLOR={no_color:?}: {seen:?}"
        );
    }
}

/// PostgreSQL and MariaDB session locks end with the holder's connection: the lock of a
/// SIGKILLed holder is free long before its lease (30 s) could end (measured from the
/// kill to the next holder's command running, process start included; the figure is
/// printed, the bound is generous: a debug build on a loaded CI machine took 514 ms).
#[test]
fn sql_session_locks_free_at_once_when_the_holder_is_killed() {
    let (Some(pg), Some(maria)) = (
        dlock_testkit::PgServer::start(),
        dlock_testkit::MariaDbServer::start(),
    ) else {
        return;
    };
    for (label, url) in [
        ("pg-advisory", format!("{}?mode=advisory", pg.url())),
        ("pg-row", format!("{}?mode=row", pg.url())),
        ("mariadb-named", format!("{}?mode=named", maria.url())),
        ("mariadb-row", format!("{}?mode=row", maria.url())),
    ] {
        let env = Env::new();
        let mut holder = env.spawn(&["run", "--url", &url, label, "--", "sleep", "30"]);
        wait_held_at(&env, &url, label);
        let killed_at = Instant::now();
        kill_group(&holder, nix::sys::signal::Signal::SIGKILL);
        let out = env.run(&["run", "--url", &url, "--wait", "15s", label, "--", "true"]);
        let took = killed_at.elapsed();
        let _ = wait_timeout(&mut holder, Duration::from_secs(5));
        assert_eq!(out.status.code(), Some(0), "{label}: {}", text(&out.stderr));
        eprintln!("figure: {label}: SIGKILLed holder -> next holder's command ran after {took:?}");
        assert!(took < Duration::from_secs(5), "{label}: {took:?}");
    }
}

/// `dlock demo flash-sale --url postgres://… / mariadb://…` keeps the stock in that
/// database and shows all four strategies; every protected one sells exactly the stock.
#[test]
fn flash_sale_demo_on_postgres_and_mariadb_shows_every_strategy() {
    let (Some(pg), Some(maria)) = (
        dlock_testkit::PgServer::start(),
        dlock_testkit::MariaDbServer::start(),
    ) else {
        return;
    };
    for url in [pg.url(), format!("{}?mode=advisory", pg.url()), maria.url()] {
        let env = Env::new();
        let out = env
            .cmd()
            .args([
                "demo",
                "flash-sale",
                "--url",
                &url,
                "--buyers",
                "120",
                "--stock",
                "15",
                "--workers",
                "4",
            ])
            .output()
            .expect("demo");
        let stdout = text(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{url}: {stdout}{}",
            text(&out.stderr)
        );
        for strategy in ["optimistic", "row-lock", "dlock"] {
            let row = stdout
                .lines()
                .find(|l| l.starts_with(&format!("{strategy} ")))
                .unwrap_or_else(|| panic!("{url}: no {strategy} row in {stdout}"));
            let cols: Vec<&str> = row.split_whitespace().collect();
            assert_eq!((cols[1], cols[2]), ("15", "0"), "{url}: {row}");
        }
        assert!(!stdout.contains(dlock_testkit::PG_PASSWORD), "{stdout}");
    }
}

/// `dlock backends --json` shows, for every scheme, what a locker of that scheme with
/// default options reports itself (`capabilities()`), on a real server of each kind —
/// no second, hand-kept copy. The only server-dependent fact (whether the token source
/// is durable) is matched to the server under test.
#[test]
fn backends_table_is_what_each_backend_reports() {
    use dlock_testkit::{Matrix, RedisCluster, RedisOptions, RedisSentinel, RedisServer};
    let Some(m) = Matrix::start() else {
        return;
    };
    let (Some(cluster), Some(sentinel), Some(tls)) = (
        RedisCluster::start(3),
        RedisSentinel::start(),
        RedisServer::start_with(RedisOptions {
            tls: true,
            ..RedisOptions::default()
        }),
    ) else {
        return;
    };
    let env = Env::new();
    let out = env.run(&["backends", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let url_of = |label: &str| {
        m.targets
            .iter()
            .find(|t| t.label == label)
            .map(|t| t.url.split('?').next().unwrap_or_default().to_owned())
            .unwrap_or_else(|| panic!("no {label} target"))
    };
    let (tls_port, certs) = tls.tls().expect("TLS port");
    let urls: Vec<(&str, String)> = vec![
        ("memory", "memory://".into()),
        ("sqlite", env.url()),
        ("redis", url_of("redis")),
        (
            "rediss",
            format!(
                "rediss://127.0.0.1:{tls_port}?ca_file={}",
                certs.ca.display()
            ),
        ),
        ("redis+cluster", cluster.url()),
        ("redis+sentinel", sentinel.url()),
        ("redlock", m.redlock_url.clone()),
        ("etcd", url_of("etcd")),
        ("etcds", String::new()),
        (
            "zk",
            format!("{}/locks", url_of("zookeeper").trim_end_matches("/locks")),
        ),
        ("postgres", url_of("postgres lease")),
        (
            "postgresql",
            url_of("postgres lease").replacen("postgres://", "postgresql://", 1),
        ),
        (
            "mysql",
            url_of("mariadb lease").replacen("mariadb://", "mysql://", 1),
        ),
        ("mariadb", url_of("mariadb lease")),
    ];
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let schemes = dlock::schemes();
    let mut compared = 0;
    for row in table.as_array().expect("array") {
        let scheme = row["scheme"].as_str().expect("scheme");
        let info = schemes
            .iter()
            .find(|s| s.scheme == scheme)
            .expect("the library knows every scheme the CLI lists");
        // The table shows the library's registry.
        assert_eq!(
            row["capabilities"],
            serde_json::to_value(info.capabilities).expect("JSON"),
            "{scheme}"
        );
        let url = urls
            .iter()
            .find(|(s, _)| *s == scheme)
            .unwrap_or_else(|| panic!("no server for {scheme}: add one to this test"))
            .1
            .clone();
        if url.is_empty() {
            // etcds: the same backend type as etcd (its own TLS test runs elsewhere).
            assert_eq!(
                info.capabilities_on(true),
                schemes
                    .iter()
                    .find(|s| s.scheme == "etcd")
                    .and_then(|s| s.capabilities_on(true))
            );
            continue;
        }
        let reported = rt.block_on(async {
            dlock::Locker::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("{scheme} ({url}): {e}"))
                .capabilities()
        });
        let durable = reported.fencing == dlock::Fencing::Durable;
        assert_eq!(
            info.capabilities_on(durable),
            Some(reported),
            "{scheme}: dlock backends disagrees with the backend"
        );
        compared += 1;
    }
    assert!(compared >= 12, "only {compared} schemes compared");
}

/// A closed stdout ends the program quietly (141), never a panic; a full disk is one
/// line and exit 74.
#[test]
fn output_errors_never_panic() {
    let env = Env::new();
    for args in [
        &["backends"][..],
        &["backends", "--json"][..],
        &["status", "a", "b"][..],
    ] {
        let mut child = env
            .cmd()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        // The reader goes away before reading anything.
        drop(child.stdout.take());
        let status = wait_timeout(&mut child, Duration::from_secs(10));
        let err = stderr_of(&mut child);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        // `status` of free locks exits 1 (scripts test it); 141 once output fails.
        assert!(
            matches!(status.code(), Some(0 | 1 | 141)),
            "{args:?}: {status:?} {err}"
        );
    }
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    let out = env
        .cmd()
        .args(["backends"])
        .stdout(full)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(74), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `status --json`: each lock's name once, `held`, and the holder's fields.
#[test]
fn status_json_names_each_lock_once() {
    let env = Env::new();
    let out = env.run(&["status", "--json", "free-one"]);
    let raw = text(&out.stdout);
    assert_eq!(raw.matches("\"name\"").count(), 1, "{raw}");
    let mut holder = env.spawn(&["run", "held-one", "--", "sleep", "30"]);
    env.wait_held("held-one");
    let raw = text(&env.run(&["status", "--json", "held-one"]).stdout);
    assert_eq!(raw.matches("\"name\"").count(), 1, "{raw}");
    kill_group(&holder, nix::sys::signal::Signal::SIGTERM);
    let _ = wait_timeout(&mut holder, Duration::from_secs(10));
}

/// Every exit status `dlock --help` lists (the one list, in `exit.rs`) is in the
/// CLI README's table, and the table lists no other.
#[test]
fn exit_statuses_are_documented_once() {
    let env = Env::new();
    let help = text(&env.run(&["--help"]).stdout);
    let mut listed: Vec<u32> = help
        .lines()
        .skip_while(|l| !l.starts_with("Exit status"))
        .skip(1)
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    listed.sort_unstable();
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let mut documented: Vec<u32> = readme
        .lines()
        .skip_while(|l| !l.starts_with("| exit status"))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| l.split('|').nth(1))
        .flat_map(|cell| {
            cell.split('/')
                .filter_map(|c| c.trim().parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .collect();
    documented.sort_unstable();
    assert!(listed.len() >= 10, "{help}");
    assert_eq!(
        listed, documented,
        "dlock --help and crates/dlock-cli/README.md disagree"
    );
}

/// Every flag a verb's `--help` lists is in the CLI's README (its synopsis or prose).
#[test]
fn every_flag_of_every_verb_is_documented() {
    let env = Env::new();
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let mut checked = 0;
    for verb in [
        &["run"][..],
        &["status"],
        &["list"],
        &["break"],
        &["backends"],
        &["completions"],
        &["manpage"],
        &["demo", "flash-sale"],
        &["bench"],
        &["check"],
    ] {
        let args: Vec<&str> = verb.iter().copied().chain(["--help"]).collect();
        let out = env.run(&args);
        assert_eq!(out.status.code(), Some(0), "{verb:?}");
        // Option lines start with the flag (after indentation): `-w, --wait <D>`.
        for line in text(&out.stdout).lines().map(str::trim_start) {
            if !line.starts_with('-') {
                continue;
            }
            let Some(flag) = line
                .split([' ', ',', '='])
                .find(|w| w.starts_with("--") && w.len() > 2)
            else {
                continue;
            };
            if flag == "--help" || flag == "--version" {
                continue;
            }
            checked += 1;
            assert!(
                readme.contains(flag),
                "dlock {} {flag} is not in crates/dlock-cli/README.md",
                verb.join(" ")
            );
        }
    }
    assert!(checked >= 50, "only {checked} flags found in --help");
}

/// Completion scripts and the manual page come from the parser's own definitions: they
/// know every verb and flag, and the bash script is valid bash.
#[test]
fn completions_and_manual_page() {
    let env = Env::new();
    for shell in ["bash", "zsh", "fish"] {
        let out = env.run(&["completions", shell]);
        assert_eq!(out.status.code(), Some(0), "{shell}: {}", text(&out.stderr));
        let script = text(&out.stdout);
        for word in ["run", "status", "also", "wait"] {
            assert!(script.contains(word), "{shell}: no {word}");
        }
        if shell == "bash" {
            let path = env.path("dlock.bash");
            std::fs::write(&path, &script).expect("write");
            let syntax = Command::new("bash")
                .arg("-n")
                .arg(&path)
                .output()
                .expect("bash");
            assert!(syntax.status.success(), "{}", text(&syntax.stderr));
        }
    }
    let out = env.run(&["manpage"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let page = text(&out.stdout);
    assert!(page.contains(".TH dlock 1"), "{page}");
    assert!(
        page.contains("completions") && page.contains("run"),
        "{page}"
    );
}

/// Fair mode: a waiter SIGKILLed while queued holds up the one behind it at most
/// `--queue-entry-ttl` (its entry must run out), on SQLite and on Redis.
#[test]
fn a_dead_fair_waiter_stalls_the_next_at_most_its_queue_entry_ttl() {
    let Some(redis) = dlock_testkit::RedisServer::start() else {
        return;
    };
    let env = Env::new();
    for url in [env.url(), redis.url()] {
        let waiting = |n: u64| {
            let end = Instant::now() + Duration::from_secs(10);
            while Instant::now() < end {
                let out = env.run(&["status", "--url", &url, "--json", "fairq"]);
                let v: serde_json::Value =
                    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
                if v[0]["waiters"].as_u64().unwrap_or(0) >= n {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            panic!("{url}: never {n} queued");
        };
        let fair = ["run", "--url", &url, "--fair", "--queue-entry-ttl", "1s"];
        let mut holder = env.spawn(&[&fair[..], &["fairq", "sleep", "30"]].concat());
        wait_held_at(&env, &url, "fairq");
        let mut dead = env.spawn(&[&fair[..], &["fairq", "true"]].concat());
        waiting(1);
        let mut next = env.spawn(&[&fair[..], &["-w", "20", "fairq", "true"]].concat());
        waiting(2);
        kill_group(&dead, nix::sys::signal::Signal::SIGKILL);
        let _ = wait_timeout(&mut dead, Duration::from_secs(5));
        let released = Instant::now();
        kill_group(&holder, nix::sys::signal::Signal::SIGTERM);
        let _ = wait_timeout(&mut holder, Duration::from_secs(10));
        let status = wait_timeout(&mut next, Duration::from_secs(20));
        let took = released.elapsed();
        assert!(status.success(), "{url}: {}", stderr_of(&mut next));
        eprintln!("figure: {url}: a dead fair waiter held up the next one for {took:?}");
        // The entry lives 1 s after its last refresh (every third of it); the default
        // 5 s entry would hold the next waiter up at least 3.3 s.
        assert!(took < Duration::from_millis(2500), "{url}: {took:?}");
    }
}

/// `dlock list [PREFIX]`: every held lock (under the prefix), as `status` shows them;
/// a backend that cannot enumerate says so (usage error, 2).
#[test]
fn list_shows_every_held_lock() {
    let Some(redis) = dlock_testkit::RedisServer::start() else {
        return;
    };
    let env = Env::new();
    let mut holders: Vec<Child> = ["q:1", "q:2", "r:1"]
        .iter()
        .map(|n| {
            let h = env.spawn(&["run", n, "sleep", "30"]);
            env.wait_held(n);
            h
        })
        .collect();
    let out = env.run(&["list", "q:"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    let names: Vec<&str> = said.lines().filter_map(|l| l.split(':').next()).collect();
    assert_eq!(said.lines().count(), 2, "{said}");
    assert!(
        said.starts_with("q:1: held by") && names.len() == 2,
        "{said}"
    );
    let out = env.run(&["list", "--json"]);
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(all.as_array().map(Vec::len), Some(3), "{all}");
    let out = env.run(&["list", "zzz", "--json"]);
    assert_eq!(text(&out.stdout).trim(), "[]");
    let out = env.run(&["list", "--url", &redis.url()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("not offered"),
        "{}",
        text(&out.stderr)
    );
    for h in &mut holders {
        kill_group(h, nix::sys::signal::Signal::SIGTERM);
        let _ = wait_timeout(h, Duration::from_secs(10));
    }
}

/// `dlock break NAME` on `url`: shows the holder, refuses off a terminal without
/// `--yes`, ends the hold (the holder's command is stopped at its next renewal: exit
/// 76) and the next holder gets a higher token; a free lock has nothing to break (1).
fn break_ends_a_stuck_hold_at(env: &Env, url: &str) {
    let mut holder = env.spawn(&["run", "--url", url, "--ttl", "2s", "stuck", "sleep", "30"]);
    wait_held_at(env, url, "stuck");
    let out = env.run(&["break", "--url", url, "stuck"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = env.run(&["break", "--url", url, "--yes", "stuck"]);
    assert_eq!(out.status.code(), Some(0), "{url}: {}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.contains("held by") && said.contains("broken"),
        "{said}"
    );
    let old: u64 = said
        .split("token ")
        .nth(1)
        .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|t| t.parse().ok())
        .expect("the old token");
    let status = wait_timeout(&mut holder, Duration::from_secs(10));
    assert_eq!(status.code(), Some(76), "{url}: {}", stderr_of(&mut holder));
    let out = env.run(&[
        "run",
        "--url",
        url,
        "--no-wait",
        "stuck",
        "sh",
        "-c",
        "echo $DLOCK_FENCING_TOKEN",
    ]);
    assert_eq!(out.status.code(), Some(0), "{url}: {}", text(&out.stderr));
    let new: u64 = text(&out.stdout).trim().parse().expect("token");
    assert!(new > old, "{url}: {new} after {old}");
    let out = env.run(&["break", "--url", url, "--yes", "stuck"]);
    assert_eq!(out.status.code(), Some(1), "{url}: {}", text(&out.stdout));
}

/// A command that ends after its lock was broken, before any renewal could notice,
/// does not exit with its own status: the release finds the hold gone and says the
/// lock was lost (76), since the command may not have run alone.
#[test]
fn a_command_that_ends_after_a_break_exits_lock_lost() {
    let env = Env::new();
    let go = env.path("go");
    let wait_for_go = format!("while [ ! -e '{}' ]; do sleep 0.02; done", go.display());
    let mut holder = env.spawn(&["run", "--ttl", "60s", "broken", "sh", "-c", &wait_for_go]);
    env.wait_held("broken");
    let out = env.run(&["break", "--yes", "broken"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    std::fs::write(&go, b"").expect("go");
    let status = wait_timeout(&mut holder, Duration::from_secs(10));
    let said = stderr_of(&mut holder);
    assert_eq!(status.code(), Some(76), "{said}");
    assert!(said.contains("lost"), "{said}");
}

#[test]
fn break_ends_a_stuck_hold() {
    let env = Env::new();
    break_ends_a_stuck_hold_at(&env, &env.url());
}

/// The same on the backends whose holders learn of a break only by looking at their
/// key or node (etcd, ZooKeeper) or at a majority of nodes (Redlock).
#[test]
fn break_ends_a_stuck_hold_on_etcd_zookeeper_and_redlock() {
    let (Some(etcd), Some(zk), Some(nodes)) = (
        dlock_testkit::EtcdServer::start(),
        dlock_testkit::ZkServer::start(),
        dlock_testkit::RedisNodes::start(3, &dlock_testkit::RedisOptions::default()),
    ) else {
        return;
    };
    let env = Env::new();
    for url in [etcd.url(), zk.url(), nodes.url()] {
        break_ends_a_stuck_hold_at(&env, &url);
    }
    // A holder that keeps no dlock record (here an election's candidate, whose key or
    // node holds its value alone, as etcdctl's and Curator's do) would never notice a
    // break: refused.
    for url in [etcd.url(), zk.url()] {
        let mut leader = env.spawn(&["elect", "--url", &url, "--value", "v", "e:x", "sleep", "30"]);
        wait_held_at(&env, &url, "e:x");
        let out = env.run(&["break", "--url", &url, "--yes", "e:x"]);
        assert_eq!(out.status.code(), Some(2), "{url}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("never notice"),
            "{}",
            text(&out.stderr)
        );
        kill_group(&leader, nix::sys::signal::Signal::SIGTERM);
        let _ = wait_timeout(&mut leader, Duration::from_secs(10));
    }
}
