//! The session: one etcd lease per backend, kept alive by a task, that every lock key
//! of this process is attached to. When the lease cannot be confirmed alive before
//! its known expiry (minus the drift margin), or etcd says it is gone, the session is
//! lost: every lock under it fires `lost()`, and the next acquisition opens a new one.
//!
//! A session lost here is ended on the server too: whatever marks it lost (the keep-alive,
//! `Session::check`, a key found missing), its keep-alive task then revokes the lease,
//! so every key still under it goes at once. Without that, a lease whose keep-alives
//! reached etcd while their answers did not would keep this process's keys — held
//! locks it was told it lost, queued contenders nobody waits for — for up to a TTL,
//! and every other client would wait behind them.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::client::{Client, RpcError, Sender, Streaming};
use super::proto::{LeaseKeepAliveRequest, LeaseKeepAliveResponse};
use tokio_util::sync::CancellationToken;

use crate::backend::SessionTrust;
use crate::error::{Error, Result};
use crate::lease::trusted_until;

/// How long a lost session's revoke waits first, so that every hold has read the loss
/// (the trust ends earlier still: [`trusted_until`]).
const LOSS_MARGIN: Duration = Duration::from_millis(50);

/// One lease.
#[derive(Debug)]
pub(crate) struct Session {
    /// The lease id (keys are named after it in lowercase hex).
    pub(crate) id: i64,
    /// Cancelled when the lease is (or may be) gone.
    pub(crate) lost: CancellationToken,
    /// Until when the lease lives on the server at least, as far as we know (its
    /// earliest end less a margin: [`trusted_until`]); the session's holds read it too.
    pub(crate) trust: SessionTrust,
}

impl Session {
    /// Grant a lease of `ttl` and start keeping it alive. The keeper stops when the
    /// session is lost or `alive` is dropped.
    pub(crate) async fn open(
        client: &Client,
        ttl: Duration,
        alive: Weak<()>,
    ) -> Result<Arc<Session>> {
        let secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let sent = Instant::now();
        let granted = client
            .lease_grant(secs)
            .await
            .map_err(|e| super::map_err(&e))?;
        let lease_ttl = Duration::from_secs(u64::try_from(granted.ttl.max(1)).unwrap_or(1));
        let session = Arc::new(Session {
            id: granted.id,
            lost: CancellationToken::new(),
            trust: SessionTrust::new(trusted_until(sent, lease_ttl)),
        });
        tokio::spawn(keep_alive(
            client.clone(),
            Arc::clone(&session),
            lease_ttl,
            alive,
        ));
        Ok(session)
    }

    /// When the lease may end, minus the drift margin: `lost` fires then at the latest.
    fn trusted_until(&self) -> Instant {
        self.trust.until()
    }

    /// An error when the session is lost.
    pub(crate) fn check(&self) -> Result<()> {
        if self.lost.is_cancelled() || Instant::now() >= self.trusted_until() {
            // For good: a keep-alive answered after this must not revive the trust its
            // holds read.
            self.trust.end();
            self.lost.cancel();
            return Err(Error::connection(
                "etcd",
                format!(
                    "the etcd session (lease {:x}) expired or could not be kept alive",
                    self.id
                ),
            ));
        }
        Ok(())
    }
}

/// Ask etcd now whether the session's lease still lives (one keep-alive); when etcd
/// says it is gone, the session is marked lost at once. Used when a key of the session
/// was found missing: an expiry must end the session's other holds now, a key deleted
/// by an operator's break must not.
pub(crate) async fn confirm(client: &Client, session: &Session) {
    let Ok((_requests, mut responses)) = client.lease_keep_alive(session.id).await else {
        return;
    };
    if let Ok(Some(resp)) = responses.message().await
        && resp.ttl <= 0
    {
        tracing::warn!(
            lease = session.id,
            "etcd session lost: the lease is gone on the server"
        );
        session.lost.cancel();
    }
}

/// Keep the lease alive every third of its TTL; declare it lost when a keep-alive
/// says it is gone or none succeeds before the known expiry. However the session comes
/// to be lost, the task ends it on the server ([`end`]).
async fn keep_alive(client: Client, session: Arc<Session>, ttl: Duration, alive: Weak<()>) {
    let every = ttl / 3;
    let mut delay = every;
    let mut stream: Option<(
        Sender<LeaseKeepAliveRequest>,
        Streaming<LeaseKeepAliveResponse>,
    )> = None;
    loop {
        let next = Instant::now() + delay;
        tokio::select! {
            () = session.lost.cancelled() => break,
            () = tokio::time::sleep_until(next.min(session.trusted_until()).into()) => {}
        }
        if alive.strong_count() == 0 {
            // The backend is gone: give the lease back so its keys go at once.
            session.lost.cancel();
            break;
        }
        if Instant::now() >= session.trusted_until() {
            tracing::warn!(
                lease = session.id,
                "etcd session lost: no keep-alive succeeded before the lease could expire"
            );
            session.lost.cancel();
            break;
        }
        let sent = Instant::now();
        let attempt = async {
            match stream.as_mut() {
                // Opening the stream sends the first keep-alive.
                None => stream = Some(client.lease_keep_alive(session.id).await?),
                Some((requests, _)) => requests
                    .send(LeaseKeepAliveRequest { id: session.id })
                    .await
                    .map_err(|_| RpcError::Transport("keep-alive stream closed".into()))?,
            }
            let Some((_, responses)) = stream.as_mut() else {
                return Ok(None);
            };
            responses
                .message()
                .await
                .map_err(|s| RpcError::Status(s.code(), s.message().to_owned()))
        };
        let budget = session.trusted_until().saturating_duration_since(sent);
        let answer = tokio::select! {
            () = session.lost.cancelled() => break,
            a = tokio::time::timeout(budget, attempt) => a,
        };
        match answer {
            Ok(Ok(Some(resp))) if resp.ttl > 0 => {
                let granted = Duration::from_secs(u64::try_from(resp.ttl).unwrap_or(1));
                session.trust.extend_to(trusted_until(sent, granted));
                delay = every;
            }
            Ok(Ok(Some(_))) => {
                tracing::warn!(
                    lease = session.id,
                    "etcd session lost: the lease is gone on the server"
                );
                session.lost.cancel();
                break;
            }
            Ok(Ok(None) | Err(_)) | Err(_) => {
                // Stream ended or failed: open a new one soon.
                stream = None;
                delay = every.min(Duration::from_millis(250));
            }
        }
    }
    drop(stream);
    end(&client, &session, ttl).await;
}

/// End a lost session on the server: revoke its lease, so the keys still under it go
/// now rather than when a keep-alive that etcd applied but whose answer never came
/// runs out. Tried until etcd answers (revoked, or already gone) or until the lease
/// must have ended by itself (no keep-alive is sent after the loss: a TTL from now).
///
/// Holders hear of the loss before their keys go: a hold reads the session's `lost`
/// token itself (`Hold::is_lost`), which was cancelled before this runs, and the
/// revoke waits out the drift margin first — the margin by which a keep-alive's loss
/// precedes the earliest expiry the server could apply.
async fn end(client: &Client, session: &Session, ttl: Duration) {
    let give_up = tokio::time::Instant::now() + ttl + Duration::from_secs(1);
    let mut backoff = LOSS_MARGIN;
    loop {
        tokio::time::sleep(backoff).await;
        match client.lease_revoke(session.id).await {
            Ok(_) => return,
            Err(RpcError::Status(tonic::Code::NotFound, _)) => return,
            Err(e) => {
                if tokio::time::Instant::now() + backoff >= give_up {
                    tracing::debug!(lease = session.id, error = %e, "could not revoke a lost etcd session; its lease ends by itself");
                    return;
                }
                tracing::debug!(lease = session.id, error = %e, "revoking a lost etcd session: retrying");
            }
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}
