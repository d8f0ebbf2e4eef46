//! The pinned connection of a session-mode hold (advisory, named, row): its heartbeat,
//! the idle connections kept for the next acquisition, and the session side of a hold.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::db_err;
use crate::error::{Error, Result};
use crate::notify::WakeOne;

/// A connection pinned to one held lock (session modes). The heartbeat pings it every
/// `interval`; when a ping fails or takes longer than `interval`, the connection is
/// dropped (its socket closed, so the server frees the lock too) and `lost` is cancelled.
#[derive(Debug)]
pub(crate) struct Pinned<C> {
    pub conn: Arc<Mutex<Option<C>>>,
    pub lost: CancellationToken,
    stop: CancellationToken,
}

impl<C: sqlx::Connection + 'static> Pinned<C> {
    /// Pin `conn` and start its heartbeat.
    pub(crate) fn new(conn: C, interval: Duration) -> Self {
        let conn = Arc::new(Mutex::new(Some(conn)));
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let (c2, l2, s2) = (Arc::clone(&conn), lost.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = s2.cancelled() => return,
                    () = tokio::time::sleep(interval) => {}
                }
                if !ping_or_drop(&c2, &l2, interval).await {
                    return;
                }
            }
        });
        Pinned { conn, lost, stop }
    }

    /// Renewal of a session hold: the session holds the lock, so renewing means proving
    /// the session is alive. A connection that does not answer within `timeout` is
    /// closed, which ends the session and the lock: the loss is certain.
    pub(crate) async fn prove_alive(&self, timeout: Duration) -> Result<()> {
        if ping_or_drop(&self.conn, &self.lost, timeout).await {
            Ok(())
        } else {
            Err(Error::NotOwner {
                name: String::new(),
            })
        }
    }

    /// Take the connection back (release); `None` when the heartbeat already lost it.
    pub(crate) async fn take(&self) -> Option<C> {
        self.stop.cancel();
        self.conn.lock().await.take()
    }
}

/// Ping the pinned connection; on failure or timeout drop it and cancel `lost`.
/// Returns whether the session is alive.
async fn ping_or_drop<C: sqlx::Connection + 'static>(
    conn: &Mutex<Option<C>>,
    lost: &CancellationToken,
    timeout: Duration,
) -> bool {
    let mut slot = conn.lock().await;
    let Some(c) = slot.as_mut() else { return false };
    if matches!(tokio::time::timeout(timeout, c.ping()).await, Ok(Ok(()))) {
        return true;
    }
    // Tell the holder first; close the session (which lets the server free the lock)
    // a moment later, so the holder always hears of the loss before anyone else can
    // take the lock.
    lost.cancel();
    if let Some(c) = slot.take() {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(c);
        });
    }
    false
}

impl<C> Drop for Pinned<C> {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Idle connections for session modes, kept for the next acquisition (at most `cap`,
/// none idle longer than `max_idle`, so a server-side idle timeout never hands us a dead
/// one). A connection comes back here only after a clean release or a clean "busy"; any
/// error drops it, which closes its session and frees whatever it held.
#[derive(Debug)]
pub(crate) struct IdleConns<C> {
    idle: std::sync::Mutex<Vec<(C, tokio::time::Instant)>>,
    cap: usize,
    max_idle: Duration,
    /// When [`IdleConns::purge`] last dropped the idle ones.
    purged: std::sync::Mutex<Option<tokio::time::Instant>>,
}

/// [`IdleConns::purge`] drops the idle connections at most this often: an error that
/// repeats on every statement (a missing privilege, a name's gate held by a stopped
/// client) must not have every statement connect again.
const PURGE_EVERY: Duration = Duration::from_secs(1);

impl<C> IdleConns<C> {
    pub(crate) fn new(cap: u32, max_idle: Duration) -> Self {
        IdleConns {
            idle: std::sync::Mutex::new(Vec::new()),
            cap: cap as usize,
            max_idle,
            purged: std::sync::Mutex::new(None),
        }
    }

    pub(crate) fn pop(&self) -> Option<C> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while let Some((c, since)) = idle.pop() {
            if since.elapsed() < self.max_idle {
                return Some(c);
            }
        }
        None
    }

    /// Drop every idle connection (closed outside the lock), unless that was done
    /// less than [`PURGE_EVERY`] ago.
    pub(crate) fn purge(&self) {
        {
            let mut purged = self
                .purged
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = tokio::time::Instant::now();
            if purged.is_some_and(|at| now.duration_since(at) < PURGE_EVERY) {
                return;
            }
            *purged = Some(now);
        }
        let gone = std::mem::take(
            &mut *self
                .idle
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        drop(gone);
    }

    pub(crate) fn put(&self, c: C) {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if idle.len() < self.cap {
            idle.push((c, tokio::time::Instant::now()));
        }
    }
}

/// The session side of a hold in a session mode: the pinned connection, where it goes
/// back after a clean release, and who to wake.
#[derive(Debug)]
pub(crate) struct Session<C> {
    pub pinned: Pinned<C>,
    pub idle: Arc<IdleConns<C>>,
    pub hub: Arc<WakeOne<[u8; 32]>>,
    pub key: [u8; 32],
    /// The lock's name, for errors.
    pub name: String,
    pub timeout: Duration,
    pub backend: &'static str,
}

impl<C: sqlx::Connection + 'static> Session<C> {
    /// Renewal: prove the session is alive (it holds the lock).
    pub(crate) async fn renew(&self) -> Result<()> {
        self.pinned.prove_alive(self.timeout).await
    }

    /// Fires when the heartbeat loses the session.
    pub(crate) fn loss_signal(&self) -> CancellationToken {
        self.pinned.lost.clone()
    }

    /// Let go: run `release` on the pinned connection (within the timeout); a clean
    /// release returns the connection for reuse and wakes a local waiter. On any error
    /// the connection is dropped, which ends the session and frees the lock anyway.
    /// A second call, or one after the heartbeat lost the session, reports the loss:
    /// the lock was no longer held when it was given back.
    pub(crate) async fn end<Fut>(&self, release: impl FnOnce(C) -> Fut) -> Result<()>
    where
        Fut: std::future::Future<Output = (C, std::result::Result<(), sqlx::Error>)>,
    {
        let Some(conn) = self.pinned.take().await else {
            return Err(Error::LockLost {
                name: self.name.clone(),
                reason: crate::LossReason::SessionLost(
                    "the lock's database connection was lost before the release".into(),
                ),
            });
        };
        match tokio::time::timeout(self.timeout, release(conn)).await {
            Ok((conn, Ok(()))) => {
                self.idle.put(conn);
                self.hub.wake(&self.key);
                Ok(())
            }
            Ok((_, Err(e))) => Err(db_err(self.backend, &e)),
            Err(_) => Err(Error::connection(
                self.backend,
                "release timed out; session closed",
            )),
        }
    }
}
