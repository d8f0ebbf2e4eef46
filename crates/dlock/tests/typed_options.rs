//! Typed backend options (`dlock::connect`): the URL they stand for, `FromStr`, and
//! connecting with them on real servers.
#![cfg(all(
    feature = "sqlite",
    feature = "redis",
    feature = "etcd",
    feature = "zookeeper",
    feature = "postgres",
    feature = "mysql"
))]

use std::time::Duration;

use dlock::connect::{
    EtcdOptions, MysqlOptions, PostgresOptions, RedisOptions, RedlockOptions, SqliteOptions,
    ZkOptions,
};
use dlock::{Error, Locker};
use dlock_testkit::{PG_PASSWORD, PgServer, RedisServer, redis_command};

#[test]
fn each_backend_s_options_stand_for_its_documented_url() {
    let s = Duration::from_secs;
    let cases = [
        (
            RedisOptions::new("cache.internal", 6380)
                .credentials("app", "pa ss@word/?&")
                .layout(dlock::redis::Layout::RedisPy)
                .prefix("billing:")
                .timeout(s(2))
                .database(3)
                .to_url(),
            "redis://app:***@cache.internal:6380/3?layout=redis-py&prefix=billing:&timeout=2000ms",
        ),
        (
            RedisOptions::sentinel([("s1", 26379), ("s2", 26380)], "main")
                .database(2)
                .handoff_burst(0)
                .to_url(),
            "redis+sentinel://s1:26379,s2:26380/main?db=2&handoff_burst=0",
        ),
        (
            RedisOptions::new("::1", 6379)
                .ca_file("/etc/ca.pem")
                .to_url(),
            "rediss://[::1]:6379?ca_file=/etc/ca.pem",
        ),
        (
            RedlockOptions::new([("a", 1), ("b", 2), ("c", 3)])
                .drift_factor(0.02)
                .retries(5)
                .to_url(),
            "redlock://a:1,b:2,c:3?drift_factor=0.02&retries=5",
        ),
        (
            EtcdOptions::new([("e1", 2379)])
                .prefix("/locks/")
                .session_ttl(s(4))
                .raw_names(true)
                .to_url(),
            "etcd://e1:2379/locks/?raw_names=true&session_ttl=4000ms",
        ),
        (
            ZkOptions::new([("z1", 2181), ("z2", 2181)])
                .root("/app/locks")
                .session_timeout(s(6))
                .to_url(),
            "zk://z1:2181,z2:2181/app/locks?session_timeout=6000ms",
        ),
        (
            PostgresOptions::new("db", 5432, "app")
                .credentials("u", "secret")
                .mode(dlock::sql::Mode::Advisory)
                .numeric_advisory_keys(true)
                .to_url(),
            "postgres://u:***@db:5432/app?advisory_key=number&mode=advisory",
        ),
        (
            MysqlOptions::new("db", 3306, "app")
                .mode(dlock::sql::Mode::Named)
                .lock_delay(Duration::from_millis(1500))
                .to_url(),
            "mysql://db:3306/app?lock_delay=1500ms&mode=named",
        ),
        (
            SqliteOptions::new("/var/lib/app/locks.db")
                .durable(false)
                .ttl(s(30))
                .wal_autocheckpoint(64)
                .to_url(),
            "sqlite:///var/lib/app/locks.db?synchronous=normal&ttl=30000ms&wal_autocheckpoint=64",
        ),
    ];
    for (got, want) in cases {
        assert_eq!(got, want);
        assert!(!got.contains("secret") && !got.contains("pa ss"), "{got}");
    }
    // Debug shows the redacted URL, never the password.
    let debug = format!(
        "{:?}",
        PostgresOptions::new("h", 1, "d").credentials("u", "hunter2")
    );
    assert!(!debug.contains("hunter2"), "{debug}");
}

#[test]
fn typed_values_no_url_could_carry_are_fixed_or_refused() {
    assert_eq!(SqliteOptions::new(":memory:").to_url(), "sqlite::memory:");
    assert_eq!(SqliteOptions::new("rel.db").to_url(), "sqlite:rel.db");
    for text in ["sqlite::memory:", "sqlite:rel.db", "sqlite:///abs/x.db"] {
        let o: SqliteOptions = text.parse().expect(text);
        assert_eq!(o.to_url(), text);
    }
    assert_eq!(
        EtcdOptions::new([("e", 1)]).prefix("locks/").to_url(),
        "etcd://e:1/locks/"
    );
    assert_eq!(
        ZkOptions::new([("z", 1)]).root("app").to_url(),
        "zk://z:1/app"
    );
    assert_eq!(
        RedisOptions::new("[::1]", 1)
            .timeout(Duration::from_micros(1500))
            .to_url(),
        "redis://[::1]:1?timeout=1500us"
    );
}

#[tokio::test]
async fn tls_on_a_redis_cluster_is_refused_not_dropped() {
    let e = Locker::with_options(RedisOptions::cluster([("127.0.0.1", 1)]).tls())
        .await
        .expect_err("no TLS on a cluster");
    assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
    assert!(e.to_string().contains("TLS"), "{e}");
}

#[test]
fn from_str_takes_the_backend_s_own_schemes_only() {
    let r: RedisOptions = "redis+cluster://a:1,b:2?prefix=x"
        .parse()
        .expect("cluster URL");
    assert_eq!(r.to_url(), "redis+cluster://a:1,b:2?prefix=x");
    let e = "postgres://h/d"
        .parse::<RedisOptions>()
        .expect_err("not redis");
    assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
    assert!(
        e.to_string().contains("redis+sentinel"),
        "names the schemes it takes: {e}"
    );
    let e = "mysql://h:99999/d"
        .parse::<MysqlOptions>()
        .expect_err("bad port");
    assert!(e.to_string().contains("99999"), "{e}");
    let p: PostgresOptions = "postgresql://u:pw@h:5/d?mode=row"
        .parse()
        .expect("postgres");
    assert!(!format!("{p:?}").contains("pw@"), "{p:?}");
}

#[tokio::test]
async fn typed_sqlite_options_connect_and_bad_values_fail_as_in_a_url() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("dir with space & ?.db");
    let locker = Locker::with_options(SqliteOptions::new(&path).poll(Duration::from_millis(5)))
        .await
        .expect("connect");
    let g = locker.lock("typed").await.expect("lock");
    assert!(
        path.exists(),
        "the database is at the path given, unescaped"
    );
    let other = Locker::connect(&format!(
        "sqlite://{}",
        path.display()
            .to_string()
            .replace(' ', "%20")
            .replace('&', "%26")
            .replace('?', "%3F")
    ))
    .await
    .expect("the same file by URL");
    assert!(
        other.try_lock("typed").await.expect("try").is_none(),
        "same store"
    );
    g.release().await.expect("release");

    let bad = Locker::with_options(SqliteOptions::new(&path).poll(Duration::ZERO)).await;
    let escaped = path
        .display()
        .to_string()
        .replace(' ', "%20")
        .replace('&', "%26")
        .replace('?', "%3F");
    let by_url = Locker::connect(&format!("sqlite://{escaped}?poll=0ms")).await;
    match (bad, by_url) {
        (Err(a), Err(b)) => {
            assert!(a.to_string().contains("poll"), "{a}");
            assert!(b.to_string().contains("poll"), "{b}");
        }
        (a, b) => panic!("poll=0 must fail both ways: {:?} / {:?}", a.err(), b.err()),
    }
}

#[tokio::test]
async fn typed_redis_options_pick_the_layout() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let port: u16 = redis
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    let locker = Locker::with_options(
        RedisOptions::new("127.0.0.1", port)
            .layout(dlock::redis::Layout::RedisPy)
            .prefix("typed:"),
    )
    .await
    .expect("connect");
    let g = locker.lock("job").await.expect("lock");
    let addr = format!("127.0.0.1:{port}").parse().expect("addr");
    let reply = redis_command(addr, &["TYPE", "typed:job"], Duration::from_secs(2)).expect("TYPE");
    assert_eq!(
        String::from_utf8_lossy(&reply).trim(),
        "+string",
        "redis-py's layout is a plain string key"
    );
    g.release().await.expect("release");
}

#[tokio::test]
async fn typed_postgres_options_log_in_with_a_password_that_never_shows() {
    let Some(pg) = PgServer::start() else {
        return;
    };
    let opts = PostgresOptions::new("127.0.0.1", pg.port(), "postgres")
        .credentials("postgres", PG_PASSWORD)
        .mode(dlock::sql::Mode::Advisory);
    let locker = Locker::with_options(opts.clone()).await.expect("connect");
    assert!(!locker.url().contains(PG_PASSWORD), "{}", locker.url());
    let g = locker.lock("typed").await.expect("lock");
    g.release().await.expect("release");
    let wrong = Locker::with_options(opts.credentials("postgres", "not-it")).await;
    let e = wrong.expect_err("a wrong password is refused");
    assert!(!e.to_string().contains("not-it"), "{e}");
}
