//! Redlock under node faults, on five independent redis-servers on loopback: a
//! minority down (locks still work), a majority down (fast `NoQuorum`, no hang), a
//! paused node, an acquisition slower than the lease (never reported), fencing tokens
//! across kills and restarts with persistence, and re-seeding a node that restarted
//! empty.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock::{Error, Fencing, LockOptions, Locker};
use dlock_testkit::{Fault, FaultProxy, PortHolder, RedisNodes, RedisOptions, redis_command};

const T: Duration = Duration::from_secs(2);

async fn nodes(persistent: bool) -> Option<RedisNodes> {
    RedisNodes::start(
        5,
        &RedisOptions {
            persistent,
            ..RedisOptions::default()
        },
    )
}

/// SIGKILL node `i` and keep its port taken (no other test's server may start there).
fn kill_and_hold(nodes: &mut RedisNodes, i: usize) -> PortHolder {
    let port = nodes.node(i).addr().port();
    nodes.node(i).process().kill();
    PortHolder::hold(port)
}

/// GET `key` on one node, raw.
fn raw_get(nodes: &mut RedisNodes, i: usize, key: &str) -> String {
    let addr = nodes.node(i).addr();
    String::from_utf8_lossy(&redis_command(addr, &["GET", key], T).expect("GET")).into_owned()
}

#[tokio::test]
async fn two_of_five_killed_still_grants_nearly_every_acquire() {
    let Some(mut nodes) = nodes(false).await else {
        return;
    };
    let locker = Locker::connect(&nodes.url()).await.expect("connect");
    let _held = [kill_and_hold(&mut nodes, 1), kill_and_hold(&mut nodes, 3)];
    let total = 200;
    let mut ok = 0;
    let mut last = 0;
    for i in 0..total {
        match locker
            .lock_timeout(&format!("minority-{}", i % 7), Duration::from_secs(2))
            .await
        {
            Ok(g) => {
                assert!(g.fencing_token() > 0);
                last = last.max(g.fencing_token());
                g.release().await.expect("release on a majority");
                ok += 1;
            }
            Err(e) => eprintln!("acquire {i} failed: {e}"),
        }
    }
    assert!(
        ok * 100 >= total * 99,
        "only {ok} of {total} acquires succeeded"
    );
}

#[tokio::test]
async fn three_of_five_down_fails_fast_with_no_quorum() {
    let Some(mut nodes) = nodes(false).await else {
        return;
    };
    let locker = Locker::connect(&nodes.url()).await.expect("connect");
    let _held: Vec<PortHolder> = [0, 2, 4]
        .into_iter()
        .map(|i| kill_and_hold(&mut nodes, i))
        .collect();
    for i in 0..20 {
        let started = Instant::now();
        // Waiting forever is asked for: unreachable nodes must still end it, fast.
        let e = tokio::time::timeout(
            Duration::from_secs(5),
            locker.lock(&format!("majority-{i}")),
        )
        .await
        .expect("an attempt hung with a majority down")
        .expect_err("granted without a majority");
        assert!(
            matches!(
                e,
                Error::NoQuorum {
                    needed: 3,
                    unreachable: 3,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "took {:?}",
            started.elapsed()
        );
        let e = locker.try_lock("majority-try").await.expect_err("try_lock");
        assert!(matches!(e, Error::NoQuorum { .. }), "{e:?}");
    }
}

/// A held lock is busy, not "no quorum", even with two nodes down: the three that
/// answer name another owner.
#[tokio::test]
async fn taken_by_another_owner_is_busy_not_no_quorum() {
    let Some(mut nodes) = nodes(false).await else {
        return;
    };
    let (a, b) = (
        Locker::connect(&nodes.url()).await.expect("connect"),
        Locker::connect(&nodes.url()).await.expect("connect"),
    );
    let g = a.lock("taken").await.expect("lock");
    // lock() returns at a majority while the other nodes' calls still run: wait until
    // the hold is on all five before killing two.
    let owner = g.owner().as_str().to_owned();
    let end = Instant::now() + Duration::from_secs(3);
    while !(0..5).all(|i| raw_get(&mut nodes, i, "taken").contains(&owner)) {
        assert!(Instant::now() < end, "the hold never reached every node");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _held = [kill_and_hold(&mut nodes, 0), kill_and_hold(&mut nodes, 4)];
    assert!(
        b.try_lock("taken")
            .await
            .expect("busy is not an error")
            .is_none()
    );
    let e = b
        .lock_timeout("taken", Duration::from_millis(300))
        .await
        .expect_err("held");
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    g.release().await.expect("release");
    let g = b.lock_timeout("taken", T).await.expect("free now");
    g.release().await.expect("release");
}

#[tokio::test]
async fn a_paused_node_neither_blocks_nor_breaks_locking() {
    let Some(mut nodes) = nodes(false).await else {
        return;
    };
    let (a, b) = (
        Locker::connect(&nodes.url()).await.expect("connect"),
        Locker::connect(&nodes.url()).await.expect("connect"),
    );
    nodes.node(2).process().pause();
    let mut last = 0;
    for i in 0..30 {
        let (c, other) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let started = Instant::now();
        let g = c
            .lock_timeout("paused", T)
            .await
            .expect("lock with one node paused");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        assert!(g.fencing_token() > last, "token went back");
        last = g.fencing_token();
        // Mutual exclusion holds meanwhile.
        assert!(other.try_lock("paused").await.expect("try").is_none());
        g.release().await.expect("release");
    }
    nodes.node(2).process().resume();
    let g = a
        .lock_timeout("paused", T)
        .await
        .expect("lock after resume");
    assert!(g.fencing_token() > last);
    g.release().await.expect("release");
}

/// Each round trip to every node takes ~400 ms under a 300 ms lease (the node timeout
/// allows it): a majority grants, but after the validity is gone — the grant must be
/// given back, never reported.
#[tokio::test]
async fn an_acquisition_slower_than_the_lease_is_never_reported() {
    let Some(nodes) = nodes(false).await else {
        return;
    };
    let mut proxies = Vec::new();
    for i in 0..nodes.len() {
        let port: u16 = nodes
            .url()
            .trim_start_matches("redlock://")
            .split(',')
            .nth(i)
            .and_then(|h| h.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .expect("port");
        let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        proxies.push(FaultProxy::start(upstream).await.expect("proxy"));
    }
    let hosts: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
    // Node calls may take up to the lease: only the validity check can refuse the grant.
    let url = format!("redlock://{}?node_timeout=5s&retries=0", hosts.join(","));
    let locker = Locker::connect(&url).await.expect("connect");
    // Load the scripts first, so that each step below is one round trip per node.
    let warm = locker.lock_timeout("warm-up", T).await.expect("warm-up");
    warm.release().await.expect("release");
    for p in &proxies {
        p.set(Fault::Delay(Duration::from_millis(200)));
    }
    let opts = LockOptions::default()
        .ttl(Duration::from_millis(300))
        .wait(dlock::Wait::NoWait);
    let started = Instant::now();
    let outcome = locker.try_lock_with("slow", &opts).await;
    match outcome {
        Ok(Some(_)) => panic!(
            "a grant that took {:?} under a 300 ms lease was reported",
            started.elapsed()
        ),
        Err(e) => assert!(e.to_string().contains("past the validity"), "{e}"),
        Ok(None) => panic!("reported busy: nobody else holds it"),
    }
    for p in &proxies {
        p.set(Fault::None);
    }
    // Whatever it left behind is owner-checked and expires with its 300 ms lease.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let fresh = Locker::connect(&url).await.expect("connect");
    let g = fresh.lock_timeout("slow", T).await.expect("free again");
    g.release().await.expect("release");
}

/// With `appendfsync always` on every node, tokens strictly increase across holders
/// while nodes are SIGKILLed and restarted — at most two down at any time.
#[tokio::test]
async fn fencing_tokens_increase_across_kills_and_restarts_with_persistence() {
    let Some(mut nodes) = nodes(true).await else {
        return;
    };
    let clients = [
        Locker::connect(&nodes.url()).await.expect("connect"),
        Locker::connect(&nodes.url()).await.expect("connect"),
        Locker::connect(&nodes.url()).await.expect("connect"),
    ];
    assert_eq!(clients[0].capabilities().fencing, Fencing::Durable);
    let mut last = 0u64;
    let mut down: Vec<usize> = Vec::new();
    for i in 0..60usize {
        if i % 4 == 0 {
            // Bring one back, take another down: the set of live majorities changes.
            if down.len() == 2 {
                let back = down.remove(0);
                nodes.node(back).restart();
            }
            let victim = (i / 4 * 3) % 5;
            if !down.contains(&victim) {
                nodes.node(victim).process().kill();
                down.push(victim);
            }
        }
        let c = &clients[i % clients.len()];
        // A restarted node may still hold a lease whose release it missed while down,
        // so with two others down there may be no majority for a moment: that is
        // `NoQuorum` (availability), retried here; the tokens are what is checked.
        let opts = LockOptions::default().ttl(Duration::from_millis(400));
        let give_up = Instant::now() + Duration::from_secs(10);
        let g = loop {
            match c.lock_with("fenced", &opts).await {
                Ok(g) => break g,
                Err(e @ Error::NoQuorum { .. }) if Instant::now() < give_up => {
                    eprintln!("round {i}, down {down:?}: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("round {i}, nodes down {down:?}: {e}"),
            }
        };
        let t = g.fencing_token();
        assert!(
            t > last,
            "round {i}: token {t} after {last} (down {down:?})"
        );
        last = t;
        if i % 5 == 4 {
            // Dropped, not released: the next holder may find it on some nodes until
            // the keeper's release lands.
            drop(g);
        } else {
            g.release().await.expect("release");
        }
    }
}

/// A node that restarts empty gets the key back on the next renewal, because a
/// majority still holds the lock — and never when the majority does not.
#[tokio::test]
async fn renewal_reseeds_a_node_that_restarted_empty() {
    let Some(mut nodes) = nodes(false).await else {
        return;
    };
    let locker = Locker::connect(&nodes.url()).await.expect("connect");
    let opts = LockOptions::default().ttl(Duration::from_millis(600));
    let g = locker.lock_with("reseed", &opts).await.expect("lock");
    let owner = g.owner().as_str().to_owned();
    // The acquire returns once a majority granted: node 0's grant may land a moment
    // later (bounded).
    let end = Instant::now() + Duration::from_secs(2);
    while !raw_get(&mut nodes, 0, "reseed").contains(&owner) && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(raw_get(&mut nodes, 0, "reseed").contains(&owner));
    nodes.node(0).restart();
    assert!(
        !raw_get(&mut nodes, 0, "reseed").contains(&owner),
        "restarted empty"
    );
    let end = Instant::now() + Duration::from_secs(3);
    while !raw_get(&mut nodes, 0, "reseed").contains(&owner) {
        assert!(Instant::now() < end, "never re-seeded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(g.is_held());
    g.release().await.expect("release");
    for i in 0..5 {
        assert!(
            !raw_get(&mut nodes, i, "reseed").contains(&owner),
            "left on node {i}"
        );
    }
}

/// Counters that disagree (two nodes ahead) are reconciled by the write-back: after the
/// two nodes that were ahead die, the next grant still gets a larger token. (Which T
/// the first grant gets depends on which majority answered first: 1001 if it included
/// a node that was ahead, else 1 — either way a majority holds at least T afterwards.)
#[tokio::test]
async fn token_write_back_survives_the_loss_of_the_nodes_that_were_ahead() {
    let Some(mut nodes) = nodes(false).await else {
        return;
    };
    let locker = Locker::connect(&nodes.url()).await.expect("connect");
    for i in [0, 1] {
        let addr = nodes.node(i).addr();
        redis_command(addr, &["SET", "dlock_token:{ahead}", "1000"], T).expect("SET");
    }
    let g = locker.lock("ahead").await.expect("lock");
    let first = g.fencing_token();
    assert!(
        first == 1 || first == 1001,
        "T {first} is not a node's counter"
    );
    g.release().await.expect("release");
    let counter = |nodes: &mut RedisNodes, i: usize| {
        raw_get(nodes, i, "dlock_token:{ahead}")
            .lines()
            .find_map(|l| l.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let at_least = (0..5).filter(|&i| counter(&mut nodes, i) >= first).count();
    assert!(
        at_least >= 3,
        "only {at_least} nodes hold a counter >= {first}"
    );
    let _held = [kill_and_hold(&mut nodes, 0), kill_and_hold(&mut nodes, 1)];
    let g = locker.lock("ahead").await.expect("lock on the other three");
    assert!(
        g.fencing_token() > first,
        "token {} after {first}",
        g.fencing_token()
    );
    g.release().await.expect("release");
}

/// The on-node layout is node-redlock's / redsync's: a foreign client that holds
/// `SET name <value> NX PX` on a majority excludes dlock, and dlock's hold is such a
/// key on every node (so `SET NX` by the foreign client fails there).
#[tokio::test]
async fn excludes_a_foreign_redlock_client_both_ways() {
    let Some(mut nodes) = nodes(false).await else {
        return;
    };
    let locker = Locker::connect(&nodes.url()).await.expect("connect");
    // Foreign client: SET NX PX on nodes 0..3 (a majority).
    for i in 0..3 {
        let addr = nodes.node(i).addr();
        let r = redis_command(addr, &["SET", "shared", "foreign-1", "NX", "PX", "5000"], T)
            .expect("SET");
        assert!(String::from_utf8_lossy(&r).starts_with("+OK"));
    }
    assert!(locker.try_lock("shared").await.expect("busy").is_none());
    // The foreign client releases (compare-and-delete, as node-redlock does).
    for i in 0..3 {
        let addr = nodes.node(i).addr();
        redis_command(addr, &["DEL", "shared"], T).expect("DEL");
    }
    let g = locker.lock_timeout("shared", T).await.expect("free now");
    for i in 0..5 {
        let addr = nodes.node(i).addr();
        let r = redis_command(addr, &["SET", "shared", "foreign-2", "NX", "PX", "5000"], T)
            .expect("SET");
        assert!(
            String::from_utf8_lossy(&r).starts_with("$-1"),
            "node {i}: the foreign client got the key while dlock holds it"
        );
        assert!(raw_get(&mut nodes, i, "shared").contains(g.owner().as_str()));
    }
    g.release().await.expect("release");
}

/// The token write-back counts only nodes that still hold the grant. Three nodes: the
/// first reached through a slow link, the second held by another client (a grant of
/// someone else that got there first), the third's counter ahead at 100. The grant
/// comes from the first and the third, with T = 101 from the third alone, so T must be
/// written back to the first before the guard is returned. Counting the second's
/// answer to the write-back instead returned the guard while the first still stood at
/// 1: a later grant there (after this one's release) could take a token below 101.
#[tokio::test]
async fn token_write_back_counts_only_the_nodes_that_hold_the_grant() {
    let Some(mut nodes) = RedisNodes::start(3, &RedisOptions::default()) else {
        return;
    };
    let addrs: Vec<_> = (0..3).map(|i| nodes.node(i).addr()).collect();
    let name = "raise-where-held";
    let counter_key = format!("dlock_token:{{{name}}}");
    redis_command(addrs[1], &["SET", name, "someone-else", "PX", "60000"], T).expect("SET");
    redis_command(addrs[2], &["SET", &counter_key, "100"], T).expect("SET");
    let slow = FaultProxy::start(addrs[0]).await.expect("proxy");
    let url = format!(
        "redlock://{},{},{}?node_timeout=5s",
        slow.addr(),
        addrs[1],
        addrs[2]
    );
    let locker = Locker::connect(&url).await.expect("connect");
    slow.set(Fault::Delay(Duration::from_millis(150)));
    let g = locker.lock(name).await.expect("lock");
    let token = g.fencing_token();
    assert_eq!(token, 101, "T is the third node's counter");
    // Read at once, around the slow link: the first node holds the grant and must
    // already stand at T.
    let first =
        String::from_utf8_lossy(&redis_command(addrs[0], &["GET", &counter_key], T).expect("GET"))
            .lines()
            .find_map(|l| l.trim().parse::<u64>().ok())
            .unwrap_or(0);
    assert!(
        first >= token,
        "the guard came back while a node holding the grant stood at {first}, below {token}"
    );
    slow.set(Fault::None);
    g.release().await.expect("release");
}

/// The write-back script answers 1 only where the node still holds the grant it names
/// (owner and nonce): another owner's key, or a later grant of the same owner, answers
/// 0 and is not counted — though the counter is raised either way (a raise never
/// hurts).
#[tokio::test]
async fn the_write_back_answers_only_for_the_grant_it_names() {
    let Some(mut nodes) = RedisNodes::start(1, &RedisOptions::default()) else {
        return;
    };
    let addr = nodes.node(0).addr();
    let raise = include_str!("../src/redlock/scripts/raise.lua");
    let run = |cmd: &[&str]| {
        String::from_utf8_lossy(&redis_command(addr, cmd, T).expect(cmd[0])).into_owned()
    };
    let raise_where = |holder: &str, nonce: &str| {
        run(&["DEL", "c", "t"]);
        run(&["SET", "l", holder, "PX", "60000"]);
        run(&[
            "SET",
            "m",
            &format!("{{\"nonce\":\"{nonce}\"}}"),
            "PX",
            "60000",
        ]);
        let answer = run(&["EVAL", raise, "4", "c", "l", "t", "m", "101", "me", "n-1"]);
        (
            answer.trim().to_owned(),
            run(&["GET", "c"]),
            run(&["GET", "t"]),
        )
    };
    let (answer, counter, _) = raise_where("someone-else", "n-1");
    assert_eq!(answer, ":0", "another owner's key counted");
    assert!(counter.contains("101"), "counter not raised: {counter:?}");
    let (answer, _, _) = raise_where("me", "n-2");
    assert_eq!(answer, ":0", "a later grant of the same owner counted");
    let (answer, counter, token) = raise_where("me", "n-1");
    assert_eq!(answer, ":1", "the grant itself not counted");
    assert!(
        counter.contains("101") && token.contains("101"),
        "{counter:?} {token:?}"
    );
}

/// `break_lock` on Redlock: a token no grant carries breaks nothing; with two of five
/// nodes paused, the three that answer are a majority and the break succeeds, each
/// node counted once, by its answer; the holder is told at its next renewal (whatever
/// the paused nodes do with the break queued for them when they resume, they are a
/// minority); then nothing is left to break.
#[tokio::test]
async fn break_lock_succeeds_with_a_majority_of_answers_and_the_holder_is_told() {
    let Some(mut nodes) = nodes(false).await else {
        return;
    };
    let holder = Locker::connect(&nodes.url()).await.expect("connect");
    let operator = Locker::connect(&nodes.url()).await.expect("connect");
    let g = holder
        .lock_with("broken", &LockOptions::new().ttl(Duration::from_secs(3)))
        .await
        .expect("lock");
    let token = g.fencing_token();
    assert!(
        !operator
            .break_lock("broken", token + 1)
            .await
            .expect("break")
    );
    assert!(g.is_held(), "a break of another token ended the hold");
    nodes.node(0).process().pause();
    nodes.node(1).process().pause();
    let broke = operator.break_lock("broken", token).await;
    nodes.node(0).process().resume();
    nodes.node(1).process().resume();
    assert!(broke.expect("break with three of five answering"));
    let lost = tokio::time::timeout(Duration::from_secs(10), g.lost())
        .await
        .expect("the holder is told of the break");
    assert!(matches!(lost, Error::LockLost { .. }), "{lost:?}");
    assert!(
        !operator.break_lock("broken", token).await.expect("break"),
        "broken twice"
    );
    let next = operator.lock_timeout("broken", T).await.expect("free");
    assert!(next.fencing_token() > token);
    next.release().await.expect("release");
}
