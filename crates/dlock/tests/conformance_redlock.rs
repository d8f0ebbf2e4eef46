//! The conformance suite on Redlock over five independent redis-servers (started from
//! PATH on free loopback ports).
#![cfg(feature = "redis")]

use dlock::conformance::Harness;
use dlock_testkit::{RedisNodes, RedisOptions};

async fn harness() -> Option<Harness> {
    let nodes = RedisNodes::start(5, &RedisOptions::default())?;
    let url = nodes.url();
    Some(Harness::new(url).keep(nodes))
}

dlock::conformance_suite!(harness());
