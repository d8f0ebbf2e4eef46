//! A holder whose process was paused past its lease (a stop-the-world pause: no task
//! ran) must not be told that its release or extend succeeded: the keeper counts the
//! passed deadline before it handles the command.

use std::time::Duration;

use dlock::{Error, LockOptions, Locker, LossReason, Renewal};

async fn paused_past_the_lease(url: &str) {
    let locker = Locker::connect(url).await.expect("connect");
    let opts = LockOptions::new()
        .ttl(Duration::from_millis(300))
        .renewal(Renewal::Off);
    for action in ["release", "extend"] {
        let g = locker.lock_with(action, &opts).await.expect("lock");
        // Block the only runtime thread: neither the keeper nor its timer can run.
        std::thread::sleep(Duration::from_millis(450));
        let r = match action {
            "release" => g.release().await,
            _ => g.extend(Duration::from_secs(5)).await,
        };
        assert!(
            matches!(
                &r,
                Err(Error::LockLost {
                    reason: LossReason::LeaseExpired,
                    ..
                })
            ),
            "{url}: {action} after the lease ended: {r:?}"
        );
    }
}

#[tokio::test(flavor = "current_thread")]
async fn memory_backend() {
    paused_past_the_lease("memory://paused").await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "current_thread")]
async fn sqlite_backend() {
    let dir = tempfile::tempdir().expect("dir");
    paused_past_the_lease(&format!("sqlite://{}", dir.path().join("p.db").display())).await;
}
