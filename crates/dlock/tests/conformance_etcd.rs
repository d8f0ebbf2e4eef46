//! The conformance suite on a real etcd (started from PATH on free loopback ports),
//! with default (encoded) names and with raw names under a path prefix.
#![cfg(feature = "etcd")]

use dlock::conformance::Harness;
use dlock_testkit::EtcdServer;

mod common;

async fn harness(query: &'static str) -> Option<Harness> {
    let etcd = EtcdServer::start()?;
    let url = format!("{}{query}", etcd.url());
    Some(Harness::new(url).keep(etcd))
}

async fn proxied(query: &'static str) -> Option<Harness> {
    let etcd = EtcdServer::start()?;
    let (url, addr) = (format!("{}{query}", etcd.url()), etcd.addr());
    Some(common::with_proxies(Harness::new(url).keep(etcd), &[addr]).await)
}

mod encoded {
    use super::*;
    dlock::conformance_suite!(harness("?session_ttl=6s"));
    dlock::conformance_faults!(proxied("?session_ttl=6s"));
    dlock::conformance_slow_network!(proxied("?session_ttl=6s"));
}

mod raw_names {
    use super::*;
    dlock::conformance_suite!(harness("/locks?raw_names=true&session_ttl=6s"));
}
