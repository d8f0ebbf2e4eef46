//! `dlock run --permits N`, `--read` and `--write`: many `dlock` processes at once,
//! judged by what their commands saw of each other (a directory each command marks
//! itself in while it runs), never by asking the lock service.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

/// What a command does under the primitive: mark itself in `dir` (as `KIND.PID`), say
/// what else is marked there and its token, stay a moment, unmark itself.
const SECTION: &str = r#"d="$1"; me="$d/$2.$$"; : > "$me"; echo "$2 $DLOCK_FENCING_TOKEN $(ls "$d" | tr '\n' ' ')" >> "$d.log"; sleep 0.3; rm "$me""#;

/// `workers` threads, each running `dlock run ARGS… -- sh -c SECTION` `rounds` times
/// (a thread's `kind` says what it marks itself as); every run must exit 0.
fn crowd(url: &str, dir: &Path, workers: &[(&str, Vec<&str>)], rounds: usize) -> Vec<String> {
    std::fs::create_dir_all(dir).expect("mark dir");
    let started = Instant::now();
    std::thread::scope(|s| {
        for (kind, args) in workers {
            s.spawn(move || {
                for _ in 0..rounds {
                    let out = Command::new(DLOCK)
                        .env_remove("DLOCK_LOG")
                        .arg("run")
                        .args(["--url", url, "--wait", "60s"])
                        .args(args)
                        .args(["--", "sh", "-c", SECTION, "section"])
                        .arg(dir)
                        .arg(kind)
                        .output()
                        .expect("run dlock");
                    assert_eq!(
                        out.status.code(),
                        Some(0),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            });
        }
    });
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "the crowd took {:?}",
        started.elapsed()
    );
    let log = std::fs::read_to_string(dir.with_extension("log")).expect("log");
    log.lines().map(str::to_owned).collect()
}

/// One line of the log: (kind, token, the kinds marked at the time).
fn parse(line: &str) -> (String, u64, Vec<String>) {
    let mut words = line.split_whitespace();
    let kind = words.next().expect("kind").to_owned();
    let token = words.next().expect("token").parse().expect("a number");
    let seen = words
        .map(|w| w.split('.').next().unwrap_or("").to_owned())
        .collect();
    (kind, token, seen)
}

/// Eight processes loop on `dlock run --permits 3`: never more than 3 commands at
/// once, 3 at once at some point, every permit with a token of its own.
fn permits_bound_the_commands(url: &str) {
    let tmp = tempfile::tempdir().expect("temp dir");
    let workers: Vec<(&str, Vec<&str>)> = (0..8)
        .map(|_| ("p", vec!["--permits", "3", "sem:jobs"]))
        .collect();
    let lines = crowd(url, &tmp.path().join("marks"), &workers, 3);
    assert_eq!(lines.len(), 24, "every run ran its command once");
    let mut most = 0;
    let mut tokens = Vec::new();
    for line in &lines {
        let (_, token, seen) = parse(line);
        assert!(seen.len() <= 3, "{} commands at once: {line}", seen.len());
        most = most.max(seen.len());
        tokens.push(token);
    }
    assert_eq!(most, 3, "never 3 commands at once:\n{}", lines.join("\n"));
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 24, "a permit token given twice");
    assert!(tokens[0] > 0, "a permit without a token");
}

/// Five readers and two writers: readers run together, a writer runs alone, and every
/// grant has a token of its own.
fn readers_together_writers_alone(url: &str) {
    let tmp = tempfile::tempdir().expect("temp dir");
    let mut workers: Vec<(&str, Vec<&str>)> =
        (0..5).map(|_| ("r", vec!["--read", "rw:table"])).collect();
    workers.extend((0..2).map(|_| ("w", vec!["--write", "rw:table"])));
    let lines = crowd(url, &tmp.path().join("marks"), &workers, 3);
    assert_eq!(lines.len(), 21);
    let mut readers_together = false;
    let mut tokens = Vec::new();
    for line in &lines {
        let (kind, token, seen) = parse(line);
        tokens.push(token);
        if kind == "w" {
            assert_eq!(seen.len(), 1, "a writer ran beside others: {line}");
        } else {
            assert!(
                seen.iter().all(|k| k == "r"),
                "a reader ran beside a writer: {line}"
            );
            readers_together |= seen.len() > 1;
        }
    }
    assert!(readers_together, "readers never ran together");
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 21, "a token given twice");
}

#[test]
fn permits_bound_the_commands_on_sqlite() {
    let tmp = tempfile::tempdir().expect("temp dir");
    permits_bound_the_commands(&format!("sqlite://{}/locks.db", tmp.path().display()));
}

#[test]
fn readers_together_writers_alone_on_sqlite() {
    let tmp = tempfile::tempdir().expect("temp dir");
    readers_together_writers_alone(&format!("sqlite://{}/locks.db", tmp.path().display()));
}

#[test]
fn permits_and_read_write_on_redis() {
    let Some(redis) = dlock_testkit::RedisServer::start() else {
        return;
    };
    permits_bound_the_commands(&redis.url());
    readers_together_writers_alone(&redis.url());
}

#[test]
fn permits_and_read_write_on_zookeeper_and_etcd() {
    let (Some(zk), Some(etcd)) = (
        dlock_testkit::ZkServer::start(),
        dlock_testkit::EtcdServer::start(),
    ) else {
        return;
    };
    for url in [zk.url(), etcd.url()] {
        permits_bound_the_commands(&url);
        readers_together_writers_alone(&url);
    }
}

/// A backend without the primitive refuses it as a usage error (2), before running
/// anything; `--permits 0` and `--read` with `--also` are usage errors too.
#[test]
fn primitives_a_backend_lacks_are_usage_errors() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", tmp.path().display());
    for args in [
        vec!["--permits", "0", "x"],
        vec!["--read", "--also", "y", "x"],
        vec!["--read", "--write", "x"],
        vec!["--permits", "2", "--fair", "x"],
    ] {
        let out = Command::new(DLOCK)
            .arg("run")
            .args(["--url", &url])
            .args(&args)
            .args(["--", "echo", "RAN"])
            .output()
            .expect("run dlock");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("RAN"));
    }
    // Redlock offers no semaphore.
    let Some(nodes) = dlock_testkit::RedisNodes::start(3, &dlock_testkit::RedisOptions::default())
    else {
        return;
    };
    let out = Command::new(DLOCK)
        .arg("run")
        .args([
            "--url",
            &nodes.url(),
            "--permits",
            "2",
            "x",
            "--",
            "echo",
            "RAN",
        ])
        .output()
        .expect("run dlock");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("semaphore"));
}

/// `dlock elect` on `url` (a dead leader is let go within `bound`): A leads, `dlock
/// leader` shows its value and term, B waits; A's `dlock` is SIGKILLed and B leads
/// within `bound` + 0.5 s (its command has written its term by then), with a higher term; a
/// `dlock leader --watch --json` saw A, then B.
fn elect_hands_over_after_a_kill(url: &str, bound: Duration) {
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path();
    let candidate = |who: &str| {
        Command::new(DLOCK)
            .env_remove("DLOCK_LOG")
            .args([
                "elect", "--url", url, "--ttl", "1s", "--value", who, "e:sched", "--",
            ])
            .args([
                "sh",
                "-c",
                r#"echo "$DLOCK_FENCING_TOKEN" > "$0.term"; exec sleep 60"#,
            ])
            .arg(dir.join(who))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("spawn dlock elect")
    };
    let wait_file = |who: &str, within: Duration| -> Option<u64> {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if let Ok(t) = std::fs::read_to_string(dir.join(format!("{who}.term")))
                && let Ok(t) = t.trim().parse()
            {
                return Some(t);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    };
    let watcher = Command::new(DLOCK)
        .args(["leader", "--url", url, "--watch", "--json", "e:sched"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn dlock leader --watch");
    let mut a = candidate("A");
    let a_term = wait_file("A", Duration::from_secs(20)).expect("A never led");
    let out = Command::new(DLOCK)
        .args(["leader", "--url", url, "--json", "e:sched"])
        .output()
        .expect("dlock leader");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(shown["leader"]["value"], "A", "{shown}");
    assert_eq!(shown["leader"]["term"], a_term);
    let mut b = candidate("B");
    assert!(
        wait_file("B", Duration::from_millis(500)).is_none(),
        "B led beside A"
    );
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(a.id()).expect("pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill A");
    let _ = a.wait();
    let b_term = wait_file("B", bound + Duration::from_secs(5)).expect("B never led");
    let took = killed.elapsed();
    eprintln!("{url}: B led {took:?} after A was killed (bound {bound:?})");
    assert!(
        took < bound + Duration::from_millis(500),
        "B led {took:?} after A was killed (bound {bound:?} + 0.5 s)"
    );
    assert!(b_term > a_term, "term {b_term} after {a_term}");
    // Long enough for the watch (it looks every 100 ms) to see B.
    std::thread::sleep(Duration::from_millis(400));
    // A's command went with it (PR_SET_PDEATHSIG): ending B ends everything.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(i32::try_from(b.id()).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = b.wait();
    let gone = Instant::now() + Duration::from_secs(5);
    let mut watcher = watcher;
    while Instant::now() < gone {
        let out = Command::new(DLOCK)
            .args(["leader", "--url", url, "e:sched"])
            .output()
            .expect("dlock leader");
        if out.status.code() == Some(1) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let _ = watcher.kill();
    let seen = watcher.wait_with_output().expect("watcher output");
    let values: Vec<String> = String::from_utf8_lossy(&seen.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["leader"]["value"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(values, ["A", "B"], "the watch saw {values:?}");
}

#[test]
fn elect_hands_over_on_sqlite() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", tmp.path().display());
    elect_hands_over_after_a_kill(&url, Duration::from_secs(1));
}

#[test]
fn elect_hands_over_on_redis_etcd_and_zookeeper() {
    let (Some(redis), Some(etcd), Some(zk)) = (
        dlock_testkit::RedisServer::start(),
        dlock_testkit::EtcdServer::start(),
        dlock_testkit::ZkServer::start(),
    ) else {
        return;
    };
    elect_hands_over_after_a_kill(&redis.url(), Duration::from_secs(1));
    let etcd_url = format!("{}?session_ttl=2s&raw_names=true", etcd.url());
    elect_hands_over_after_a_kill(&etcd_url, Duration::from_secs(2));
    // etcd's own client sees dlock elect's leader and value (concurrency.Election).
    let mut leader = Command::new(DLOCK)
        .args([
            "elect",
            "--url",
            &etcd_url,
            "--value",
            "seen-by-etcdctl",
            "e:seen",
        ])
        .args(["--", "sleep", "30"])
        .spawn()
        .expect("dlock elect");
    let mut observer = etcd
        .etcdctl()
        .args(["elect", "-l", "e:seen"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("etcdctl elect -l");
    let out = observer.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(out)).map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let end = Instant::now() + Duration::from_secs(10);
    let mut seen = false;
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) if line.trim() == "seen-by-etcdctl" => {
                seen = true;
                break;
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let _ = observer.kill();
    let _ = observer.wait();
    let _ = leader.kill();
    let _ = leader.wait();
    assert!(seen, "etcdctl elect -l never showed dlock elect's value");
    elect_hands_over_after_a_kill(
        &format!("{}?session_timeout=2s", zk.url()),
        Duration::from_secs(2),
    );
}

#[test]
fn permits_and_read_write_on_postgres_and_mariadb() {
    let (Some(pg), Some(maria)) = (
        dlock_testkit::PgServer::start(),
        dlock_testkit::MariaDbServer::start(),
    ) else {
        return;
    };
    for url in [pg.url(), maria.url()] {
        permits_bound_the_commands(&url);
        readers_together_writers_alone(&url);
    }
}

/// `dlock status --semaphore` lists every permit holder with its token and note;
/// `--rwlock` the readers; exit 0 when each named one is held, 1 when one is free.
#[test]
fn status_shows_permit_holders_and_readers() {
    use std::process::Stdio;
    let tmp = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", tmp.path().display());
    let hold = |args: &[&str], note: &str| {
        Command::new(DLOCK)
            .args(["run", "--url", &url, "--note", note])
            .args(args)
            .args(["--", "sh", "-c", "echo in; exec sleep 30"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn dlock run")
    };
    let mut holders = vec![
        hold(&["--permits", "3", "sem"], "first"),
        hold(&["--permits", "3", "sem"], "second"),
        hold(&["--read", "rw"], "reader"),
    ];
    for h in &mut holders {
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(h.stdout.as_mut().expect("stdout")),
            &mut line,
        )
        .expect("read");
        assert_eq!(line.trim(), "in");
    }
    let status = |args: &[&str]| {
        Command::new(DLOCK)
            .args(["status", "--url", &url, "--json"])
            .args(args)
            .output()
            .expect("dlock status")
    };
    let out = status(&["--semaphore", "sem"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let notes: Vec<&str> = v[0]["holders"]
        .as_array()
        .expect("holders")
        .iter()
        .map(|h| {
            assert_eq!(h["hold"], "permit");
            assert!(h["fencing_token"].as_u64().unwrap_or(0) > 0);
            h["metadata"]["note"].as_str().unwrap_or("")
        })
        .collect();
    assert_eq!(notes.len(), 2, "{v}");
    assert!(
        notes.contains(&"first") && notes.contains(&"second"),
        "{notes:?}"
    );
    let out = status(&["--rwlock", "rw"]);
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v[0]["holders"][0]["hold"], "read", "{v}");
    let out = status(&["--rwlock", "rw", "free-one"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a free read-write lock is not held"
    );
    for mut h in holders {
        let _ = h.kill();
        let _ = h.wait();
    }
}
