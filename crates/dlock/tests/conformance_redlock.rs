//! The conformance suite on Redlock over five independent redis-servers (started from
//! PATH on free loopback ports).
#![cfg(feature = "redis")]

use dlock::conformance::Harness;
use dlock_testkit::{RedisNodes, RedisOptions};

mod common;

async fn harness() -> Option<Harness> {
    let nodes = RedisNodes::start(5, &RedisOptions::default())?;
    let url = nodes.url();
    Some(Harness::new(url).keep(nodes))
}

/// Every node behind a proxy of its own; the faults hit all of them at once. `query`
/// goes after the node list.
async fn proxied(query: &str) -> Option<Harness> {
    let mut nodes = RedisNodes::start(5, &RedisOptions::default())?;
    let url = format!("{}{query}", nodes.url());
    let addrs: Vec<_> = (0..5).map(|i| nodes.node(i).addr()).collect();
    Some(common::with_proxies(Harness::new(url).keep(nodes), &addrs).await)
}

dlock::conformance_suite!(harness());
dlock::conformance_faults!(proxied(""));
// Each node's call must outlast the slow network's round trip (default: 50 ms).
dlock::conformance_slow_network!(proxied("?node_timeout=1s"));
