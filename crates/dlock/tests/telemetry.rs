//! The metrics a locker records through the `metrics` facade, read back from a
//! debugging recorder installed while the locker is made.

use std::time::Duration;

use dlock::memory::MemoryBackend;
use dlock::{LockOptions, Locker, Renewal, Wait};
use metrics_util::CompositeKey;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// (name, labels "k=v" sorted) → value, for every series the snapshot holds.
fn series(snap: &Snapshotter) -> Vec<(String, Vec<String>, DebugValue)> {
    snap.snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value): (CompositeKey, _, _, DebugValue)| {
            let (_, key) = key.into_parts();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            (key.name().to_owned(), labels, value)
        })
        .collect()
}

fn counter(all: &[(String, Vec<String>, DebugValue)], name: &str, labels: &[&str]) -> u64 {
    all.iter()
        .filter(|(n, l, _)| n == name && labels.iter().all(|want| l.iter().any(|h| h == want)))
        .map(|(_, _, v)| match v {
            DebugValue::Counter(c) => *c,
            _ => 0,
        })
        .sum()
}

fn samples(all: &[(String, Vec<String>, DebugValue)], name: &str, labels: &[&str]) -> usize {
    all.iter()
        .filter(|(n, l, _)| n == name && labels.iter().all(|want| l.iter().any(|h| h == want)))
        .map(|(_, _, v)| match v {
            DebugValue::Histogram(h) => h.len(),
            _ => 0,
        })
        .sum()
}

#[tokio::test]
async fn a_locker_counts_acquisitions_waits_busy_answers_renewals_and_losses() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let locker =
        metrics::with_local_recorder(&recorder, || Locker::from_backend(MemoryBackend::new()));

    // granted, then busy (try_lock), then a timeout, then a wait that is granted.
    let g = locker.lock("m").await.expect("lock");
    assert!(locker.try_lock("m").await.expect("try").is_none());
    let timed_out = locker
        .lock_with(
            "m",
            &LockOptions::new().wait(Wait::Timeout(Duration::from_millis(50))),
        )
        .await;
    assert!(matches!(timed_out, Err(dlock::Error::Timeout { .. })));
    // A caller that gives up by dropping the future.
    let dropped = tokio::time::timeout(Duration::from_millis(30), locker.lock("m")).await;
    assert!(dropped.is_err(), "still held");
    let waiter = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.lock("m").await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    g.release().await.expect("release");
    let g = waiter.await.expect("join").expect("waited lock");
    g.release().await.expect("release");

    // Renewals: a short lease renewed a few times, then a loss (max hold).
    let renewed = locker
        .lock_with(
            "r",
            &LockOptions::new()
                .ttl(Duration::from_millis(300))
                .renewal(Renewal::Auto)
                .max_hold(Duration::from_millis(400)),
        )
        .await
        .expect("lock r");
    let lost = tokio::time::timeout(Duration::from_secs(5), renewed.lost()).await;
    assert!(lost.is_ok(), "max_hold ended the hold");

    let all = series(&snap);
    let s = ["scheme=memory"];
    assert_eq!(
        counter(
            &all,
            "dlock_acquisitions_total",
            &["scheme=memory", "outcome=granted"]
        ),
        3,
        "{all:#?}"
    );
    assert_eq!(
        counter(
            &all,
            "dlock_acquisitions_total",
            &["scheme=memory", "outcome=busy"]
        ),
        1
    );
    assert_eq!(
        counter(
            &all,
            "dlock_acquisitions_total",
            &["scheme=memory", "outcome=timeout"]
        ),
        1
    );
    assert_eq!(
        counter(
            &all,
            "dlock_acquisitions_total",
            &["scheme=memory", "outcome=cancelled"]
        ),
        1
    );
    assert_eq!(samples(&all, "dlock_acquire_seconds", &s), 6);
    assert_eq!(
        samples(&all, "dlock_wait_seconds", &s),
        1,
        "only the waiter that got it waited"
    );
    assert!(counter(&all, "dlock_busy_answers_total", &s) >= 3);
    assert!(
        counter(
            &all,
            "dlock_renewals_total",
            &["scheme=memory", "result=ok"]
        ) >= 1
    );
    assert_eq!(
        counter(
            &all,
            "dlock_renewals_total",
            &["scheme=memory", "result=failed"]
        ),
        0
    );
    assert!(
        all.iter()
            .all(|(_, l, _)| l.iter().any(|x| x.starts_with("scheme="))),
        "every series names its backend: {all:#?}"
    );
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_hand_off_is_counted() {
    let Some(redis) = dlock_testkit::RedisServer::start() else {
        return;
    };
    // The hand-off counter is recorded where the hand-off happens (a task of the
    // backend): only a global recorder sees it. The other test here records locally.
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    metrics::set_global_recorder(recorder).expect("the only recorder of this binary");
    let counted = Locker::connect(&redis.url()).await.expect("connect");
    let g = counted.lock("h").await.expect("lock");
    let waiter = {
        let counted = counted.clone();
        tokio::spawn(async move { counted.lock("h").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    g.release().await.expect("release");
    waiter
        .await
        .expect("join")
        .expect("handed")
        .release()
        .await
        .expect("release");
    let handoffs: u64 = snap
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "dlock_handoffs_total")
        .map(|(.., v)| match v {
            metrics_util::debugging::DebugValue::Counter(c) => c,
            _ => 0,
        })
        .sum();
    assert_eq!(handoffs, 1);
}

/// Forty waiters of one name in one process ask the SQLite file as one: one of them on
/// the poll interval, the rest only on a fallback that grows with their number (before,
/// each asked for itself every 5–10 ms; attempts are counted here as busy answers).
/// The holder is another `Locker` on the file, as another process would be: its
/// release is noticed by polling, so the first grant after it comes within a poll or
/// two, not on the others' fallback (20 ms times their number). Waiters give up at
/// random moments, the poller among them: the role passes on, and every remaining
/// waiter still gets the lock, one at a time and in increasing token order, as a fenced
/// store checks. Then permits freed elsewhere reach twenty waiters of one semaphore.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_waiters_of_one_name_poll_as_one_per_process() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::Instant;

    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let holder = Locker::connect(&url).await.expect("holder");
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    // The meters are made as the locker is: the recorder must be this thread's then.
    let waiters = tokio::task::block_in_place(|| {
        metrics::with_local_recorder(&recorder, || {
            tokio::runtime::Handle::current().block_on(Locker::connect(&format!("{url}?poll=20ms")))
        })
    })
    .expect("waiters");
    let waiters = Arc::new(waiters);
    let busy = || {
        counter(
            &series(&snap),
            "dlock_busy_answers_total",
            &["scheme=sqlite"],
        )
    };

    let held = holder.lock("poll-as-one").await.expect("hold");
    // The fenced store: who is in, and the last token it accepted.
    let inside = Arc::new(AtomicBool::new(false));
    let last = Arc::new(AtomicU64::new(held.fencing_token()));
    let first_grant = Arc::new(std::sync::OnceLock::new());
    let mut tasks = Vec::new();
    for i in 0..40u64 {
        let (waiters, inside, last, first_grant) = (
            Arc::clone(&waiters),
            Arc::clone(&inside),
            Arc::clone(&last),
            Arc::clone(&first_grant),
        );
        tasks.push(tokio::spawn(async move {
            // Every fourth waiter gives up while the lock is still held, at a moment
            // of its own between 200 and 800 ms.
            let timeout = if i % 4 == 0 {
                Duration::from_millis(200 + (i * 7919) % 601)
            } else {
                Duration::from_secs(60)
            };
            let Ok(g) = waiters.lock_timeout("poll-as-one", timeout).await else {
                return false;
            };
            first_grant.get_or_init(Instant::now);
            assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
            let token = g.fencing_token();
            let before = last.swap(token, Ordering::SeqCst);
            assert!(token > before, "token {token} after {before}");
            tokio::time::sleep(Duration::from_millis(2)).await;
            inside.store(false, Ordering::SeqCst);
            g.release().await.expect("release");
            true
        }));
    }
    // Let every waiter register and settle, then count one second of asking.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A snapshot takes the counts since the last one.
    let _ = busy();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let asked = busy();
    held.release().await.expect("release");
    let started = Instant::now();
    let mut got = 0;
    for t in tasks {
        let ok = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("a waiter never finished")
            .expect("waiter task");
        got += usize::from(ok);
    }
    let took = started.elapsed();
    assert_eq!(got, 30, "every waiter that did not give up got the lock");
    // Measured here: about 135 (each waiter asking for itself: 1,877).
    assert!(
        asked < 400,
        "{asked} attempts in one second of 40 waiters waiting"
    );
    // A vacant poller role would leave the first grant to the others' fallback: 20 ms
    // times the 30 left, jittered 50–100 %, so 300 ms at the least.
    let first = first_grant
        .get()
        .map(|at| at.saturating_duration_since(started))
        .expect("a first grant");
    assert!(
        first < Duration::from_millis(250),
        "first grant after {first:?}"
    );
    assert!(took < Duration::from_secs(10), "30 grants took {took:?}");
    eprintln!(
        "figure: sqlite: 40 waiters of one name made {asked} attempts in 1 s; the first grant came {first:?} after another locker's release; the 30 that stayed took it in turn in {took:?}"
    );

    let held = [
        holder
            .semaphore("poll-permits", 2)
            .acquire()
            .await
            .expect("permit"),
        holder
            .semaphore("poll-permits", 2)
            .acquire()
            .await
            .expect("permit"),
    ];
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let waiters = Arc::clone(&waiters);
        tasks.push(tokio::spawn(async move {
            let g = waiters
                .semaphore("poll-permits", 2)
                .acquire_timeout(Duration::from_secs(60))
                .await
                .expect("a permit");
            tokio::time::sleep(Duration::from_millis(2)).await;
            g.release().await.expect("release");
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for g in held {
        g.release().await.expect("release");
    }
    let started = Instant::now();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("a permit waiter never finished")
            .expect("permit waiter task");
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "20 permits took {took:?}");
    eprintln!("figure: sqlite: 20 permit waiters of one process served in {took:?}");
}
