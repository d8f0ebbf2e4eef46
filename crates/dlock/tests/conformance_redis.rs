//! The conformance suite on a single real redis-server (started from PATH on a free
//! loopback port), in each on-server layout.
#![cfg(feature = "redis")]

use dlock::conformance::Harness;
use dlock_testkit::RedisServer;

mod common;

async fn harness(query: &'static str) -> Option<Harness> {
    let redis = RedisServer::start()?;
    let url = format!("{}{query}", redis.url());
    Some(Harness::new(url).keep(redis))
}

async fn proxied(query: &'static str) -> Option<Harness> {
    let redis = RedisServer::start()?;
    let (url, addr) = (format!("{}{query}", redis.url()), redis.addr());
    Some(common::with_proxies(Harness::new(url).keep(redis), &[addr]).await)
}

mod redisson {
    use super::*;
    dlock::conformance_suite!(harness(""));
    dlock::conformance_faults!(proxied(""));
    dlock::conformance_slow_network!(proxied(""));
}

mod redis_py {
    use super::*;
    dlock::conformance_suite!(harness("?layout=redis-py"));
    dlock::conformance_faults!(proxied("?layout=redis-py"));
    dlock::conformance_slow_network!(proxied("?layout=redis-py"));
}

mod python_redis_lock {
    use super::*;
    dlock::conformance_suite!(harness("?layout=python-redis-lock"));
    dlock::conformance_faults!(proxied("?layout=python-redis-lock"));
    dlock::conformance_slow_network!(proxied("?layout=python-redis-lock"));
}

/// The suite on a three-master Redis Cluster.
mod cluster {
    use super::*;
    use dlock_testkit::RedisCluster;

    async fn cluster_harness(query: &'static str) -> Option<Harness> {
        let cluster = RedisCluster::start(3)?;
        let url = format!("{}{query}", cluster.url());
        Some(Harness::new(url).keep(cluster))
    }

    mod redisson {
        use super::*;
        dlock::conformance_suite!(cluster_harness(""));
    }

    mod redis_py {
        use super::*;
        dlock::conformance_suite!(cluster_harness("?layout=redis-py"));
    }
}

/// The suite on a master + replica watched by three Sentinels.
mod sentinel {
    use super::*;
    use dlock_testkit::RedisSentinel;

    async fn sentinel_harness() -> Option<Harness> {
        let setup = RedisSentinel::start()?;
        let url = setup.url();
        Some(Harness::new(url).keep(setup))
    }

    dlock::conformance_suite!(sentinel_harness());
}
