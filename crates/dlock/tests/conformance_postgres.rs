//! The conformance suite on a real PostgreSQL (started from PATH or Debian's
//! `/usr/lib/postgresql/*/bin` on a free loopback port), in every mode.
#![cfg(feature = "postgres")]

use dlock::conformance::Harness;
use dlock_testkit::PgServer;

mod common;

async fn proxied(query: &'static str) -> Option<Harness> {
    let server = PgServer::start()?;
    let url = format!("{}{query}", server.url());
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], server.port()));
    Some(common::with_proxies(Harness::new(url).keep(server), &[addr]).await)
}

async fn harness(query: &'static str) -> Option<Harness> {
    let pg = PgServer::start()?;
    let url = format!("{}{query}", pg.url());
    Some(Harness::new(url).keep(pg))
}

mod lease {
    use super::*;
    dlock::conformance_suite!(harness(""));
    dlock::conformance_faults!(proxied(""));
    dlock::conformance_slow_network!(proxied(""));
}

mod advisory {
    use super::*;
    dlock::conformance_suite!(harness("?mode=advisory"));
    dlock::conformance_faults!(proxied("?mode=advisory"));
    dlock::conformance_slow_network!(proxied("?mode=advisory"));
}

mod row {
    use super::*;
    dlock::conformance_suite!(harness("?mode=row&table_prefix=locks_by_row"));
    dlock::conformance_faults!(proxied("?mode=row&table_prefix=locks_by_row"));
    dlock::conformance_slow_network!(proxied("?mode=row&table_prefix=locks_by_row"));
}
