//! `lock_delay` on the lease-table backends (SQLite, PostgreSQL and MariaDB lease
//! mode): a lease that ran out without a release keeps the lock from other owners for
//! the delay; a clean release frees it at once; a waiter is granted after lease +
//! delay; bad values and session modes are refused.
#![cfg(all(feature = "postgres", feature = "mysql"))]

use std::time::Duration;

use dlock::{Error, LockOptions, Locker, Renewal, Wait};
use dlock_testkit::{MariaDbServer, PgServer};
use tokio::time::Instant;

const TTL: Duration = Duration::from_millis(300);
const DELAY: Duration = Duration::from_secs(1);

fn unique(label: &str) -> String {
    format!("delay:{label}:{}", dlock::Owner::random())
}

/// `url` must carry `lock_delay=1s`.
async fn delays_after_expiry_only(label: &str, url: &str) {
    let a = Locker::connect(url).await.expect("connect a");
    let b = Locker::connect(url).await.expect("connect b");
    let lapse = LockOptions::new().ttl(TTL).renewal(Renewal::Off);

    // A clean release frees the lock at once.
    let name = unique("released");
    let g = a.lock_with(&name, &lapse).await.expect("lock");
    g.release().await.expect("release");
    let taken = b.try_lock(&name).await.expect("try");
    assert!(
        taken.is_some(),
        "{label}: a released lock must be free at once"
    );
    drop(taken);

    // A lease left to run out blocks others for the delay after its expiry.
    let name = unique("lapsed");
    let started = Instant::now();
    let held = a.lock_with(&name, &lapse).await.expect("lock");
    tokio::time::sleep(TTL + Duration::from_millis(150)).await;
    assert!(
        b.try_lock(&name).await.expect("try").is_none(),
        "{label}: expired {:?} ago, still within the delay",
        started.elapsed().saturating_sub(TTL)
    );
    let waiter = LockOptions::new().wait(Wait::Timeout(Duration::from_secs(10)));
    let next = b
        .lock_with(&name, &waiter)
        .await
        .expect("granted after the delay");
    let after = started.elapsed();
    eprintln!(
        "figure: {label}: lapsed lease of {TTL:?}, lock_delay {DELAY:?} → next grant after {after:?}"
    );
    assert!(
        after >= TTL + DELAY - Duration::from_millis(50),
        "{label}: granted after {after:?}"
    );
    assert!(
        after <= TTL + DELAY + Duration::from_secs(2),
        "{label}: granted only after {after:?}"
    );
    // The lapsed holder learns it lost the lock; its release says so.
    assert!(matches!(held.release().await, Err(Error::LockLost { .. })));
    next.release().await.expect("release");

    // The same owner asking again inside the delay gets a new grant with a higher
    // token (or none): never the lapsed grant's token, which a paused holder still
    // carries and a fenced resource must be able to reject.
    let name = unique("same-owner");
    let mine = lapse.clone().owner(a.owner());
    let lapsed = a.lock_with(&name, &mine).await.expect("lock");
    let old = lapsed.fencing_token();
    tokio::time::sleep(TTL + Duration::from_millis(150)).await;
    if let Some(again) = a.try_lock_with(&name, &mine).await.expect("try") {
        assert!(
            again.fencing_token() > old,
            "{label}: the same owner re-entered a lapsed lease with its old token {old}"
        );
        again.release().await.expect("release");
    }
}

async fn refuses_bad_values(base: &str, session_mode: Option<&str>) {
    let sep = if base.contains('?') { '&' } else { '?' };
    for bad in ["2h", "abc", "-1s", "5"] {
        let url = format!("{base}{sep}lock_delay={bad}");
        let e = Locker::connect(&url)
            .await
            .expect_err("a bad lock_delay accepted");
        assert!(
            matches!(e, Error::InvalidUrl { .. } | Error::InvalidOption { .. }),
            "lock_delay={bad}: {e:?}"
        );
    }
    if let Some(mode) = session_mode {
        let url = format!("{base}{sep}mode={mode}&lock_delay=1s");
        let e = Locker::connect(&url)
            .await
            .expect_err("a bad lock_delay accepted");
        assert!(
            e.to_string().contains("lock_delay applies to mode=lease"),
            "{e}"
        );
    }
}

#[tokio::test]
async fn sqlite_lock_delay() {
    let dir = tempfile::tempdir().expect("temp dir");
    let base = format!("sqlite://{}", dir.path().join("locks.db").display());
    delays_after_expiry_only("sqlite", &format!("{base}?lock_delay=1s")).await;
    refuses_bad_values(&base, None).await;
}

#[tokio::test]
async fn postgres_lock_delay() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    delays_after_expiry_only("postgres", &format!("{}?lock_delay=1s", pg.url())).await;
    refuses_bad_values(&pg.url(), Some("advisory")).await;
}

#[tokio::test]
async fn mariadb_lock_delay() {
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    delays_after_expiry_only("mariadb", &format!("{}?lock_delay=1s", maria.url())).await;
    refuses_bad_values(&maria.url(), Some("named")).await;
}
