//! Semaphores and read-write locks on Redis; the layout is in the module docs
//! ([`crate::redis`], "Semaphores and read-write locks"). One script per step keeps the
//! rule of [`crate::shared_holds`] on the server.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use super::layout::{self, suffixed};
use super::{Inner, map_err, uncertain};
use crate::backend::{AcquireRequest, Attempt, HeldLock, Primitive};
use crate::error::{Error, Result};
use crate::name::LockName;

/// The keys of one semaphore or read-write lock.
#[derive(Debug, Clone)]
pub(super) struct SharedKeys {
    entries: String,
    expiry: String,
    token: String,
    pub channel: String,
}

impl SharedKeys {
    pub(super) fn new(inner: &Inner, name: &LockName, primitive: Primitive) -> Self {
        let base = inner.prefixed(name);
        let family = crate::shared_holds::family(primitive);
        SharedKeys {
            entries: suffixed(&format!("dlock_{family}"), &base),
            expiry: suffixed(&format!("dlock_{family}_expiry"), &base),
            token: suffixed(&format!("dlock_{family}_token"), &base),
            channel: suffixed(&format!("dlock_{family}_channel"), &base),
        }
    }
}

/// A lease in milliseconds for a script: at least 1 (Redis refuses a 0 ms expiry).
fn millis(d: Duration) -> u64 {
    crate::lease::millis(d).max(1)
}

/// Remove what `acquisition` has under `keys`: `what` is a token, `want` or `any`.
async fn remove(inner: &Inner, keys: &SharedKeys, acquisition: &str, what: &str) -> Result<()> {
    let _: i64 = layout::SHARED_RELEASE
        .key(&keys.entries)
        .key(&keys.expiry)
        .key(&keys.channel)
        .arg(acquisition)
        .arg(what)
        .invoke_async(&mut inner.conn.clone())
        .await
        .map_err(|e| map_err(&e))?;
    Ok(())
}

/// [`remove`] again in the background until it gets through or `within` (the lease
/// it gives back) has passed.
fn remove_later(
    inner: &Arc<Inner>,
    keys: &SharedKeys,
    (acquisition, what): (&str, &str),
    within: Duration,
) {
    let (inner, keys) = (Arc::clone(inner), keys.clone());
    let (acquisition, what) = (acquisition.to_owned(), what.to_owned());
    crate::finish::release_later(CancellationToken::new(), within, move || {
        let (inner, keys) = (Arc::clone(&inner), keys.clone());
        let (acquisition, what) = (acquisition.clone(), what.clone());
        async move { remove(&inner, &keys, &acquisition, &what).await.is_ok() }
    });
}

/// An attempt at a permit, read or write.
pub(super) async fn try_acquire(inner: &Arc<Inner>, req: &AcquireRequest) -> Result<Attempt> {
    let keys = SharedKeys::new(inner, &req.name, req.primitive);
    let acquisition = req.acquisition.to_string();
    let (asked, permits) = match req.primitive {
        Primitive::Permit { permits } => ("permit", permits),
        Primitive::Read => ("read", 0),
        _ => ("write", 0),
    };
    let want_ttl = match req.enqueue {
        Some(ttl) if req.primitive == Primitive::Write => millis(ttl),
        _ => 0,
    };
    let answer: redis::RedisResult<(i64, i64)> = layout::SHARED_ACQUIRE
        .key(&keys.entries)
        .key(&keys.expiry)
        .key(&keys.token)
        .arg(&acquisition)
        .arg(req.owner.as_str())
        .arg(asked)
        .arg(permits)
        .arg(millis(req.ttl))
        .arg(want_ttl)
        .invoke_async(&mut inner.conn.clone())
        .await;
    match answer {
        Ok((1, token)) => {
            if let Err(e) = inner.wait_replicas().await {
                let token = token.to_string();
                if remove(inner, &keys, &acquisition, &token).await.is_err() {
                    let within = req.ttl + Duration::from_secs(1);
                    remove_later(inner, &keys, (&acquisition, &token), within);
                }
                return Err(e);
            }
            // Pass the wake-up on: another local waiter may be let in beside this
            // grant (a reader after a write, a permit of several freed).
            inner.subscriber.wake_one(&keys.channel);
            Ok(Attempt::Acquired(Box::new(RedisSharedHeld {
                inner: Arc::clone(inner),
                name: req.name.clone(),
                keys,
                acquisition,
                token: u64::try_from(token).unwrap_or(0),
                released: std::sync::atomic::AtomicBool::new(false),
                lease_ms: std::sync::atomic::AtomicU64::new(millis(req.ttl)),
            })))
        }
        Ok((0, left)) => Ok(Attempt::Busy {
            retry_after: u64::try_from(left)
                .ok()
                .filter(|ms| *ms > 0)
                .map(Duration::from_millis),
        }),
        Ok(_) => Err(Error::UpgradeRefused {
            name: req.name.as_str().to_owned(),
        }),
        Err(e) => {
            if uncertain(&e) {
                // The script may have granted: undo whatever this acquisition left
                // (it ends with this error, so nothing of it can still arrive).
                // Until the server answers, for as long as the lease it may have
                // granted: that lease would otherwise keep the grant from everyone.
                let within = req.ttl + Duration::from_secs(1);
                remove_later(inner, &keys, (&acquisition, "any"), within);
            }
            Err(map_err(&e))
        }
    }
}

/// Every live hold of `name` (`holders`), in token order.
pub(super) async fn holders(
    inner: &Inner,
    name: &LockName,
    primitive: Primitive,
) -> Result<Vec<crate::backend::LockInfo>> {
    let keys = SharedKeys::new(inner, name, primitive);
    let flat: Vec<redis::Value> = layout::SHARED_HOLDERS
        .key(&keys.entries)
        .key(&keys.expiry)
        .invoke_async(&mut inner.conn.clone())
        .await
        .map_err(|e| map_err(&e))?;
    let mut held = Vec::new();
    for pair in flat.chunks(2) {
        let [entry, left] = pair else { continue };
        let (Ok(entry), Ok(left)) = (
            redis::from_redis_value::<String>(entry.clone()),
            redis::from_redis_value::<u64>(left.clone()),
        ) else {
            continue;
        };
        let mut parts = entry.splitn(3, ' ');
        let (Some(kind), Some(token), Some(owner)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let Some(kind) = crate::shared_holds::EntryKind::parse(kind) else {
            continue;
        };
        held.push(crate::shared_holds::holder_info(
            name,
            kind,
            owner.to_owned(),
            token.parse().unwrap_or(0),
            Some(Duration::from_millis(left)),
            crate::options::Metadata::default(),
        ));
    }
    held.sort_by_key(|i| i.fencing_token);
    Ok(held)
}

/// Remove a waiting writer's entry (`leave_queue`).
pub(super) async fn leave(inner: &Inner, req: &AcquireRequest) -> Result<()> {
    let keys = SharedKeys::new(inner, &req.name, req.primitive);
    remove(inner, &keys, &req.acquisition.to_string(), "want").await
}

/// One held permit, read or write.
struct RedisSharedHeld {
    inner: Arc<Inner>,
    name: LockName,
    keys: SharedKeys,
    acquisition: String,
    token: u64,
    released: std::sync::atomic::AtomicBool,
    /// The lease last asked for (ms): how long a release that could not get through
    /// is worth trying again.
    lease_ms: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for RedisSharedHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSharedHeld")
            .field("name", &self.name)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl HeldLock for RedisSharedHeld {
    fn fencing_token(&self) -> u64 {
        self.token
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let renewed: i64 = layout::SHARED_RENEW
            .key(&self.keys.entries)
            .key(&self.keys.expiry)
            .arg(&self.acquisition)
            .arg(self.token)
            .arg(millis(ttl))
            .invoke_async(&mut self.inner.conn.clone())
            .await
            .map_err(|e| map_err(&e))?;
        if renewed == 1 {
            self.lease_ms
                .store(millis(ttl), std::sync::atomic::Ordering::Relaxed);
            Ok(())
        } else {
            Err(Error::NotOwner {
                name: self.name.as_str().to_owned(),
            })
        }
    }

    async fn release(&self) -> Result<()> {
        use std::sync::atomic::Ordering;
        if self.released.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let token = self.token.to_string();
        let done = remove(&self.inner, &self.keys, &self.acquisition, &token).await;
        if done.is_err() {
            // Keep trying in the background (this entry alone: by acquisition and
            // token), or the lease would keep the grant from everyone until it ran out.
            let within = Duration::from_millis(self.lease_ms.load(Ordering::Relaxed))
                + Duration::from_secs(1);
            remove_later(&self.inner, &self.keys, (&self.acquisition, &token), within);
        }
        done
    }
}
