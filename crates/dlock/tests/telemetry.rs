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
