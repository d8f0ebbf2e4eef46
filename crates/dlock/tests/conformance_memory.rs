//! The conformance suite on the in-process backend.

use dlock::conformance::Harness;

async fn harness() -> Option<Harness> {
    // A named store so that every client of one test shares it.
    Some(Harness::new(format!("memory://{}", dlock::Owner::random())))
}

dlock::conformance_suite!(harness());
