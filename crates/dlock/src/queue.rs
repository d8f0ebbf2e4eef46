//! What the queue-and-watch backends (etcd, ZooKeeper) share, as Curator's recipes and
//! etcd's `concurrency` package share theirs: the holder record stored in a contender's
//! key or node, and finishing in the background a delete that could not reach the
//! server (the session outlives the outage, and so would the key or node).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backend::{AcquireRequest, Capabilities, Fencing};
use crate::error::Error;
use crate::options::Metadata;

/// The session timeout etcd and ZooKeeper backends use unless the URL says otherwise.
pub(crate) const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// The guarantees etcd and ZooKeeper share: a server-side queue every waiter joins, a
/// watch on the predecessor, a session, and durable tokens (revision / zxid).
pub(crate) fn capabilities(session_timeout: Duration) -> Capabilities {
    let mut caps = Capabilities::new(Fencing::Durable);
    caps.fifo = true;
    caps.native_wait = true;
    caps.session_bound = true;
    caps.cross_process = true;
    caps.queued_waiting = true;
    caps.session_timeout = Some(session_timeout);
    caps
}

/// A break refused on etcd or ZooKeeper: the holder's key or node keeps no dlock record
/// (etcdctl, Curator, kazoo, or an election's candidate, which stores its value alone),
/// so it never looks at it and would never hear of the break.
pub(crate) fn break_unnoticed() -> Error {
    Error::Unsupported(
        "the holder is not a dlock lock holder (it keeps no dlock record): it would never \
         notice a break"
            .into(),
    )
}

/// After a release that could not reach the server, keep trying in the background
/// (50 ms doubling to 1 s, for at most 10 min) until `attempt` reports it done or
/// `gone` is cancelled (the session ended and took the lock with it). On a
/// session-bound backend the lock would otherwise stay held for as long as this
/// process's session lives, which after a reconnect is indefinitely.
pub(crate) fn finish_release_later<F, Fut>(gone: CancellationToken, mut attempt: F)
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    tokio::spawn(async move {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(600);
        let mut backoff = Duration::from_millis(50);
        while tokio::time::Instant::now() < give_up {
            tokio::select! {
                () = gone.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            if attempt().await {
                return;
            }
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
        tracing::warn!("a release could not reach the server for 10 minutes; giving up");
    });
}

/// What queue-and-watch backends (etcd, ZooKeeper) store in a contender's key or node:
/// the owner token and the metadata, as JSON. Foreign clients store anything else.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct StoredHolder {
    pub(crate) owner: String,
    #[serde(flatten)]
    pub(crate) metadata: Metadata,
}

impl StoredHolder {
    /// The JSON for `req`'s contender.
    pub(crate) fn encode(req: &AcquireRequest) -> Vec<u8> {
        serde_json::to_vec(&StoredHolder {
            owner: req.owner.as_str().to_owned(),
            metadata: req.metadata.clone(),
        })
        .unwrap_or_default()
    }

    /// Parse what a contender stored; `None` for a foreign client's value.
    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        serde_json::from_slice(bytes).ok()
    }
}
