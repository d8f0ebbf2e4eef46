//! What several test files share: putting a harness's servers behind fault proxies.

use std::net::SocketAddr;
use std::sync::Arc;

use dlock::conformance::{Harness, NetFault};
use dlock_testkit::{Fault, FaultProxy};

/// `harness` plus a proxied URL: every address of `upstreams` in the harness's URL is
/// replaced by a fault proxy in front of it, and the harness's switch applies each
/// [`NetFault`] to all of them.
pub async fn with_proxies(harness: Harness, upstreams: &[SocketAddr]) -> Harness {
    let mut url = harness.url().to_owned();
    let mut proxies = Vec::new();
    for upstream in upstreams {
        let proxy = FaultProxy::start(*upstream).await.expect("proxy");
        let (from, to) = (upstream.to_string(), proxy.addr().to_string());
        assert!(url.contains(&from), "{upstream} is not in the harness URL");
        url = url.replace(&from, &to);
        proxies.push(proxy);
    }
    let proxies = Arc::new(proxies);
    harness.with_proxy(url, move |fault| {
        for p in proxies.iter() {
            match fault {
                NetFault::Delay(d) => p.set(Fault::Delay(d)),
                NetFault::DropReplies => p.set(Fault::DropReplies),
                NetFault::ResetAll => p.reset_all(),
                _ => p.set(Fault::None),
            }
        }
    })
}
