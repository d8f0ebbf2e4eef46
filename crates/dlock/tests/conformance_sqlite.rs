//! The conformance suite on the embedded SQLite backend: a WAL database file, every
//! client with its own connection pool. (Separate OS processes are covered by the CLI's
//! tests, which run `dlock` itself several times against one file.)

use dlock::conformance::Harness;

async fn harness() -> Option<Harness> {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    Some(Harness::new(url).keep(dir))
}

dlock::conformance_suite!(harness());
