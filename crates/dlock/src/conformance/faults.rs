//! Scenarios the backend-specific fault tests share. The fault itself stays with the
//! caller (a proxy in the test kit, a signal): these take it as closures.

use std::time::Duration;

use tokio::time::Instant;

use crate::Locker;

/// Wait until `inspect` on `locker` counts `n` waiters on `name`.
///
/// # Panics
/// When `inspect` fails, or the count is not reached `within`.
pub async fn wait_until_queued(locker: &Locker, name: &str, n: usize, within: Duration) {
    let end = Instant::now() + within;
    loop {
        let waiters = locker
            .inspect(name)
            .await
            .expect("inspect")
            .and_then(|i| i.waiters);
        if waiters == Some(n) {
            return;
        }
        assert!(
            Instant::now() < end,
            "{name}: {waiters:?} waiters queued, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A waiter on `cut` queues behind `other`'s hold of `name` and is cancelled while
/// `cut_off` has stopped its traffic, so its leaving cannot reach the server;
/// `outage` later `restore` brings the connection back. Its queue entry must not
/// outlive that: once `other` releases, `other` gets the lock again within 5 s
/// (a session-bound backend's session outlives the outage, so an entry left behind
/// would keep everyone queued behind it).
///
/// # Panics
/// When the waiter never queues or `other` cannot take the lock back.
pub async fn waiter_cancelled_in_an_outage(
    cut: &Locker,
    other: &Locker,
    name: &str,
    outage: Duration,
    cut_off: impl FnOnce(),
    restore: impl FnOnce(),
) {
    let held = other.lock(name).await.expect("lock");
    let (waiting, waited) = (cut.clone(), name.to_owned());
    let waiter = tokio::spawn(async move { waiting.lock(&waited).await });
    wait_until_queued(other, name, 1, Duration::from_secs(5)).await;
    cut_off();
    waiter.abort();
    tokio::time::sleep(outage).await;
    restore();
    held.release().await.expect("release");
    let freed = other
        .lock_timeout(name, Duration::from_secs(5))
        .await
        .expect("the cancelled waiter's queue entry stayed under its live session");
    freed.release().await.expect("release");
}

/// A holder whose runtime stalls past its session's life — its only thread blocked,
/// so no keep-alive, renewal or watcher runs — counts as lost the moment it looks
/// again, before any of them has run: the server may have ended its session and
/// handed the lock on meanwhile. Each URL (a session-bound backend whose session
/// lives less than `stall` unproven) on a thread and a current-thread runtime of its
/// own, at once.
///
/// # Panics
/// When a holder still counts as held after the stall, or is told another reason.
pub fn a_stalled_holder_counts_as_lost(urls: &[String], stall: Duration) {
    std::thread::scope(|scope| {
        for url in urls {
            let full = url.as_str();
            scope.spawn(move || {
                // Named without its credentials.
                let shown = match (url.find("://"), url.rfind('@')) {
                    (Some(start), Some(at)) if at > start => {
                        format!("{}://…{}", &url[..start], &url[at..])
                    }
                    _ => url.clone(),
                };
                let url = &shown;
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let (locker, guard) = rt.block_on(async {
                    let locker = Locker::connect(full).await.expect("connect");
                    let guard = locker.lock(&super::unique("stalled")).await.expect("lock");
                    (locker, guard)
                });
                assert!(guard.is_held(), "{url}: not held at once");
                std::thread::sleep(stall);
                assert!(
                    !guard.is_held(),
                    "{url}: still held by its own account after a stall past its session's life"
                );
                assert!(
                    guard.context().lost.is_cancelled(),
                    "{url}: its loss token did not fire"
                );
                assert!(
                    matches!(guard.loss_reason(), Some(crate::LossReason::SessionLost(_))),
                    "{url}: lost for {:?}",
                    guard.loss_reason()
                );
                rt.block_on(async move {
                    let _ = guard.release().await;
                    drop(locker);
                });
            });
        }
    });
}
