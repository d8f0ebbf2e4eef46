//! The conformance suite on a real ZooKeeper (Debian's package, started with java on a
//! free loopback port).
#![cfg(feature = "zookeeper")]

use dlock::conformance::Harness;
use dlock_testkit::ZkServer;

mod common;

async fn harness() -> Option<Harness> {
    let zk = ZkServer::start()?;
    let url = format!("{}/locks?session_timeout=6s", zk.url());
    Some(Harness::new(url).keep(zk))
}

async fn proxied() -> Option<Harness> {
    let zk = ZkServer::start()?;
    let (url, addr) = (format!("{}/locks?session_timeout=6s", zk.url()), zk.addr());
    Some(common::with_proxies(Harness::new(url).keep(zk), &[addr]).await)
}

dlock::conformance_suite!(harness());
dlock::conformance_faults!(proxied());
dlock::conformance_slow_network!(proxied());
