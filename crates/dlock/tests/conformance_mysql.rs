//! The conformance suite on a real MariaDB (started from PATH on a free loopback port),
//! in every mode.
#![cfg(feature = "mysql")]

use dlock::conformance::Harness;
use dlock_testkit::MariaDbServer;

async fn harness(query: &'static str) -> Option<Harness> {
    let db = MariaDbServer::start()?;
    let url = format!("{}{query}", db.url());
    Some(Harness::new(url).keep(db))
}

mod lease {
    use super::*;
    dlock::conformance_suite!(harness(""));
}

mod named {
    use super::*;
    dlock::conformance_suite!(harness("?mode=named"));
}

mod row {
    use super::*;
    dlock::conformance_suite!(harness("?mode=row&table_prefix=locks_by_row"));
}
