//! Puts that etcd applies after the attempt that sent them has been cleaned up.
//!
//! A put whose answer never came (the connection was cut) may still be applied: etcd
//! can take the request off the dead connection and propose it after the client has
//! given up on it, and after the delete that cleaned up the attempt, sent on a new
//! connection. The key then stands under a live session with nobody behind it — a
//! permit, a read or a lock that nobody holds, kept for as long as the session lives.
//! So after an attempt whose put went unanswered ends, its key is looked for again and
//! deleted each time it turns up, for [`LATE_PUT`]; measured under the fault crowd, a
//! late put landed seconds after the cleanup (`primitives_under_faults` on etcd).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::client::Client;
use super::proto;
use super::session::Session;

/// How long after an unanswered put's cleanup its key is looked for, and how long a
/// name stays closed after an unanswered delete by name: twice the default request
/// timeout.
pub(super) const LATE_PUT: Duration = Duration::from_secs(10);

/// The first pause before a look; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);

/// The longest pause between two looks: a late key stands at most about this long.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// In a task of its own, [`looks`] until `until` or until `session` is lost (its keys
/// went with it).
pub(super) fn sweep<F, Fut>(session: Arc<Session>, until: Instant, look: F)
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    tokio::spawn(async move { looks(&session.lost, until, look).await });
}

/// Call `look` after 100 ms, then at pauses doubling to a second, until `until` or
/// until `lost` is cancelled.
pub(super) async fn looks<F, Fut>(lost: &CancellationToken, until: Instant, mut look: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut pause = FIRST_PAUSE;
    while Instant::now() < until {
        tokio::select! {
            () = lost.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        look().await;
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// The create revision of `key`, if it exists (a look that gets no answer within a
/// second finds nothing: the next one looks again).
pub(super) async fn find(client: &Client, key: &str) -> Option<i64> {
    let look = client.range(proto::RangeRequest {
        key: key.as_bytes().to_vec(),
        keys_only: true,
        ..proto::RangeRequest::default()
    });
    let found = tokio::time::timeout(MAX_PAUSE, look).await.ok()?.ok()?;
    found.kvs.first().map(|kv| kv.create_revision)
}

/// Delete `key` while its create revision is `revision`, asking until etcd answers
/// (either way) or the session is `lost` (a dropped backend's session is revoked, so
/// this ends with it too). Once answered, the key of that revision is gone for good
/// (revisions are never reused), so a try that went unanswered and lands later
/// deletes nothing. It never gives up before that: a try that went unanswered may
/// still land, and a caller that then freed the name could see the next local
/// acquisition adopt the key and lose it to that late delete.
pub(super) async fn delete_found(
    client: &Client,
    lost: &CancellationToken,
    key: &str,
    revision: i64,
) {
    while !lost.is_cancelled() {
        if super::Inner::delete_key(client, key, Some(revision))
            .await
            .is_ok()
        {
            return;
        }
        tokio::time::sleep(FIRST_PAUSE).await;
    }
}
