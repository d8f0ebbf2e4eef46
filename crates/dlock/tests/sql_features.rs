//! PostgreSQL and MariaDB beyond the conformance suite: a cut-off holder hears of the
//! loss before the server frees its session lock (through the fault proxy), contended
//! lease rows never surface a deadlock, advisory keys shared with raw SQL, least-privilege
//! users, and passwords kept out of errors.
#![cfg(all(feature = "postgres", feature = "mysql"))]

use std::net::SocketAddr;
use std::time::Duration;

use dlock::{Error, LockOptions, Locker, Renewal};
use dlock_testkit::{Fault, FaultProxy, MariaDbServer, PG_PASSWORD, PgServer};
use sqlx::Connection;
use tokio::time::Instant;

/// Two lockers on `url` (two processes, as far as the server can tell).
async fn two_lockers(url: &str) -> (Locker, Locker) {
    (
        Locker::connect(url).await.expect("connect"),
        Locker::connect(url).await.expect("connect"),
    )
}

fn unique(label: &str) -> String {
    format!("sqlf:{label}:{}", dlock::Owner::random())
}

/// The holder reaches the server through a proxy that then turns to `fault` (silent,
/// or dropping the server's replies). Returns (cut → holder's `lost()`, cut → another
/// client holds the lock). The holder takes the lock with `opts`.
async fn cut_off(
    direct: &str,
    via_proxy: &str,
    proxy: &FaultProxy,
    name: &str,
    opts: &LockOptions,
    fault: Fault,
) -> (Duration, Duration) {
    let holder = Locker::connect(via_proxy).await.expect("holder connects");
    let other = Locker::connect(direct).await.expect("other connects");
    let g = holder.lock_with(name, opts).await.expect("lock");
    assert!(other.try_lock(name).await.expect("try").is_none());
    let proxy_cut = Instant::now();
    proxy.set(fault);
    let lost = tokio::spawn(async move {
        let _ = g.lost().await;
        Instant::now()
    });
    let taken = other
        .lock_timeout(name, Duration::from_secs(30))
        .await
        .expect("the server must free a cut-off session");
    let taken_at = Instant::now();
    let lost_at = tokio::time::timeout(Duration::from_secs(5), lost)
        .await
        .expect("lost() never fired")
        .expect("task");
    taken.release().await.expect("release");
    (lost_at - proxy_cut, taken_at - proxy_cut)
}

async fn proxied(addr: SocketAddr) -> FaultProxy {
    FaultProxy::start(addr).await.expect("proxy")
}

fn pg_addr(pg: &PgServer) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], pg.port()))
}

fn via(url: &str, port: u16, proxy: &FaultProxy) -> String {
    url.replace(&format!(":{port}/"), &format!(":{}/", proxy.addr().port()))
}

/// The session modes' cases named in `labels`: the label, the server's URL with the
/// mode, the proxy in front of that server (`proxies`: PostgreSQL's, MariaDB's) and
/// the server's port.
fn session_cases<'a>(
    pg: &PgServer,
    maria: &MariaDbServer,
    proxies: &'a (FaultProxy, FaultProxy),
    labels: &[&str],
) -> Vec<(&'static str, String, &'a FaultProxy, u16)> {
    let (pg_proxy, maria_proxy) = proxies;
    [
        ("pg advisory", pg.url(), "advisory", pg_proxy, pg.port()),
        ("pg row", pg.url(), "row", pg_proxy, pg.port()),
        (
            "mariadb named",
            maria.url(),
            "named",
            maria_proxy,
            maria.port(),
        ),
        ("mariadb row", maria.url(), "row", maria_proxy, maria.port()),
    ]
    .into_iter()
    .filter(|case| labels.contains(&case.0))
    .map(|(label, url, mode, proxy, port)| (label, format!("{url}?mode={mode}"), proxy, port))
    .collect()
}

/// A proxy in front of each server: PostgreSQL's, MariaDB's.
async fn session_proxies(pg: &PgServer, maria: &MariaDbServer) -> (FaultProxy, FaultProxy) {
    (
        proxied(pg_addr(pg)).await,
        proxied(SocketAddr::from(([127, 0, 0, 1], maria.port()))).await,
    )
}

/// Each of the `labels` cases, cut off by each of `faults`: a holder taking its lock
/// with `opts` must declare the loss within 4 s and before the server frees the lock.
async fn cut_off_holders_hear_first(
    labels: &[&str],
    opts: &LockOptions,
    faults: &[Fault],
    what: &str,
) {
    let (Some(pg), Some(maria)) = (PgServer::start(), MariaDbServer::start()) else {
        return;
    };
    let proxies = session_proxies(&pg, &maria).await;
    for (label, direct, proxy, port) in session_cases(&pg, &maria, &proxies, labels) {
        for &fault in faults {
            proxy.set(Fault::None);
            let through = via(&direct, port, proxy);
            let (lost, freed) =
                cut_off(&direct, &through, proxy, &unique("cut"), opts, fault).await;
            eprintln!(
                "figure: {label}{what}, {fault:?}: cut-off holder lost() after {lost:?}; server freed the lock after {freed:?}"
            );
            assert!(
                lost < freed,
                "{label}: lost() {lost:?} after the server freed it {freed:?}"
            );
            assert!(
                lost < Duration::from_secs(4),
                "{label}: lost() after {lost:?}"
            );
        }
    }
}

/// Session modes: a holder cut off from the server declares the loss (heartbeat 1 s)
/// before the server ends its session and another client gets the lock: whether the
/// server hears nothing more (a partition), or hears the holder but its answers are
/// lost, so that the connection's close reaches it at once (a failed renewal's
/// connection is closed only after the hold was marked lost).
#[tokio::test(flavor = "current_thread")]
async fn cut_off_session_holder_hears_before_the_server_frees() {
    let all = ["pg advisory", "pg row", "mariadb named", "mariadb row"];
    let faults = [Fault::Blackhole, Fault::DropReplies];
    cut_off_holders_hear_first(&all, &LockOptions::new(), &faults, "").await;
}

/// The same with renewal off: the keeper's renewals are what prove a session alive,
/// so a hold the keeper does not renew pings its connection by itself (the session's
/// heartbeat), and a cut-off holder still hears of the loss first. A lease of 60 s:
/// its local end is not what tells the holder here. One advisory (PostgreSQL) and one
/// row-lock (MariaDB) hold, the two ways a session lock is given back.
#[tokio::test(flavor = "current_thread")]
async fn cut_off_session_holder_without_renewal_hears_before_the_server_frees() {
    let opts = LockOptions::new()
        .ttl(Duration::from_secs(60))
        .renewal(Renewal::Off);
    let labels = ["pg advisory", "mariadb row"];
    cut_off_holders_hear_first(&labels, &opts, &[Fault::Blackhole], ", renewal off").await;
}

/// Hold up `proxy`'s traffic while an extension of `g` pings its connection, and
/// drop the extension before the answer comes; the answer arrives afterwards, unread.
async fn abandon_an_extension(g: &dlock::LockGuard, proxy: &FaultProxy, label: &str) {
    proxy.set(Fault::Delay(Duration::from_millis(300)));
    let cut = tokio::time::timeout(
        Duration::from_millis(100),
        g.extend(Duration::from_secs(60)),
    )
    .await;
    assert!(cut.is_err(), "{label}: the extension was not cut off");
    tokio::time::sleep(Duration::from_millis(700)).await;
    proxy.set(Fault::None);
}

/// Session modes: an extension dropped before its ping was answered (here: replies
/// held up by the proxy) leaves the pinned connection with an answer nobody read. No
/// later statement may take that answer for its own (on MySQL, a ping or a
/// `RELEASE_LOCK` reading an old `OK`). Asked again, the hold finds the lock lost
/// (hearing it before the connection closes, which frees the lock); released at once,
/// the connection is closed instead of used, which frees the lock too; and the locker
/// goes on with connections in step. Renewal off and a heartbeat of 30 s: nothing
/// else pings meanwhile.
#[tokio::test(flavor = "current_thread")]
async fn abandoned_ping_never_leaves_its_answer_to_the_next_statement() {
    let (Some(pg), Some(maria)) = (PgServer::start(), MariaDbServer::start()) else {
        return;
    };
    let proxies = session_proxies(&pg, &maria).await;
    let labels = ["mariadb named", "mariadb row", "pg advisory"];
    let opts = LockOptions::new()
        .ttl(Duration::from_secs(60))
        .renewal(Renewal::Off);
    for (label, direct, proxy, port) in session_cases(&pg, &maria, &proxies, &labels) {
        let direct = format!("{direct}&heartbeat=30s");
        proxy.set(Fault::None);
        let through = via(&direct, port, proxy);
        let holder = Locker::connect(&through).await.expect("holder connects");
        let other = Locker::connect(&direct).await.expect("other connects");

        let name = unique("abandoned");
        let g = holder.lock_with(&name, &opts).await.expect("lock");
        abandon_an_extension(&g, proxy, label).await;
        let again = g.extend(Duration::from_secs(60)).await;
        assert!(
            matches!(
                &again,
                Err(Error::LockLost {
                    reason: dlock::LossReason::SessionLost(_),
                    ..
                })
            ),
            "{label}: extended again: {again:?}"
        );
        assert!(!g.is_held(), "{label}: still held after the loss");
        assert!(g.release().await.is_err(), "{label}: released a lost lock");
        let taken = other
            .lock_timeout(&name, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{label}: the lost lock was never freed: {e}"));
        taken.release().await.expect("release");

        let name = unique("abandoned");
        let g = holder.lock_with(&name, &opts).await.expect("lock");
        abandon_an_extension(&g, proxy, label).await;
        g.release()
            .await
            .unwrap_or_else(|e| panic!("{label}: release after the cut: {e}"));
        let taken = other
            .lock_timeout(&name, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{label}: the released lock was never freed: {e}"));
        taken.release().await.expect("release");

        for i in 0..3 {
            let g = holder
                .lock(&format!("{name}-{i}"))
                .await
                .unwrap_or_else(|e| panic!("{label}: lock after: {e}"));
            assert!(
                other
                    .try_lock(&format!("{name}-{i}"))
                    .await
                    .expect("try")
                    .is_none(),
                "{label}: two holders"
            );
            g.release()
                .await
                .unwrap_or_else(|e| panic!("{label}: release after: {e}"));
        }
    }
}

/// Session modes: an attempt whose statement goes unanswered (the network cut, or the
/// server's replies lost after it ran the statement) fails with a connection error
/// after the backend's `timeout`, as every other statement does. (It used to wait as
/// long as the server kept the session: 5 s here, where both servers end a session
/// silent for five heartbeats; for ever where the server's close never arrives, as
/// over a cut network.) It drops its connection, so a lock the server granted it
/// unheard goes with the session: once the network is back, another client takes the
/// name at once, and so does the locker that failed.
#[tokio::test(flavor = "current_thread")]
async fn an_unanswered_session_attempt_fails_within_the_timeout() {
    let (Some(pg), Some(maria)) = (PgServer::start(), MariaDbServer::start()) else {
        return;
    };
    let proxies = session_proxies(&pg, &maria).await;
    let labels = ["pg advisory", "pg row", "mariadb named", "mariadb row"];
    for (label, direct, proxy, port) in session_cases(&pg, &maria, &proxies, &labels) {
        for fault in [Fault::Blackhole, Fault::DropReplies] {
            proxy.set(Fault::None);
            let through = via(&format!("{direct}&timeout=1s"), port, proxy);
            let holder = Locker::connect(&through).await.expect("holder connects");
            let other = Locker::connect(&direct).await.expect("other connects");
            let name = unique("unanswered");
            // Leaves a session connection idle: the next attempt sends its statement
            // on it (no new connection, whose own timeout would answer instead).
            let g = holder.lock(&name).await.expect("lock");
            g.release().await.expect("release");

            proxy.set(fault);
            let started = Instant::now();
            let attempt = tokio::time::timeout(Duration::from_secs(20), holder.lock(&name)).await;
            let took = started.elapsed();
            let Ok(r) = attempt else {
                panic!("{label}, {fault:?}: an attempt still unanswered after {took:?}");
            };
            assert!(
                took < Duration::from_secs(3),
                "{label}, {fault:?}: failed after {took:?} (timeout 1 s): {r:?}"
            );
            assert!(
                matches!(r, Err(Error::Connection { .. })),
                "{label}, {fault:?}: {r:?}"
            );

            proxy.set(Fault::None);
            for (who, locker) in [("another client", &other), ("the same locker", &holder)] {
                let g = locker
                    .lock_timeout(&name, Duration::from_secs(10))
                    .await
                    .unwrap_or_else(|e| {
                        panic!("{label}, {fault:?}: {who} cannot take the name after the cut: {e}")
                    });
                g.release().await.expect("release");
            }
        }
    }
}

/// Take `name` once and give it back: its row and holder record exist from then on.
async fn taken_once(locker: &Locker, name: &str) {
    locker
        .lock(name)
        .await
        .expect("lock")
        .release()
        .await
        .expect("release");
}

/// MariaDB row mode: a transaction outside dlock on `raw` locks the row of `key`.
async fn row_locked_outside(raw: &mut sqlx::MySqlConnection, key: &[u8; 32]) {
    sqlx::query("BEGIN")
        .execute(&mut *raw)
        .await
        .expect("begin");
    sqlx::query("SELECT 1 FROM dlock_rows WHERE lock_key = ? FOR UPDATE")
        .bind(&key[..])
        .fetch_one(&mut *raw)
        .await
        .expect("raw row lock");
}

/// MariaDB row mode: an attempt cut off while its token's statement (on a connection of
/// its own) still runs has the holder record that statement writes cleared of its dead
/// session. A trigger holds that statement for 2 s, past the 1 s timeout: the attempt
/// fails, its session ends, and the statement commits a second later, writing the
/// record. Until a later holder writes its own, `inspect` would name the dead attempt
/// while a transaction outside dlock holds the row; the backend clears the record's
/// session in the background.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_row_attempt_cut_off_at_its_token_has_its_record_cleared() {
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    let url = format!("{}?mode=row&timeout=1s", maria.url());
    let locker = Locker::connect(&url).await.expect("connect");
    let name = unique("rowcut");
    // The name's row and record exist: the cut-off statement is the record's update.
    taken_once(&locker, &name).await;
    let mut raw = sqlx::MySqlConnection::connect(&maria.url())
        .await
        .expect("raw");
    let trigger = format!(
        "CREATE TRIGGER dlock_test_slow BEFORE UPDATE ON dlock_holders FOR EACH ROW \
         BEGIN IF NEW.name = '{name}' AND NEW.conn_id <> 0 THEN SET @slept = SLEEP(2); END IF; END"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(trigger))
        .execute(&mut raw)
        .await
        .expect("trigger");

    let owner = dlock::Owner::random();
    let cut = locker
        .lock_with(&name, &LockOptions::new().owner(owner.clone()))
        .await;

    sqlx::query("DROP TRIGGER dlock_test_slow")
        .execute(&mut raw)
        .await
        .expect("drop trigger");
    assert!(
        matches!(cut, Err(Error::Connection { .. })),
        "an attempt whose token's statement went unanswered: {cut:?}"
    );

    // `DROP TRIGGER` waited for the held statement, which has committed its record.
    // That record must not name the attempt's session for long.
    let key = dlock::sql::lock_key(&dlock::name::LockName::new(&name).expect("name"));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (rec_owner, conn_id): (Vec<u8>, u64) = sqlx::query_as(
            "SELECT owner, CAST(conn_id AS UNSIGNED) FROM dlock_holders WHERE lock_key = ?",
        )
        .bind(&key[..])
        .fetch_one(&mut raw)
        .await
        .expect("record");
        if rec_owner != owner.as_str().as_bytes() || conn_id == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the record still names the cut-off attempt's session {conn_id} 10 s on"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A transaction outside dlock holding the row is not taken for the dead attempt.
    row_locked_outside(&mut raw, &key).await;
    let info = locker
        .inspect(&name)
        .await
        .expect("inspect")
        .expect("a row locked outside dlock is reported free");
    assert_ne!(info.owner, owner.as_str(), "{info:?}");
    sqlx::query("ROLLBACK")
        .execute(&mut raw)
        .await
        .expect("end");

    // And the name is free for dlock again.
    taken_once(&locker, &name).await;
}

/// Many clients taking and giving back fresh lease rows at once on MariaDB: every call
/// succeeds (no deadlock error reaches the caller) and the counter is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contended_mariadb_lease_rows_never_deadlock() {
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    let names: Vec<String> = (0..3).map(|i| unique(&format!("dl{i}"))).collect();
    let counter = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    let start = Instant::now();
    for t in 0..24usize {
        let (url, names, counter) = (maria.url(), names.clone(), std::sync::Arc::clone(&counter));
        tasks.push(tokio::spawn(async move {
            let locker = Locker::connect(&url).await.expect("connect");
            for i in 0..30usize {
                let name = &names[(t + i) % names.len()];
                let g = locker
                    .lock_timeout(name, Duration::from_secs(30))
                    .await
                    .unwrap_or_else(|e| panic!("task {t} cycle {i}: {e}"));
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                g.release().await.unwrap_or_else(|e| panic!("release: {e}"));
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(counter.load(std::sync::atomic::Ordering::SeqCst), 24 * 30);
    eprintln!(
        "figure: mariadb lease: 720 contended cycles on 3 fresh names by 24 clients in {:?}, no error",
        start.elapsed()
    );
}

/// Row mode on MariaDB, many clients on fresh names at once, each hold longer than the
/// statement timeout: a waiter that found no row must not block behind a holder's row
/// lock while creating it (INSERT IGNORE waits for the lock of a row that exists).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fresh_row_locks_under_contention_never_block_a_waiter() {
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    let url = format!("{}?mode=row&timeout=1s", maria.url());
    for round in 0..2 {
        let name = unique(&format!("rowfresh{round}"));
        let mut tasks = Vec::new();
        for t in 0..8usize {
            let (url, name) = (url.clone(), name.clone());
            tasks.push(tokio::spawn(async move {
                let locker = Locker::connect(&url).await.expect("connect");
                let g = locker
                    .lock_timeout(&name, Duration::from_secs(60))
                    .await
                    .unwrap_or_else(|e| panic!("round {round} task {t}: {e}"));
                // Longer than the 1 s statement timeout.
                tokio::time::sleep(Duration::from_millis(1_200)).await;
                g.release().await.unwrap_or_else(|e| panic!("release: {e}"));
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(90), t)
                .await
                .expect("the waiters finish")
                .expect("task");
        }
    }
}

/// `advisory_key=number` shares PostgreSQL advisory locks with code that calls
/// `pg_advisory_lock(N)` itself; a name that is not a number is a typed error. A
/// MariaDB named lock or lock row held by SQL outside dlock is reported held (token 0).
#[tokio::test]
async fn advisory_numeric_keys_exclude_raw_sql() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = format!("{}?mode=advisory&advisory_key=number", pg.url());
    let locker = Locker::connect(&url).await.expect("connect");
    let mut raw = sqlx::PgConnection::connect(&pg.url()).await.expect("raw");
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut raw)
        .await
        .expect("raw lock");
    assert!(
        locker.try_lock("4242").await.expect("try").is_none(),
        "dlock took a key raw SQL holds"
    );
    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut raw)
        .await
        .expect("raw unlock");
    let g = locker
        .try_lock("4242")
        .await
        .expect("try")
        .expect("free now");
    let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(4242)")
        .fetch_one(&mut raw)
        .await
        .expect("raw try");
    assert!(!taken, "raw SQL took a key dlock holds");
    g.release().await.expect("release");
    let err = locker.try_lock("not-a-number").await.expect_err("bad name");
    assert!(matches!(err, Error::InvalidName { .. }), "{err}");
}

/// Least privilege: once the tables exist, a role with only SELECT/INSERT/UPDATE on
/// them (and USAGE on the sequence) locks in every mode; it cannot create tables, and
/// says so clearly.
#[tokio::test]
async fn least_privilege_roles_lock() {
    let (Some(pg), Some(maria)) = (PgServer::start(), MariaDbServer::start()) else {
        return;
    };
    // The administrator's first connection creates the tables.
    drop(Locker::connect(&pg.url()).await.expect("admin"));
    drop(Locker::connect(&maria.url()).await.expect("admin"));
    let _ = pg.psql(
        "CREATE ROLE app LOGIN PASSWORD 'app-pw';
         GRANT SELECT, INSERT, UPDATE ON dlock_locks, dlock_holders, dlock_rows TO app;
         GRANT USAGE ON SEQUENCE dlock_fence TO app;",
    );
    let _ = maria.sql(
        "CREATE USER 'app'@'127.0.0.1' IDENTIFIED BY 'app-pw';
         GRANT SELECT, INSERT, UPDATE ON dlock.dlock_locks TO 'app'@'127.0.0.1';
         GRANT SELECT, INSERT, UPDATE ON dlock.dlock_holders TO 'app'@'127.0.0.1';
         GRANT SELECT, INSERT, UPDATE ON dlock.dlock_rows TO 'app'@'127.0.0.1';",
    );
    let pg_app = format!("postgres://app:app-pw@127.0.0.1:{}/postgres", pg.port());
    let maria_app = format!("mariadb://app:app-pw@127.0.0.1:{}/dlock", maria.port());
    for (app, admin, query) in [
        (&pg_app, pg.url(), ""),
        (&pg_app, pg.url(), "?mode=advisory"),
        (&pg_app, pg.url(), "?mode=row"),
        (&maria_app, maria.url(), ""),
        (&maria_app, maria.url(), "?mode=named"),
        (&maria_app, maria.url(), "?mode=row"),
    ] {
        let url = format!("{app}{query}");
        let locker = Locker::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        // A lock the administrator holds is shown to the role as held.
        let admin = Locker::connect(&format!("{admin}{query}"))
            .await
            .expect("admin");
        let theirs = admin.lock(&unique("admin")).await.expect("admin lock");
        let seen = locker
            .inspect(theirs.name())
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(
            seen.map(|i| i.fencing_token),
            Some(theirs.fencing_token()),
            "{url}: another user's hold"
        );
        theirs.release().await.expect("release");
        let name = unique("app");
        let g = locker
            .lock(&name)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(g.fencing_token() > 0);
        // Its own holds are visible to it without server-wide privileges.
        let seen = locker
            .inspect(&name)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(
            seen.map(|i| i.fencing_token),
            Some(g.fencing_token()),
            "{url}"
        );
        g.release().await.unwrap_or_else(|e| panic!("{url}: {e}"));
    }
    for url in [
        format!("{pg_app}?table_prefix=other"),
        format!("{maria_app}?table_prefix=other"),
    ] {
        let err = Locker::connect(&url)
            .await
            .expect_err("cannot create tables");
        let text = err.to_string();
        assert!(
            text.contains("denied") || text.contains("permission"),
            "{url}: {text}"
        );
        assert!(!text.contains("app-pw"), "{text}");
    }
}

/// MariaDB row mode: an observer that asks who holds a lock every 10 ms sees each new
/// holder within seconds, and each release. (`inspect` once read `INNODB_TRX`, which
/// InnoDB refreshes only after 100 ms without a reader: such an observer saw the first
/// answer for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_mode_holders_are_seen_by_an_observer_that_polls_fast() {
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    let url = format!("{}?mode=row", maria.url());
    let (a, b, observer) = (
        Locker::connect(&url).await.expect("connect"),
        Locker::connect(&url).await.expect("connect"),
        Locker::connect(&url).await.expect("connect"),
    );
    let name = unique("rowseen");
    let stop = tokio_util::sync::CancellationToken::new();
    let (seen_tx, mut seen) = tokio::sync::watch::channel(None::<u64>);
    let poller = tokio::spawn({
        let (observer, name, stop) = (observer.clone(), name.clone(), stop.clone());
        async move {
            while !stop.is_cancelled() {
                let now = observer.inspect(&name).await.expect("inspect");
                seen_tx.send_replace(now.map(|i| i.fencing_token));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    for locker in [&a, &b, &a] {
        let g = locker.lock(&name).await.expect("lock");
        let token = g.fencing_token();
        let shown =
            tokio::time::timeout(Duration::from_secs(5), seen.wait_for(|t| *t == Some(token)))
                .await
                .is_ok();
        assert!(
            shown,
            "holder with token {token} not seen in 5 s; the observer sees {:?}",
            *seen.borrow()
        );
        g.release().await.expect("release");
        let gone = tokio::time::timeout(Duration::from_secs(5), seen.wait_for(Option::is_none))
            .await
            .is_ok();
        assert!(gone, "a released hold still shown");
    }
    stop.cancel();
    poller.await.expect("poller");
}

/// Tables made by an earlier dlock have no `xact` column in the holder records: a
/// row-mode `open` by the tables' owner adds it, and row mode then records, shows and
/// releases holds (without the column, the token's statement fails). A role that may
/// not alter the tables opens the other modes, and row mode with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_holder_records_of_an_earlier_layout_gain_their_column() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    drop(Locker::connect(&pg.url()).await.expect("first open"));
    let _ = pg.psql(
        "ALTER TABLE dlock_holders DROP COLUMN xact;
         CREATE ROLE app LOGIN PASSWORD 'app-pw';
         GRANT SELECT, INSERT, UPDATE ON dlock_locks, dlock_holders, dlock_rows TO app;
         GRANT USAGE ON SEQUENCE dlock_fence TO app;",
    );
    // A role that may not alter the tables: the modes that do not need the column
    // work; row mode says what it lacks.
    let app = format!("postgres://app:app-pw@127.0.0.1:{}/postgres", pg.port());
    for query in ["", "?mode=advisory"] {
        let locker = Locker::connect(&format!("{app}{query}"))
            .await
            .unwrap_or_else(|e| panic!("{query}: open without the column: {e}"));
        let g = locker.lock(&unique("oldlayout")).await.expect("lock");
        g.release().await.expect("release");
    }
    match Locker::connect(&format!("{app}?mode=row")).await {
        Ok(_) => panic!("row mode opened without the column it needs"),
        // The server's refusal names the table to alter.
        Err(e) => assert!(
            e.to_string().contains("dlock_holders"),
            "row mode's refusal does not name the table: {e}"
        ),
    }
    let url = format!("{}?mode=row", pg.url());
    let (a, observer) = (
        Locker::connect(&url)
            .await
            .expect("open over the earlier layout"),
        Locker::connect(&url).await.expect("connect"),
    );
    let name = unique("layout");
    let g = a.lock(&name).await.expect("lock");
    let shown = observer.inspect(&name).await.expect("inspect");
    assert_eq!(shown.map(|i| i.fencing_token), Some(g.fencing_token()));
    g.release().await.expect("release");
    assert!(observer.inspect(&name).await.expect("inspect").is_none());
}

/// PostgreSQL row mode: a holder whose session ended is not shown by its record (its
/// transaction is over), and the lock is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_row_holder_whose_session_ended_is_not_shown() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = format!("{}?mode=row", pg.url());
    let (a, b) = two_lockers(&url).await;
    let name = unique("ended");
    let g = a.lock(&name).await.expect("lock");
    let first = g.fencing_token();
    assert_eq!(
        b.inspect(&name)
            .await
            .expect("inspect")
            .map(|i| i.fencing_token),
        Some(first)
    );
    let ended = pg.psql(&format!(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM dlock_holders \
         WHERE name = '{name}' AND pid <> 0) t"
    ));
    assert!(
        ended.contains('1'),
        "the holder's session was not ended: {ended}"
    );
    let freed = async {
        while b.inspect(&name).await.expect("inspect").is_some() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), freed)
        .await
        .expect("the ended holder still shown after 5 s");
    let next = tokio::time::timeout(Duration::from_secs(5), b.lock(&name))
        .await
        .expect("lock again within 5 s")
        .expect("lock again");
    assert!(next.fencing_token() > first);
    drop(g);
}

/// PostgreSQL row mode, watched by a role outside `pg_read_all_stats` (which sees no
/// other role's session start): the record of a holder whose session ended is not
/// shown even when a live session that locks another row has the same pid (made here
/// by rewriting the record's pid: a reused pid). Before, `inspect` went by the pid
/// and showed the ended holder and its token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_row_inspect_ignores_a_reused_pid() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = format!("{}?mode=row", pg.url());
    let admin = Locker::connect(&url).await.expect("admin");
    let _ = pg.psql(
        "CREATE ROLE watcher LOGIN PASSWORD 'watcher-pw';
         GRANT SELECT ON dlock_locks, dlock_holders, dlock_rows TO watcher;",
    );
    let watcher = Locker::connect(&format!(
        "postgres://watcher:watcher-pw@127.0.0.1:{}/postgres?mode=row",
        pg.port()
    ))
    .await
    .expect("watcher");
    let (ended, live) = (unique("ended"), unique("live"));
    let gone = admin.lock(&ended).await.expect("lock");
    let dead_pid = pg.psql(&format!(
        "SELECT pid FROM dlock_holders WHERE name = '{ended}'"
    ));
    let dead_pid = dead_pid.trim();
    let ended_sessions = pg.psql(&format!(
        "SELECT count(*) FROM (SELECT pg_terminate_backend({dead_pid})) t"
    ));
    assert_eq!(
        ended_sessions.trim(),
        "1",
        "the holder's session was not ended"
    );
    let exited = async {
        loop {
            let left = pg.psql(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = {dead_pid}"
            ));
            if left.trim() == "0" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), exited)
        .await
        .expect("the ended session still runs after 5 s");
    let still = admin.lock(&live).await.expect("lock another name");
    let rewritten = pg.psql(&format!(
        "WITH u AS (UPDATE dlock_holders
                    SET pid = (SELECT pid FROM dlock_holders WHERE name = '{live}')
                    WHERE name = '{ended}' AND pid <> 0 RETURNING 1)
         SELECT count(*) FROM u"
    ));
    assert_eq!(
        rewritten.trim(),
        "1",
        "the ended holder's record was not rewritten"
    );
    let shown = watcher.inspect(&ended).await.expect("inspect");
    assert!(
        shown.is_none(),
        "an ended holder shown through a reused pid: {shown:?}"
    );
    let live_shown = watcher.inspect(&live).await.expect("inspect");
    assert_eq!(
        live_shown.map(|i| i.fencing_token),
        Some(still.fencing_token()),
        "the live holder is not shown to the watcher"
    );
    drop(gone);
}

/// `inspect` shows `g` as its name's holder (in `round`); then `g` is released.
async fn shown_then_released(locker: &Locker, g: dlock::LockGuard, round: u32) {
    let info = locker.inspect(g.name()).await.expect("inspect");
    assert_eq!(
        info.map(|i| i.fencing_token),
        Some(g.fencing_token()),
        "round {round}: the holder is not shown"
    );
    g.release().await.expect("release");
}

/// PostgreSQL advisory mode: a hold's record names its session by pid and start
/// (`backend_start`, which a session connection reads when it is made and gives each
/// acquisition on it, bound in binary), on a new connection and on one kept idle from an earlier hold. `inspect`
/// shows the record only with its own session: a record whose start is another's (a
/// session that had the same pid before) is not the holder's, and the key shows as
/// held outside dlock.
#[tokio::test]
async fn postgres_advisory_record_names_its_session_by_its_start() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = format!("{}?mode=advisory", pg.url());
    let locker = Locker::connect(&url).await.expect("connect");
    let name = unique("advisory-start");
    let same_session = format!(
        "SELECT count(*) FROM dlock_holders h JOIN pg_stat_activity a
           ON a.pid = h.pid AND a.backend_start = h.backend_start
         WHERE h.name = '{name}'"
    );
    let mut pids = Vec::new();
    for round in 0..2 {
        let g = locker.lock(&name).await.expect("lock");
        assert_eq!(
            pg.psql(&same_session).trim(),
            "1",
            "round {round}: the record's start is not its session's"
        );
        pids.push(pg.psql(&format!(
            "SELECT pid FROM dlock_holders WHERE name = '{name}'"
        )));
        shown_then_released(&locker, g, round).await;
    }
    assert_eq!(
        pids[0], pids[1],
        "the second hold did not reuse the idle session connection"
    );
    let g = locker.lock(&name).await.expect("lock");
    let rewritten = pg.psql(&format!(
        "WITH u AS (UPDATE dlock_holders SET backend_start = backend_start - interval '1 day'
                    WHERE name = '{name}' AND backend_start IS NOT NULL RETURNING 1)
         SELECT count(*) FROM u"
    ));
    assert_eq!(rewritten.trim(), "1", "the record was not rewritten");
    let info = locker.inspect(&name).await.expect("inspect");
    let info = info.expect("a held key is reported free");
    assert_eq!(
        info.fencing_token, 0,
        "a record of another session shown as the holder: {info:?}"
    );
    g.release().await.expect("release");
}

/// PostgreSQL advisory mode under a role the login switches to (`ALTER ROLE … SET
/// role`) that lacks the login role's privileges: the server hides the session's own
/// `backend_start` from it (NULL). The lock is still taken and released, its record
/// names the session by its pid alone, and `inspect` shows the holder.
#[tokio::test]
async fn postgres_advisory_locks_where_the_session_start_is_hidden() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    drop(
        Locker::connect(&format!("{}?mode=advisory", pg.url()))
            .await
            .expect("admin"),
    );
    let _ = pg.psql(
        "CREATE ROLE worker NOLOGIN;
         GRANT SELECT, INSERT, UPDATE ON dlock_locks, dlock_holders, dlock_rows TO worker;
         GRANT USAGE ON SEQUENCE dlock_fence TO worker;
         CREATE ROLE gate LOGIN PASSWORD 'gate-pw' IN ROLE worker;
         ALTER ROLE gate SET role = 'worker';",
    );
    let url = format!(
        "postgres://gate:gate-pw@127.0.0.1:{}/postgres?mode=advisory",
        pg.port()
    );
    let locker = Locker::connect(&url).await.expect("connect as gate");
    let name = unique("hidden-start");
    for round in 0..2 {
        let g = locker
            .lock(&name)
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let record = pg.psql(&format!(
            "SELECT h.backend_start IS NULL, a.usename
             FROM dlock_holders h JOIN pg_stat_activity a ON a.pid = h.pid
             WHERE h.name = '{name}'"
        ));
        assert_eq!(
            record.trim(),
            "t|gate",
            "round {round}: no record of the gate session with its start hidden (NULL)"
        );
        shown_then_released(&locker, g, round).await;
    }
}

/// A MariaDB server whose default is `autocommit=0`: dlock's connections commit each
/// statement anyway. (Otherwise the row probe of `inspect` left its shared lock on an
/// idle pool connection, and the row could be taken by nobody after the first look.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_mode_ignores_the_servers_autocommit_default() {
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    let _ = maria.sql("SET GLOBAL autocommit = 0");
    assert_eq!(
        maria.sql("SELECT @@GLOBAL.autocommit").trim(),
        "0",
        "the server default did not change"
    );
    let url = format!("{}?mode=row", maria.url());
    let (a, b) = two_lockers(&url).await;
    let name = unique("autocommit");
    for round in 0..3 {
        assert!(
            a.inspect(&name).await.expect("inspect").is_none(),
            "round {round}: free lock shown held"
        );
        let g = tokio::time::timeout(Duration::from_secs(5), b.lock(&name))
            .await
            .unwrap_or_else(|_| panic!("round {round}: a free lock not taken in 5 s"))
            .expect("lock");
        let shown = a
            .inspect(&name)
            .await
            .expect("inspect")
            .map(|i| i.fencing_token);
        assert_eq!(
            shown,
            Some(g.fencing_token()),
            "round {round}: holder not shown"
        );
        g.release().await.expect("release");
    }
}

/// Row mode opens its own transaction and inlines its key: a role whose defaults are
/// serializable transactions and `standard_conforming_strings = off` still takes,
/// shows, releases and hands over the lock (a release whose update ran under the
/// role's isolation saw the record as it was before the token was taken, so it left
/// the record naming the session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_mode_ignores_the_roles_session_defaults() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    drop(Locker::connect(&pg.url()).await.expect("admin"));
    let _ = pg.psql(
        "CREATE ROLE strict LOGIN PASSWORD 'strict-pw';
         GRANT SELECT, INSERT, UPDATE ON dlock_locks, dlock_holders, dlock_rows TO strict;
         GRANT USAGE ON SEQUENCE dlock_fence TO strict;
         ALTER ROLE strict SET default_transaction_isolation = 'serializable';
         ALTER ROLE strict SET standard_conforming_strings = off;",
    );
    let url = format!(
        "postgres://strict:strict-pw@127.0.0.1:{}/postgres?mode=row",
        pg.port()
    );
    let locker = Locker::connect(&url).await.expect("connect");
    let other = Locker::connect(&url).await.expect("connect");
    let name = unique("strict");
    let mut last = 0;
    for round in 0..3 {
        let g = locker.lock(&name).await.expect("lock");
        assert!(g.fencing_token() > last, "round {round}");
        last = g.fencing_token();
        let info = other.inspect(&name).await.expect("inspect");
        assert_eq!(
            info.map(|i| i.fencing_token),
            Some(last),
            "round {round}: inspect shows the holder"
        );
        // A waiter of another locker gets the lock after the release.
        let waiter = {
            let (other, name) = (other.clone(), name.clone());
            tokio::spawn(async move {
                let opts =
                    dlock::LockOptions::new().wait(dlock::Wait::Timeout(Duration::from_secs(10)));
                let g = other.lock_with(&name, &opts).await.expect("waiter");
                let token = g.fencing_token();
                g.release().await.expect("waiter's release");
                token
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        g.release().await.expect("release");
        let token = waiter.await.expect("waiter task");
        assert!(
            token > last,
            "round {round}: the waiter's token comes after"
        );
        last = token;
        assert!(other.inspect(&name).await.expect("inspect").is_none());
        // The released record no longer names the waiter's session, which now locks
        // another row (its idle connection is reused): the name still reads free.
        let elsewhere = other.lock(&unique("elsewhere")).await.expect("lock");
        assert!(
            locker.inspect(&name).await.expect("inspect").is_none(),
            "round {round}: a released name shown held by its last holder's session"
        );
        elsewhere.release().await.expect("release");
    }
}

/// A wrong password is a clear error that does not show the password.
#[tokio::test]
async fn wrong_password_is_reported_without_it() {
    let (Some(pg), Some(maria)) = (PgServer::start(), MariaDbServer::start()) else {
        return;
    };
    for url in [
        pg.url().replace(PG_PASSWORD, "WRONGpwMARKER"),
        format!(
            "mariadb://root:WRONGpwMARKER@127.0.0.1:{}/dlock",
            maria.port()
        ),
    ] {
        let err = Locker::connect(&url).await.expect_err("wrong password");
        let all = format!("{err} {err:?}");
        assert!(!all.contains("WRONGpwMARKER"), "{all}");
        assert!(
            all.contains("password") || all.contains("denied"),
            "unclear error: {all}"
        );
    }
}

/// `inspect` asks the server what an acquire asks: a key held by a psql session shows
/// as held — never as free while `try_lock` would refuse it; another spelling of a
/// number (`042` for `42`) is not a name of that lock.
#[tokio::test]
async fn inspect_sees_every_holder_of_an_advisory_key() {
    let (Some(pg), Some(maria)) = (PgServer::start(), MariaDbServer::start()) else {
        return;
    };
    let url = format!("{}?mode=advisory&advisory_key=number", pg.url());
    let locker = Locker::connect(&url).await.expect("connect");
    let mut raw = sqlx::PgConnection::connect(&pg.url()).await.expect("raw");
    sqlx::query("SELECT pg_advisory_lock(7)")
        .execute(&mut raw)
        .await
        .expect("raw lock");
    assert!(locker.try_lock("7").await.expect("try").is_none());
    let info = locker.inspect("7").await.expect("inspect");
    let info = info.expect("a key psql holds is reported free");
    assert_eq!(
        info.fencing_token, 0,
        "a foreign holder has no token: {info:?}"
    );
    assert!(info.owner.contains("pid"), "{info:?}");
    sqlx::query("SELECT pg_advisory_unlock(7)")
        .execute(&mut raw)
        .await
        .expect("raw unlock");
    assert!(locker.inspect("7").await.expect("inspect").is_none());
    // dlock holds 42; another spelling of the same key (042) is refused: one lock,
    // one name (two names of one lock would defeat lock_all's order).
    let g = locker.lock("42").await.expect("lock");
    assert!(matches!(
        locker.try_lock("042").await,
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        locker.inspect("042").await,
        Err(Error::InvalidName { .. })
    ));
    let info = locker.inspect("42").await.expect("inspect").expect("held");
    assert_eq!(info.fencing_token, g.fencing_token());
    g.release().await.expect("release");

    // MariaDB GET_LOCK held by a connection outside dlock, under dlock's server name.
    let url = format!("{}?mode=named", maria.url());
    let locker = Locker::connect(&url).await.expect("connect");
    let key = dlock::sql::lock_key(&dlock::name::LockName::new("job").expect("name"));
    let server_name: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut raw = sqlx::MySqlConnection::connect(&maria.url())
        .await
        .expect("raw");
    let got: i64 = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
        .bind(&server_name)
        .fetch_one(&mut raw)
        .await
        .expect("raw GET_LOCK");
    assert_eq!(got, 1);
    assert!(locker.try_lock("job").await.expect("try").is_none());
    let info = locker.inspect("job").await.expect("inspect");
    assert!(
        info.is_some(),
        "a GET_LOCK held outside dlock is reported free"
    );
    drop(raw);

    // MariaDB row mode: the name's row locked by a transaction outside dlock, after a
    // dlock holder had come and gone (its record stays, naming it).
    let url = format!("{}?mode=row", maria.url());
    let locker = Locker::connect(&url).await.expect("connect");
    taken_once(&locker, "job").await;
    let mut raw = sqlx::MySqlConnection::connect(&maria.url())
        .await
        .expect("raw");
    row_locked_outside(&mut raw, &key).await;
    assert!(locker.try_lock("job").await.expect("try").is_none());
    let info = locker
        .inspect("job")
        .await
        .expect("inspect")
        .expect("a row locked outside dlock is reported free");
    assert_eq!(info.fencing_token, 0, "{info:?}");
    sqlx::query("ROLLBACK")
        .execute(&mut raw)
        .await
        .expect("end");
    assert!(locker.inspect("job").await.expect("inspect").is_none());
}

/// `Locker::list(prefix)` in every mode of both servers: the held locks under the
/// prefix, exactly, in byte order — not a released one, not one outside the prefix, and
/// a prefix with `%` and `_` is not a pattern.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn list_shows_the_held_locks_under_a_prefix() {
    let (Some(pg), Some(maria)) = (PgServer::start(), MariaDbServer::start()) else {
        return;
    };
    for url in [
        pg.url(),
        format!("{}?mode=advisory", pg.url()),
        format!("{}?mode=row", pg.url()),
        maria.url(),
        format!("{}?mode=named", maria.url()),
        format!("{}?mode=row", maria.url()),
    ] {
        let locker = Locker::connect(&url).await.expect("connect");
        let base = unique("list");
        let prefix = format!("{base}:A%_");
        let held = [format!("{prefix}2"), format!("{prefix}1")];
        let mut guards = Vec::new();
        for name in &held {
            guards.push(locker.lock(name).await.expect("lock"));
        }
        let released = locker.lock(&format!("{prefix}3")).await.expect("lock");
        released.release().await.expect("release");
        let outside = locker.lock(&format!("{base}:a%_9")).await.expect("lock");
        let wildcard = locker.lock(&format!("{base}:AB_1")).await.expect("lock");
        let listed: Vec<String> = locker
            .list(&prefix)
            .await
            .expect("list")
            .into_iter()
            .map(|i| i.name)
            .collect();
        assert_eq!(listed, [held[1].clone(), held[0].clone()], "{url}");
        drop((outside, wildcard, guards));
    }
}

/// `Locker::break_lock` in lease mode on both servers: the hold seen by `inspect` ends,
/// its holder hears of it at its next renewal, a stale token breaks nothing, the next
/// grant's token is higher; session modes refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn break_lock_ends_the_hold_it_was_shown() {
    let (Some(pg), Some(maria)) = (PgServer::start(), MariaDbServer::start()) else {
        return;
    };
    for url in [pg.url(), maria.url()] {
        let (a, b) = two_lockers(&url).await;
        let name = unique("break");
        let opts = dlock::LockOptions::new().ttl(Duration::from_secs(2));
        let held = a.lock_with(&name, &opts).await.expect("lock");
        let seen = b.inspect(&name).await.expect("inspect").expect("held");
        assert_eq!(seen.fencing_token, held.fencing_token());
        assert!(
            !b.break_lock(&name, seen.fencing_token + 1)
                .await
                .expect("break")
        );
        assert!(
            b.break_lock(&name, seen.fencing_token)
                .await
                .expect("break")
        );
        tokio::time::timeout(Duration::from_secs(5), held.lost())
            .await
            .unwrap_or_else(|_| panic!("{url}: the holder never heard of the break"));
        let next = b
            .try_lock(&name)
            .await
            .expect("try")
            .expect("free after the break");
        assert!(next.fencing_token() > seen.fencing_token, "{url}");
        assert!(
            !b.break_lock(&name, seen.fencing_token)
                .await
                .expect("break")
        );
        next.release().await.expect("release");
    }
    let session = Locker::connect(&format!("{}?mode=advisory", pg.url()))
        .await
        .expect("connect");
    let name = unique("break-session");
    let g = session.lock(&name).await.expect("lock");
    let token = session
        .inspect(&name)
        .await
        .expect("inspect")
        .expect("held")
        .fencing_token;
    assert!(matches!(
        session.break_lock(&name, token).await,
        Err(Error::Unsupported(_))
    ));
    g.release().await.expect("release");
}

/// A session connection left idle past the server's limit for silent sessions
/// (PostgreSQL 14 and later: five heartbeats, at least 5 s) is never handed to the next
/// acquisition: it was kept for 5 min, and the lock after such a pause failed with the
/// server's "terminating connection due to idle-session timeout" (57P05).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_connection_is_dropped_before_the_server_ends_it() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let after_a_pause = |mode: &'static str| {
        let url = format!("{}?mode={mode}&heartbeat=200ms", pg.url());
        async move {
            let locker = Locker::connect(&url).await.expect("connect");
            let name = unique("idle");
            let g = locker.lock(&name).await.expect("first lock");
            g.release().await.expect("release");
            // Past the server's 5 s, with the released session's connection idle.
            tokio::time::sleep(Duration::from_millis(5_800)).await;
            let g = locker
                .lock(&name)
                .await
                .unwrap_or_else(|e| panic!("{mode}: the lock after a pause: {e}"));
            g.release().await.expect("release");
        }
    };
    tokio::join!(after_a_pause("advisory"), after_a_pause("row"));
}

/// The lease statements' own connections are not kept idle past the server's limit
/// for idle sessions either (`idle_session_timeout`, set here server-wide as an
/// operator would): they were kept for 5 min, so the first lock after a pause met a
/// connection the server had ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_lease_connection_is_dropped_before_the_server_ends_it() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let mut admin = sqlx::PgConnection::connect(&pg.url()).await.expect("admin");
    sqlx::query("ALTER SYSTEM SET idle_session_timeout = '2s'")
        .execute(&mut admin)
        .await
        .expect("set");
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&mut admin)
        .await
        .expect("reload");
    let _ = admin.close().await;
    // The reload reaches new sessions once the postmaster has read it: wait until one
    // sees it (bounded).
    let mut seen = String::new();
    for _ in 0..50 {
        let mut probe = sqlx::PgConnection::connect(&pg.url()).await.expect("probe");
        seen = sqlx::query_scalar("SHOW idle_session_timeout")
            .fetch_one(&mut probe)
            .await
            .expect("show");
        let _ = probe.close().await;
        if seen == "2s" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(seen, "2s", "the server never took the setting");
    let locker = Locker::connect(&pg.url()).await.expect("connect");
    let name = unique("idle-lease");
    for round in 0..3 {
        let g = locker
            .try_lock(&name)
            .await
            .unwrap_or_else(|e| panic!("round {round}: the lock after a pause: {e}"))
            .expect("free");
        // A statement on the pool too (whose idle connections must go as early).
        locker
            .inspect(&name)
            .await
            .unwrap_or_else(|e| panic!("round {round}: inspect after a pause: {e}"))
            .expect("held");
        g.release().await.expect("release");
        // Past the server's 2 s, with the lease and pool connections idle.
        tokio::time::sleep(Duration::from_millis(2_600)).await;
    }
}

/// How often the waiting statements are counted: MariaDB refreshes what
/// `INNODB_TRX` shows only when it went unread for more than 100 ms, so polled faster
/// it can show the same count for ever.
const POLL_TRX: Duration = Duration::from_millis(150);

/// Poll `$count` (a statement counting the acquires that wait for a row lock, on the
/// observer connection `$conn`) until one does (bounded).
macro_rules! until_an_acquire_waits {
    ($conn:expr, $count:expr) => {{
        let mut waits = false;
        for _ in 0..100 {
            let n: i64 = sqlx::query_scalar($count)
                .fetch_one(&mut $conn)
                .await
                .expect("count the waiting acquires");
            if n >= 1 {
                waits = true;
                break;
            }
            tokio::time::sleep(POLL_TRX).await;
        }
        assert!(waits, "the acquire never waited for the row");
    }};
}

/// Poll `$count` on `$conn` until no acquire waits for a row lock any more (bounded):
/// the one that waited has run.
macro_rules! until_no_acquire_waits {
    ($conn:expr, $count:expr) => {{
        for _ in 0..100 {
            let n: i64 = sqlx::query_scalar($count)
                .fetch_one(&mut $conn)
                .await
                .expect("count the waiting acquires");
            if n == 0 {
                break;
            }
            tokio::time::sleep(POLL_TRX).await;
        }
    }};
}

/// PostgreSQL: lock the name's lease row and write nothing (binds the name; counts
/// the rows locked).
const PG_LOCK_ROW: &str =
    "SELECT count(*) FROM (SELECT 1 FROM dlock_locks WHERE name = $1 FOR UPDATE) r";

/// PostgreSQL: how many statements on the lease table (acquires, renewals) wait for
/// a row lock.
const PG_ROW_WAITS: &str = "SELECT count(*) FROM pg_stat_activity
                            WHERE wait_event_type = 'Lock' AND query LIKE '%dlock_locks%'";

/// A locker, a fresh name whose lease row exists (taken and released once), and the
/// owner (with options naming it) that took it.
async fn an_owner_whose_row_exists(
    url: &str,
) -> (Locker, String, dlock::Owner, dlock::LockOptions) {
    let locker = Locker::connect(url).await.expect("connect");
    let name = unique("late-reentry");
    let owner = dlock::Owner::random();
    let mine = dlock::LockOptions::new().owner(owner.clone());
    locker
        .lock_with(&name, &mine)
        .await
        .expect("lock")
        .release()
        .await
        .expect("release");
    (locker, name, owner, mine)
}

/// The acquire `waiting` (of the owner whose hold with `ended_token` ended while it
/// waited) was a new grant: a new token, and the lock is free once it is released.
async fn a_new_grant_after_the_ended_hold(
    waiting: tokio::task::JoinHandle<dlock::Result<Option<dlock::LockGuard>>>,
    ended_token: i64,
    url: &str,
    name: &str,
) {
    let g = waiting
        .await
        .expect("task")
        .expect("try_lock")
        .expect("free: the other hold's lease ended");
    let ended_token = u64::try_from(ended_token).expect("a positive token");
    assert!(
        g.fencing_token() > ended_token,
        "token {} re-granted after its lease ended",
        g.fencing_token()
    );
    g.release().await.expect("release");
    assert_free_to_another(
        url,
        name,
        "the lock stayed taken after its only live hold was released",
    )
    .await;
}

/// Another client takes `name` at once (else panic with `why`), and gives it back.
async fn assert_free_to_another(url: &str, name: &str, why: &str) {
    let other = Locker::connect(url).await.expect("connect");
    let g = other.try_lock(name).await.expect("try_lock");
    let g = g.unwrap_or_else(|| panic!("{why}"));
    g.release().await.expect("release");
}

/// PostgreSQL lease mode: an acquire that has to wait for the lock's row (another
/// client's statement has it locked) takes its fencing token *after* that wait. A
/// token drawn before it is lower than the token of a grant the other client
/// committed meanwhile: the next holder's writes would then lose to the delayed
/// writes of the one before (the crowd of `lock_all` found it, 1 run in about 70).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_token_is_drawn_after_waiting_for_the_row() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = pg.url();
    let locker = Locker::connect(&url).await.expect("connect");
    let name = unique("late-token");
    // The lock's row exists (it is kept after a release).
    let first = locker.lock(&name).await.expect("lock");
    let first_token = first.fencing_token();
    first.release().await.expect("release");

    // Another client's statement holds the row.
    let mut rival = sqlx::PgConnection::connect(&url).await.expect("rival");
    let mut tx = rival.begin().await.expect("begin");
    let locked: i64 = sqlx::query_scalar(PG_LOCK_ROW)
        .bind(&name)
        .fetch_one(&mut *tx)
        .await
        .expect("lock the row");
    assert_eq!(locked, 1, "the lock's row");

    let waiting = {
        let (locker, name) = (locker.clone(), name.clone());
        tokio::spawn(async move { locker.try_lock(&name).await })
    };
    // Until the acquire waits for the row (bounded).
    let mut observer = sqlx::PgConnection::connect(&url).await.expect("observer");
    until_an_acquire_waits!(
        observer,
        "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO dlock_locks%'"
    );

    // Meanwhile the other client is granted the lock and releases it: a newer token
    // on the row.
    let rival_token: i64 = sqlx::query_scalar(
        "UPDATE dlock_locks SET owner = 'rival', fence = nextval('dlock_fence'), holds = 0
         WHERE name = $1 RETURNING fence",
    )
    .bind(&name)
    .fetch_one(&mut *tx)
    .await
    .expect("the rival's grant");
    tx.commit().await.expect("commit");
    let rival_token = u64::try_from(rival_token).expect("a positive token");
    assert!(rival_token > first_token);

    let g = waiting
        .await
        .expect("task")
        .expect("try_lock")
        .expect("free once the rival released");
    assert!(
        g.fencing_token() > rival_token,
        "token {} granted after the rival's {rival_token}: tokens went backwards",
        g.fencing_token()
    );
    g.release().await.expect("release");
}

/// PostgreSQL lease mode: whether the row is a live hold of the same owner (to be
/// re-entered with its token) is judged when the row is locked, not when the statement
/// started. An acquire that started while another process of the owner held the lock
/// and ran after that lease had ended re-entered the ended hold: the retired token
/// again (the ended holder's late writes still accepted), and a hold count that kept
/// the lock taken after the new holder's release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_reentry_is_judged_when_the_row_is_locked() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = pg.url();
    let (locker, name, owner, mine) = an_owner_whose_row_exists(&url).await;

    // Another process of the same owner holds the lock with a short lease, and its
    // statement still has the row locked.
    let mut rival = sqlx::PgConnection::connect(&url).await.expect("rival");
    let mut tx = rival.begin().await.expect("begin");
    let ended_token: i64 = sqlx::query_scalar(
        "UPDATE dlock_locks SET holds = 1, fence = nextval('dlock_fence'),
                expires_at = clock_timestamp() + interval '1 second'
         WHERE name = $1 AND owner = $2 RETURNING fence",
    )
    .bind(&name)
    .bind(owner.as_str())
    .fetch_one(&mut *tx)
    .await
    .expect("the other process's hold");
    let waiting = {
        let (locker, name, mine) = (locker.clone(), name.clone(), mine.clone());
        tokio::spawn(async move { locker.try_lock_with(&name, &mine).await })
    };
    let mut observer = sqlx::PgConnection::connect(&url).await.expect("observer");
    until_an_acquire_waits!(
        observer,
        "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO dlock_locks%'"
    );
    // That lease ends while the acquire waits.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    tx.commit().await.expect("commit");

    a_new_grant_after_the_ended_hold(waiting, ended_token, &url, &name).await;
}

/// MariaDB lease mode: whether the asking owner's own lease has run out (then a new
/// grant with a new token, never a re-entry of the ended hold) is judged by the clock
/// when the statement runs, not when it started — the statement may wait for the row
/// while that lease ends (the same as `postgres_lease_reentry_is_judged_when_the_row_is_locked`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_lease_reentry_is_judged_when_the_row_is_locked() {
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    let url = maria.url();
    let (locker, name, owner, mine) = an_owner_whose_row_exists(&url).await;

    // Another process of the same owner holds the lock with a short lease, and its
    // statement still has the row locked.
    let mut rival = sqlx::MySqlConnection::connect(&url).await.expect("rival");
    let mut tx = rival.begin().await.expect("begin");
    let updated = sqlx::query(
        "UPDATE dlock_locks SET holds = 1, fence = fence + 1,
                expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 SECOND
         WHERE name = ? AND owner = ?",
    )
    .bind(&name)
    .bind(owner.as_str().as_bytes())
    .execute(&mut *tx)
    .await
    .expect("the other process's hold");
    assert_eq!(updated.rows_affected(), 1, "the lock's row");
    let ended_token: i64 = sqlx::query_scalar("SELECT fence FROM dlock_locks WHERE name = ?")
        .bind(&name)
        .fetch_one(&mut *tx)
        .await
        .expect("its token");
    let waiting = {
        let (locker, name, mine) = (locker.clone(), name.clone(), mine.clone());
        tokio::spawn(async move { locker.try_lock_with(&name, &mine).await })
    };
    let mut observer = sqlx::MySqlConnection::connect(&url)
        .await
        .expect("observer");
    until_an_acquire_waits!(
        observer,
        "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'"
    );
    // That lease ends while the acquire waits.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    tx.commit().await.expect("commit");

    a_new_grant_after_the_ended_hold(waiting, ended_token, &url, &name).await;
}

/// An acquire whose client gave up — its statement waited for the lock's row past the
/// client's `timeout` — grants nothing when the row comes free. The server does not
/// see that the client went away, so the statement ran on and granted a lock no one
/// knew of, kept from everyone for a TTL. `$server` starts the server, `$conn` is its
/// sqlx connection type; `$lock_row` locks the name's row (binds the name) and
/// `$waiting` counts the acquires that wait for a row lock.
macro_rules! abandoned_acquire_grants_nothing {
    ($server:ty, $conn:ty, $lock_row:expr, $waiting:expr) => {{
        let Some(server) = <$server>::start() else {
            return;
        };
        let url = server.url();
        let (locker, name, _, _) = an_owner_whose_row_exists(&url).await;
        let impatient = Locker::connect(&format!("{url}?timeout=1s"))
            .await
            .expect("connect");

        let mut rival = <$conn>::connect(&url).await.expect("rival");
        let mut tx = rival.begin().await.expect("begin");
        let locked: i64 = sqlx::query_scalar($lock_row)
            .bind(&name)
            .fetch_one(&mut *tx)
            .await
            .expect("lock the row");
        assert_eq!(locked, 1, "the lock's row");
        let started = Instant::now();
        match impatient.try_lock(&name).await {
            Err(_) => {}
            Ok(g) => panic!("an acquire answered while its row was locked: {g:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the client's 1 s timeout took {:?}",
            started.elapsed()
        );
        // The abandoned statement still waits on the server.
        let mut observer = <$conn>::connect(&url).await.expect("observer");
        until_an_acquire_waits!(observer, $waiting);
        tx.commit().await.expect("commit");
        // Once it has run (bounded), the lock is free.
        until_no_acquire_waits!(observer, $waiting);
        assert!(
            locker.try_lock(&name).await.expect("try_lock").is_some(),
            "the lock was granted to a client that had given up"
        );
    }};
}

/// PostgreSQL lease mode: [`abandoned_acquire_grants_nothing`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_acquire_abandoned_by_its_client_grants_nothing() {
    abandoned_acquire_grants_nothing!(PgServer, sqlx::PgConnection, PG_LOCK_ROW, PG_ROW_WAITS);
}

/// MariaDB lease mode: [`abandoned_acquire_grants_nothing`] (there the statement may
/// wait for the row as long as `innodb_lock_wait_timeout`, 50 s by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_lease_acquire_abandoned_by_its_client_grants_nothing() {
    abandoned_acquire_grants_nothing!(
        MariaDbServer,
        sqlx::MySqlConnection,
        "SELECT COUNT(*) FROM (SELECT 1 FROM dlock_locks WHERE name = ? FOR UPDATE) r",
        "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'"
    );
}

/// MariaDB lease mode on a server whose `sql_mode` has `SIMULTANEOUS_ASSIGNMENT` (every
/// assignment of an update reads the row as it was): a grant over another owner's
/// ended lease still gets a lease of its own. (An expiry assigned only when the owner
/// column, read before the grant changed it, named the new holder kept the old, past
/// expiry: a second owner was granted the lock at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_lease_grant_holds_under_simultaneous_assignment() {
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    let _ =
        maria.sql("SET GLOBAL sql_mode = CONCAT(@@GLOBAL.sql_mode, ',SIMULTANEOUS_ASSIGNMENT')");
    assert!(
        maria
            .sql("SELECT @@GLOBAL.sql_mode")
            .contains("SIMULTANEOUS_ASSIGNMENT"),
        "the server's sql_mode did not change"
    );
    let url = maria.url();
    let (a, b) = two_lockers(&url).await;
    for round in 0..3 {
        let name = unique("simultaneous");
        // The name's row holds another owner's lease, ended a second ago.
        a.lock(&name)
            .await
            .expect("lock")
            .release()
            .await
            .expect("release");
        let mut conn = sqlx::MySqlConnection::connect(&url).await.expect("connect");
        let ended = sqlx::query(
            "UPDATE dlock_locks SET owner = 'gone', holds = 1,
                    expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND
             WHERE name = ?",
        )
        .bind(&name)
        .execute(&mut conn)
        .await
        .expect("an ended lease");
        assert_eq!(ended.rows_affected(), 1, "round {round}: the lock's row");
        let held = a
            .try_lock(&name)
            .await
            .expect("try_lock")
            .unwrap_or_else(|| panic!("round {round}: an ended lease kept the lock"));
        assert!(
            b.try_lock(&name).await.expect("try_lock").is_none(),
            "round {round}: a second owner was granted the lock held with token {}",
            held.fencing_token()
        );
        held.release().await.expect("release");
    }
}

/// A lock `label` held on `url` for `ttl`, its renewal left to the test (with the
/// locker that holds it, which must outlive it).
async fn held_unrenewed(
    url: &str,
    label: &str,
    ttl: Duration,
) -> (Locker, String, dlock::LockGuard) {
    let locker = Locker::connect(url).await.expect("connect");
    let name = unique(label);
    let once = dlock::LockOptions::new()
        .ttl(ttl)
        .renewal(dlock::Renewal::Off);
    let held = locker.lock_with(&name, &once).await.expect("lock");
    (locker, name, held)
}

/// PostgreSQL lease mode: a renewal that waited for the lock's row while the lease
/// ended does not bring the ended lease back, also when the transaction it waited
/// for only locked the row (a busy acquire, a `FOR UPDATE`): an UPDATE judges its
/// condition when it reads the row and, after such a wait, goes on with that answer.
/// The lease held by two holds of one owner stayed taken for the renewal's TTL after
/// it had ended (and a re-entry of the owner would have taken the retired token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_renewal_is_judged_when_the_row_is_locked() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = pg.url();
    let (_locker, name, held) = held_unrenewed(&url, "late-renewal", Duration::from_secs(1)).await;
    // Another process of the owner holds it too (its hold count stays when this one's
    // keeper gives its hold back after the loss).
    let mut rival = sqlx::PgConnection::connect(&url).await.expect("rival");
    let reentered = sqlx::query("UPDATE dlock_locks SET holds = holds + 1 WHERE name = $1")
        .bind(&name)
        .execute(&mut rival)
        .await
        .expect("a second hold");
    assert_eq!(reentered.rows_affected(), 1, "the lock's row");

    // Another transaction locks the row and writes nothing.
    let mut tx = rival.begin().await.expect("begin");
    let locked: i64 = sqlx::query_scalar(PG_LOCK_ROW)
        .bind(&name)
        .fetch_one(&mut *tx)
        .await
        .expect("lock the row");
    assert_eq!(locked, 1, "the lock's row");
    let mut observer = sqlx::PgConnection::connect(&url).await.expect("observer");
    // A renewal asking for 5 s more starts while the lease is live and waits for the
    // row; the lease (1 s) ends meanwhile.
    let (_, ()) = tokio::join!(held.extend(Duration::from_secs(5)), async {
        until_an_acquire_waits!(observer, PG_ROW_WAITS);
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        tx.commit().await.expect("commit");
        until_no_acquire_waits!(observer, PG_ROW_WAITS);
    });
    assert_free_to_another(
        &url,
        &name,
        "a renewal that waited for the row brought the ended lease back",
    )
    .await;
}

/// PostgreSQL lease mode: a waiter behind a lease that ends without a release (its
/// holder cut off: no release is announced) takes the lock when the lease ends, not
/// at its next look: a busy answer to a waiter's second or later try says how long the
/// lease has left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_waiter_takes_a_lease_ended_unreleased_when_it_ends() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = pg.url();
    let proxy = proxied(pg_addr(&pg)).await;
    // Its poller would look only every minute; a wait without the hint lasts a second.
    let waiter = Locker::connect(&format!("{url}?poll=60s"))
        .await
        .expect("connect");
    let ttl = Duration::from_secs(3);
    // The holder reaches the server through the proxy, which then goes silent: its
    // release (and any announcement) never arrives.
    let (_holder, name, held) =
        held_unrenewed(&via(&url, pg.port(), &proxy), "ended-unreleased", ttl).await;
    let granted = Instant::now();
    proxy.set(Fault::Blackhole);
    // The wait starts 1.5 s before the lease ends: looks a second apart from there
    // (timers fire late, never early) would take it 0.5 s after the end at the soonest.
    tokio::time::sleep_until(granted + ttl - Duration::from_millis(1_500)).await;
    let g = waiter
        .lock_timeout(&name, Duration::from_secs(10))
        .await
        .expect("the ended lease is taken");
    let after = granted.elapsed();
    g.release().await.expect("release");
    drop(held);
    assert!(
        after < ttl + Duration::from_millis(400),
        "a lease of {ttl:?} that ended unreleased was taken after {after:?}"
    );
}

/// PostgreSQL lease mode: a renewal whose row is deleted by hand while it waits for
/// it renews nothing (the renewal is an insert whose conflict updates: with the row
/// gone, what it inserts is a free row, not a renewed lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lease_renewal_of_a_deleted_row_renews_nothing() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = pg.url();
    let (_locker, name, held) =
        held_unrenewed(&url, "deleted-renewal", Duration::from_secs(5)).await;

    // An operator deletes the row; the renewal starts before that commits.
    let mut rival = sqlx::PgConnection::connect(&url).await.expect("rival");
    let mut tx = rival.begin().await.expect("begin");
    let deleted = sqlx::query("DELETE FROM dlock_locks WHERE name = $1")
        .bind(&name)
        .execute(&mut *tx)
        .await
        .expect("delete");
    assert_eq!(deleted.rows_affected(), 1, "the lock's row");
    let mut observer = sqlx::PgConnection::connect(&url).await.expect("observer");
    let (renewed, ()) = tokio::join!(held.extend(Duration::from_secs(5)), async {
        until_an_acquire_waits!(observer, PG_ROW_WAITS);
        tx.commit().await.expect("commit");
    });
    assert!(
        renewed.is_err(),
        "a renewal of a deleted row was reported renewed"
    );

    // An acquire that started on that row and found it taken meanwhile answers busy
    // (its wait is computed from the row it started on, so that row's expiry must be
    // a finite time).
    let other = Locker::connect(&url).await.expect("connect");
    let mut tx = rival.begin().await.expect("begin");
    let taken = sqlx::query(
        "UPDATE dlock_locks SET owner = 'rival', holds = 1,
                expires_at = statement_timestamp() + interval '1 minute'
         WHERE name = $1",
    )
    .bind(&name)
    .execute(&mut *tx)
    .await
    .expect("the rival's grant");
    assert_eq!(taken.rows_affected(), 1, "the row the renewal put back");
    let (answer, ()) = tokio::join!(other.try_lock(&name), async {
        until_an_acquire_waits!(observer, PG_ROW_WAITS);
        tx.commit().await.expect("commit");
    });
    assert!(
        answer.expect("a busy answer, not an error").is_none(),
        "granted while the rival held it"
    );
    sqlx::query("UPDATE dlock_locks SET holds = 0 WHERE name = $1")
        .bind(&name)
        .execute(&mut rival)
        .await
        .expect("the rival's release");
    assert!(
        other.try_lock(&name).await.expect("try_lock").is_some(),
        "the row a renewal put back holds the lock"
    );
}

/// Advisory locks a process's waiter marks hold (shared, two-`int4` form).
async fn waiter_marks(observer: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
         AND mode = 'ShareLock' AND granted",
    )
    .fetch_one(observer)
    .await
    .expect("marks")
}

/// Until some waiter mark is held (`any`) or none is, at most 10 s (else `what`).
async fn until_marks(observer: &mut sqlx::PgConnection, any: bool, what: &str) {
    let since = Instant::now();
    while (waiter_marks(observer).await > 0) != any {
        assert!(since.elapsed() < Duration::from_secs(10), "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `a` takes `name`; a waiter of `b` (another process, as far as the server can tell,
/// with a re-poll a minute away) marks the key, and `a`'s release must wake it within
/// 5 s. The waiter's guard (`mode` names the case in messages).
async fn woken_elsewhere(
    a: &Locker,
    b: &Locker,
    name: &str,
    observer: &mut sqlx::PgConnection,
    mode: &str,
) -> dlock::LockGuard {
    let held = a
        .lock_with(
            name,
            &dlock::LockOptions::new().ttl(Duration::from_secs(60)),
        )
        .await
        .expect("lock");
    let waiter = {
        let (b, name) = (b.clone(), name.to_owned());
        tokio::spawn(async move { b.lock_timeout(&name, Duration::from_secs(30)).await })
    };
    until_marks(
        observer,
        true,
        &format!("{mode}: the waiter never marked the key"),
    )
    .await;
    // The attempt the mark's wake-up causes is over: only the notification can wake
    // the waiter now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    held.release().await.expect("release");
    let got = waiter.await.expect("join").expect("the waiter is woken");
    let woken = released.elapsed();
    assert!(
        woken < Duration::from_secs(5),
        "{mode}: a waiter whose re-poll is 60 s away took {woken:?}"
    );
    got
}

/// PostgreSQL, every mode: a release nobody waits for sends no `NOTIFY` (it would cost
/// the server a queue write and every listening process a message); a release somebody
/// waits for does, and wakes that waiter at once although its re-poll is a minute
/// away. The waiter's mark goes with its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_releases_notify_only_keys_waited_for() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let mut listener = sqlx::postgres::PgListener::connect(&pg.url())
        .await
        .expect("listener");
    listener.listen("dlock_released").await.expect("listen");
    let mut observer = sqlx::PgConnection::connect(&pg.url())
        .await
        .expect("observer");
    for mode in ["lease", "advisory", "row"] {
        let url = format!("{}?mode={mode}&poll=60s", pg.url());
        let (a, b) = two_lockers(&url).await;
        let name = unique("quiet");
        for _ in 0..20 {
            a.lock(&name)
                .await
                .expect("lock")
                .release()
                .await
                .expect("release");
        }
        let sem = a.semaphore(&name, 1);
        for _ in 0..5 {
            sem.acquire()
                .await
                .expect("permit")
                .release()
                .await
                .expect("release");
        }
        let heard = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
        assert!(
            heard.is_err(),
            "{mode}: a release nobody waited for notified: {heard:?}"
        );

        let got = woken_elsewhere(&a, &b, &name, &mut observer, mode).await;
        let heard = tokio::time::timeout(Duration::from_secs(2), listener.recv()).await;
        assert!(
            heard.is_ok(),
            "{mode}: the waited-for release did not notify"
        );
        got.release().await.expect("release");
        until_marks(
            &mut observer,
            false,
            &format!("{mode}: a mark outlived its wait"),
        )
        .await;
        while tokio::time::timeout(Duration::from_millis(200), listener.recv())
            .await
            .is_ok()
        {}
    }
}

/// PostgreSQL: a release that stayed silent while a waiter's mark could not be taken
/// yet (its bucket held by someone else, then the lease ended by hand, without a
/// release) does not strand the waiter: once its mark is taken, it is woken and tries
/// again — with a re-poll a minute away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_waiter_marked_late_tries_again_once_marked() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = format!("{}?poll=60s", pg.url());
    let (a, b) = two_lockers(&url).await;
    let name = unique("late-mark");
    let held = a
        .lock_with(
            &name,
            &dlock::LockOptions::new().ttl(Duration::from_secs(60)),
        )
        .await
        .expect("lock");
    let mut raw = sqlx::PgConnection::connect(&pg.url()).await.expect("raw");
    let bucket: i32 =
        sqlx::query_scalar("SELECT get_byte(lock_key, 0) >> 2 FROM dlock_locks WHERE name = $1")
            .bind(&name)
            .fetch_one(&mut raw)
            .await
            .expect("the lock's bucket");
    sqlx::query("SELECT pg_advisory_lock(1684828003, $1)")
        .bind(bucket)
        .execute(&mut raw)
        .await
        .expect("hold the bucket");
    let waiter = {
        let (b, name) = (b.clone(), name.clone());
        tokio::spawn(async move { b.lock_timeout(&name, Duration::from_secs(30)).await })
    };
    // The waiter is waiting, its mark not taken; the lease then ends without a release
    // (nothing notifies), and the bucket comes free.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(!waiter.is_finished(), "the waiter got a held lock");
    let ended = sqlx::query("UPDATE dlock_locks SET holds = 0 WHERE name = $1")
        .bind(&name)
        .execute(&mut raw)
        .await
        .expect("end the lease");
    assert_eq!(ended.rows_affected(), 1);
    let freed = Instant::now();
    sqlx::query("SELECT pg_advisory_unlock(1684828003, $1)")
        .bind(bucket)
        .execute(&mut raw)
        .await
        .expect("free the bucket");
    let got = waiter
        .await
        .expect("join")
        .expect("the waiter is woken once its mark is taken");
    let took = freed.elapsed();
    assert!(took < Duration::from_secs(10), "took {took:?}");
    got.release().await.expect("release");
    drop(held);
}

/// PostgreSQL lease mode: a lock handed from task to task of one process sends no
/// `NOTIFY` — each release wakes the next task itself, and no task marks a key held or
/// being taken here — yet another process's waiter still is, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_hand_offs_within_a_process_stay_silent() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let mut listener = sqlx::postgres::PgListener::connect(&pg.url())
        .await
        .expect("listener");
    listener.listen("dlock_released").await.expect("listen");
    let url = format!("{}?poll=60s", pg.url());
    let (a, b) = two_lockers(&url).await;
    let name = unique("in-process");
    let (tasks, rounds) = (4u32, 25u32);
    let handed = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let workers: Vec<_> = (0..tasks)
        .map(|_| {
            let (a, name, handed) = (a.clone(), name.clone(), std::sync::Arc::clone(&handed));
            tokio::spawn(async move {
                for _ in 0..rounds {
                    let g = a
                        .lock_timeout(&name, Duration::from_secs(30))
                        .await
                        .expect("every task gets its turn");
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    handed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    g.release().await.expect("release");
                }
            })
        })
        .collect();
    let mut heard = 0u32;
    let done = joined(workers);
    tokio::pin!(done);
    loop {
        tokio::select! {
            _ = &mut done => break,
            n = listener.recv() => {
                n.expect("listener");
                heard += 1;
            }
        }
    }
    while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await {
        heard += 1;
    }
    assert_eq!(
        handed.load(std::sync::atomic::Ordering::Relaxed),
        tasks * rounds
    );
    // Marked, each of these releases would notify (a waiter of this process was there
    // for nearly every one: 98 of 100 when measured so). A mark taken in the instant
    // between a release and the next attempt lingers a second or two, and makes the
    // releases meanwhile notify: up to half are allowed for.
    assert!(
        heard < tasks * rounds / 2,
        "{heard} of {} releases handed on within one process notified",
        tasks * rounds
    );

    // Another process's waiter marks the key, and the release wakes it.
    let mut observer = sqlx::PgConnection::connect(&pg.url())
        .await
        .expect("observer");
    let got = woken_elsewhere(&a, &b, &name, &mut observer, "lease").await;
    got.release().await.expect("release");
}

/// PostgreSQL lease mode: a task that waited unmarked behind a holder of its own
/// process, and then lost the lock to another process, marks the key itself, and that
/// process's release wakes it. Rounds race a waiter of each process for a release,
/// until the other process has won three (at most 60 rounds, and it must win one);
/// in those, once the other process's own mark has lapsed, a mark must be held (the
/// local waiter's: without it the release would stay silent, and only the waiter's
/// one-second look, not this test, would serve it). Every waiter must be served
/// within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_waiter_that_lost_to_another_process_is_notified() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = format!("{}?poll=60s", pg.url());
    let (a, b) = two_lockers(&url).await;
    let name = unique("lost-to-remote");
    let mut observer = sqlx::PgConnection::connect(&pg.url())
        .await
        .expect("observer");
    let mut lost_to_remote = 0;
    let mut rounds = 0;
    for round in 0..60 {
        if lost_to_remote == 3 {
            break;
        }
        rounds += 1;
        let held = a.lock(&name).await.expect("lock");
        let local = {
            let (a, name) = (a.clone(), name.clone());
            tokio::spawn(async move {
                let g = a.lock_timeout(&name, Duration::from_secs(20)).await;
                (Instant::now(), g)
            })
        };
        let remote = {
            let (b, name) = (b.clone(), name.clone());
            tokio::spawn(async move {
                let g = b.lock_timeout(&name, Duration::from_secs(20)).await;
                (Instant::now(), g)
            })
        };
        // Both wait (the remote one marked); the round's release goes to either.
        tokio::time::sleep(Duration::from_millis(200 + 7 * round)).await;
        held.release().await.expect("release");
        let (mut local, mut remote) = (local, remote);
        let (first, second, hold_for) = tokio::select! {
            r = &mut local => (r.expect("join"), remote, Duration::from_millis(20)),
            r = &mut remote => {
                lost_to_remote += 1;
                // Past the linger of the other process's own mark (a second after its
                // waiter left, checked every second): only the local waiter's mark
                // can be there then.
                (r.expect("join"), local, Duration::from_millis(3_000))
            }
        };
        let (_, got) = first;
        let got = got.expect("the first waiter");
        tokio::time::sleep(hold_for).await;
        if hold_for > Duration::from_secs(1) {
            until_marks(
                &mut observer,
                true,
                &format!("round {round}: the local waiter did not mark the key it lost"),
            )
            .await;
        }
        let released = Instant::now();
        got.release().await.expect("release");
        let (at, got) = second.await.expect("join");
        let got = got.expect("the second waiter is served");
        let waited = at.saturating_duration_since(released);
        assert!(
            waited < Duration::from_secs(5),
            "round {round}: the second waiter took {waited:?} after the release (re-poll: 60 s)"
        );
        got.release().await.expect("release");
    }
    assert!(
        lost_to_remote > 0,
        "the local waiter won all {rounds} rounds: the case was never made"
    );
    eprintln!("the other process won {lost_to_remote} of {rounds} rounds");
}

/// Statements MariaDB has been sent so far (every client's, this read's own included).
async fn questions(observer: &mut sqlx::MySqlConnection) -> i64 {
    let row: (String, String) = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Questions'")
        .fetch_one(&mut *observer)
        .await
        .expect("Questions");
    row.1.parse().expect("a count")
}

/// Forty waiters of one name in one process poll the server as one: one of them on the
/// poll interval, the rest only on a fallback that grows with their number (before, each
/// polled every 10 ms: about 5,000 statements a second here). When waiters give up at
/// random moments — the poller among them — the role passes on: every remaining waiter
/// still gets the lock, one at a time and in increasing token order, as a fenced store
/// checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_one_name_poll_as_one_per_process() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    let (holder, waiters) = two_lockers(&maria.url()).await;
    let waiters = Arc::new(waiters);
    let name = unique("poll-as-one");
    let held = holder.lock(&name).await.expect("hold");
    let mut observer = sqlx::MySqlConnection::connect(&maria.url())
        .await
        .expect("observer");
    // The fenced store: who is in, and the last token it accepted.
    let inside = Arc::new(AtomicBool::new(false));
    let last = Arc::new(AtomicU64::new(held.fencing_token()));
    let mut tasks = Vec::new();
    for i in 0..40u64 {
        let (waiters, name, inside, last) = (
            Arc::clone(&waiters),
            name.clone(),
            Arc::clone(&inside),
            Arc::clone(&last),
        );
        tasks.push(tokio::spawn(async move {
            // Every fourth waiter gives up (is cancelled) while the lock is still held.
            let timeout = if i % 4 == 0 {
                Duration::from_millis(200 + give_up_spread_ms(i))
            } else {
                Duration::from_secs(60)
            };
            let Ok(g) = waiters.lock_timeout(&name, timeout).await else {
                return false;
            };
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
    // Let every waiter register and settle, then count one second of polling.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = questions(&mut observer).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let polled = questions(&mut observer).await - before;
    held.release().await.expect("release");
    let started = Instant::now();
    let got = joined(tasks).await.into_iter().filter(|g| *g).count();
    let took = started.elapsed();
    assert_eq!(got, 30, "every waiter that did not give up got the lock");
    assert!(
        polled < 1_500,
        "{polled} statements in one second of 40 waiters polling"
    );
    // Measured: about 0.13 s. A vacant poller role would leave each grant to the
    // others' fallback (seconds each).
    assert!(took < Duration::from_secs(10), "30 grants took {took:?}");
    eprintln!(
        "figure: mariadb lease: 40 waiters of one name sent {polled} statements in 1 s; the 30 that stayed took it in turn in {took:?}"
    );

    // Permits freed by another process are found by this one's single poller, then
    // one waiter after another takes the role: all twenty get one, soon.
    let name = unique("poll-permits");
    let held = [
        holder.semaphore(&name, 2).acquire().await.expect("permit"),
        holder.semaphore(&name, 2).acquire().await.expect("permit"),
    ];
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (waiters, name) = (Arc::clone(&waiters), name.clone());
        tasks.push(tokio::spawn(async move {
            let g = waiters
                .semaphore(&name, 2)
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
    joined(tasks).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "20 permits took {took:?}");
    eprintln!("figure: mariadb: 20 permit waiters of one process served in {took:?}");
}

/// Every task's result, each awaited for at most a minute (a task that never finishes,
/// or panics, fails the test).
async fn joined<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(
            tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("a waiter never finished")
                .expect("waiter task"),
        );
    }
    out
}

/// A spread of give-up times from 0 to 600 ms, by waiter (fixed, so a run repeats).
fn give_up_spread_ms(i: u64) -> u64 {
    (i * 7919) % 601
}

/// Lock a semaphore's gate row for the name (bound) until the transaction ends.
const PG_LOCK_GATE: &str = "SELECT fence FROM dlock_shared_gate
     WHERE lock_key = sha256(convert_to($1, 'UTF8')) AND family = 'semaphore' FOR UPDATE";

/// [`PG_LOCK_GATE`] on MariaDB.
const MARIADB_LOCK_GATE: &str = "SELECT fence FROM dlock_shared_gate
     WHERE lock_key = UNHEX(SHA2(?, 256)) AND family = 'semaphore' FOR UPDATE";

/// Take the free permit of the semaphore of one `name` at once, and give it back.
async fn a_free_permit(locker: &Locker, name: &str, why: &str) {
    let g = locker
        .semaphore(name, 1)
        .try_acquire()
        .await
        .expect("try_acquire")
        .unwrap_or_else(|| panic!("busy: {why}"));
    g.release().await.expect("release");
}

/// A locker on `url`, and a fresh name whose semaphore tables and gate row exist (a
/// permit taken and given back).
async fn a_gate(url: &str, label: &str) -> (Locker, String) {
    let locker = Locker::connect(url).await.expect("connect");
    let name = unique(label);
    let first = locker.semaphore(&name, 1).acquire().await.expect("permit");
    first.release().await.expect("release");
    (locker, name)
}

/// The answer of `waiting`, a `try_acquire` on a semaphore of one whose only permit
/// is taken: busy. `why` names the mistake a second permit would show.
async fn refused_a_second_permit<T: std::fmt::Debug, E: std::fmt::Debug>(
    waiting: tokio::task::JoinHandle<Result<Option<T>, E>>,
    why: &str,
) {
    let answer = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the attempt answers")
        .expect("task")
        .expect("try_acquire");
    assert!(
        answer.is_none(),
        "a second permit of a semaphore of one: {why}"
    );
}

/// A permit attempt that has to wait for its name's gate row (another transaction
/// holds it) reads the live permits *after* that wait. The attempt's first round trip
/// batches the gate, the deletion of dead rows and the read; each statement must see
/// what was committed before it began, not what was there when the batch arrived: read
/// before the wait, the permit the other transaction committed meanwhile would be
/// missed, and a semaphore of one would grant a second. `$lock_gate` locks the name's
/// gate row (binds the name), `$put_permit` writes a live permit for it (binds the
/// name), `$waiting` counts the statements waiting for a row lock.
macro_rules! permits_are_read_after_the_gate {
    ($server:ty, $conn:ty, $lock_gate:expr, $put_permit:expr, $waiting:expr) => {{
        let Some(server) = <$server>::start() else {
            return;
        };
        let url = server.url();
        let (locker, name) = a_gate(&url, "gate-wait").await;

        let mut rival = <$conn>::connect(&url).await.expect("rival");
        let mut tx = rival.begin().await.expect("begin");
        sqlx::query($lock_gate)
            .bind(&name)
            .execute(&mut *tx)
            .await
            .expect("lock the gate");
        let waiting = {
            let (locker, name) = (locker.clone(), name.clone());
            tokio::spawn(async move { locker.semaphore(&name, 1).try_acquire().await })
        };
        let mut observer = <$conn>::connect(&url).await.expect("observer");
        until_an_acquire_waits!(observer, $waiting);
        // Meanwhile the other transaction takes the only permit.
        sqlx::query($put_permit)
            .bind(&name)
            .execute(&mut *tx)
            .await
            .expect("the rival's permit");
        tx.commit().await.expect("commit");

        refused_a_second_permit(waiting, "the live permits were read before the gate").await;
        // The rival's permit taken, the name is free again.
        sqlx::query("DELETE FROM dlock_shared WHERE owner = 'rival'")
            .execute(&mut observer)
            .await
            .expect("cleanup");
        a_free_permit(&locker, &name, "the rival's permit is gone").await;
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_permits_are_read_after_waiting_for_the_gate() {
    permits_are_read_after_the_gate!(
        PgServer,
        sqlx::PgConnection,
        PG_LOCK_GATE,
        "INSERT INTO dlock_shared
            (lock_key, family, acquisition, name, owner, kind, fence, expires_at, metadata)
         VALUES (sha256(convert_to($1, 'UTF8')), 'semaphore', 42, $1, 'rival', 'permit',
                 1000000, now() + interval '1 minute', '{}')",
        "SELECT count(*) FROM pg_stat_activity
         WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO dlock_shared_gate%'"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_permits_are_read_after_waiting_for_the_gate() {
    permits_are_read_after_the_gate!(
        MariaDbServer,
        sqlx::MySqlConnection,
        MARIADB_LOCK_GATE,
        "INSERT INTO dlock_shared
            (lock_key, family, acquisition, name, owner, kind, fence, expires_at, metadata)
         SELECT UNHEX(SHA2(n, 256)), 'semaphore', 42, n, 'rival', 'permit', 1000000,
                UTC_TIMESTAMP(6) + INTERVAL 60 SECOND, '{}' FROM (SELECT ? AS n) AS v",
        "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'"
    );
}

/// PostgreSQL: a permit whose lease had run out when an attempt arrived, but whose
/// renewal (begun in time, its row locked) commits while the attempt waits for the
/// row, is counted: the attempt's deletion of dead rows waits for the renewal and
/// spares the row, and the read of live rows comes after, in a statement of its own.
/// A read in the deleting statement would see the row as it was before (run out) and
/// grant a semaphore of one a second permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_permit_renewed_while_an_attempt_waits_is_counted() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let url = pg.url();
    let (locker, name) = a_gate(&url, "renewed-meanwhile").await;
    // Another process's permit, its lease about to run out.
    let mut other = sqlx::PgConnection::connect(&url).await.expect("other");
    sqlx::query(
        "INSERT INTO dlock_shared
            (lock_key, family, acquisition, name, owner, kind, fence, expires_at, metadata)
         VALUES (sha256(convert_to($1, 'UTF8')), 'semaphore', 43, $1, 'renewing', 'permit',
                 1000000, clock_timestamp() + interval '300 milliseconds', '{}')",
    )
    .bind(&name)
    .execute(&mut other)
    .await
    .expect("the other permit");
    // Its renewal has the row, and has not committed.
    let mut tx = other.begin().await.expect("begin");
    let renewed = sqlx::query(
        "UPDATE dlock_shared SET expires_at = clock_timestamp() + interval '1 minute'
         WHERE owner = 'renewing'",
    )
    .execute(&mut *tx)
    .await
    .expect("renew");
    assert_eq!(renewed.rows_affected(), 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waiting = {
        let (locker, name) = (locker.clone(), name.clone());
        tokio::spawn(async move { locker.semaphore(&name, 1).try_acquire().await })
    };
    let mut observer = sqlx::PgConnection::connect(&url).await.expect("observer");
    until_an_acquire_waits!(
        observer,
        "SELECT count(*) FROM pg_stat_activity
         WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO dlock_shared_gate%'"
    );
    tx.commit().await.expect("commit the renewal");
    refused_a_second_permit(waiting, "the renewed permit was read as run out").await;
    sqlx::query("DELETE FROM dlock_shared WHERE owner = 'renewing'")
        .execute(&mut observer)
        .await
        .expect("cleanup");
}

/// A client that stops inside a permit attempt (its first round trip sent, so its
/// transaction holds the name's gate, and nothing after) does not keep the gate: the
/// server ends that transaction about twice the statement timeout later (1 s here),
/// and another client's permit is granted. Left to the server's defaults, the gate
/// would stay taken until the server noticed the client gone (MariaDB: `wait_timeout`,
/// 8 hours by default; PostgreSQL: never, on loopback).
macro_rules! a_stalled_attempt_frees_the_gate {
    ($server:ty) => {{
        let Some(server) = <$server>::start() else {
            return;
        };
        let url = format!("{}?timeout=1s", server.url());
        let proxy = proxied(SocketAddr::from(([127, 0, 0, 1], server.port()))).await;
        // The attempts' connection is open, through the proxy.
        let (stalled, name) = a_gate(&via(&url, server.port(), &proxy), "stalled").await;
        let other = Locker::connect(&server.url()).await.expect("connect");

        proxy.set(Fault::Stalled);
        let answer = stalled.semaphore(&name, 1).try_acquire().await;
        assert!(
            answer.is_err(),
            "an attempt whose replies never came answered {answer:?}"
        );
        let since = Instant::now();
        let permit =
            tokio::time::timeout(Duration::from_secs(30), other.semaphore(&name, 1).acquire())
                .await
                .expect("the stalled attempt kept the name's gate")
                .expect("permit");
        let waited = since.elapsed();
        assert!(
            waited < Duration::from_secs(15),
            "the gate was freed only after {waited:?}"
        );
        // The stalled attempt did take the gate (freed about 2 s after it began,
        // 1 s before the other client asked).
        assert!(
            waited > Duration::from_millis(300),
            "the other client was not kept waiting ({waited:?}): the stalled attempt \
             never held the gate, and this test shows nothing"
        );
        permit.release().await.expect("release");
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_stalled_attempt_frees_the_gate() {
    a_stalled_attempt_frees_the_gate!(PgServer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_a_stalled_attempt_frees_the_gate() {
    a_stalled_attempt_frees_the_gate!(MariaDbServer);
}

/// An attempt whose client gave up while it waited for its name's gate (another
/// transaction holds it) stops waiting on the server soon after (twice the statement
/// timeout, 1 s here), though the gate is still held: the server does not see its
/// client leave while a statement waits, and would otherwise keep it queued
/// (MariaDB: `innodb_lock_wait_timeout`, 50 s by default; PostgreSQL: until the gate
/// is free), a server connection each. (The attempt's undo, tried again in the
/// background, queues for the gate too, each try on a connection of its own: so the
/// sessions that waited when the client gave up are followed, not the count.)
/// `$lock_gate` locks the name's gate row (binds the name), `$waiting` lists the
/// sessions waiting for a row lock.
macro_rules! an_abandoned_wait_for_the_gate_ends {
    ($server:ty, $conn:ty, $lock_gate:expr, $waiting:literal) => {{
        let Some(server) = <$server>::start() else {
            return;
        };
        let url = format!("{}?timeout=1s", server.url());
        let (locker, name) = a_gate(&url, "abandoned-wait").await;

        let mut rival = <$conn>::connect(&server.url()).await.expect("rival");
        let mut tx = rival.begin().await.expect("begin");
        sqlx::query($lock_gate)
            .bind(&name)
            .execute(&mut *tx)
            .await
            .expect("lock the gate");
        let mut observer = <$conn>::connect(&server.url()).await.expect("observer");
        let attempt = {
            let (locker, name) = (locker.clone(), name.clone());
            tokio::spawn(async move { locker.semaphore(&name, 1).try_acquire().await })
        };
        until_an_acquire_waits!(
            observer,
            concat!("SELECT COUNT(*) FROM (", $waiting, ") AS w")
        );
        let abandoned: Vec<i64> = sqlx::query_scalar($waiting)
            .fetch_all(&mut observer)
            .await
            .expect("the waiting sessions");
        let answer = attempt.await.expect("task");
        assert!(
            answer.is_err(),
            "an attempt behind a held gate answered {answer:?}"
        );
        let since = Instant::now();
        loop {
            let waiting: Vec<i64> = sqlx::query_scalar($waiting)
                .fetch_all(&mut observer)
                .await
                .expect("the waiting sessions");
            if !waiting.iter().any(|s| abandoned.contains(s)) {
                break;
            }
            assert!(
                since.elapsed() < Duration::from_secs(15),
                "an attempt still waits on the server for the gate, {:?} after its \
                 client gave up",
                since.elapsed()
            );
            tokio::time::sleep(POLL_TRX).await;
        }
        tx.commit().await.expect("commit");
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_abandoned_wait_for_the_gate_ends() {
    an_abandoned_wait_for_the_gate_ends!(
        PgServer,
        sqlx::PgConnection,
        PG_LOCK_GATE,
        "SELECT pid::bigint FROM pg_stat_activity
         WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO dlock_shared_gate%'"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_an_abandoned_wait_for_the_gate_ends() {
    an_abandoned_wait_for_the_gate_ends!(
        MariaDbServer,
        sqlx::MySqlConnection,
        MARIADB_LOCK_GATE,
        "SELECT CAST(trx_mysql_thread_id AS SIGNED) FROM information_schema.INNODB_TRX
         WHERE trx_state = 'LOCK WAIT'"
    );
}

/// MariaDB: an attempts' connection left idle longer than the limit that ends a silent
/// attempt (twice the statement timeout, 1 s here) is still good for the next
/// attempt: the limit applies inside a transaction only (`idle_transaction_timeout`),
/// so the server did not close it under the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_an_attempts_connection_idle_past_the_limit_still_serves() {
    let Some(maria) = MariaDbServer::start() else {
        return;
    };
    let url = format!("{}?timeout=1s", maria.url());
    let (locker, name) = a_gate(&url, "idle-past-limit").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    a_free_permit(&locker, &name, "after an idle spell").await;
}

/// A session-mode holder whose runtime stalled past the server's idle limit for its
/// session (5 s: the server may have ended it, freeing the lock) counts as lost at
/// once, before any ping runs again (see the conformance helper).
#[test]
fn a_session_holder_stalled_past_the_idle_limit_counts_as_lost_at_once() {
    let (Some(pg), Some(maria)) = (PgServer::start(), MariaDbServer::start()) else {
        return;
    };
    let urls = [
        format!("{}?mode=advisory", pg.url()),
        format!("{}?mode=row", pg.url()),
        format!("{}?mode=named", maria.url()),
        format!("{}?mode=row", maria.url()),
    ];
    dlock::conformance::a_stalled_holder_counts_as_lost(&urls, Duration::from_millis(5600));
}
