//! The conformance suite on a real MariaDB (started from PATH on a free loopback port),
//! in every mode.
#![cfg(feature = "mysql")]

use dlock::conformance::Harness;
use dlock_testkit::MariaDbServer;

mod common;

async fn proxied(query: &'static str) -> Option<Harness> {
    let server = MariaDbServer::start()?;
    let url = format!("{}{query}", server.url());
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], server.port()));
    Some(common::with_proxies(Harness::new(url).keep(server), &[addr]).await)
}

async fn harness(query: &'static str) -> Option<Harness> {
    let db = MariaDbServer::start()?;
    let url = format!("{}{query}", db.url());
    Some(Harness::new(url).keep(db))
}

mod lease {
    use super::*;
    dlock::conformance_suite!(harness(""));
    dlock::conformance_faults!(proxied(""));
    dlock::conformance_slow_network!(proxied(""));
}

mod named {
    use super::*;
    dlock::conformance_suite!(harness("?mode=named"));
    dlock::conformance_faults!(proxied("?mode=named"));
    dlock::conformance_slow_network!(proxied("?mode=named"));
}

mod row {
    use super::*;
    dlock::conformance_suite!(harness("?mode=row&table_prefix=locks_by_row"));
    dlock::conformance_faults!(proxied("?mode=row&table_prefix=locks_by_row"));
    dlock::conformance_slow_network!(proxied("?mode=row&table_prefix=locks_by_row"));
}
