//! The conformance suite on a real ZooKeeper (Debian's package, started with java on a
//! free loopback port).
#![cfg(feature = "zookeeper")]

use dlock::conformance::Harness;
use dlock_testkit::ZkServer;

async fn harness() -> Option<Harness> {
    let zk = ZkServer::start()?;
    let url = format!("{}/locks?session_timeout=6s", zk.url());
    Some(Harness::new(url).keep(zk))
}

dlock::conformance_suite!(harness());
