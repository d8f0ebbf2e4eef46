//! ZooKeeper beyond the conformance suite: the real kazoo `Lock` (the Python client,
//! which recognises Curator-style `-lock-` nodes) against dlock in both directions,
//! ACLs, hostile names, 1,000 queued waiters, and a session cut off through the proxy.
#![cfg(feature = "zookeeper")]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dlock::Locker;
use dlock::conformance::Crowd;
use dlock_testkit::{Fault, FaultProxy, ZkServer, find_binary, servers_required};

const T: Duration = Duration::from_secs(5);

/// The thousand-waiter test runs alone: it and its server's JVM need both cores of a
/// CI machine, and next to the other tests of this file (each with its own server) a
/// starved session went 5 s without an answer, so its client dropped the connection.
static ALONE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Run a kazoo script (`ZK` is the connection string), or `None` when kazoo is missing
/// (a failure with `DLOCK_REQUIRE_SERVERS=1`).
fn kazoo(zk: &ZkServer, script: &str) -> Option<Child> {
    let python = find_binary("python3")?;
    let has = Command::new(&python)
        .args(["-c", "import kazoo"])
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        assert!(
            !servers_required(),
            "kazoo not installed (pip install kazoo)"
        );
        eprintln!("skipped: kazoo not installed");
        return None;
    }
    let prelude = format!(
        "import sys, time\nfrom kazoo.client import KazooClient\nHOSTS = '{}'\nzk = KazooClient(hosts=HOSTS)\nzk.start()\n",
        zk.addr()
    );
    Some(
        Command::new(python)
            .args(["-u", "-c", &format!("{prelude}{script}")])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3"),
    )
}

fn first_line(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    line.trim().to_owned()
}

#[tokio::test]
async fn kazoo_lock_and_dlock_exclude_each_other() {
    let _alone = ALONE.read().await;
    let Some(zk) = ZkServer::start() else {
        return;
    };
    let locker = Locker::connect(&format!("{}/locks", zk.url()))
        .await
        .expect("connect");
    // kazoo holds /locks/orders: dlock waits.
    let Some(mut foreign) = kazoo(
        &zk,
        "lock = zk.Lock('/locks/orders', 'kazoo', extra_lock_patterns=['-lock-'])\n\
         lock.acquire()\nprint('held', flush=True)\ntime.sleep(2)\nlock.release()\nzk.stop()\n",
    ) else {
        return;
    };
    assert_eq!(first_line(&mut foreign), "held");
    let started = Instant::now();
    assert!(locker.try_lock("orders").await.expect("try").is_none());
    let g = locker.lock_timeout("orders", T).await.expect("after kazoo");
    assert!(
        started.elapsed() > Duration::from_millis(1200),
        "granted while kazoo held it ({:?})",
        started.elapsed()
    );
    let _ = foreign.wait();

    // dlock holds: kazoo waits, and sees dlock's node as a contender.
    let Some(mut waiting) = kazoo(
        &zk,
        "lock = zk.Lock('/locks/orders', 'kazoo', extra_lock_patterns=['-lock-'])\n\
         print('contenders', len(lock.contenders()), flush=True)\n\
         lock.acquire()\nprint('got it', flush=True)\nlock.release()\nzk.stop()\n",
    ) else {
        return;
    };
    assert_eq!(first_line(&mut waiting), "contenders 1");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        waiting.try_wait().expect("try_wait").is_none(),
        "kazoo got the lock while dlock held it"
    );
    let released_at = Instant::now();
    g.release().await.expect("release");
    let line = tokio::task::spawn_blocking(move || {
        let l = first_line(&mut waiting);
        let _ = waiting.wait();
        l
    })
    .await
    .expect("join");
    assert_eq!(line, "got it");
    assert!(released_at.elapsed() < Duration::from_secs(3));
}

/// Nodes made by an authenticated dlock carry the creator-only ACL: a client without
/// the credentials cannot delete them (or read them).
#[tokio::test]
async fn an_unauthenticated_client_cannot_delete_lock_nodes() {
    let _alone = ALONE.read().await;
    let Some(zk) = ZkServer::start() else {
        return;
    };
    let url = format!("zk://locker:s3cret@{}/secure", zk.addr());
    let locker = Locker::connect(&url).await.expect("connect");
    let g = locker.lock("vault").await.expect("lock");
    let Some(mut intruder) = kazoo(
        &zk,
        "from kazoo.exceptions import NoAuthError\n\
         owner = KazooClient(hosts=HOSTS, auth_data=[('digest', 'locker:s3cret')])\n\
         owner.start()\n\
         node = '/secure/vault/' + owner.get_children('/secure/vault')[0]\n\
         try:\n    zk.delete(node)\n    print('deleted', flush=True)\n\
         except NoAuthError:\n    print('refused', flush=True)\nzk.stop()\nowner.stop()\n",
    ) else {
        return;
    };
    assert_eq!(first_line(&mut intruder), "refused");
    let _ = intruder.wait();
    assert!(g.is_held());
    let other = Locker::connect(&url).await.expect("connect");
    assert!(other.try_lock("vault").await.expect("try").is_none());
    g.release().await.expect("release");
    let shown = format!("{locker:?}");
    assert!(!shown.contains("s3cret"), "{shown}");
}

/// Names with `/`, `..`, dots and unicode all become one child of the lock root.
#[tokio::test]
async fn hostile_names_stay_under_the_lock_root() {
    let _alone = ALONE.read().await;
    let Some(zk) = ZkServer::start() else {
        return;
    };
    let locker = Locker::connect(&format!("{}/locks", zk.url()))
        .await
        .expect("connect");
    let names = [
        "../../zookeeper",
        "a/b/../c",
        "..",
        ".",
        "/",
        "ünïcødé ✓",
        "zookeeper",
    ];
    let mut guards = Vec::new();
    for n in names {
        guards.push(locker.lock(n).await.expect(n));
    }
    assert!(locker.lock("nul\0byte").await.is_err(), "NUL accepted");
    let Some(mut lister) = kazoo(
        &zk,
        "print(sorted(zk.get_children('/')), len(zk.get_children('/locks')), flush=True)\nzk.stop()\n",
    ) else {
        return;
    };
    assert_eq!(
        first_line(&mut lister),
        format!("['locks', 'zookeeper'] {}", names.len())
    );
    let _ = lister.wait();
    for g in guards {
        g.release().await.expect("release");
    }
}

/// 1,000 waiters on one lock, each with its own session: each release wakes only the
/// next one, and afterwards the server is back to its baseline node count (ephemeral
/// nodes gone with their sessions, the lock node removed as an empty container).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_waiters_leave_the_server_as_they_found_it() {
    let _alone = ALONE.write().await;
    let Some(zk) = ZkServer::start() else {
        return;
    };
    // A session that goes unanswered for a while on two busy cores must not expire:
    // the test is about queue hygiene. (A waiter whose connection drops still fails
    // its lock() today instead of carrying on while its session lives.)
    let url = format!("{}/crowd?session_timeout=20s", zk.url());
    let mut baseline = 0;
    for _ in 0..50 {
        baseline = zk.znode_count();
        if baseline > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(baseline > 0, "mntr gave no znode count");
    let n = 1000;
    let crowd = Crowd::queue(&url, "crowd", n).await;
    let packets0 = zk.mntr("zk_packets_received");
    let took = crowd.release_all().await;
    let packets = zk.mntr("zk_packets_received") - packets0;
    eprintln!(
        "figure: ZooKeeper, {n} queued waiters granted in {took:?} ({:.0}/s); {packets} requests received meanwhile (incl. pings of {n} sessions)",
        n as f64 / took.as_secs_f64()
    );
    // One wake per grant: a few requests each (read children, watch, delete) plus
    // session pings and probes; a herd would be ~n²/2 = 500,000.
    assert!(packets < 25 * n as u64, "{packets} requests for {n} grants");
    let end = Instant::now() + Duration::from_secs(20);
    while zk.znode_count() > baseline {
        assert!(
            Instant::now() < end,
            "{} znodes left (baseline {baseline})",
            zk.znode_count()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A ZooKeeper server, a fault proxy in front of it, a `Locker` through the proxy
/// (with `session_timeout=session`) and one straight to the server; `None` without
/// ZooKeeper.
async fn cut_off_and_direct(session: &str) -> Option<(ZkServer, FaultProxy, Locker, Locker)> {
    let zk = ZkServer::start()?;
    let proxy = FaultProxy::start(zk.addr()).await.expect("proxy");
    let cut = Locker::connect(&format!(
        "zk://{}/locks?session_timeout={session}",
        proxy.addr()
    ))
    .await
    .expect("connect through proxy");
    let other = Locker::connect(&format!("{}/locks", zk.url()))
        .await
        .expect("connect");
    Some((zk, proxy, cut, other))
}

/// The client cut off from ZooKeeper (blackhole): its locks become suspect, then
/// `lost()` fires before the server can expire the session; another client gets the
/// lock once the session has expired.
#[tokio::test]
async fn a_cut_off_session_fires_lost_before_the_server_frees_the_lock() {
    let _alone = ALONE.read().await;
    let Some((_zk, proxy, cut, other)) = cut_off_and_direct("2s").await else {
        return;
    };
    let g = cut.lock("cutoff").await.expect("lock");
    assert!(!g.is_suspect());
    let cut_at = Instant::now();
    proxy.set(Fault::Blackhole);
    // The client notices the disconnection: the lock is suspect before it is lost.
    let end = Instant::now() + Duration::from_secs(3);
    while !g.is_suspect() && g.is_held() {
        assert!(Instant::now() < end, "never suspect");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let suspect_after = cut_at.elapsed();
    tokio::time::timeout(Duration::from_secs(6), g.lost())
        .await
        .expect("lost() never fired");
    let noticed = cut_at.elapsed();
    let freed = other
        .lock_timeout("cutoff", Duration::from_secs(15))
        .await
        .expect("session expiry must free the lock");
    let recovered = cut_at.elapsed();
    eprintln!(
        "figure: ZooKeeper session 2 s cut off: holder suspect after {suspect_after:?}, lost() after {noticed:?}, lock free for others after {recovered:?}"
    );
    assert!(noticed < recovered, "lost() fired after the lock was free");
    freed.release().await.expect("release");
}

/// A lock lost locally while the server may still keep its session (the orphan gap of
/// the ZooKeeper module docs): requests still reach the server, its replies do not, so
/// the client gives the session up while the server has no reason to. With
/// `replies_return`, the replies come back the moment `lost()` fires (the client may
/// reconnect to the session it gave up); without, they never do. Either way the node
/// must not outlive the loss by more than about one session timeout: another client
/// gets the lock within 6 s of `lost()` (the 2 s session timeout twice, and 2 s of
/// slack for a loaded machine), while the cut-off `Locker` stays alive.
async fn a_lock_lost_locally_is_freed_within_a_session_timeout(replies_return: bool) {
    let _alone = ALONE.read().await;
    let Some((_zk, proxy, cut, other)) = cut_off_and_direct("2s").await else {
        return;
    };
    let g = cut.lock("orphan").await.expect("lock");
    proxy.set(Fault::DropReplies);
    tokio::time::timeout(Duration::from_secs(10), g.lost())
        .await
        .expect("lost() never fired");
    let lost_at = Instant::now();
    if replies_return {
        proxy.set(Fault::None);
    }
    let freed = other
        .lock_timeout("orphan", Duration::from_secs(20))
        .await
        .expect("the node outlived the local loss by far more than a session timeout");
    let after = lost_at.elapsed();
    eprintln!(
        "figure: ZooKeeper session 2 s, replies dropped (return after the loss: {replies_return}): lock free for others {after:?} after lost()"
    );
    assert!(
        after < Duration::from_secs(6),
        "the node outlived the loss by {after:?}"
    );
    assert!(!g.is_held(), "the lost guard still says held");
    freed.release().await.expect("release");
    drop(g);
    drop(cut);
}

#[tokio::test]
async fn a_lock_lost_while_replies_vanish_is_freed_within_a_session_timeout() {
    a_lock_lost_locally_is_freed_within_a_session_timeout(false).await;
}

#[tokio::test]
async fn a_lock_lost_and_reconnected_is_freed_within_a_session_timeout() {
    a_lock_lost_locally_is_freed_within_a_session_timeout(true).await;
}

/// A waiter is cancelled while its connection is cut: its delete is swallowed, then
/// the connection resets (ConnectionLoss). The session outlives the outage, so the
/// node would queue every other contender until the process ends; it is deleted
/// once the server answers again.
#[tokio::test]
async fn a_waiter_leaving_during_an_outage_leaves_no_node_behind() {
    let _alone = ALONE.read().await;
    let Some((_zk, proxy, cut, other)) = cut_off_and_direct("25s").await else {
        return;
    };
    // Cancelled while nothing gets through: the delete is swallowed, then the reset.
    dlock::conformance::waiter_cancelled_in_an_outage(
        &cut,
        &other,
        "leaving",
        Duration::from_millis(500),
        || proxy.set(Fault::Blackhole),
        || {
            proxy.reset_all();
            proxy.set(Fault::None);
        },
    )
    .await;
    drop(cut);
}

/// A waiter queued right behind a node its own process holds the lock with is granted
/// on that node's deletion without listing the children again. Two lockers (two
/// sessions) with four tasks each cycle one lock, so queues mix local and foreign
/// predecessors, and impatient tasks join the queue and give up mid-queue (a deleted
/// predecessor that never held the lock): no two critical sections may overlap, and
/// every task finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_hand_offs_keep_exclusion_across_sessions() {
    let _alone = ALONE.read().await;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    let Some(zk) = ZkServer::start() else {
        return;
    };
    let url = format!("{}/handoff", zk.url());
    let inside = Arc::new(AtomicBool::new(false));
    let overlaps = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    let mut impatient = Vec::new();
    let mut last_token = 0;
    for _ in 0..2 {
        let locker = Arc::new(Locker::connect(&url).await.expect("connect"));
        for _ in 0..4 {
            let (locker, inside, overlaps) = (
                Arc::clone(&locker),
                Arc::clone(&inside),
                Arc::clone(&overlaps),
            );
            let (l, inside2, overlaps2) = (
                Arc::clone(&locker),
                Arc::clone(&inside),
                Arc::clone(&overlaps),
            );
            impatient.push(tokio::spawn(async move {
                for i in 0..40u64 {
                    let wait = Duration::from_millis(1 + (i * 7) % 20);
                    if let Ok(g) = l.lock_timeout("shared", wait).await {
                        if inside2.swap(true, Ordering::SeqCst) {
                            overlaps2.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::task::yield_now().await;
                        inside2.store(false, Ordering::SeqCst);
                        g.release().await.expect("release");
                    }
                }
            }));
            tasks.push(tokio::spawn(async move {
                let mut tokens = Vec::new();
                for _ in 0..25 {
                    let g = locker
                        .lock_timeout("shared", Duration::from_secs(30))
                        .await
                        .expect("lock");
                    if inside.swap(true, Ordering::SeqCst) {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    tokens.push(g.fencing_token());
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    g.release().await.expect("release");
                }
                tokens
            }));
        }
    }
    let mut all = Vec::new();
    for t in tasks {
        let tokens = tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("a task did not finish")
            .expect("task");
        all.extend(tokens);
    }
    for t in impatient {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("an impatient task did not finish")
            .expect("task");
    }
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "critical sections overlapped"
    );
    assert_eq!(all.len(), 200);
    all.sort_unstable();
    for t in all {
        assert!(t > last_token, "token {t} repeated");
        last_token = t;
    }
}

/// Any client may create children under a lock's node: a name that is not a contender
/// (here `€€€€`, whose last ten bytes split a character) is ignored, never a panic.
#[tokio::test]
async fn a_foreign_child_of_any_name_is_ignored() {
    let _alone = ALONE.read().await;
    let Some(zk) = ZkServer::start() else {
        return;
    };
    let locker = Locker::connect(&format!("{}/locks", zk.url()))
        .await
        .expect("connect");
    let Some(mut creator) = kazoo(
        &zk,
        "zk.ensure_path('/locks/foreign')\nzk.create('/locks/foreign/\u{20ac}\u{20ac}\u{20ac}\u{20ac}')\nzk.create('/locks/foreign/x' + '\u{20ac}' * 10)\nprint('made', flush=True)\nzk.stop()\n",
    ) else {
        return;
    };
    assert_eq!(first_line(&mut creator), "made");
    let _ = creator.wait();
    let guard = locker.lock_timeout("foreign", T).await.expect("lock");
    let info = locker
        .inspect("foreign")
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.owner, guard.owner().as_str());
    assert!(locker.try_lock("foreign").await.expect("try").is_none());
    guard.release().await.expect("release");
    assert!(locker.try_lock("foreign").await.expect("try").is_some());
}

/// A release after the lock's node is gone (its session expired, unseen by this
/// process yet — here: deleted by another client) reports the loss instead of
/// succeeding.
#[tokio::test]
async fn a_release_after_the_node_is_gone_reports_the_loss() {
    let _alone = ALONE.read().await;
    let Some(zk) = ZkServer::start() else {
        return;
    };
    let locker = Locker::connect(&format!("{}/locks", zk.url()))
        .await
        .expect("connect");
    let guard = locker.lock("vanish").await.expect("lock");
    // A permit tells it too (`Capabilities::release_reports_loss`): its lease node.
    let permit = locker
        .semaphore("vanish", 2)
        .acquire()
        .await
        .expect("permit");
    let Some(mut deleter) = kazoo(
        &zk,
        "for d in ('/locks/vanish', '/locks/%semaphore/vanish/leases'):\n    for c in zk.get_children(d):\n        zk.delete(d + '/' + c)\nprint('deleted', flush=True)\nzk.stop()\n",
    ) else {
        return;
    };
    assert_eq!(first_line(&mut deleter), "deleted");
    let _ = deleter.wait();
    let released = guard.release().await;
    assert!(
        matches!(released, Err(dlock::Error::LockLost { .. })),
        "a release of a node that was gone: {released:?}"
    );
    let released = permit.release().await;
    assert!(
        matches!(released, Err(dlock::Error::LockLost { .. })),
        "a permit's release after its lease node was gone: {released:?}"
    );
}

/// A holder whose runtime stalled past its session's timeout (2 s) counts as lost at
/// once, before any probe or renewal runs again (see the conformance helper).
#[test]
fn a_holder_stalled_past_its_session_counts_as_lost_at_once() {
    let Some(zk) = ZkServer::start() else {
        return;
    };
    dlock::conformance::a_stalled_holder_counts_as_lost(
        &[format!("{}/stalled?session_timeout=2s", zk.url())],
        Duration::from_millis(2600),
    );
}

/// Protected creation on a server that may lag (a follower): a create whose reply was
/// lost, looked for by its uuid and sent again on an empty answer, leaves two nodes
/// with the uuid (a twin) when the first send did land. The twin, in the session
/// dlock keeps, would queue every other contender until the process ends. A single
/// server never lags, so the twin is made by hand: while the reply of the attempt's
/// create is held back, a second client adds a node with the same uuid; then the
/// connection resets (the create's outcome unknown). The attempt finds its node by the
/// uuid, and the twin must be gone within seconds — and, after the release, another
/// client gets the lock at once.
#[tokio::test]
async fn a_twin_of_a_protected_create_is_deleted() {
    use zookeeper_client as zk;
    let _alone = ALONE.read().await;
    let Some((zk_server, proxy, cut, other)) = cut_off_and_direct("25s").await else {
        return;
    };
    let raw = zk::Client::connect(&zk_server.addr().to_string())
        .await
        .expect("raw client");
    let dir = "/locks/twin";
    // The session is up before the fault (its handshake must get through).
    cut.lock("twin")
        .await
        .expect("lock")
        .release()
        .await
        .expect("release");
    // A child that is no contender keeps the (container) lock node from being deleted
    // before dlock's create reaches it (the server sweeps empty containers).
    let pin = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
    raw.create(&format!("{dir}/pin"), b"", &pin)
        .await
        .expect("pin");
    // The create reaches the server, its reply does not reach dlock.
    proxy.set(Fault::DropReplies);
    let taking = tokio::spawn(async move {
        let g = cut.lock_timeout("twin", Duration::from_secs(20)).await;
        (cut, g)
    });
    let end = Instant::now() + Duration::from_secs(10);
    let created = loop {
        let children = raw.list_children(dir).await.unwrap_or_default();
        if let Some(c) = children.into_iter().find(|c| c.starts_with("_c_")) {
            break c;
        }
        assert!(
            Instant::now() < end,
            "dlock's create never reached the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let stem = &created[..created.len() - 10];
    let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let (_, twin_seq) = raw
        .create(&format!("{dir}/{stem}"), b"", &options)
        .await
        .expect("twin");
    let twin = format!("{stem}{twin_seq}");
    // The create's outcome is now unknown to dlock: it looks for its uuid.
    proxy.set(Fault::None);
    proxy.reset_all();
    let (cut, g) = tokio::time::timeout(Duration::from_secs(25), taking)
        .await
        .expect("the attempt never finished")
        .expect("task");
    let g = g.expect("lock after the reset");
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let children = raw.list_children(dir).await.expect("list");
        if !children.contains(&twin) {
            assert!(
                children.contains(&created),
                "the node dlock holds the lock with was deleted: {children:?}"
            );
            break;
        }
        assert!(
            Instant::now() < end,
            "the twin {twin} is still there: {children:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    g.release().await.expect("release");
    let freed = other
        .lock_timeout("twin", T)
        .await
        .expect("free once the holder released");
    freed.release().await.expect("release");
    drop(cut);
}
