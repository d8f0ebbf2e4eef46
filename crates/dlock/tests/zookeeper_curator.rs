//! The real Curator recipes against dlock, in both directions: `InterProcessMutex`,
//! `InterProcessReadWriteLock` and `InterProcessSemaphoreV2` from Debian's
//! `libcurator-recipes-java` jars, driven by a small Java program
//! (`tests/curator/Peer.java`, compiled once per run with `javac`).
#![cfg(feature = "zookeeper")]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dlock::Locker;
use dlock_testkit::{ZkServer, find_binary, skip};

const T: Duration = Duration::from_secs(5);
const JARS: &str = "/usr/share/java";
/// What the peer needs from `JARS` (Curator 5 and its dependencies).
const CLASSPATH: [&str; 7] = [
    "curator-recipes.jar",
    "curator-framework.jar",
    "curator-client.jar",
    "zookeeper.jar",
    "zookeeper-jute.jar",
    "guava.jar",
    "slf4j-api.jar",
];

/// The compiled peer, or `None` (a failure with `DLOCK_REQUIRE_SERVERS=1`) without a
/// JDK or the jars.
struct Curator {
    _classes: tempfile::TempDir,
    classpath: String,
    java: PathBuf,
}

fn curator() -> Option<Curator> {
    let (Some(java), Some(javac)) = (find_binary("java"), find_binary("javac")) else {
        return skip("java/javac not found (apt-get install default-jdk-headless)");
    };
    if let Some(jar) = CLASSPATH
        .iter()
        .find(|j| !std::path::Path::new(JARS).join(j).is_file())
    {
        return skip(&format!(
            "{JARS}/{jar} not found (apt-get install libcurator-recipes-java)"
        ));
    }
    let classes = tempfile::tempdir().expect("tempdir");
    let jars: Vec<String> = CLASSPATH.iter().map(|j| format!("{JARS}/{j}")).collect();
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/curator/Peer.java");
    let built = Command::new(javac)
        .args(["-cp", &jars.join(":"), "-d"])
        .arg(classes.path())
        .arg(source)
        .status()
        .expect("javac");
    assert!(built.success(), "javac failed on {source}");
    let classpath = format!("{}:{}", classes.path().display(), jars.join(":"));
    Some(Curator {
        _classes: classes,
        classpath,
        java,
    })
}

/// One Curator client taking one lock, read, write or lease; killed on drop.
struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn start(
        c: &Curator,
        zk: &ZkServer,
        kind: &str,
        path: &str,
        permits: u32,
        hold: Duration,
    ) -> Peer {
        let mut child = Command::new(&c.java)
            .args([
                "-cp",
                &c.classpath,
                "Peer",
                &zk.addr().to_string(),
                kind,
                path,
            ])
            .arg(permits.to_string())
            .arg(hold.as_millis().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("java");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line.trim().to_owned()).is_err() {
                    break;
                }
            }
        });
        let peer = Peer { child, lines };
        peer.expect("ready", Duration::from_secs(20));
        peer
    }

    /// The next line, if one comes within `within`.
    fn next(&self, within: Duration) -> Option<String> {
        self.lines.recv_timeout(within).ok()
    }

    fn expect(&self, line: &str, within: Duration) {
        assert_eq!(
            self.next(within).as_deref(),
            Some(line),
            "the Curator peer did not say {line:?} within {within:?}"
        );
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Assert the peer says `held` only after `release` runs, and promptly after it.
async fn waits_until<F: std::future::Future<Output = ()>>(peer: &Peer, release: F) {
    assert_eq!(
        peer.next(Duration::from_millis(800)),
        None,
        "Curator got in beside dlock"
    );
    let released = Instant::now();
    release.await;
    peer.expect("held", Duration::from_secs(5));
    assert!(released.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn curator_mutex_and_dlock_exclude_each_other() {
    let (Some(c), Some(zk)) = (curator(), ZkServer::start()) else {
        return;
    };
    let locker = Locker::connect(&format!("{}/locks", zk.url()))
        .await
        .expect("connect");
    // Curator holds /locks/orders: dlock waits for it.
    let peer = Peer::start(
        &c,
        &zk,
        "mutex",
        "/locks/orders",
        1,
        Duration::from_millis(1500),
    );
    peer.expect("held", T);
    let held_at = Instant::now();
    assert!(locker.try_lock("orders").await.expect("try").is_none());
    // Curator would never notice a break: refused.
    let shown = locker
        .inspect("orders")
        .await
        .expect("inspect")
        .expect("held");
    assert!(
        matches!(
            locker.break_lock("orders", shown.fencing_token).await,
            Err(dlock::Error::Unsupported(_))
        ),
        "a break of Curator's hold was not refused"
    );
    let g = locker
        .lock_timeout("orders", T)
        .await
        .expect("after Curator");
    assert!(
        held_at.elapsed() > Duration::from_millis(1000),
        "granted while Curator held it ({:?})",
        held_at.elapsed()
    );
    peer.expect("released", T);
    // dlock holds: Curator waits for it.
    let waiting = Peer::start(&c, &zk, "mutex", "/locks/orders", 1, Duration::ZERO);
    waits_until(&waiting, async { g.release().await.expect("release") }).await;
}

#[tokio::test]
async fn curator_read_write_lock_and_dlock_share_reads_and_exclude_writes() {
    let (Some(c), Some(zk)) = (curator(), ZkServer::start()) else {
        return;
    };
    let locker = Locker::connect(&format!("{}/locks", zk.url()))
        .await
        .expect("connect");
    let rw = locker.rwlock("prices");
    let path = "/locks/%rwlock/prices";
    // A Curator writer keeps dlock's readers and writers out.
    let writer = Peer::start(&c, &zk, "write", path, 1, Duration::from_millis(1500));
    writer.expect("held", T);
    let held_at = Instant::now();
    assert!(rw.try_read().await.expect("try_read").is_none());
    assert!(rw.try_write().await.expect("try_write").is_none());
    let r = rw
        .read_timeout(T)
        .await
        .expect("read after Curator's write");
    assert!(
        held_at.elapsed() > Duration::from_millis(1000),
        "read while Curator wrote ({:?})",
        held_at.elapsed()
    );
    writer.expect("released", T);
    // dlock reads: a Curator reader shares it, a Curator writer waits for it.
    let reader = Peer::start(&c, &zk, "read", path, 1, Duration::from_millis(1500));
    reader.expect("held", T);
    let seen = rw.holders().await.expect("holders");
    assert_eq!(seen.len(), 2, "dlock's and Curator's reads: {seen:?}");
    let writer = Peer::start(&c, &zk, "write", path, 1, Duration::ZERO);
    // Curator's waiting writer keeps a new dlock reader out (writer first, both ways).
    // (once its node is there: the peer says "ready" before it asks)
    let give_up = Instant::now() + T;
    loop {
        match rw.try_read().await.expect("try_read") {
            None => break,
            Some(g) => g.release().await.expect("release"),
        }
        assert!(
            Instant::now() < give_up,
            "new readers pass Curator's waiting writer"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    reader.expect("released", T);
    waits_until(&writer, async { r.release().await.expect("release") }).await;
    writer.expect("released", T);
    // dlock writes: a Curator reader waits for it.
    let w = rw.write_timeout(T).await.expect("write");
    let reader = Peer::start(&c, &zk, "read", path, 1, Duration::ZERO);
    waits_until(&reader, async { w.release().await.expect("release") }).await;
}

#[tokio::test]
async fn curator_semaphore_and_dlock_share_its_permits() {
    let (Some(c), Some(zk)) = (curator(), ZkServer::start()) else {
        return;
    };
    let locker = Locker::connect(&format!("{}/locks", zk.url()))
        .await
        .expect("connect");
    let sem = locker.semaphore("api", 2);
    let path = "/locks/%semaphore/api";
    // Curator takes one lease of two, dlock the other; a third waits on both sides.
    let first = Peer::start(&c, &zk, "semaphore", path, 2, Duration::from_millis(2000));
    first.expect("held", T);
    let held_at = Instant::now();
    let p = sem.acquire_timeout(T).await.expect("the second permit");
    assert!(
        sem.try_acquire().await.expect("try").is_none(),
        "a third permit"
    );
    let seen = sem.holders().await.expect("holders");
    assert_eq!(
        seen.len(),
        2,
        "Curator's lease and dlock's permit: {seen:?}"
    );
    // dlock waits for Curator's lease (keeping the semaphore's mutex meanwhile).
    let third = sem.acquire_timeout(T).await.expect("after Curator's lease");
    assert!(
        held_at.elapsed() > Duration::from_millis(1500),
        "a third permit while Curator held one ({:?})",
        held_at.elapsed()
    );
    first.expect("released", T);
    // Both permits are dlock's: a Curator acquirer waits for one.
    let waiting = Peer::start(&c, &zk, "semaphore", path, 2, Duration::ZERO);
    waits_until(&waiting, async { p.release().await.expect("release") }).await;
    waiting.expect("released", T);
    third.release().await.expect("release");
}

#[tokio::test]
async fn curator_leader_latch_and_dlock_elect_one_leader_and_see_each_other() {
    let (Some(c), Some(zk)) = (curator(), ZkServer::start()) else {
        return;
    };
    let locker = Locker::connect(&format!("{}/locks", zk.url()))
        .await
        .expect("connect");
    let election = locker.election("cron");
    let path = "/locks/cron";
    // A Curator LeaderLatch leads: dlock sees its id and waits for it.
    let latch = Peer::start(&c, &zk, "latch", path, 1, Duration::from_millis(1500));
    latch.expect("held", T);
    let held_at = Instant::now();
    let seen = election.leader().await.expect("leader").expect("a leader");
    assert_eq!(seen.value, "curator-peer");
    let lead = tokio::time::timeout(T, election.campaign("dlock-leader"))
        .await
        .expect("led within 5 s")
        .expect("campaign");
    assert!(
        held_at.elapsed() > Duration::from_millis(1000),
        "led beside Curator's leader ({:?})",
        held_at.elapsed()
    );
    assert!(lead.term() > seen.term, "the term went down");
    latch.expect("released", T);
    // dlock leads: Curator sees its value, and a Curator latch waits for it.
    let observer = Peer::start(&c, &zk, "leader", path, 1, Duration::ZERO);
    observer.expect("leader dlock-leader", T);
    let waiting = Peer::start(&c, &zk, "latch", path, 1, Duration::ZERO);
    waits_until(&waiting, async { lead.resign().await.expect("resign") }).await;
}
