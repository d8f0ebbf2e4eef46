//! The conformance suite on a real PostgreSQL (started from PATH or Debian's
//! `/usr/lib/postgresql/*/bin` on a free loopback port), in every mode.
#![cfg(feature = "postgres")]

use dlock::conformance::Harness;
use dlock_testkit::PgServer;

async fn harness(query: &'static str) -> Option<Harness> {
    let pg = PgServer::start()?;
    let url = format!("{}{query}", pg.url());
    Some(Harness::new(url).keep(pg))
}

mod lease {
    use super::*;
    dlock::conformance_suite!(harness(""));
}

mod advisory {
    use super::*;
    dlock::conformance_suite!(harness("?mode=advisory"));
}

mod row {
    use super::*;
    dlock::conformance_suite!(harness("?mode=row&table_prefix=locks_by_row"));
}
