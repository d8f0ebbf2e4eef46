//! Redis server features around the lock: replica acknowledgement (`min_replicas`),
//! a least-privilege ACL user, passwords kept out of every message, and fencing
//! durability reported from the server's persistence settings.
#![cfg(feature = "redis")]

use std::time::Duration;

use dlock::{Error, Fencing, Locker};
use dlock_testkit::{RedisOptions, RedisServer, redis_command};

const T: Duration = Duration::from_secs(2);

/// The commands dlock needs, as an ACL rule (also in the README).
const DLOCK_ACL: &str = "+evalsha +eval +script|load +publish +subscribe +unsubscribe +ping \
     +hgetall +pttl +get +wait +exists +incr +hset +hexists +hincrby +hget +hmget +pexpire \
     +del +set +lpush";

#[tokio::test]
async fn min_replicas_waits_for_a_replica_and_refuses_without_enough() {
    let Some(master) = RedisServer::start() else {
        return;
    };
    let Some(replica) = RedisServer::start_with(RedisOptions {
        extra_args: vec![
            "--replicaof".into(),
            "127.0.0.1".into(),
            master.addr().port().to_string(),
        ],
        ..RedisOptions::default()
    }) else {
        return;
    };
    // Wait until the replica is in sync.
    let end = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let info = redis_command(replica.addr(), &["INFO", "replication"], T).unwrap_or_default();
        if String::from_utf8_lossy(&info).contains("master_link_status:up") {
            break;
        }
        assert!(std::time::Instant::now() < end, "replica never synced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let one = Locker::connect(&format!("{}?min_replicas=1", master.url()))
        .await
        .expect("connect");
    let g = one
        .lock("replicated")
        .await
        .expect("acknowledged by one replica");
    g.release().await.expect("release");

    let two = Locker::connect(&format!(
        "{}?min_replicas=2&wait_timeout=200ms",
        master.url()
    ))
    .await
    .expect("connect");
    let err = two
        .lock_timeout("replicated", Duration::from_secs(3))
        .await
        .expect_err("only one replica");
    assert!(
        matches!(
            err,
            Error::NoQuorum {
                granted: 1,
                needed: 2
            }
        ),
        "{err}"
    );
    // The refused grant was given back.
    assert!(one.inspect("replicated").await.expect("inspect").is_none());
    drop(replica);
}

#[tokio::test]
async fn least_privilege_acl_user_is_enough() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut args = vec![
        "ACL",
        "SETUSER",
        "locker",
        "on",
        ">s3cretMARKER",
        "~*",
        "&*",
        "resetchannels",
        "&*",
        "-@all",
    ];
    let rules: Vec<&str> = DLOCK_ACL.split_whitespace().collect();
    args.extend(rules);
    let ok = redis_command(server.addr(), &args, T).expect("ACL SETUSER");
    assert_eq!(ok, b"+OK\r\n", "{}", String::from_utf8_lossy(&ok));
    let url = format!("redis://locker:s3cretMARKER@{}", server.addr());
    let a = Locker::connect(&url)
        .await
        .expect("connect as the ACL user");
    let b = Locker::connect(&url)
        .await
        .expect("connect as the ACL user");
    // CONFIG is not allowed: fencing is reported as best effort, not assumed durable.
    assert_eq!(a.capabilities().fencing, Fencing::BestEffort);
    let g = a.lock("acl").await.expect("lock");
    assert!(b.try_lock("acl").await.expect("try").is_none());
    let info = b.inspect("acl").await.expect("inspect").expect("held");
    assert_eq!(info.fencing_token, g.fencing_token());
    g.extend(Duration::from_secs(20)).await.expect("renew");
    // A waiter (pub/sub) is woken by the release.
    let waiter = tokio::spawn(async move { b.lock("acl").await.map(|g| g.fencing_token()) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    g.release().await.expect("release");
    let t = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect("waiter not woken")
        .expect("join")
        .expect("lock");
    assert!(t > info.fencing_token);
    // Nothing shows the password.
    assert!(!format!("{a:?}").contains("s3cretMARKER"));
    let bad = Locker::connect(&format!("redis://locker:wrongMARKER@{}", server.addr()))
        .await
        .expect_err("wrong password");
    assert!(!bad.to_string().contains("wrongMARKER"), "{bad}");
    assert!(!format!("{bad:?}").contains("wrongMARKER"));
}

#[tokio::test]
async fn fencing_is_durable_only_with_appendfsync_always() {
    let Some(plain) = RedisServer::start() else {
        return;
    };
    let l = Locker::connect(&plain.url()).await.expect("connect");
    assert_eq!(l.capabilities().fencing, Fencing::BestEffort);
    let Some(persistent) = RedisServer::start_with(RedisOptions {
        persistent: true,
        ..RedisOptions::default()
    }) else {
        return;
    };
    let l = Locker::connect(&persistent.url()).await.expect("connect");
    assert_eq!(l.capabilities().fencing, Fencing::Durable);
}

#[tokio::test]
async fn fencing_survives_a_restart_with_persistence() {
    let Some(mut server) = RedisServer::start_with(RedisOptions {
        persistent: true,
        ..RedisOptions::default()
    }) else {
        return;
    };
    let l = Locker::connect(&server.url()).await.expect("connect");
    let g = l.lock("durable").await.expect("lock");
    let before = g.fencing_token();
    g.release().await.expect("release");
    drop(l);
    server.restart();
    let l = Locker::connect(&server.url()).await.expect("reconnect");
    let g = l.lock("durable").await.expect("lock after restart");
    assert!(
        g.fencing_token() > before,
        "token {} after {before}",
        g.fencing_token()
    );
}
