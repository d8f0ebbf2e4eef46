//! etcd beyond the conformance suite: the real `etcdctl lock` against dlock in both
//! directions, 1,000 queued waiters woken one at a time, session loss (keep-alives cut
//! off through the fault proxy), and a user whose role is limited to the lock prefix.
#![cfg(feature = "etcd")]

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use dlock::conformance::Crowd;
use dlock::{Error, LockOptions, Locker};
use dlock_testkit::{EtcdServer, Fault, FaultProxy};

const T: Duration = Duration::from_secs(5);

/// A locker reaching etcd through `proxy`, with requests timing out after 1 s.
async fn through(proxy: &FaultProxy, session_ttl: &str) -> Locker {
    Locker::connect(&format!(
        "etcd://{}?session_ttl={session_ttl}&timeout=1s",
        proxy.addr()
    ))
    .await
    .expect("connect through proxy")
}

/// `etcdctl lock NAME sh -c 'echo held; sleep S'`, returned once it holds the lock.
fn etcdctl_holding(etcd: &EtcdServer, name: &str, secs: u32) -> Child {
    let mut child = etcd
        .etcdctl()
        .args([
            "lock",
            name,
            "--",
            "sh",
            "-c",
            &format!("echo held; sleep {secs}"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl lock");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    assert_eq!(line.trim(), "held");
    child
}

#[tokio::test]
async fn etcdctl_lock_and_dlock_exclude_each_other() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let url = format!("{}?raw_names=true", etcd.url());
    let locker = Locker::connect(&url).await.expect("connect");

    // etcdctl holds: dlock waits until it lets go.
    let mut foreign = etcdctl_holding(&etcd, "shared", 2);
    let started = Instant::now();
    assert!(locker.try_lock("shared").await.expect("try").is_none());
    let g = locker
        .lock_timeout("shared", T)
        .await
        .expect("after etcdctl");
    assert!(
        started.elapsed() > Duration::from_millis(1200),
        "granted while etcdctl held it ({:?})",
        started.elapsed()
    );
    let _ = foreign.wait();
    // dlock's key is etcd's recipe key: NAME/<lease id in hex>.
    let keys = etcd.etcdctl_output(&["get", "shared/", "--prefix", "--keys-only"]);
    let key = keys.lines().find(|l| !l.is_empty()).expect("dlock's key");
    assert!(
        key.strip_prefix("shared/")
            .is_some_and(|hex| u64::from_str_radix(hex, 16).is_ok()),
        "{key:?}"
    );

    // dlock holds: etcdctl waits until dlock releases.
    let mut waiting = etcd
        .etcdctl()
        .args(["lock", "shared", "--", "echo", "got it"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl lock");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        waiting.try_wait().expect("try_wait").is_none(),
        "etcdctl got the lock while dlock held it"
    );
    let released_at = Instant::now();
    g.release().await.expect("release");
    let out = tokio::task::spawn_blocking(move || waiting.wait_with_output())
        .await
        .expect("join")
        .expect("etcdctl output");
    assert!(String::from_utf8_lossy(&out.stdout).contains("got it"));
    assert!(released_at.elapsed() < Duration::from_secs(3));
}

/// 1,000 waiters, each with its own session, queue on one lock. Every release wakes
/// exactly the next one (each watches only its predecessor), so the requests per grant
/// stay constant instead of growing with the queue; afterwards etcd holds no key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_waiters_are_woken_one_at_a_time() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let baseline_keys = etcd.key_count();
    let n = 1000;
    let crowd = Crowd::queue(&etcd.url(), "crowd", n).await;
    let txn = |e: &EtcdServer| e.metric("grpc_server_handled_total", &["grpc_method=\"Txn\""]);
    let watches =
        |e: &EtcdServer| e.metric("grpc_server_started_total", &["grpc_method=\"Watch\""]);
    let (txn0, watch0) = (txn(&etcd), watches(&etcd));
    let took = crowd.release_all().await;
    let (txns, watch_streams) = (txn(&etcd) - txn0, watches(&etcd) - watch0);
    eprintln!(
        "figure: {n} queued waiters granted in {took:?} ({:.0}/s); {txns} transactions and {watch_streams} watch streams for {n} grants",
        n as f64 / took.as_secs_f64()
    );
    // A herd would cost O(n) requests per grant (~n²/2 in all); one wake per grant
    // costs a small constant: the queued re-attempt, and at most a few spurious ones.
    assert!(txns <= 3.0 * n as f64, "{txns} transactions for {n} grants");
    assert!(
        watch_streams <= 3.0 * n as f64,
        "{watch_streams} watches for {n} grants"
    );
    let end = Instant::now() + Duration::from_secs(15);
    while etcd.key_count() != baseline_keys {
        assert!(
            Instant::now() < end,
            "{} keys left (baseline {baseline_keys})",
            etcd.key_count()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Tasks of one process on one lock take turns: a releaser that asks again queues
/// behind the local owners already waiting instead of taking the lock straight back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_owners_take_turns() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let locker = Locker::connect(&etcd.url()).await.expect("connect");
    let (tasks, total) = (8usize, 400usize);
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::with_capacity(total)));
    let mut joins = Vec::new();
    for t in 0..tasks {
        let (locker, order) = (locker.clone(), std::sync::Arc::clone(&order));
        joins.push(tokio::spawn(async move {
            loop {
                let guard = locker.lock("turns").await.expect("lock");
                let done = {
                    let mut order = order.lock().expect("order");
                    order.push(t);
                    order.len() >= total
                };
                guard.release().await.expect("release");
                if done {
                    return;
                }
            }
        }));
    }
    let finished = tokio::time::timeout(Duration::from_secs(60), async {
        // The first task to see the total stops; the others are stopped here.
        while order.lock().expect("order").len() < total {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    for j in &joins {
        j.abort();
    }
    assert!(
        finished.is_ok(),
        "{} grants in 60 s",
        order.lock().expect("order").len()
    );
    let order = order.lock().expect("order").clone();
    let taken_back = order.windows(2).filter(|w| w[0] == w[1]).count();
    let mut per_task = vec![0usize; tasks];
    for &t in &order {
        per_task[t] += 1;
    }
    eprintln!(
        "figure: {taken_back} of {} grants went back to the releaser; per task {per_task:?}",
        order.len()
    );
    assert!(
        taken_back * 10 <= order.len(),
        "{taken_back} taken back: {order:?}"
    );
    let fair_share = order.len() / tasks;
    assert!(
        per_task.iter().all(|&n| n * 2 >= fair_share),
        "per task {per_task:?}"
    );
}

/// Keep-alives cut off (blackhole through the fault proxy): the holder's `lost()` fires
/// before the lease can expire on the server, a waiter on the same cut-off session stops
/// with an error instead of waiting forever, and another client gets the lock once the
/// lease is gone.
#[tokio::test]
async fn a_cut_off_session_fires_lost_and_frees_the_lock_after_its_ttl() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let proxy = FaultProxy::start(etcd.addr()).await.expect("proxy");
    let cut = through(&proxy, "2s").await;
    let other = Locker::connect(&etcd.url()).await.expect("connect");
    let g = cut.lock("cutoff").await.expect("lock");
    let blocker = other.lock("second").await.expect("lock second");
    let waiter = {
        let cut = cut.clone();
        tokio::spawn(async move { cut.lock_timeout("second", Duration::from_secs(30)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cut_at = Instant::now();
    proxy.set(Fault::Blackhole);
    tokio::time::timeout(Duration::from_secs(4), g.lost())
        .await
        .expect("lost() never fired");
    let noticed = cut_at.elapsed();
    let e = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter kept waiting on a dead session")
        .expect("join")
        .expect_err("granted on a dead session");
    assert!(e.is_retryable(), "{e:?}");
    let freed = other
        .lock_timeout("cutoff", Duration::from_secs(10))
        .await
        .expect("the lease must free the lock");
    let recovered = cut_at.elapsed();
    eprintln!(
        "figure: etcd session 2 s cut off: holder lost() after {noticed:?}, lock free for others after {recovered:?}"
    );
    assert!(noticed < recovered, "lost() fired after the lock was free");
    freed.release().await.expect("release");
    blocker.release().await.expect("release");
}

/// Keep-alives that reach etcd while their answers do not (replies dropped by the
/// proxy): the holder's session is lost here while etcd still extends its lease, so
/// the process ends it on the server — the lock and the read it held are free for
/// others at once, not when the lease applied last runs out (at least a third of
/// the 6 s session TTL after `lost()`).
#[tokio::test]
async fn a_session_lost_here_is_ended_on_the_server() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let proxy = FaultProxy::start(etcd.addr()).await.expect("proxy");
    let cut = through(&proxy, "6s").await;
    let other = Locker::connect(&etcd.url()).await.expect("connect");
    let g = cut.lock("lost-here").await.expect("lock");
    let read = cut.rwlock("lost-here").read().await.expect("read");
    proxy.set(Fault::DropReplies);
    tokio::time::timeout(Duration::from_secs(15), g.lost())
        .await
        .expect("lost() never fired");
    let lost_at = Instant::now();
    let freed = other
        .lock_timeout("lost-here", Duration::from_secs(15))
        .await
        .expect("the lock comes free");
    let write = other
        .rwlock("lost-here")
        .write_timeout(Duration::from_secs(15))
        .await
        .expect("the write comes free");
    let took = lost_at.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "the keys of a session lost here outlived it by {took:?}"
    );
    assert!(
        read.release().await.is_err(),
        "a read released after its loss"
    );
    freed.release().await.expect("release");
    write.release().await.expect("release");
    let keys = etcd.etcdctl_output(&["get", "/dlock/", "--prefix", "--keys-only"]);
    assert!(keys.trim().is_empty(), "keys left: {keys}");
}

/// A user whose role may only read and write under `/dlock/` can lock; the same user
/// cannot touch keys outside it (etcd refuses), and no password shows in errors.
#[tokio::test]
async fn a_user_limited_to_the_prefix_is_enough() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    for args in [
        &["user", "add", "root:rootpw"][..],
        &["user", "grant-role", "root", "root"],
        &["role", "add", "dlock"],
        &[
            "role",
            "grant-permission",
            "dlock",
            "--prefix=true",
            "readwrite",
            "/dlock/",
        ],
        &["user", "add", "locker:s3cret-pw"],
        &["user", "grant-role", "locker", "dlock"],
        &["auth", "enable"],
    ] {
        let _ = etcd.etcdctl_output(args);
    }
    let url = format!("etcd://locker:s3cret-pw@{}", etcd.addr());
    let locker = Locker::connect(&url)
        .await
        .expect("connect as a limited user");
    let g = locker.lock("jobs/nightly").await.expect("lock");
    assert!(g.fencing_token() > 0);
    let b = Locker::connect(&url).await.expect("connect");
    assert!(b.try_lock("jobs/nightly").await.expect("try").is_none());
    g.release().await.expect("release");
    // Outside its prefix the role may do nothing.
    let outside = format!(
        "etcd://locker:s3cret-pw@{}/elsewhere?raw_names=true",
        etcd.addr()
    );
    let e = Locker::connect(&outside)
        .await
        .expect_err("outside the prefix");
    let shown = format!("{e} {e:?}");
    assert!(shown.contains("permission denied"), "{shown}");
    assert!(!shown.contains("s3cret-pw"), "password shown: {shown}");
    let wrong = format!("etcd://locker:wrong@{}", etcd.addr());
    let e = Locker::connect(&wrong).await.expect_err("wrong password");
    assert!(!format!("{e} {e:?}").contains("wrong@"), "{e:?}");
}

#[tokio::test]
async fn bad_etcd_urls_are_typed_errors() {
    for url in [
        "etcd://127.0.0.1:1?session_ttl=1s",
        "etcd://127.0.0.1:1?session_ttl=2500ms",
        "etcd://127.0.0.1:1?ca_file=/x",
        "etcds://127.0.0.1:1?cert_file=/x",
        "etcd://127.0.0.1:1?raw_names=maybe",
        "etcd://127.0.0.1:1?layout=redisson",
    ] {
        let e = Locker::connect(url).await.expect_err(url);
        assert!(
            matches!(e, Error::InvalidUrl { .. } | Error::InvalidOption { .. }),
            "{url}: {e:?}"
        );
    }
    let _ = LockOptions::default();
}

/// `etcds://`: the server is verified against `ca_file`, and a server that requires
/// client certificates admits only a client that presents one.
#[tokio::test]
async fn etcds_verifies_the_server_and_presents_a_client_certificate() {
    let Some(etcd) = EtcdServer::start_tls() else {
        return;
    };
    let (port, certs) = etcd.tls().expect("TLS port");
    let p = |p: &std::path::Path| p.display().to_string();
    let base = format!("etcds://127.0.0.1:{port}?timeout=2s");
    let good = format!(
        "{base}&ca_file={}&cert_file={}&key_file={}",
        p(&certs.ca),
        p(&certs.client_cert),
        p(&certs.client_key)
    );
    let locker = Locker::connect(&good).await.expect("TLS connect");
    let g = locker.lock("over-tls").await.expect("lock over TLS");
    assert!(g.fencing_token() > 0);
    let plain = Locker::connect(&etcd.url()).await.expect("plain port");
    assert!(
        plain.try_lock("over-tls").await.expect("try").is_none(),
        "same server"
    );
    g.release().await.expect("release");

    let no_cert = format!("{base}&ca_file={}", p(&certs.ca));
    assert!(
        Locker::connect(&no_cert).await.is_err(),
        "admitted without a client cert"
    );
    let wrong_ca = format!(
        "{base}&ca_file={}&cert_file={}&key_file={}",
        p(&certs.other_ca),
        p(&certs.client_cert),
        p(&certs.client_key)
    );
    assert!(
        Locker::connect(&wrong_ca).await.is_err(),
        "trusted an unknown CA"
    );
}

/// Replies lost mid-acquire (requests reach etcd, answers vanish): the acquire fails
/// after its timeout, and the key it may have put is deleted at once — another client
/// gets the lock without waiting for the session lease to expire.
#[tokio::test]
async fn a_reply_lost_mid_acquire_leaves_no_key_behind() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let proxy = FaultProxy::start(etcd.addr()).await.expect("proxy");
    let cut = through(&proxy, "30s").await;
    // Open the session before the fault, so only the acquire itself is affected.
    let warm = cut.lock("warm").await.expect("warm-up");
    warm.release().await.expect("release");
    proxy.set(Fault::DropReplies);
    let e = cut
        .lock_timeout("lost-reply", Duration::from_secs(3))
        .await
        .expect_err("no reply, no grant");
    assert!(e.is_retryable(), "{e:?}");
    let other = Locker::connect(&etcd.url()).await.expect("connect");
    // Far less than the 30 s session lease.
    let g = other
        .lock_timeout("lost-reply", Duration::from_secs(5))
        .await
        .expect("the lost attempt's key must be gone");
    g.release().await.expect("release");
    let keys = etcd.etcdctl_output(&["get", "/dlock/", "--prefix", "--keys-only"]);
    assert!(keys.trim().is_empty(), "keys left: {keys}");
}

/// A waiter is cancelled while its connection is cut: its delete cannot get through
/// and fails. The session lease outlives the outage (30 s), so the key would queue
/// every other contender until the process ends; it is deleted once etcd answers
/// again.
#[tokio::test]
async fn a_waiter_leaving_during_an_outage_leaves_no_key_behind() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let proxy = FaultProxy::start(etcd.addr()).await.expect("proxy");
    let cut = through(&proxy, "30s").await;
    let other = Locker::connect(&etcd.url()).await.expect("connect");
    // Cancelled while nothing gets through: the delete times out, then the reset.
    dlock::conformance::waiter_cancelled_in_an_outage(
        &cut,
        &other,
        "leaving",
        Duration::from_millis(1500),
        || proxy.set(Fault::Blackhole),
        || {
            proxy.reset_all();
            proxy.set(Fault::None);
        },
    )
    .await;
    drop(cut);
}

/// A release after the session's lease ended on the server — before this process's
/// keep-alive noticed — reports the loss instead of succeeding (the key went with the
/// lease: nothing was released, the lock had already been free).
#[tokio::test]
async fn a_release_after_an_unseen_session_expiry_reports_the_loss() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let locker = Locker::connect(&format!("{}?session_ttl=30s", etcd.url()))
        .await
        .expect("connect");
    let guard = locker.lock("revoked").await.expect("lock");
    // A permit of the same session tells it too (`Capabilities::release_reports_loss`).
    let permit = locker
        .semaphore("revoked-permits", 2)
        .acquire()
        .await
        .expect("permit");
    revoke_the_one_lease(&etcd);
    let released = guard.release().await;
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "a release after the session ended: {released:?}"
    );
    let released = permit.release().await;
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "a permit's release after the session ended: {released:?}"
    );
    // A new acquisition opens a new session and works.
    let again = locker.lock_timeout("revoked", T).await.expect("lock again");
    again.release().await.expect("release");
}

/// An attempt made on a session whose lease ended unseen (revoked here; under load it
/// expires) fails with a retryable connection error, not a server error the caller
/// would give up on; the session is marked lost at once (the lock held under it fires
/// `lost()`), and the next attempt opens a new session and works.
#[tokio::test]
async fn an_attempt_on_an_ended_session_is_retryable_and_ends_the_session() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let locker = Locker::connect(&format!("{}?session_ttl=30s", etcd.url()))
        .await
        .expect("connect");
    let held = locker.lock("ended-a").await.expect("lock");
    revoke_the_one_lease(&etcd);
    let attempt = locker.try_lock("ended-b").await;
    match &attempt {
        Err(e @ Error::Connection { .. }) => assert!(e.is_retryable()),
        other => panic!("an attempt on the ended session: {other:?}"),
    }
    tokio::time::timeout(Duration::from_secs(2), held.lost())
        .await
        .expect("the lock held under the ended session did not fire lost()");
    let again = locker
        .try_lock("ended-b")
        .await
        .expect("the next attempt")
        .expect("free");
    again.release().await.expect("release");
}

/// End the one lease the server has (the session's) by hand, as an expiry its
/// keep-alive has not seen yet.
fn revoke_the_one_lease(etcd: &EtcdServer) {
    let listed = etcd.etcdctl_output(&["lease", "list"]);
    let leases: Vec<&str> = listed
        .lines()
        .skip(1)
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(leases.len(), 1, "{listed}");
    let _ = etcd.etcdctl_output(&["lease", "revoke", leases[0]]);
}

/// Lines of a child's stdout, as they come (read on a thread of their own).
fn lines_of(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line.trim().to_owned()).is_err() {
                return;
            }
        }
    });
    rx
}

/// Whether `line` comes from `rx` within `within`.
fn saw(rx: &std::sync::mpsc::Receiver<String>, line: &str, within: Duration) -> bool {
    let end = Instant::now() + within;
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) if l == line => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
    false
}

fn stop(child: &mut Child) {
    // SIGTERM: etcdctl resigns (revokes its session) before it exits.
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

/// The real `etcdctl elect` and dlock's elections (raw names) share etcd's
/// `concurrency.Election` layout: each sees the other's leader and value, and they
/// exclude each other in both directions; `etcdctl elect -l` observes dlock's leader.
#[tokio::test]
async fn etcdctl_elect_and_dlock_see_and_exclude_each_other() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    let url = format!("{}?raw_names=true", etcd.url());
    let election = Locker::connect(&url)
        .await
        .expect("connect")
        .election("sched");

    let mut foreign = etcd
        .etcdctl()
        .args(["elect", "sched", "proposal-etcdctl"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl elect");
    let said = lines_of(&mut foreign);
    assert!(saw(&said, "proposal-etcdctl", T), "etcdctl never led");
    let leader = election.leader().await.expect("leader").expect("a leader");
    assert_eq!(leader.value, "proposal-etcdctl");
    assert!(leader.term > 0);
    let short = LockOptions::new().wait(dlock::Wait::Timeout(Duration::from_millis(500)));
    match election.campaign_with("dlock-a", &short).await {
        Err(Error::Timeout { .. }) => {}
        other => panic!("dlock led beside etcdctl: {other:?}"),
    }
    stop(&mut foreign);

    let me = election
        .campaign_with("dlock-a", &LockOptions::new().wait(dlock::Wait::Timeout(T)))
        .await
        .expect("dlock leads once etcdctl resigned");
    assert!(me.term() > leader.term, "terms do not increase");
    let mut observer = etcd
        .etcdctl()
        .args(["elect", "-l", "sched"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl elect -l");
    let observed = lines_of(&mut observer);
    assert!(
        saw(&observed, "dlock-a", T),
        "etcdctl elect -l never showed dlock's leader"
    );
    stop(&mut observer);

    let mut next = etcd
        .etcdctl()
        .args(["elect", "sched", "proposal-next"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl elect");
    let next_said = lines_of(&mut next);
    assert!(
        !saw(&next_said, "proposal-next", Duration::from_secs(1)),
        "etcdctl led beside dlock"
    );
    me.resign().await.expect("resign");
    assert!(
        saw(&next_said, "proposal-next", T),
        "etcdctl never led after dlock resigned"
    );
    stop(&mut next);
}

/// A holder whose runtime stalled past its session lease (2 s) counts as lost at once,
/// before any keep-alive or renewal runs again (see the conformance helper).
#[test]
fn a_holder_stalled_past_its_session_counts_as_lost_at_once() {
    let Some(etcd) = EtcdServer::start() else {
        return;
    };
    dlock::conformance::a_stalled_holder_counts_as_lost(
        &[format!("{}?session_ttl=2s", etcd.url())],
        Duration::from_millis(2600),
    );
}
