//! The pinned connection of a session-mode hold (advisory, named, row): its heartbeat,
//! the idle connections kept for the next acquisition, and the session side of a hold.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::db_err;
use crate::backend::SessionTrust;
use crate::error::{Error, Result};
use crate::lease::trusted_until;
use crate::notify::WakeOne;

/// What a session mode's connection must do for the hold pinned to it (a dialect's
/// [`super::dialect::Dialect::Conn`]): answer a ping, which proves its session alive.
pub(crate) trait SessionConn: Send + 'static {
    /// One round trip on the connection.
    fn ping(&mut self) -> impl Future<Output = std::result::Result<(), sqlx::Error>> + Send + '_;
}

/// A connection pinned to one held lock (session modes). Its session is proven alive
/// every `interval` by a ping: the keeper's renewals do it (a session hold asks to be
/// renewed at least that often, [`crate::backend::HeldLock::prove_alive_every`]), or,
/// for a hold the keeper does not renew, a heartbeat task of its own
/// ([`Pinned::watch_alone`]). A ping must answer within `interval` (or the `timeout`,
/// if shorter). The holder always hears of a failed ping before the connection closes
/// (which ends its session, so the server frees the lock): a renewal's failed ping
/// answers the loss and leaves the connection to the release that follows every loss;
/// the heartbeat cancels its loss signal, then closes it 50 ms later. A ping whose
/// caller went away before its answer (a renewal cut off at the lease's local end, a
/// dropped `extend`) leaves the connection out of step (the answer unread): it is used
/// for nothing more, as if that ping had failed.
#[derive(Debug)]
pub(crate) struct Pinned<C> {
    conn: Arc<PinnedConn<C>>,
    interval: Duration,
    /// How long a ping may take: `interval`, or the `timeout` if shorter.
    answer_within: Duration,
    /// Made by [`Pinned::watch_alone`] only: the loss signal its heartbeat cancels when
    /// a ping fails, and the token that ends the heartbeat.
    alone: OnceLock<Alone>,
}

/// The pinned connection itself (shared with a heartbeat task, if there is one):
/// `None` once taken back or dropped.
#[derive(Debug)]
struct PinnedConn<C> {
    slot: Mutex<Option<C>>,
    /// A ping on it was abandoned before its answer came (the next answer read from
    /// it could be that ping's), or failed: it is used for nothing more.
    out_of_step: AtomicBool,
    /// Until when the server keeps the session: the last answered ping's send time
    /// (or the pinning's) plus `silence`, less a margin; ended by a failed ping. The
    /// hold reads it ([`crate::backend::HeldLock::session_trust`]): a holder whose
    /// process or runtime was paused past it counts as lost before it can act, as
    /// the server may have ended its session (and freed the lock) meanwhile.
    trust: SessionTrust,
    /// How long the server keeps a session that sends nothing
    /// ([`super::dialect::Dialect::session_silence`]).
    silence: Duration,
}

#[derive(Debug)]
struct Alone {
    lost: CancellationToken,
    stop: CancellationToken,
}

/// What [`Pinned::take`] found.
pub(crate) enum Taken<C> {
    /// The connection, in step: the lock is still held on it.
    Conn(C),
    /// The heartbeat's failed ping dropped it (or it was taken before): the lock went
    /// with it.
    Gone,
    /// Out of step (a failed or abandoned ping): dropped now, which ends its session
    /// and frees the lock.
    Dropped,
}

impl<C: SessionConn> Pinned<C> {
    /// Pin `conn`, to be proven alive every `interval`, each ping answered within
    /// `interval` or `timeout`, whichever is shorter.
    /// `proven` is when the last statement the session answered on it was sent.
    pub(crate) fn new(
        conn: C,
        interval: Duration,
        timeout: Duration,
        silence: Duration,
        proven: Instant,
    ) -> Self {
        Pinned {
            conn: Arc::new(PinnedConn {
                slot: Mutex::new(Some(conn)),
                out_of_step: AtomicBool::new(false),
                trust: SessionTrust::new(trusted_until(proven, silence)),
                silence,
            }),
            interval,
            answer_within: interval.min(timeout),
            alone: OnceLock::new(),
        }
    }

    /// How often the session must be proven alive.
    pub(crate) fn interval(&self) -> Duration {
        self.interval
    }

    /// Until when the session is known to live (see [`PinnedConn::trust`]).
    pub(crate) fn trust(&self) -> SessionTrust {
        self.conn.trust.clone()
    }

    /// Nobody renews this hold: start its heartbeat, which pings every `interval` and
    /// cancels its loss signal ([`Pinned::loss_signal`]) when a ping fails. Once; a
    /// second call does nothing.
    pub(crate) fn watch_alone(&self) {
        self.alone.get_or_init(|| {
            let (lost, stop) = (CancellationToken::new(), CancellationToken::new());
            let (conn, l2, s2) = (Arc::clone(&self.conn), lost.clone(), stop.clone());
            let (interval, within) = (self.interval, self.answer_within);
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = s2.cancelled() => return,
                        () = tokio::time::sleep(interval) => {}
                    }
                    if !ping_or_drop(&conn, Some(&l2), within).await {
                        return;
                    }
                }
            });
            Alone { lost, stop }
        });
    }

    /// The heartbeat's loss signal, if [`Pinned::watch_alone`] started one.
    pub(crate) fn loss_signal(&self) -> Option<CancellationToken> {
        self.alone.get().map(|a| a.lost.clone())
    }

    /// Renewal of a session hold: the session holds the lock, so renewing means proving
    /// the session is alive. A connection that does not answer in time, or that an
    /// abandoned ping left out of step, fails the proof: the loss is certain and
    /// answered ([`Error::LockLost`], the session lost). The connection is closed
    /// after that, by the release that follows every loss (a hold with a heartbeat:
    /// 50 ms after its loss signal).
    pub(crate) async fn prove_alive(&self) -> Result<()> {
        let lost = self.alone.get().map(|a| &a.lost);
        if ping_or_drop(&self.conn, lost, self.answer_within).await {
            Ok(())
        } else {
            Err(Error::LockLost {
                name: String::new(),
                reason: crate::LossReason::SessionLost(
                    "the lock's database connection failed a ping (or one abandoned halfway \
                     left it out of step); its session is closed"
                        .into(),
                ),
            })
        }
    }

    /// Take the connection back (release).
    pub(crate) async fn take(&self) -> Taken<C> {
        if let Some(a) = self.alone.get() {
            a.stop.cancel();
        }
        let taken = self.conn.slot.lock().await.take();
        match taken {
            None => Taken::Gone,
            Some(c) if self.conn.out_of_step.load(Ordering::SeqCst) => {
                drop(c);
                Taken::Dropped
            }
            Some(c) => Taken::Conn(c),
        }
    }
}

/// Sets `out_of_step` if dropped before [`Abandoned::disarm`]: the ping it covers was
/// abandoned with its answer unread.
struct Abandoned<'a>(Option<&'a AtomicBool>);

impl Abandoned<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some(flag) = self.0 {
            flag.store(true, Ordering::SeqCst);
        }
    }
}

/// Ping the pinned connection. Returns whether the session is alive: not if the ping
/// failed or took longer than `within`, or an abandoned ping left the connection out
/// of step. Then, with a loss signal `lost` (a heartbeat's), cancel it and close the
/// connection 50 ms later; without one (a renewal, whose caller hears the answer),
/// mark it out of step and leave it to the release that follows the loss.
async fn ping_or_drop<C: SessionConn>(
    conn: &PinnedConn<C>,
    lost: Option<&CancellationToken>,
    within: Duration,
) -> bool {
    let mut slot = conn.slot.lock().await;
    let Some(c) = slot.as_mut() else { return false };
    if !conn.out_of_step.load(Ordering::SeqCst) {
        // Dropped here, unfinished (the caller went away), the ping leaves its answer
        // unread: the connection is out of step from then on. (Cut off by its own
        // timeout below, it is dropped anyway.)
        let abandoned = Abandoned(Some(&conn.out_of_step));
        let sent = Instant::now();
        let answered = matches!(tokio::time::timeout(within, c.ping()).await, Ok(Ok(())));
        abandoned.disarm();
        if answered {
            conn.trust.extend_to(trusted_until(sent, conn.silence));
            return true;
        }
    }
    // The holder hears of the loss before the session closes (which lets the server
    // free the lock). A renewal's caller hears it from this answer and marks the hold
    // lost; the release that follows closes the connection, never before.
    conn.out_of_step.store(true, Ordering::SeqCst);
    conn.trust.end();
    let Some(lost) = lost else {
        return false;
    };
    // A heartbeat's signal is read by the hold at once; the close comes a moment later.
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
        if let Some(a) = self.alone.get() {
            a.stop.cancel();
        }
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

impl<C: SessionConn> Session<C> {
    /// Renewal: prove the session is alive (it holds the lock).
    pub(crate) async fn renew(&self) -> Result<()> {
        self.pinned.prove_alive().await
    }

    /// The heartbeat's loss signal, if [`Session::watch_alone`] started one.
    pub(crate) fn loss_signal(&self) -> Option<CancellationToken> {
        self.pinned.loss_signal()
    }

    /// Nobody renews this hold: it proves its session alive by itself (a heartbeat).
    pub(crate) fn watch_alone(&self) {
        self.pinned.watch_alone();
    }

    /// How often the session must be proven alive (the `heartbeat` option).
    pub(crate) fn prove_alive_every(&self) -> Duration {
        self.pinned.interval()
    }

    /// Until when the session is known to live.
    pub(crate) fn trust(&self) -> SessionTrust {
        self.pinned.trust()
    }

    /// Let go: run `release` on the pinned connection (within the timeout); a clean
    /// release returns the connection for reuse and wakes a local waiter. On any error
    /// the connection is dropped, which ends the session and frees the lock anyway.
    /// A second call, or one after a failed ping dropped the connection, reports the loss:
    /// the lock was no longer held when it was given back. A connection a failed or
    /// abandoned ping left out of step is closed instead of used, which frees the lock:
    /// the release is done (a failed ping's loss was answered before).
    pub(crate) async fn end<Fut>(&self, release: impl FnOnce(C) -> Fut) -> Result<()>
    where
        Fut: std::future::Future<Output = (C, std::result::Result<(), sqlx::Error>)>,
    {
        let conn = match self.pinned.take().await {
            Taken::Conn(conn) => conn,
            Taken::Gone => {
                return Err(Error::LockLost {
                    name: self.name.clone(),
                    reason: crate::LossReason::SessionLost(
                        "the lock's database connection was lost before the release".into(),
                    ),
                });
            }
            Taken::Dropped => {
                self.hub.wake(&self.key);
                return Ok(());
            }
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
