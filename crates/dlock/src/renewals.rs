//! What the batched renewers of the backends share (SQLite, the SQL lease mode, Redis,
//! Redlock): a batch is the request that woke the renewer and whatever waits behind it.

use tokio::sync::mpsc;

/// `first` and the requests waiting behind it in `rx`, up to `max` in all, without
/// those whose caller stopped waiting (`abandoned`: a keeper that gave up on a renewal
/// sends another if the hold still stands).
pub(crate) fn gather<R>(
    first: R,
    rx: &mut mpsc::UnboundedReceiver<R>,
    max: usize,
    abandoned: impl Fn(&R) -> bool,
) -> Vec<R> {
    let mut batch = vec![first];
    while batch.len() < max {
        match rx.try_recv() {
            Ok(r) => batch.push(r),
            Err(_) => break,
        }
    }
    batch.retain(|r| !abandoned(r));
    batch
}
