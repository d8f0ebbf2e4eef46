//! The conformance suite on a single real redis-server (started from PATH on a free
//! loopback port), in each on-server layout.
#![cfg(feature = "redis")]

use dlock::conformance::Harness;
use dlock_testkit::RedisServer;

async fn harness(query: &'static str) -> Option<Harness> {
    let redis = RedisServer::start()?;
    let url = format!("{}{query}", redis.url());
    Some(Harness::new(url).keep(redis))
}

mod redisson {
    use super::*;
    dlock::conformance_suite!(harness(""));
}

mod redis_py {
    use super::*;
    dlock::conformance_suite!(harness("?layout=redis-py"));
}

mod python_redis_lock {
    use super::*;
    dlock::conformance_suite!(harness("?layout=python-redis-lock"));
}
