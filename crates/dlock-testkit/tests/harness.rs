//! The testkit proves its own pattern: a real redis-server from PATH, reached directly
//! and through every fault of the proxy, paused, killed and restarted, and gone with
//! a starter killed by a signal when asked to be; its SQL servers small for tests and
//! at their own default sizes when asked to be.

use std::time::{Duration, Instant};

use dlock_testkit::{
    Fault, FaultProxy, MariaDbServer, PgServer, RedisOptions, RedisServer, redis_command,
    redis_ping, segments_created_by,
};

const T: Duration = Duration::from_secs(2);

fn ping(addr: std::net::SocketAddr) -> std::io::Result<()> {
    redis_ping(addr, T)
}

#[test]
fn redis_starts_answers_and_dies_on_drop() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let addr = redis.addr();
    assert!(addr.ip().is_loopback());
    ping(addr).expect("PING");
    drop(redis);
    assert!(ping(addr).is_err(), "server still answering after Drop");
}

/// A killed PostgreSQL keeps its segment; 4,096 of them and no PostgreSQL starts on the
/// machine. Killed, restarted, killed again and dropped, the server leaves none.
#[test]
fn a_killed_postgres_leaves_no_shared_memory() {
    let Some(mut pg) = PgServer::start() else {
        return;
    };
    let first = pg.process().pid();
    assert_eq!(
        segments_created_by(first).len(),
        1,
        "the postmaster's segment"
    );
    pg.restart();
    let second = pg.process().pid();
    assert!(
        segments_created_by(first).is_empty(),
        "left by the restarted server"
    );
    assert_eq!(
        segments_created_by(second).len(),
        1,
        "the new postmaster's segment"
    );
    pg.process().kill();
    drop(pg);
    // Marked for removal, a segment is listed until the killed server's last backend
    // has noticed and detached.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !segments_created_by(second).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        segments_created_by(second).is_empty(),
        "left by the dropped server"
    );
}

#[test]
fn sigstop_freezes_and_sigcont_resumes() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let addr = redis.addr();
    redis.process().pause();
    assert!(
        redis_ping(addr, Duration::from_millis(300)).is_err(),
        "paused server answered"
    );
    redis.process().resume();
    ping(addr).expect("PING after SIGCONT");
}

#[test]
fn restart_keeps_the_port_and_persisted_data() {
    let Some(mut redis) = RedisServer::start_with(RedisOptions {
        persistent: true,
        ..RedisOptions::default()
    }) else {
        return;
    };
    let addr = redis.addr();
    let ok = redis_command(addr, &["SET", "k", "kept"], T).expect("SET");
    assert_eq!(ok, b"+OK\r\n");
    redis.restart();
    ping(addr).expect("PING after restart");
    let got = redis_command(addr, &["GET", "k"], T).expect("GET");
    assert_eq!(
        got, b"$4\r\nkept\r\n",
        "appendfsync always lost an acknowledged write"
    );
}

#[tokio::test]
async fn proxy_faults() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let proxy = FaultProxy::start(redis.addr()).await.expect("proxy");
    let addr = proxy.addr();
    let run =
        move |timeout: Duration| tokio::task::spawn_blocking(move || redis_ping(addr, timeout));

    run(T).await.expect("join").expect("PING through the proxy");

    proxy.set(Fault::Delay(Duration::from_millis(150)));
    let start = Instant::now();
    run(T).await.expect("join").expect("delayed PING");
    assert!(
        start.elapsed() >= Duration::from_millis(300),
        "delay not applied both ways"
    );

    proxy.set(Fault::Blackhole);
    assert!(
        run(Duration::from_millis(300))
            .await
            .expect("join")
            .is_err(),
        "blackhole answered"
    );

    proxy.set(Fault::DropReplies);
    assert!(
        run(Duration::from_millis(300))
            .await
            .expect("join")
            .is_err(),
        "reply not dropped"
    );

    proxy.set(Fault::ResetAfter(3));
    assert!(run(T).await.expect("join").is_err(), "connection not reset");

    proxy.set(Fault::None);
    run(T)
        .await
        .expect("join")
        .expect("PING after faults cleared");
}

#[tokio::test]
async fn proxy_reset_all_cuts_open_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let proxy = FaultProxy::start(redis.addr()).await.expect("proxy");
    let mut conn = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    conn.write_all(b"PING\r\n").await.expect("write");
    let mut buf = [0u8; 16];
    let n = conn.read(&mut buf).await.expect("read");
    assert!(buf[..n].starts_with(b"+PONG"));
    proxy.reset_all();
    let r = tokio::time::timeout(T, conn.read(&mut buf))
        .await
        .expect("no reaction to reset");
    assert!(
        matches!(r, Ok(0) | Err(_)),
        "connection survived reset_all: {r:?}"
    );
}

#[test]
fn a_three_master_cluster_forms() {
    let Some(mut cluster) = dlock_testkit::RedisCluster::start(3) else {
        return;
    };
    assert!(cluster.url().starts_with("redis+cluster://127.0.0.1:"));
    for node in cluster.nodes() {
        let info = redis_command(node.addr(), &["CLUSTER", "INFO"], T).expect("CLUSTER INFO");
        let info = String::from_utf8_lossy(&info).into_owned();
        assert!(info.contains("cluster_known_nodes:3"), "{info}");
    }
}

#[test]
fn sentinels_watch_a_master_and_its_replica() {
    let Some(mut setup) = dlock_testkit::RedisSentinel::start() else {
        return;
    };
    let master = setup.servers()[0].addr();
    assert_eq!(setup.master_addr(), Some(master));
    assert!(setup.url().starts_with("redis+sentinel://127.0.0.1:"));
}

/// With `servers_die_with_this_thread`, a program killed by a signal (which runs no
/// Drop) leaves no server behind. The test runs itself again as that program: a child
/// process that starts a Redis server, prints its pid and waits; the child is
/// SIGKILLed, and the server must be gone (or a zombie nobody reaped) soon after.
#[test]
fn a_starter_killed_by_a_signal_leaves_no_server_when_asked() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};

    const CHILD: &str = "DLOCK_TESTKIT_STARTER_CHILD";
    const NAME: &str = "a_starter_killed_by_a_signal_leaves_no_server_when_asked";
    if std::env::var_os(CHILD).is_some() {
        dlock_testkit::servers_die_with_this_thread();
        let Some(mut redis) = RedisServer::start() else {
            return;
        };
        println!("server pid {}", redis.process().pid());
        let _ = std::io::stdout().flush();
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    if dlock_testkit::find_binary("redis-server").is_none() {
        assert!(
            !dlock_testkit::servers_required(),
            "DLOCK_REQUIRE_SERVERS=1 but redis-server not found on PATH"
        );
        return;
    }
    // The starter's server leaves its temp dir behind (no Drop runs): in one of ours.
    let tmp = tempfile::tempdir().expect("temp dir");
    let exe = std::env::current_exe().expect("this test binary");
    let child = Command::new(exe)
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("TMPDIR", tmp.path())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run the starter");
    // Killed however this test ends, so a failed assertion leaves no starter behind.
    struct Starter(std::process::Child);
    impl Drop for Starter {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Starter(child);
    let out = child.0.stdout.take().expect("stdout");
    let pid = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        // libtest's "test NAME ... " precedes it on the same line.
        .find_map(|l| l.split_once("server pid ")?.1.trim().parse::<i32>().ok())
        .expect("the starter printed its server's pid");
    assert!(alive(pid), "the server is not running before the kill");
    child.0.kill().expect("SIGKILL the starter");
    child.0.wait().expect("reap the starter");
    let end = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(
            Instant::now() < end,
            "the server {pid} outlived its killed starter by 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether process `pid` exists and is not a zombie.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// PostgreSQL's `shared_buffers` and InnoDB's buffer pool and redo log, in bytes, of
/// servers started now.
fn sql_sizes() -> Option<[u64; 3]> {
    let pg = PgServer::start()?;
    let maria = MariaDbServer::start()?;
    let shared = pg.psql("SELECT pg_size_bytes(current_setting('shared_buffers'))");
    let innodb = maria.sql("SELECT @@innodb_buffer_pool_size, @@innodb_log_file_size");
    let mut innodb = innodb.split_whitespace();
    let parse = |s: Option<&str>| -> u64 {
        s.and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("a size, not {s:?}"))
    };
    Some([
        parse(Some(&shared)),
        parse(innodb.next()),
        parse(innodb.next()),
    ])
}

/// Tests get the test kit's small SQL servers; after `sql_servers_at_default_sizes`, a
/// program (the test again, as a child process: the setting is process-wide) gets the
/// servers' own default sizes, and `sql_server_settings` says which.
#[test]
fn sql_servers_are_small_unless_asked_for_their_defaults() {
    use std::process::Command;

    const CHILD: &str = "DLOCK_TESTKIT_DEFAULT_SIZES_CHILD";
    const NAME: &str = "sql_servers_are_small_unless_asked_for_their_defaults";
    const MB: u64 = 1 << 20;
    if std::env::var_os(CHILD).is_some() {
        dlock_testkit::sql_servers_at_default_sizes();
        assert!(dlock_testkit::sql_server_settings().contains("default memory sizes"));
        if let Some(sizes) = sql_sizes() {
            println!("default sizes {sizes:?}");
        }
        return;
    }
    let settings = dlock_testkit::sql_server_settings();
    assert!(settings.contains("shared_buffers=32MB"), "{settings}");
    assert!(settings.contains("fsync=off"), "{settings}");
    let Some(small) = sql_sizes() else {
        return;
    };
    assert_eq!(small, [32 * MB, 32 * MB, 8 * MB], "the test kit's sizes");
    let exe = std::env::current_exe().expect("this test binary");
    let out = Command::new(exe)
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let defaults = stdout
        .split_once("default sizes [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(sizes, _)| {
            sizes
                .split(',')
                .map(|n| n.trim().parse::<u64>().expect("a size"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_else(|| panic!("the child printed no sizes: {stdout}"));
    // The servers' defaults (128 MB, 128 MB and 96 MB here), whatever their version
    // says, are larger than the test kit's.
    assert_eq!(defaults.len(), 3);
    for (default, small) in defaults.iter().zip(small) {
        assert!(*default > small, "{defaults:?} against {small}");
    }
}
