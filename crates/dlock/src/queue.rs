//! What the queue-and-watch backends (etcd, ZooKeeper) share, as Curator's recipes and
//! etcd's `concurrency` package share theirs: the holder record stored in a contender's
//! key or node, and finishing in the background a delete that could not reach the
//! server (the session outlives the outage, and so would the key or node).

use std::time::Duration;

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
    caps.release_reports_loss = true;
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
            metadata: Metadata::clone(&req.metadata),
        })
        .unwrap_or_default()
    }

    /// Parse what a contender stored; `None` for a foreign client's value.
    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        serde_json::from_slice(bytes).ok()
    }
}
