//! What the batched renewers of the backends share (SQLite, the SQL lease mode, Redis,
//! Redlock): a batch is the request that woke the renewer and whatever waits behind it.

#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
use std::{
    future::Future,
    sync::Arc,
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
use tokio::sync::Semaphore;
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

/// How a renewer that runs several batches at once forms and runs them.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
pub(crate) struct Batching<A> {
    /// Most requests in one batch.
    pub max: usize,
    /// Batches running at once: one that hangs (a locked row, a slow node) holds up
    /// only itself, and while every place is taken requests gather for the next.
    pub in_flight: usize,
    /// Whether a request's caller stopped waiting for it (it is dropped unrun).
    pub abandoned: A,
}

#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
impl<A> Batching<A> {
    /// Start the task that takes requests from `rx` and runs each batch with `run`, as
    /// a task of its own that keeps its place until it ends. `run` answering `None`
    /// ends the task (its backend is gone); so does the last sender's drop. The task
    /// runs on the current runtime. Returns how many batches were formed so far
    /// (tests watch it).
    pub(crate) fn spawn<R, F, Fut>(
        self,
        mut rx: mpsc::UnboundedReceiver<R>,
        mut run: F,
    ) -> Arc<AtomicUsize>
    where
        A: Fn(&R) -> bool + Send + 'static,
        R: Send + 'static,
        F: FnMut(Vec<R>) -> Option<Fut> + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let places = Arc::new(Semaphore::new(self.in_flight));
        let formed = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&formed);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let Ok(place) = Arc::clone(&places).acquire_owned().await else {
                    return;
                };
                let batch = gather(first, &mut rx, self.max, &self.abandoned);
                if batch.is_empty() {
                    // Every caller stopped waiting: nothing to run.
                    continue;
                }
                counted.fetch_add(1, Ordering::Relaxed);
                let Some(work) = run(batch) else {
                    return;
                };
                tokio::spawn(async move {
                    work.await;
                    drop(place);
                });
            }
        });
        formed
    }
}

/// `batch` split by TTL (one statement or call renews to one TTL), in the order each
/// TTL first appears.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
pub(crate) fn by_ttl<R>(
    mut batch: Vec<R>,
    ttl: impl Fn(&R) -> Duration,
) -> Vec<(Duration, Vec<R>)> {
    let mut parts = Vec::new();
    while let Some(t) = batch.first().map(&ttl) {
        let (same, rest): (Vec<R>, Vec<R>) = batch.into_iter().partition(|r| ttl(r) == t);
        parts.push((t, same));
        batch = rest;
    }
    parts
}

#[cfg(all(test, any(feature = "redis", feature = "postgres", feature = "mysql")))]
mod tests {
    use std::time::Duration;

    #[test]
    fn a_batch_splits_by_ttl_in_first_seen_order() {
        let s = Duration::from_secs;
        let batch = vec![
            (s(3), 'a'),
            (s(1), 'b'),
            (s(3), 'c'),
            (s(2), 'd'),
            (s(1), 'e'),
        ];
        let parts = super::by_ttl(batch, |r| r.0);
        let got: Vec<(u64, String)> = parts
            .into_iter()
            .map(|(t, rs)| (t.as_secs(), rs.into_iter().map(|r| r.1).collect()))
            .collect();
        assert_eq!(
            got,
            vec![(3, "ac".into()), (1, "be".into()), (2, "d".into())]
        );
    }
}
