//! [`Finish`]: a future that runs to completion even if its caller stops polling it.
//!
//! Dropped unfinished, the rest of the job runs in a task of its own, followed by an
//! optional epilogue that sees the job's output (a grant to give back, a queue place to
//! leave). A release must not stop halfway because its caller was cancelled, and an
//! acquisition attempt must not be cleaned up before it has finished.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

type Job<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Epilogue<T> = Box<dyn FnOnce(T) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// See the module docs.
pub(crate) struct Finish<T: Send + 'static> {
    job: Option<Job<T>>,
    /// Runs after the job, in the background task, only if this was dropped unfinished.
    abandoned: Option<Epilogue<T>>,
}

impl<T: Send + 'static> Finish<T> {
    pub(crate) fn new(job: impl Future<Output = T> + Send + 'static) -> Self {
        Finish {
            job: Some(Box::pin(job)),
            abandoned: None,
        }
    }

    /// Like [`Finish::new`], and if this is dropped before the job finished, `then`
    /// gets the job's output once it has (in the background task).
    pub(crate) fn with_epilogue<F, Fut>(
        job: impl Future<Output = T> + Send + 'static,
        then: F,
    ) -> Self
    where
        F: FnOnce(T) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        Finish {
            job: Some(Box::pin(job)),
            abandoned: Some(Box::new(move |out| Box::pin(then(out)))),
        }
    }
}

impl<T: Send + 'static> Future for Finish<T> {
    /// `None` only if polled again after it finished.
    type Output = Option<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let Some(job) = self.job.as_mut() else {
            return Poll::Ready(None);
        };
        let out = job.as_mut().poll(cx);
        if out.is_ready() {
            self.job = None;
            self.abandoned = None;
        }
        out.map(Some)
    }
}

impl<T: Send + 'static> Drop for Finish<T> {
    fn drop(&mut self) {
        let Some(job) = self.job.take() else {
            return;
        };
        let then = self.abandoned.take();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let out = job.await;
                if let Some(then) = then {
                    then(out).await;
                }
            });
        }
    }
}

/// How long a session-bound backend keeps trying a release in the background: its
/// lock would otherwise stay held for as long as this process's session lives.
#[cfg_attr(
    not(any(
        feature = "redis",
        feature = "postgres",
        feature = "mysql",
        feature = "etcd",
        feature = "zookeeper"
    )),
    allow(dead_code)
)]
pub(crate) const SESSION_RELEASE_RETRIES: Duration = Duration::from_secs(600);

/// After a release (or an undo) that could not reach the server, keep trying in the
/// background (50 ms doubling to 1 s) until `attempt` reports it done, `gone` is
/// cancelled (the session ended and took the lock with it), or `within` has passed.
/// On a session-bound backend the lock would otherwise stay held for as long as this
/// process's session lives, which after a reconnect is indefinitely
/// ([`SESSION_RELEASE_RETRIES`]); on a lease backend, until its lease runs out (so
/// `within` is the lease: after it there is nothing left to give back). `attempt` must
/// touch nothing but what it gives back (remove by acquisition and token), so a late
/// success harms no later grant.
#[cfg_attr(
    not(any(
        feature = "redis",
        feature = "postgres",
        feature = "mysql",
        feature = "etcd",
        feature = "zookeeper"
    )),
    allow(dead_code)
)]
pub(crate) fn release_later<F, Fut>(gone: CancellationToken, within: Duration, mut attempt: F)
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    tokio::spawn(async move {
        let give_up = tokio::time::Instant::now()
            .checked_add(within)
            .unwrap_or_else(|| tokio::time::Instant::now() + SESSION_RELEASE_RETRIES);
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
        tracing::warn!(
            after = ?within,
            "a release could not reach the server; giving up (a lease ends by itself)"
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn a_dropped_job_finishes_then_runs_its_epilogue() {
        let seen = Arc::new(AtomicU32::new(0));
        let s = Arc::clone(&seen);
        let f = Finish::with_epilogue(
            async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                7
            },
            move |out| async move {
                s.store(out, Ordering::SeqCst);
            },
        );
        // Polled once, then dropped.
        let _ = tokio::time::timeout(Duration::from_millis(1), f).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(seen.load(Ordering::SeqCst), 7);
    }

    #[tokio::test]
    async fn a_finished_job_runs_no_epilogue() {
        let seen = Arc::new(AtomicU32::new(0));
        let s = Arc::clone(&seen);
        let f = Finish::with_epilogue(async { 3 }, move |out| async move {
            s.store(out, Ordering::SeqCst);
        });
        assert_eq!(f.await, Some(3));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(seen.load(Ordering::SeqCst), 0);
    }
}
