//! `etcd://h1:2379[,h2:2379…][/prefix]` and `etcds://…` (TLS): locks on etcd v3
//! (feature `etcd`), in the layout of etcd's own `concurrency.Mutex` and `etcdctl lock`.
//!
//! # How a lock works here
//! Each backend keeps one **session**: an etcd lease (`session_ttl`, default 10 s) kept
//! alive every third of its TTL. A lock `NAME` is a directory `<prefix><NAME>/`; a
//! contender puts the key `<prefix><NAME>/<lease id in lowercase hex>` attached to the
//! session lease, and the holder is the key with the **lowest create revision** under
//! the directory. That create revision is the **fencing token**: etcd revisions are
//! global, raft-committed and never reused, so tokens are durable.
//!
//! - The first attempt is one transaction: "if nothing is under the directory, put my
//!   key" — an uncontended acquire+release is exactly two writes (put, delete), and a
//!   `try_lock` on a held lock writes nothing.
//! - A waiter puts its key (it is now queued, first come first served), then watches
//!   **only its predecessor** (the key created just before its own) for deletion: a
//!   release wakes exactly one waiter, never a herd.
//! - Within one backend, one acquisition at a time per name talks to etcd (the key is
//!   named after the session lease, as in etcd's recipe): it owns the name's local
//!   *slot* from its first attempt until its key is deleted again (released, or left
//!   when it gave up). Other local acquisitions — other owners, or tasks sharing one
//!   owner — queue in-process, first come first served: a release hands the slot to
//!   the longest-waiting one, so the releaser cannot take it straight back past them.
//!   The slot belongs to an acquisition under one session, never to an owner string,
//!   so one task's late cleanup can never touch another task's key, nor an
//!   acquisition's cleanup of a lost session's key the key it holds under the next.
//! - A put whose answer never came may still be applied by etcd after the attempt's
//!   cleanup deleted the key. For 10 s after the cleanup's delete was answered,
//!   whoever frees the slot last looks for the key again, at pauses doubling from
//!   100 ms to 1 s, and deletes it —
//!   with the slot closed for the look, so a local acquisition that found the key
//!   there and took it as its own keeps it. A waiter's leaving deletes its key by name
//!   (that works even when answers are lost); when such a delete went unanswered, the
//!   slot stays closed for 10 s after the retry that was answered, so the late delete
//!   cannot hit the next local acquisition's key of the same name; meanwhile the key is
//!   looked for and deleted just the same (a late put of it cannot be anyone's).
//! - A release deletes the key only if its create revision is still the grant's token:
//!   a key that went with an expired session is reported as a lost lock, not as a
//!   successful release.
//!
//! # Names
//! By default the name is encoded (`/`-free, injective), so `jobs/a` and `jobs/a/x`
//! are independent locks and the default prefix is `/dlock/`. With `raw_names=true`
//! the name is used as it is and the prefix is the URL path (empty by default): then
//! `etcdctl lock NAME` and dlock exclude each other on the same name (with raw names,
//! as in etcd's recipe, `jobs/a` also sees the keys of `jobs/a/x`).
//!
//! # Elections
//! [`Locker::election`](crate::Locker::election) keeps etcd's `concurrency.Election`
//! layout: a candidate's key under the name's prefix holds its value alone (a lock's
//! key holds dlock's JSON record). With `raw_names=true`, `etcdctl elect NAME VALUE`
//! and dlock exclude each other on the same name, each sees the other's leader and
//! value, and `etcdctl elect -l NAME` observes dlock's leader (tested against the
//! real etcdctl).
//!
//! # Semaphores and read-write locks
//! dlock's own layout (etcd has no recipe for either): a semaphore `NAME` is the
//! directory `<prefix>%semaphore/<NAME>/` and a read-write lock `<prefix>%rwlock/<NAME>/`
//! (no encoded lock name begins with `%` and a letter; with `raw_names=true`, avoid lock
//! names `%semaphore` and `%rwlock` and names beginning with them). Each attempt puts
//! its own key (`<session lease>-<acquisition>-<nonce>`, with `read-`/`write-` in front
//! on a read-write lock) attached to the session lease, holding dlock's JSON record;
//! order is the create revision, which is also the token.
//!
//! - A permit is held by the N oldest keys: first come, first served. Tokens are
//!   unique, and above those of every permit released before the key was put (two
//!   waiters let in by one release may be told in either order).
//! - A read-write lock follows the order rule ZooKeeper's does (Curator's): a read
//!   waits for every earlier write of another owner, a write for every earlier key of
//!   another owner, so a waiting writer is never starved; a read passes its owner's
//!   earlier write once that write is let in, and an owner that holds a read and no
//!   write is refused a write ([`Error::UpgradeRefused`]).
//! - A waiter watches the directory for a deletion after its listing: each release
//!   wakes every waiter of that name (each lists once), not only the next. Its watch
//!   is opened from the current revision before it lists again and kept for the
//!   whole wait (etcd delivers a watch opened from an older revision up to 100 ms
//!   late).
//! - `fair` is accepted and changes nothing: contenders are served in the order
//!   of their keys ([`crate::Primitives::fifo`]). A write is never downgraded past
//!   a waiting writer of another owner ([`crate::RwLock::downgrade`]).
//! - The key is put before the listing that decides (a `try_` attempt lists first and
//!   writes nothing when it would not be let in); a key whose put's reply was lost is
//!   deleted when the attempt ends, and looked for again for 10 s, as for a lock
//!   (etcd may still apply a put the client gave up on); a dead holder's keys go with
//!   its session.
//!
//! # Breaking a lock
//! [`Locker::break_lock`](crate::Locker::break_lock) deletes the holder's key if its
//! create revision is the token shown; later keys have higher revisions. A holder
//! checks its key at each renewal (one range request), so its `lost()` fires then. A
//! holder whose key keeps no dlock record (etcdctl, an election's candidate) is
//! refused: it would never notice.
//!
//! # Loss and TTLs
//! The session is the lease on the server: a holder that dies frees its locks when the
//! session lease expires (`session_ttl`). While the process lives, `lost()` fires when
//! no keep-alive has been confirmed before the lease's known expiry, or etcd says the
//! lease is gone. A session lost in the process is then revoked on the server, 50 ms
//! later (the margin by which `lost()` precedes the lease's earliest end), retried
//! until etcd answers or the lease must have ended: its keep-alives may have reached
//! etcd while their answers did not, and the keys of the holds that were told of their
//! loss go at once instead of when that lease runs out. A lock's own TTL is kept by
//! the live holder (renewal off: the holder gives the lock back when its TTL ends). A
//! waiter whose session ends stops waiting with an error.
//!
//! # Options
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `session_ttl` | `10s` | the session lease (whole seconds, at least 2 s): how long a dead holder's locks outlive it |
//! | `raw_names` | `false` | use names as they are (etcdctl's layout; the prefix is the URL path) |
//! | `timeout` | `5s` | per request, and connecting |
//! | `ca_file`, `cert_file`, `key_file` | none | `etcds://` only: the CA that signs the server, a client certificate |
//!
//! `user:password@` in the URL authenticates (etcd's auth token is renewed when it
//! expires). A role with `readwrite` on the prefix only (e.g. `/dlock/`) is enough
//! (tested). dlock speaks etcd's v3 gRPC protocol through a small client of its own
//! (`client.rs`, `proto.rs`): building needs no `protoc`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use client::{Client, ConnectOptions, RpcError, create_revision_is, prefix_end, revision};
use proto::{Request, RequestOp, Response, SortOrder, SortTarget};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::backend::AcquisitionId;
use crate::backend::{
    AcquireRequest, Attempt, Backend, Capabilities, HeldLock, LockInfo, Primitive, Waiter,
};
use crate::error::{Error, LossReason, Result};
use crate::name::LockName;
use crate::queue::StoredHolder;
use crate::url::ConnectUrl;

mod client;
mod late_put;
mod proto;
mod session;
mod shared;

use session::Session;

const SCHEME: &str = "etcd";

/// A transaction operation.
fn op(request: Request) -> RequestOp {
    RequestOp {
        request: Some(request),
    }
}

/// How long a queued waiter waits for its predecessor's deletion before it looks again
/// (the watch is the wake-up; this only bounds a missed event).
const RECHECK: Duration = Duration::from_secs(10);

pub(crate) fn map_err(e: &RpcError) -> Error {
    if e.is_retryable() {
        Error::connection(SCHEME, e)
    } else if matches!(
        e,
        RpcError::Status(
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied,
            _
        )
    ) {
        Error::denied(SCHEME, e)
    } else {
        Error::backend(SCHEME, e)
    }
}

/// The error of a write attached to `session`'s lease. etcd refusing the lease
/// ("requested lease not found": it expired or was revoked before the keep-alive
/// noticed) means the session is over: it is marked lost at once (every lock under it
/// fires `lost()`: their keys went with the lease), and the attempt fails with a
/// connection error, retryable, because the next one opens a new session.
fn session_err(session: &Session, e: &RpcError) -> Error {
    let lease_gone = matches!(e, RpcError::Status(tonic::Code::NotFound, msg) if msg.contains("lease not found"));
    if lease_gone {
        session.lost.cancel();
        return Error::connection(
            SCHEME,
            format!(
                "the session's lease {:x} has ended ({e}); the next attempt opens a new session",
                session.id
            ),
        );
    }
    map_err(e)
}

/// A local acquisition queued for a directory's slot.
struct LocalWaiter {
    acquisition: AcquisitionId,
    wake: Arc<Notify>,
}

/// This backend's own contender for one lock directory: one acquisition at a time.
struct Slot {
    acquisition: AcquisitionId,
    session: Arc<Session>,
    key: String,
    /// Granted, or closed (while its key's delete is pending, for 10 s after an
    /// unanswered delete by name, or while a sweep deletes a late key): nobody else
    /// may use it.
    held: bool,
    /// A put of the key has been sent (it may exist): leaving must delete it.
    maybe_put: bool,
    /// A put of the key went unanswered: etcd may still apply it until then, after
    /// the key's delete. Passed on with the slot; whoever frees it last looks for the
    /// key until then ([`late_put`]).
    late_until: Option<Instant>,
    /// When queued: the key created just before ours and its create revision (its
    /// deletion is watched; a key of the same name with another revision — another
    /// local contender of that process reusing the name — means it is gone).
    predecessor: Option<(String, i64)>,
}

/// What a leaving acquisition has to do with its slot ([`EtcdBackend::leave_queue`]).
enum Leaving {
    /// The slot is not its own (any more).
    Nothing,
    /// Reserved for it under the session of this lease id, its key never put.
    Free(i64),
    /// Its key (maybe put) under this session is to be deleted; the slot is closed.
    Delete(String, Arc<Session>),
}

struct Inner {
    client: Client,
    prefix: String,
    raw_names: bool,
    session_ttl: Duration,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    /// Keepers hold a weak reference: when the backend goes, sessions are revoked.
    alive: Arc<()>,
    slots: Mutex<HashMap<String, Slot>>,
    /// Local acquisitions waiting for a directory that another local acquisition is
    /// using, in arrival order, each with its own wake-up. Lock order: `slots`, then
    /// `local`.
    local: Mutex<HashMap<String, VecDeque<LocalWaiter>>>,
    /// Waiting attempts at semaphores and read-write locks, by directory and
    /// acquisition.
    shared: Mutex<HashMap<(String, u64), shared::SharedWait>>,
    shown: String,
}

/// The etcd backend.
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("url", &self.inner.shown)
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

impl EtcdBackend {
    pub(crate) async fn open(mut url: ConnectUrl) -> Result<Arc<Self>> {
        let tls = url.scheme() == "etcds";
        let timeout = url.take_duration("timeout", Duration::from_secs(5))?;
        let session_ttl =
            url.take_duration("session_ttl", crate::queue::DEFAULT_SESSION_TIMEOUT)?;
        if session_ttl < Duration::from_secs(2) || session_ttl.subsec_nanos() != 0 {
            return Err(url.invalid("session_ttl must be whole seconds, at least 2s"));
        }
        let raw_names = url.take_bool("raw_names")?.unwrap_or(false);
        let ca = url.take_param("ca_file");
        let cert = url.take_param("cert_file");
        let key = url.take_param("key_file");
        url.finish(&[
            "timeout",
            "session_ttl",
            "raw_names",
            "ca_file",
            "cert_file",
            "key_file",
        ])?;
        if !tls && (ca.is_some() || cert.is_some() || key.is_some()) {
            return Err(url.invalid("ca_file, cert_file and key_file need TLS: use etcds://"));
        }
        if cert.is_some() != key.is_some() {
            return Err(url.invalid("cert_file and key_file go together (mutual TLS)"));
        }
        let mut prefix = url.path().to_owned();
        if prefix.is_empty() && !raw_names {
            prefix = "/dlock/".into();
        } else if !prefix.is_empty() && !prefix.ends_with('/') {
            prefix.push('/');
        }
        let scheme = if tls { "https" } else { "http" };
        let endpoints: Vec<String> = if url.hosts().is_empty() {
            // No silent default address (a forgotten host is a usage error).
            return Err(url.invalid("name the server: etcd://HOST[:PORT][,HOST[:PORT]...]"));
        } else {
            url.hosts()
                .iter()
                .map(|h| {
                    let host = if h.host.contains(':') {
                        format!("[{}]", h.host)
                    } else {
                        h.host.clone()
                    };
                    format!("{scheme}://{host}:{}", h.port.unwrap_or(2379))
                })
                .collect()
        };
        let mut options = ConnectOptions {
            timeout: Some(timeout),
            keep_alive: Some((Duration::from_secs(2), Duration::from_secs(2))),
            ..ConnectOptions::default()
        };
        if let Some(user) = url.username() {
            let password = url
                .password()
                .map(|p| p.expose().to_owned())
                .unwrap_or_default();
            options.credentials = Some((user.to_owned(), password));
        }
        if tls {
            let read = |param: &str, path: &str| {
                std::fs::read(path).map_err(|e| {
                    url.invalid(&format!("cannot read {param} {path:?}: {}", e.kind()))
                })
            };
            let mut t = tonic::transport::ClientTlsConfig::new();
            if let Some(ca) = &ca {
                t = t.ca_certificate(tonic::transport::Certificate::from_pem(read(
                    "ca_file", ca,
                )?));
            }
            if let (Some(cert), Some(key)) = (&cert, &key) {
                t = t.identity(tonic::transport::Identity::from_pem(
                    read("cert_file", cert)?,
                    read("key_file", key)?,
                ));
            }
            options.tls = Some(t);
        }
        let tried = |e: &RpcError| {
            let e = map_err(e);
            match e {
                Error::Connection { .. } => Error::connection(SCHEME, format!("{url}: {e}")),
                other => other,
            }
        };
        let client = tokio::time::timeout(timeout, Client::connect(&endpoints, options))
            .await
            .map_err(|_| Error::connection(SCHEME, format!("connecting to {url} timed out")))?
            .map_err(|e| tried(&e))?;
        // Fail now, not on the first lock, when the cluster does not answer (a read
        // under the prefix: a role limited to the prefix may read nothing else).
        let probe = proto::RangeRequest {
            key: format!("{prefix}dlock-connect-probe").into_bytes(),
            count_only: true,
            ..proto::RangeRequest::default()
        };
        tokio::time::timeout(timeout, client.range(probe))
            .await
            .map_err(|_| Error::connection(SCHEME, format!("{url} did not answer")))?
            .map_err(|e| tried(&e))?;
        Ok(Arc::new(EtcdBackend {
            inner: Arc::new(Inner {
                client,
                prefix,
                raw_names,
                session_ttl,
                session: tokio::sync::Mutex::new(None),
                alive: Arc::new(()),
                slots: Mutex::new(HashMap::new()),
                local: Mutex::new(HashMap::new()),
                shared: Mutex::new(HashMap::new()),
                shown: url.to_string(),
            }),
        }))
    }
}

impl Inner {
    fn dir(&self, name: &LockName) -> String {
        if self.raw_names {
            format!("{}{}/", self.prefix, name.as_str())
        } else {
            format!("{}{}/", self.prefix, name.encoded())
        }
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u64), shared::SharedWait>> {
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn local(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<LocalWaiter>>> {
        self.local
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The slot for `dir`, if `acquisition` has it under the session `session` (its
    /// lease id), is free again: hand it to the local acquisition that has waited
    /// longest (reserved for it, its key not yet put) and wake that one only. The
    /// session is part of the slot's identity: after a session was lost, the same
    /// acquisition may hold the name again under a new session (another key), which a
    /// late cleanup of the old one must not free.
    fn free_slot(self: &Arc<Self>, dir: &str, acquisition: AcquisitionId, session: i64) {
        self.free_slot_with(dir, acquisition, session, false);
    }

    /// [`Inner::free_slot`] once the key's delete was answered (or once the name,
    /// closed after an unanswered one, opens again). An unanswered put's window runs on
    /// from that moment: a put may land at any time before it, however late it came.
    fn free_slot_after_delete(
        self: &Arc<Self>,
        dir: &str,
        acquisition: AcquisitionId,
        session: i64,
    ) {
        self.free_slot_with(dir, acquisition, session, true);
    }

    fn free_slot_with(
        self: &Arc<Self>,
        dir: &str,
        acquisition: AcquisitionId,
        session: i64,
        deleted: bool,
    ) {
        let mut slots = self.slots();
        let freed = match slots.get(dir) {
            Some(s) if s.acquisition == acquisition && s.session.id == session => slots.remove(dir),
            _ => None,
        };
        let Some(freed) = freed else {
            return;
        };
        let now = Instant::now();
        let late_until = freed
            .late_until
            .map(|t| {
                if deleted {
                    t.max(now + late_put::LATE_PUT)
                } else {
                    t
                }
            })
            .filter(|t| *t > now);
        let mut local = self.local();
        let next = local.get_mut(dir).and_then(VecDeque::pop_front);
        if local.get(dir).is_some_and(VecDeque::is_empty) {
            local.remove(dir);
        }
        drop(local);
        if let Some(next) = next {
            // A late put lands on the next acquisition's key name, which takes it as
            // its own (its put finds the key there): it frees the slot with the key.
            slots.insert(
                dir.to_owned(),
                Slot {
                    acquisition: next.acquisition,
                    session: freed.session,
                    key: freed.key,
                    held: false,
                    maybe_put: false,
                    late_until,
                    predecessor: None,
                },
            );
            drop(slots);
            next.wake.notify_one();
        } else if let Some(until) = late_until {
            drop(slots);
            self.sweep_late_put(dir, freed.key, freed.session, until);
        }
    }

    /// Until `until`, delete `key` each time it turns up while no local acquisition
    /// uses the slot. The slot is closed from the look that found the key until its
    /// delete is answered: a local acquisition that took the key as its own (its put
    /// found it there) must keep it, and it can only have done so while the slot was
    /// free. Holds the backend weakly: a dropped backend revokes its session.
    fn sweep_late_put(
        self: &Arc<Self>,
        dir: &str,
        key: String,
        session: Arc<Session>,
        until: Instant,
    ) {
        let (inner, dir) = (Arc::downgrade(self), dir.to_owned());
        late_put::sweep(Arc::clone(&session), until, move || {
            let (inner, dir, key, session) = (
                std::sync::Weak::clone(&inner),
                dir.clone(),
                key.clone(),
                Arc::clone(&session),
            );
            async move {
                // The backend is held only between awaits: a dropped backend revokes
                // its session even while a look waits for etcd.
                let client = match inner.upgrade() {
                    Some(backend) if !backend.slots().contains_key(&dir) => backend.client.clone(),
                    _ => return,
                };
                let Some(revision) = late_put::find(&client, &key).await else {
                    return;
                };
                let look = AcquisitionId::new();
                {
                    let Some(backend) = inner.upgrade() else {
                        return;
                    };
                    let mut slots = backend.slots();
                    if slots.contains_key(&dir) {
                        // Taken meanwhile: the key is that acquisition's now.
                        return;
                    }
                    slots.insert(
                        dir.clone(),
                        Slot {
                            acquisition: look,
                            session: Arc::clone(&session),
                            key: key.clone(),
                            held: true,
                            maybe_put: false,
                            late_until: None,
                            predecessor: None,
                        },
                    );
                }
                late_put::delete_found(&client, &session.lost, &key, revision).await;
                if let Some(backend) = inner.upgrade() {
                    backend.free_slot(&dir, look, session.id);
                }
            }
        });
    }

    /// Queue `acquisition` for `dir`'s slot unless the slot is free or already its
    /// own; `false` when there is no need to wait.
    fn wait_for_slot(&self, dir: &str, acquisition: AcquisitionId, wake: &Arc<Notify>) -> bool {
        let slots = self.slots();
        match slots.get(dir) {
            Some(s) if s.acquisition != acquisition => {}
            _ => return false,
        }
        let mut local = self.local();
        let queue = local.entry(dir.to_owned()).or_default();
        if !queue.iter().any(|w| Arc::ptr_eq(&w.wake, wake)) {
            queue.push_back(LocalWaiter {
                acquisition,
                wake: Arc::clone(wake),
            });
        }
        true
    }

    /// A local waiter is gone: take it out of the queue.
    fn forget_waiter(&self, dir: &str, wake: &Arc<Notify>) {
        let mut local = self.local();
        if let Some(queue) = local.get_mut(dir) {
            queue.retain(|w| !Arc::ptr_eq(&w.wake, wake));
            if queue.is_empty() {
                local.remove(dir);
            }
        }
    }

    /// Delete a contender's key — only while its create revision is `revision`, if
    /// given — and free its slot. A delete by name that went unanswered may be applied
    /// late (as a put may, [`late_put`]): after one, the slot stays closed for
    /// [`late_put::LATE_PUT`] after the retry that was answered, so no local
    /// acquisition puts the name again while it may still land
    /// ([`Inner::closed_after_unanswered_delete`]). `Ok(false)`: the key was not (or no
    /// longer) the one with that revision. The key lives as long as the session, and the session
    /// outlives a reconnect: when the server cannot be reached, the slot stays closed
    /// and the delete is finished in the background once the server answers again (or
    /// the session ends and takes the key).
    async fn delete_and_free(
        self: &Arc<Self>,
        session: &Session,
        key: &str,
        revision: Option<i64>,
        dir: &str,
        acquisition: AcquisitionId,
    ) -> Result<bool> {
        match Self::delete_key(&self.client, key, revision).await {
            Ok(deleted) => {
                self.free_slot_after_delete(dir, acquisition, session.id);
                Ok(deleted)
            }
            Err(e) => {
                let (inner, key, dir) = (Arc::clone(self), key.to_owned(), dir.to_owned());
                let (lost, session_id) = (session.lost.clone(), session.id);
                // Should the session end first, the key goes with it and
                // `claim_slot` drops the slot.
                crate::finish::release_later(
                    session.lost.clone(),
                    crate::finish::SESSION_RELEASE_RETRIES,
                    move || {
                        let (inner, key, dir, lost) =
                            (Arc::clone(&inner), key.clone(), dir.clone(), lost.clone());
                        async move {
                            let done = Self::delete_key(&inner.client, &key, revision)
                                .await
                                .is_ok();
                            if done && revision.is_none() {
                                // An earlier delete by name went unanswered and may
                                // still land: were the slot free, it could hit the next
                                // local acquisition's key of the same name (two
                                // holders). The name stays closed here until it cannot.
                                tokio::spawn(Self::closed_after_unanswered_delete(
                                    Arc::downgrade(&inner),
                                    dir,
                                    key,
                                    (acquisition, session_id),
                                    lost,
                                ));
                            } else if done {
                                inner.free_slot_after_delete(&dir, acquisition, session_id);
                            }
                            done
                        }
                    },
                );
                Err(map_err(&e))
            }
        }
    }

    /// After a delete by name of `key` went unanswered and a retry was answered: keep
    /// `dir`'s slot closed (`acquisition` has it under the session of lease id
    /// `session`) for [`late_put::LATE_PUT`], then free
    /// it. Meanwhile a key of that name that turns up is deleted by its revision: it can
    /// only be the attempt's own put landing late, since no local acquisition puts the
    /// name while the slot is closed, and no other process puts a key named by this
    /// session's lease. Holds the backend weakly, and only between awaits; ends early
    /// with the session (the next session's key has another name).
    async fn closed_after_unanswered_delete(
        inner: std::sync::Weak<Self>,
        dir: String,
        key: String,
        (acquisition, session): (AcquisitionId, i64),
        lost: CancellationToken,
    ) {
        // Only this task frees the slot while it is closed, and `claim_slot` drops it
        // only once its session is lost: between this check and the delete, the slot
        // stays ours (or the session, and the key with it, is gone).
        let closed = |backend: &Self| {
            backend
                .slots()
                .get(&dir)
                .is_some_and(|s| s.acquisition == acquisition && s.session.id == session)
        };
        let until = Instant::now() + late_put::LATE_PUT;
        late_put::looks(&lost, until, || async {
            let client = match inner.upgrade() {
                Some(backend) if closed(&backend) => backend.client.clone(),
                _ => return,
            };
            if let Some(revision) = late_put::find(&client, &key).await
                && inner.upgrade().is_some_and(|backend| closed(&backend))
            {
                late_put::delete_found(&client, &lost, &key, revision).await;
            }
        })
        .await;
        // Freed as after any answered delete: should the last look have gone
        // unanswered, a put's window still sweeps on once the name is open.
        if let Some(backend) = inner.upgrade() {
            backend.free_slot_after_delete(&dir, acquisition, session);
        }
    }

    /// Delete `key` (only while its create revision is `revision`, when given);
    /// whether a key was deleted. Without a revision the delete goes by name: it takes
    /// effect even when its answer is lost, and the caller keeps the name closed to
    /// local acquisitions while an unanswered one may still land
    /// ([`Inner::delete_and_free`]).
    async fn delete_key(
        client: &Client,
        key: &str,
        revision: Option<i64>,
    ) -> std::result::Result<bool, RpcError> {
        match revision {
            Some(rev) => Self::delete_revision(client, key, rev).await,
            None => {
                let delete = proto::DeleteRangeRequest {
                    key: key.as_bytes().to_vec(),
                    ..proto::DeleteRangeRequest::default()
                };
                Ok(client.delete_range(delete).await?.deleted > 0)
            }
        }
    }

    /// Delete `key` while its create revision is `rev`; whether it was deleted.
    async fn delete_revision(
        client: &Client,
        key: &str,
        rev: i64,
    ) -> std::result::Result<bool, RpcError> {
        let txn = proto::TxnRequest {
            compare: vec![create_revision_is(key.as_bytes(), rev, false)],
            success: vec![op(Request::DeleteRange(proto::DeleteRangeRequest {
                key: key.as_bytes().to_vec(),
                ..proto::DeleteRangeRequest::default()
            }))],
            failure: Vec::new(),
        };
        Ok(client.txn(txn).await?.succeeded)
    }

    /// The live session, opening a new one if there is none or it was lost.
    async fn session(&self) -> Result<Arc<Session>> {
        let mut current = self.session.lock().await;
        if let Some(s) = current.as_ref()
            && s.check().is_ok()
        {
            return Ok(Arc::clone(s));
        }
        let s = Session::open(&self.client, self.session_ttl, Arc::downgrade(&self.alive)).await?;
        *current = Some(Arc::clone(&s));
        Ok(s)
    }

    /// The key created first under `dir` (the holder).
    fn first_created(dir: &str) -> RequestOp {
        op(Request::Range(Self::first_created_range(dir)))
    }

    /// The range that reads the key created first under `dir` (with its value).
    fn first_created_range(dir: &str) -> proto::RangeRequest {
        proto::RangeRequest {
            key: dir.as_bytes().to_vec(),
            range_end: prefix_end(dir.as_bytes()),
            sort_target: SortTarget::Create as i32,
            sort_order: SortOrder::Ascend as i32,
            limit: 1,
            ..proto::RangeRequest::default()
        }
    }

    /// Take the local slot for `dir` for `acquisition` (and note that its key is
    /// about to be put), or say that another acquisition has it.
    async fn claim_slot(
        &self,
        dir: &str,
        acquisition: AcquisitionId,
    ) -> Result<Option<(Arc<Session>, String)>> {
        {
            let mut slots = self.slots();
            if slots
                .get(dir)
                .is_some_and(|s| s.session.lost.is_cancelled())
            {
                // Its key went with its session (a delete left pending included).
                slots.remove(dir);
            }
            if let Some(s) = slots.get_mut(dir) {
                if s.acquisition != acquisition || s.held {
                    return Ok(None);
                }
                s.maybe_put = true;
                return Ok(Some((Arc::clone(&s.session), s.key.clone())));
            }
        }
        let session = self.session().await?;
        let key = format!("{dir}{:x}", session.id);
        let mut slots = self.slots();
        match slots.get_mut(dir) {
            Some(s) if s.acquisition != acquisition || s.held => Ok(None),
            Some(s) => {
                s.maybe_put = true;
                Ok(Some((Arc::clone(&s.session), s.key.clone())))
            }
            None => {
                slots.insert(
                    dir.to_owned(),
                    Slot {
                        acquisition,
                        session: Arc::clone(&session),
                        key: key.clone(),
                        held: false,
                        maybe_put: true,
                        late_until: None,
                        predecessor: None,
                    },
                );
                Ok(Some((session, key)))
            }
        }
    }

    /// `req`'s key holds the lock with create revision `token`. The slot is still
    /// this acquisition's: only it frees its own slot, and the core never cleans up
    /// an acquisition while one of its attempts runs (a slot dropped because its
    /// session was lost took the key with it: that is reported as such).
    fn granted(
        self: &Arc<Self>,
        dir: &str,
        key: String,
        req: &AcquireRequest,
        session: Arc<Session>,
        token: i64,
    ) -> Result<Attempt> {
        if session.lost.is_cancelled() {
            // Lost while the grant was on its way: the key goes with the session (it is
            // revoked), and no hold may start under it.
            return Err(Error::connection(
                SCHEME,
                "the etcd session was lost while acquiring",
            ));
        }
        match self.slots().get_mut(dir) {
            Some(s) if s.acquisition == req.acquisition => {
                s.held = true;
                s.predecessor = None;
            }
            _ => {
                session.lost.cancel();
                return Err(Error::connection(
                    SCHEME,
                    "the etcd session ended while acquiring (its lease expired)",
                ));
            }
        }
        Ok(Attempt::Acquired(Box::new(EtcdHeld {
            inner: Arc::clone(self),
            dir: dir.to_owned(),
            key,
            acquisition: req.acquisition,
            session,
            revision: token,
            token: u64::try_from(token).unwrap_or(0),
            released: AtomicBool::new(false),
        })))
    }

    /// A put of `acquisition`'s key went unanswered: note how long etcd may still apply
    /// it (see [`Slot::late_until`]); the error to report.
    fn unanswered(
        &self,
        dir: &str,
        acquisition: AcquisitionId,
        session: &Session,
        e: &RpcError,
    ) -> Error {
        if let Some(s) = self.slots().get_mut(dir)
            && s.acquisition == acquisition
        {
            s.late_until = Some(Instant::now() + late_put::LATE_PUT);
        }
        session_err(session, e)
    }

    /// Put this contender's key (owner and metadata), attached to the session lease.
    fn put_mine(req: &AcquireRequest, key: &str, session: &Session) -> RequestOp {
        op(Request::Put(proto::PutRequest {
            key: key.as_bytes().to_vec(),
            // A candidate stores its value alone, as etcd's Election does.
            value: req
                .campaign
                .as_ref()
                .map_or_else(|| StoredHolder::encode(req), |v| v.as_bytes().to_vec()),
            lease: session.id,
            ..proto::PutRequest::default()
        }))
    }

    /// First attempt: put the key only if the directory is empty (no holder, nobody
    /// queued). Writes nothing when the lock is taken.
    async fn try_empty(
        self: &Arc<Self>,
        req: &AcquireRequest,
        dir: &str,
        session: Arc<Session>,
        key: String,
    ) -> Result<Attempt> {
        let txn = proto::TxnRequest {
            compare: vec![create_revision_is(dir.as_bytes(), 0, true)],
            success: vec![Self::put_mine(req, &key, &session)],
            failure: vec![Self::first_created(dir)],
        };
        let resp = self
            .client
            .txn(txn)
            .await
            .map_err(|e| self.unanswered(dir, req.acquisition, &session, &e))?;
        if resp.succeeded {
            let rev = revision(resp.header.as_ref());
            return self.granted(dir, key, req, session, rev);
        }
        // Not queued (nothing was put): the slot is given back for other local
        // acquisitions.
        self.free_slot(dir, req.acquisition, session.id);
        Ok(Attempt::Busy {
            retry_after: Some(RECHECK),
        })
    }

    /// Later attempts: be queued (put the key if it is not there), then either hold
    /// the lowest create revision or learn the predecessor to watch.
    async fn try_queued(
        self: &Arc<Self>,
        req: &AcquireRequest,
        dir: &str,
        session: Arc<Session>,
        key: String,
    ) -> Result<Attempt> {
        let client = &self.client;
        let get_mine = op(Request::Range(proto::RangeRequest {
            key: key.as_bytes().to_vec(),
            ..proto::RangeRequest::default()
        }));
        let txn = proto::TxnRequest {
            compare: vec![create_revision_is(key.as_bytes(), 0, false)],
            success: vec![
                Self::put_mine(req, &key, &session),
                Self::first_created(dir),
            ],
            failure: vec![get_mine, Self::first_created(dir)],
        };
        let resp = client
            .txn(txn)
            .await
            .map_err(|e| self.unanswered(dir, req.acquisition, &session, &e))?;
        let ranges: Vec<Option<&proto::RangeResponse>> = resp
            .responses
            .iter()
            .map(|r| match &r.response {
                Some(Response::Range(g)) => Some(g),
                _ => None,
            })
            .collect();
        let my_rev = if resp.succeeded {
            revision(resp.header.as_ref())
        } else {
            match ranges.first().copied().flatten() {
                Some(g) if !g.kvs.is_empty() => g.kvs[0].create_revision,
                _ => {
                    // Our key is gone although the slot says queued: the session lease
                    // ended under us (then etcd says so, and the session is lost), or
                    // someone deleted the key (then only this attempt ends).
                    self.free_slot(dir, req.acquisition, session.id);
                    session::confirm(client, &session).await;
                    return Err(Error::connection(
                        SCHEME,
                        "this waiter's key was deleted (with its session, or by hand)",
                    ));
                }
            }
        };
        let holder_rev = ranges
            .get(1)
            .copied()
            .flatten()
            .and_then(|g| g.kvs.first())
            .map_or(0, |kv| kv.create_revision);
        if holder_rev == my_rev {
            return self.granted(dir, key, req, session, my_rev);
        }
        // The key created just before ours: only its deletion can make us the holder.
        let before = client
            .range(proto::RangeRequest {
                key: dir.as_bytes().to_vec(),
                range_end: prefix_end(dir.as_bytes()),
                max_create_revision: my_rev - 1,
                sort_target: SortTarget::Create as i32,
                sort_order: SortOrder::Descend as i32,
                limit: 1,
                keys_only: true,
                ..proto::RangeRequest::default()
            })
            .await
            .map_err(|e| map_err(&e))?;
        let predecessor = before.kvs.first().map(|kv| {
            (
                String::from_utf8_lossy(&kv.key).into_owned(),
                kv.create_revision,
            )
        });
        let retry_now = predecessor.is_none();
        if let Some(s) = self.slots().get_mut(dir)
            && s.acquisition == req.acquisition
        {
            s.predecessor = predecessor;
        }
        Ok(Attempt::Busy {
            retry_after: Some(if retry_now { Duration::ZERO } else { RECHECK }),
        })
    }
}

#[async_trait]
impl Backend for EtcdBackend {
    fn scheme(&self) -> &'static str {
        if self.inner.shown.starts_with("etcds:") {
            "etcds"
        } else {
            SCHEME
        }
    }

    fn capabilities(&self) -> Capabilities {
        Self::capabilities_of(self.inner.session_ttl)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        let inner = &self.inner;
        if req.primitive != Primitive::Lock {
            return shared::try_acquire(inner, req).await;
        }
        let dir = inner.dir(&req.name);
        let Some((session, key)) = inner.claim_slot(&dir, req.acquisition).await? else {
            return Ok(Attempt::Busy { retry_after: None });
        };
        if let Err(e) = session.check() {
            // The key (if any) went with the session.
            inner.free_slot(&dir, req.acquisition, session.id);
            return Err(e);
        }
        let queued = inner
            .slots()
            .get(&dir)
            .is_some_and(|s| s.predecessor.is_some());
        let outcome = if req.attempt == 0 && !queued {
            inner.try_empty(req, &dir, session, key).await
        } else {
            inner.try_queued(req, &dir, session, key).await
        };
        if outcome.is_err() {
            // Whether the key exists is unknown: the core calls `leave_queue`, which
            // deletes it and frees the slot.
            tracing::debug!(lock = %req.name, "etcd attempt failed; leave_queue will clean up");
        }
        outcome
    }

    async fn subscribe(&self, req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        if req.primitive != Primitive::Lock {
            let dir = shared::dir(&self.inner, &req.name, req.primitive);
            // Opened before the attempt that follows a subscription lists again.
            let watch = shared::watch_from_now(&self.inner.client, &dir).await;
            return Ok(Box::new(shared::SharedWaiter {
                inner: Arc::clone(&self.inner),
                slot: (dir, req.acquisition.get()),
                watch,
            }));
        }
        let dir = self.inner.dir(&req.name);
        Ok(Box::new(EtcdWaiter {
            wake: Arc::new(Notify::new()),
            inner: Arc::clone(&self.inner),
            dir,
            acquisition: req.acquisition,
        }))
    }

    async fn leave_queue(&self, req: &AcquireRequest) -> Result<()> {
        let inner = &self.inner;
        if req.primitive != Primitive::Lock {
            return shared::leave_queue(inner, req).await;
        }
        let dir = inner.dir(&req.name);
        let slot = {
            let mut slots = inner.slots();
            // No longer waiting for the local slot either: a release must not hand the
            // slot to an acquisition that has gone (nobody would ever free it).
            {
                let mut local = inner.local();
                if let Some(queue) = local.get_mut(&dir) {
                    queue.retain(|w| w.acquisition != req.acquisition);
                    if queue.is_empty() {
                        local.remove(&dir);
                    }
                }
            }
            match slots.get_mut(&dir) {
                Some(s) if s.acquisition == req.acquisition && !s.held => {
                    if s.maybe_put {
                        // Closed to every local acquisition until the key is gone: a
                        // later one must not reuse a key whose delete is still pending.
                        s.held = true;
                        Leaving::Delete(s.key.clone(), Arc::clone(&s.session))
                    } else {
                        // Reserved for it, never used: nothing to delete.
                        Leaving::Free(s.session.id)
                    }
                }
                // Not its slot (any more): nothing of this acquisition's is left.
                _ => Leaving::Nothing,
            }
        };
        match slot {
            Leaving::Nothing => Ok(()),
            Leaving::Free(session) => {
                inner.free_slot(&dir, req.acquisition, session);
                Ok(())
            }
            Leaving::Delete(key, session) => inner
                .delete_and_free(&session, &key, None, &dir, req.acquisition)
                .await
                .map(drop),
        }
    }

    async fn names(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        // Every contender key under the backend's prefix is `<prefix><name>/<lease>`
        // (the name percent-encoded unless raw_names): one range, keys only.
        let base = self.inner.prefix.as_bytes();
        let resp = self
            .inner
            .client
            .range(proto::RangeRequest {
                key: base.to_vec(),
                range_end: prefix_end(base),
                keys_only: true,
                limit: 100_000,
                ..proto::RangeRequest::default()
            })
            .await
            .map_err(|e| map_err(&e))?;
        let mut names: Vec<String> = resp
            .kvs
            .iter()
            .filter_map(|kv| {
                let rest = kv.key.get(base.len()..)?;
                let rest = std::str::from_utf8(rest).ok()?;
                let (dir, _) = rest.rsplit_once('/')?;
                if shared::is_shared_dir(dir) {
                    // A semaphore's or read-write lock's key.
                    None
                } else if self.inner.raw_names {
                    Some(dir.to_owned())
                } else {
                    crate::name::decode(dir)
                }
            })
            .filter(|n| n.starts_with(prefix))
            .collect();
        names.sort_unstable();
        names.dedup();
        names.truncate(limit);
        Ok(names)
    }

    async fn holders(&self, name: &LockName, primitive: Primitive) -> Result<Vec<LockInfo>> {
        shared::holders(&self.inner, name, primitive).await
    }

    async fn break_lock(&self, name: &LockName, fence: u64) -> Result<bool> {
        // The holder's key (the first created), deleted only while its create revision
        // is the token shown. Later keys have higher revisions, and the holder's next
        // renewal finds its key gone.
        let dir = self.inner.dir(name);
        let Ok(rev) = i64::try_from(fence) else {
            return Ok(false);
        };
        let first = self
            .inner
            .client
            .range(Inner::first_created_range(&dir))
            .await
            .map_err(|e| map_err(&e))?;
        let Some(kv) = first.kvs.first().filter(|kv| kv.create_revision == rev) else {
            return Ok(false);
        };
        if StoredHolder::decode(&kv.value).is_none() {
            return Err(crate::queue::break_unnoticed());
        }
        let key = String::from_utf8_lossy(&kv.key).into_owned();
        Inner::delete_key(&self.inner.client, &key, Some(rev))
            .await
            .map_err(|e| map_err(&e))
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let dir = self.inner.dir(name);
        let resp = self
            .inner
            .client
            .range(proto::RangeRequest {
                key: dir.as_bytes().to_vec(),
                range_end: prefix_end(dir.as_bytes()),
                sort_target: SortTarget::Create as i32,
                sort_order: SortOrder::Ascend as i32,
                ..proto::RangeRequest::default()
            })
            .await
            .map_err(|e| map_err(&e))?;
        let Some(first) = resp.kvs.first() else {
            return Ok(None);
        };
        let stored = StoredHolder::decode(&first.value);
        // A foreign holder (etcdctl) stores nothing: show its key's last part.
        let owner = stored.as_ref().map_or_else(
            || {
                String::from_utf8_lossy(&first.key)
                    .rsplit('/')
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            },
            |s| s.owner.clone(),
        );
        let mut info = LockInfo::new(
            name,
            owner,
            1,
            u64::try_from(first.create_revision).unwrap_or(0),
        );
        match stored {
            Some(s) => info.metadata = s.metadata,
            // A candidate of an election (dlock's or `etcdctl elect`'s) stores its
            // value alone: show it as the note.
            None if !first.value.is_empty() => {
                info.metadata.note = Some(String::from_utf8_lossy(&first.value).into_owned());
            }
            None => {}
        }
        info.waiters = Some(resp.kvs.len() - 1);
        Ok(Some(info))
    }
}

/// The bare etcd operations under the backend, for measuring the server's own cost
/// next to a lock's (`dlock bench`'s floor: a put attached to a lease, a delete, and
/// the store's revision to count writes). Not a general etcd client.
#[derive(Debug, Clone)]
pub struct RawClient {
    client: Client,
}

impl RawClient {
    /// Connect to `endpoints` (`http://host:port`), without credentials or TLS.
    ///
    /// # Errors
    /// [`Error::Connection`] when no endpoint answers.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect(endpoints: &[String]) -> Result<Self> {
        let options = ConnectOptions {
            timeout: Some(Duration::from_secs(5)),
            ..ConnectOptions::default()
        };
        let client = Client::connect(endpoints, options)
            .await
            .map_err(|e| map_err(&e))?;
        Ok(RawClient { client })
    }

    /// Grant a lease of `ttl_secs`; its id.
    ///
    /// # Errors
    /// Connection or server errors.
    ///
    /// # Cancel safety
    /// Cancel safe (the lease may or may not have been granted).
    pub async fn lease_grant(&self, ttl_secs: i64) -> Result<i64> {
        Ok(self
            .client
            .lease_grant(ttl_secs)
            .await
            .map_err(|e| map_err(&e))?
            .id)
    }

    /// Revoke lease `id` (its keys go with it).
    ///
    /// # Errors
    /// Connection or server errors.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn lease_revoke(&self, id: i64) -> Result<()> {
        self.client
            .lease_revoke(id)
            .await
            .map(drop)
            .map_err(|e| map_err(&e))
    }

    /// Put `key` = `value` attached to `lease` (0: none); the store's revision after.
    ///
    /// # Errors
    /// Connection or server errors.
    ///
    /// # Cancel safety
    /// Cancel safe (the put may or may not have happened).
    pub async fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<i64> {
        let r = self
            .client
            .put(proto::PutRequest {
                key: key.as_bytes().to_vec(),
                value: value.to_vec(),
                lease,
                ..proto::PutRequest::default()
            })
            .await
            .map_err(|e| map_err(&e))?;
        Ok(revision(r.header.as_ref()))
    }

    /// Delete `key`; the store's revision after.
    ///
    /// # Errors
    /// Connection or server errors.
    ///
    /// # Cancel safety
    /// Cancel safe (the delete may or may not have happened).
    pub async fn delete(&self, key: &str) -> Result<i64> {
        let r = self
            .client
            .delete_range(proto::DeleteRangeRequest {
                key: key.as_bytes().to_vec(),
                ..proto::DeleteRangeRequest::default()
            })
            .await
            .map_err(|e| map_err(&e))?;
        Ok(revision(r.header.as_ref()))
    }

    /// The store's current revision (it grows by one with every write), read with a
    /// count of `key`.
    ///
    /// # Errors
    /// Connection or server errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn revision(&self, key: &str) -> Result<i64> {
        let r = self
            .client
            .range(proto::RangeRequest {
                key: key.as_bytes().to_vec(),
                count_only: true,
                ..proto::RangeRequest::default()
            })
            .await
            .map_err(|e| map_err(&e))?;
        Ok(revision(r.header.as_ref()))
    }

    /// The keys under `prefix` with the `limit` oldest create revisions, keys only:
    /// what a counted grant reads to learn whether its key is among the first `limit`.
    ///
    /// # Errors
    /// Connection or server errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn oldest(&self, prefix: &str, limit: u32) -> Result<Vec<String>> {
        let r = self
            .client
            .range(proto::RangeRequest {
                key: prefix.as_bytes().to_vec(),
                range_end: prefix_end(prefix.as_bytes()),
                limit: i64::from(limit),
                sort_target: SortTarget::Create as i32,
                sort_order: SortOrder::Ascend as i32,
                keys_only: true,
                ..proto::RangeRequest::default()
            })
            .await
            .map_err(|e| map_err(&e))?;
        Ok(r.kvs
            .into_iter()
            .map(|kv| String::from_utf8_lossy(&kv.key).into_owned())
            .collect())
    }
}

impl EtcdBackend {
    /// The capabilities with the default session TTL (tokens are revisions: always
    /// durable).
    pub(crate) fn capabilities_with(_durable: bool) -> Capabilities {
        Self::capabilities_of(crate::queue::DEFAULT_SESSION_TIMEOUT)
    }

    fn capabilities_of(session_ttl: Duration) -> Capabilities {
        let mut caps = crate::queue::capabilities(session_ttl);
        caps.primitives = crate::backend::Primitives {
            // Contenders are ordered by arrival (shared_order): a read after a
            // waiting writer of another owner queues behind it.
            downgrade_while_a_writer_waits: false,
            fifo: true,
            ..crate::backend::Primitives::ALL
        };
        caps
    }
}

/// Waits for the predecessor's deletion (queued in etcd) or for the local slot.
struct EtcdWaiter {
    inner: Arc<Inner>,
    dir: String,
    acquisition: AcquisitionId,
    /// Notified when a release hands this waiter the slot.
    wake: Arc<Notify>,
}

impl Drop for EtcdWaiter {
    fn drop(&mut self) {
        // A slot already handed over is given back by `leave_queue`.
        self.inner.forget_waiter(&self.dir, &self.wake);
    }
}

impl std::fmt::Debug for EtcdWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdWaiter")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Waiter for EtcdWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        let ours = {
            let slots = self.inner.slots();
            slots
                .get(&self.dir)
                .filter(|s| s.acquisition == self.acquisition)
                .map(|s| (s.predecessor.clone(), s.session.lost.clone()))
        };
        let Some((predecessor, lost)) = ours else {
            // Another local acquisition is using this lock: queue for the slot.
            if self
                .inner
                .wait_for_slot(&self.dir, self.acquisition, &self.wake)
            {
                let _ = tokio::time::timeout(max, self.wake.notified()).await;
            }
            return Ok(());
        };
        let Some((key, key_revision)) = predecessor else {
            return Ok(());
        };
        // Watch from "now" (a watch that starts at an older revision is caught up by
        // etcd's background sync, up to 100 ms late), then check the key still exists:
        // a deletion before the watch was created shows there, one after it in the watch.
        let inner = &self.inner;
        let deleted = async {
            let is_delete = |r: &proto::WatchResponse| {
                r.events
                    .iter()
                    .any(|e| e.r#type == proto::EventType::Delete as i32)
            };
            let next = |m: std::result::Result<Option<proto::WatchResponse>, tonic::Status>| {
                m.map_err(|s| RpcError::Status(s.code(), s.message().to_owned()))
            };
            // The request stream must stay open for the watch to go on.
            let (_requests, mut stream) = inner.client.watch(key.as_bytes()).await?;
            while let Some(resp) = next(stream.message().await)? {
                if resp.canceled || is_delete(&resp) {
                    return Ok(());
                }
                if resp.created {
                    break;
                }
            }
            let still = inner
                .client
                .range(proto::RangeRequest {
                    key: key.as_bytes().to_vec(),
                    keys_only: true,
                    ..proto::RangeRequest::default()
                })
                .await?;
            // Gone, or a new key of the same name (a later contender): not ours to wait for.
            if still
                .kvs
                .first()
                .is_none_or(|kv| kv.create_revision != key_revision)
            {
                return Ok(());
            }
            while let Some(resp) = next(stream.message().await)? {
                if resp.canceled || is_delete(&resp) {
                    break;
                }
            }
            Ok::<(), RpcError>(())
        };
        tokio::select! {
            () = lost.cancelled() => Err(Error::connection(
                SCHEME,
                "the etcd session ended while waiting (its lease expired)",
            )),
            () = tokio::time::sleep(max) => Ok(()),
            r = deleted => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "etcd watch failed; looking again");
                    // Do not spin on a failing watch.
                    tokio::time::sleep(Duration::from_millis(50).min(max)).await;
                }
                Ok(())
            }
        }
    }
}

/// Whether `key` still exists with create revision `revision` (`true` when etcd does
/// not answer: the session's keep-alive decides then).
async fn still_there(client: &Client, key: &str, revision: i64) -> bool {
    let got = client
        .range(proto::RangeRequest {
            key: key.as_bytes().to_vec(),
            keys_only: true,
            ..proto::RangeRequest::default()
        })
        .await;
    match got {
        Ok(r) => r
            .kvs
            .first()
            .is_some_and(|kv| kv.create_revision == revision),
        Err(e) => {
            tracing::debug!(%key, error = %e, "etcd renewal check unanswered");
            true
        }
    }
}

struct EtcdHeld {
    inner: Arc<Inner>,
    dir: String,
    key: String,
    acquisition: AcquisitionId,
    session: Arc<Session>,
    /// The key's create revision (the fencing token).
    revision: i64,
    token: u64,
    released: AtomicBool,
}

impl std::fmt::Debug for EtcdHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdHeld")
            .field("key", &self.key)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl HeldLock for EtcdHeld {
    fn fencing_token(&self) -> u64 {
        self.token
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        // The session's keep-alive is the renewal; this reports whether it holds, and
        // whether the key is still the grant's (an operator's `break_lock` deletes it).
        let not_owner = || Error::NotOwner {
            name: self.dir.clone(),
        };
        self.session.check().map_err(|_| not_owner())?;
        // Bounded well inside the renewal's budget: a slow answer is no loss.
        let check = still_there(&self.inner.client, &self.key, self.revision);
        match tokio::time::timeout(ttl / 4, check).await {
            Ok(false) => Err(not_owner()),
            Ok(true) | Err(_) => Ok(()),
        }
    }

    async fn release(&self) -> Result<()> {
        if self.released.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let lost = || {
            Error::LockLost {
            name: self.dir.clone(),
            reason: LossReason::SessionLost(
                "the lock's key was gone before the release (the etcd session expired, or the lock was broken)".into(),
            ),
        }
        };
        if self.session.check().is_err() {
            // The key went (or goes) with the lease; nothing of ours is left to delete.
            self.inner
                .free_slot(&self.dir, self.acquisition, self.session.id);
            return Err(lost());
        }
        let deleted = self
            .inner
            .delete_and_free(
                &self.session,
                &self.key,
                Some(self.revision),
                &self.dir,
                self.acquisition,
            )
            .await?;
        if deleted {
            Ok(())
        } else {
            // Our key was gone: the session expired (then its other holds end now), or
            // an operator broke this lock (which must not end them). (The delete is
            // sent once: its "not there" is not its own doing.)
            session::confirm(&self.inner.client, &self.session).await;
            if self.session.check().is_err() {
                Err(lost())
            } else {
                Err(Error::NotOwner {
                    name: self.dir.clone(),
                })
            }
        }
    }

    fn loss_signal(&self) -> Option<CancellationToken> {
        Some(self.session.lost.clone())
    }
    fn session_trust(&self) -> Option<crate::backend::SessionTrust> {
        Some(self.session.trust.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::{Metadata, Owner};

    fn request(name: &str, attempt: u32) -> AcquireRequest {
        AcquireRequest {
            name: LockName::new(name).expect("name"),
            owner: Owner::random(),
            acquisition: AcquisitionId::new(),
            ttl: Duration::from_secs(30),
            fair: false,
            enqueue: None,
            metadata: Metadata::default().into(),
            attempt,
            will_wait: true,
            primitive: crate::backend::Primitive::Lock,
            campaign: None,
        }
    }

    /// A queued waiter's predecessor is deleted and its name put again at once (the
    /// next local acquisition of that process reuses the session's key name): the
    /// waiter is not fooled by the name — it looks again at once instead of waiting
    /// for the new key to go.
    #[tokio::test]
    async fn a_reused_key_name_is_not_the_predecessor() {
        let Some(etcd) = dlock_testkit::EtcdServer::start() else {
            return;
        };
        let open =
            || async { EtcdBackend::open(ConnectUrl::parse(&etcd.url()).expect("url")).await };
        let (p, q) = (open().await.expect("p"), open().await.expect("q"));
        let first = request("reuse", 0);
        let Attempt::Acquired(held) = p.try_acquire(&first).await.expect("p1") else {
            panic!("a free lock was busy");
        };
        let mut waiting = request("reuse", 1);
        assert!(matches!(
            q.try_acquire(&waiting).await.expect("q"),
            Attempt::Busy { .. }
        ));
        held.release().await.expect("release");
        // p's next acquisition puts the same key name again, behind q.
        let second = request("reuse", 1);
        assert!(matches!(
            p.try_acquire(&second).await.expect("p2"),
            Attempt::Busy { .. }
        ));
        let mut waiter = q.subscribe(&waiting).await.expect("subscribe");
        let started = std::time::Instant::now();
        waiter
            .changed(Duration::from_secs(10))
            .await
            .expect("changed");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "waited {:?} for a key that was not its predecessor",
            started.elapsed()
        );
        waiting.attempt = 2;
        assert!(matches!(
            q.try_acquire(&waiting).await.expect("q again"),
            Attempt::Acquired(_)
        ));
    }

    /// Put `key` under the current session's lease, as a late put would land.
    async fn land_late(b: &EtcdBackend, key: &str) {
        let session = b.inner.session().await.expect("session");
        b.inner
            .client
            .put(proto::PutRequest {
                key: key.as_bytes().to_vec(),
                value: b"late".to_vec(),
                lease: session.id,
                ..proto::PutRequest::default()
            })
            .await
            .expect("put");
    }

    /// Land `key` late (as [`land_late`]) and assert it is gone within 2.5 s: `what`
    /// names the moment the put lands after, for the failure message.
    async fn assert_swept(b: &EtcdBackend, key: &str, what: &str) {
        land_late(b, key).await;
        assert!(
            !still_there_after(b, key, Duration::from_millis(2500)).await,
            "a late put's key stood 2.5 s after {what}"
        );
    }

    /// Whether `key` exists, once it has had `within` to go.
    async fn still_there_after(b: &EtcdBackend, key: &str, within: Duration) -> bool {
        tokio::time::sleep(within).await;
        let found = b
            .inner
            .client
            .range(proto::RangeRequest {
                key: key.as_bytes().to_vec(),
                ..proto::RangeRequest::default()
            })
            .await
            .expect("range");
        !found.kvs.is_empty()
    }

    /// An open backend on `etcd`, with `query` appended to its URL.
    async fn backend(etcd: &dlock_testkit::EtcdServer, query: &str) -> Arc<EtcdBackend> {
        let url = format!("{}{query}", etcd.url());
        EtcdBackend::open(ConnectUrl::parse(&url).expect("url"))
            .await
            .expect("open")
    }

    /// Take `name` at once (a look of a sweep may close the slot for an instant).
    async fn take(b: &EtcdBackend, name: &str) -> (AcquireRequest, Box<dyn HeldLock>) {
        let started = std::time::Instant::now();
        loop {
            let req = request(name, 0);
            match b.try_acquire(&req).await.expect("try_acquire") {
                Attempt::Acquired(held) => return (req, held),
                Attempt::Busy { .. } => {
                    b.leave_queue(&req).await.expect("leave");
                    assert!(
                        started.elapsed() < Duration::from_secs(5),
                        "a free lock stayed busy"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    /// Mark the slot of `name` as having had a put go unanswered.
    fn unanswered_put(b: &EtcdBackend, name: &str) -> String {
        let dir = b.inner.dir(&LockName::new(name).expect("name"));
        let mut slots = b.inner.slots();
        let slot = slots.get_mut(&dir).expect("slot");
        slot.late_until = Some(Instant::now() + late_put::LATE_PUT);
        slot.key.clone()
    }

    /// A lock whose acquisition had a put go unanswered: the put lands after the
    /// release deleted the key (as etcd may apply it), and the key goes within about a
    /// second instead of standing for the session's life.
    #[tokio::test]
    async fn a_late_lock_put_is_swept() {
        let Some(etcd) = dlock_testkit::EtcdServer::start() else {
            return;
        };
        let b = backend(&etcd, "").await;
        let (_, held) = take(&b, "late").await;
        let key = unanswered_put(&b, "late");
        held.release().await.expect("release");
        assert_swept(&b, &key, "the release").await;
    }

    /// The next local acquisition of the name puts the same key name while the sweep
    /// runs: the sweep leaves its key alone.
    #[tokio::test]
    async fn the_sweep_leaves_a_local_holds_key_alone() {
        let Some(etcd) = dlock_testkit::EtcdServer::start() else {
            return;
        };
        let b = backend(&etcd, "").await;
        let (_, held) = take(&b, "late-kept").await;
        let key = unanswered_put(&b, "late-kept");
        held.release().await.expect("release");
        let (_, taken) = take(&b, "late-kept").await;
        assert!(
            still_there_after(&b, &key, Duration::from_millis(2500)).await,
            "the sweep deleted a key a local acquisition holds"
        );
        taken.release().await.expect("the hold's key was kept");
    }

    /// The window of an unanswered put goes with the slot to the local acquisition
    /// that waited for it; when that one leaves without putting anything, the late
    /// key is still swept.
    #[tokio::test]
    async fn a_handed_over_slot_keeps_the_late_window() {
        let Some(etcd) = dlock_testkit::EtcdServer::start() else {
            return;
        };
        let b = backend(&etcd, "").await;
        let (first, held) = take(&b, "late-handed").await;
        let key = unanswered_put(&b, "late-handed");
        let dir = b.inner.dir(&first.name);
        let next = request("late-handed", 0);
        assert!(
            b.inner
                .wait_for_slot(&dir, next.acquisition, &Arc::new(Notify::new())),
            "the slot was free while held"
        );
        held.release().await.expect("release");
        assert!(
            b.inner
                .slots()
                .get(&dir)
                .is_some_and(|s| s.acquisition == next.acquisition && s.late_until.is_some()),
            "the slot went to the waiter without the late window"
        );
        b.leave_queue(&next).await.expect("leave");
        assert_swept(&b, &key, "the handed-over slot was left").await;
    }

    /// A put that etcd does not answer (the server is paused past the request
    /// timeout) opens the late window, in a first attempt and in a queued one; once
    /// etcd runs again and the attempt has left, its key is swept even if it lands
    /// after that.
    #[tokio::test]
    async fn an_unanswered_put_opens_the_late_window() {
        let Some(etcd) = dlock_testkit::EtcdServer::start() else {
            return;
        };
        let b = backend(&etcd, "?timeout=1s").await;
        b.inner.session().await.expect("session");
        for attempt in [0, 1] {
            let req = request(&format!("late-paused-{attempt}"), attempt);
            etcd.pause();
            let tried = b.try_acquire(&req).await;
            let late = b
                .inner
                .slots()
                .get(&b.inner.dir(&req.name))
                .map(|s| (s.late_until.is_some(), s.key.clone()));
            etcd.resume();
            assert!(
                tried.is_err(),
                "attempt {attempt} against a paused etcd succeeded"
            );
            let (opened, key) = late.expect("the attempt's slot");
            assert!(
                opened,
                "attempt {attempt}: an unanswered put did not open the late window"
            );
            let _ = b.leave_queue(&req).await;
            assert_swept(&b, &key, &format!("attempt {attempt} left")).await;
        }
    }

    /// What [`left_unanswered`] leaves behind.
    struct LeftUnanswered {
        /// The other backend, and its hold of the name.
        _holder: Arc<EtcdBackend>,
        held: Box<dyn HeldLock>,
        /// The backend whose waiter left, with a 1 s request timeout.
        b: Arc<EtcdBackend>,
        waiting: AcquireRequest,
        dir: String,
        key: String,
    }

    /// A queued waiter of `name` (its put went unanswered too: the realistic double
    /// fault) leaves while etcd is paused past the request timeout, so its delete by
    /// name goes unanswered and is retried once etcd is back.
    async fn left_unanswered(etcd: &dlock_testkit::EtcdServer, name: &str) -> LeftUnanswered {
        let (holder, b) = (backend(etcd, "").await, backend(etcd, "?timeout=1s").await);
        let (_, held) = take(&holder, name).await;
        let mut waiting = request(name, 0);
        for attempt in [0, 1] {
            waiting.attempt = attempt;
            assert!(matches!(
                b.try_acquire(&waiting).await.expect("attempt"),
                Attempt::Busy { .. }
            ));
        }
        let dir = b.inner.dir(&waiting.name);
        let key = unanswered_put(&b, name);
        etcd.pause();
        let left = b.leave_queue(&waiting).await;
        etcd.resume();
        assert!(left.is_err(), "a delete against a paused etcd was answered");
        LeftUnanswered {
            _holder: holder,
            held,
            b,
            waiting,
            dir,
            key,
        }
    }

    /// After an unanswered leave ([`left_unanswered`]), once a retry is answered the
    /// key is gone, but the slot stays closed to this backend's acquisitions of the
    /// name while the unanswered delete may still land on their key; a late put of
    /// the key meanwhile is swept all the same, and the name opens again after the
    /// window.
    #[tokio::test]
    async fn an_unanswered_leave_keeps_the_name_closed() {
        let Some(etcd) = dlock_testkit::EtcdServer::start() else {
            return;
        };
        let left = left_unanswered(&etcd, "late-leave").await;
        let (b, dir, key) = (&left.b, &left.dir, &left.key);
        let back = std::time::Instant::now();
        assert!(
            !still_there_after(b, key, Duration::from_millis(2500)).await,
            "the waiter's key stood 2.5 s after etcd came back"
        );
        let closed = || {
            b.inner
                .slots()
                .get(dir)
                .is_some_and(|s| s.acquisition == left.waiting.acquisition && s.held)
        };
        assert!(
            closed(),
            "the name was open again while an unanswered delete could still land"
        );
        assert_swept(b, key, "an unanswered leave, while the name was closed").await;
        assert!(closed(), "the sweep opened the name before its time");
        left.held.release().await.expect("release");
        // The window runs LATE_PUT from the answered retry, which came after `back`.
        let deadline = back + late_put::LATE_PUT + Duration::from_secs(10);
        while closed() {
            assert!(
                std::time::Instant::now() < deadline,
                "the name stayed closed 10 s past its window"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            back.elapsed() >= late_put::LATE_PUT - Duration::from_secs(2),
            "the name opened {:?} after etcd came back, inside the window",
            back.elapsed()
        );
        let (_, taken) = take(b, "late-leave").await;
        taken.release().await.expect("release the reopened name");
    }

    /// The name closed after an unanswered leave ([`left_unanswered`]) opens at once
    /// when the session is lost (its key went with it; the next session's key has
    /// another name), and the local acquisition waiting for it gets it.
    #[tokio::test]
    async fn a_lost_session_opens_the_closed_name() {
        let Some(etcd) = dlock_testkit::EtcdServer::start() else {
            return;
        };
        let left = left_unanswered(&etcd, "late-lost").await;
        let (b, dir) = (&left.b, &left.dir);
        // A retry answered (the key gone) starts the closed window this test ends.
        assert!(
            !still_there_after(b, &left.key, Duration::from_millis(2500)).await,
            "the waiter's key stood 2.5 s after etcd came back"
        );
        let slot = || {
            b.inner
                .slots()
                .get(dir)
                .map(|s| (s.acquisition, Arc::clone(&s.session)))
        };
        assert!(
            slot().is_some_and(|(a, _)| a == left.waiting.acquisition),
            "the name was not closed by the leave"
        );
        let next = request("late-lost", 0);
        let wake = Arc::new(Notify::new());
        assert!(
            b.inner.wait_for_slot(dir, next.acquisition, &wake),
            "the closed name was free"
        );
        let (_, session) = slot().expect("still closed");
        session.lost.cancel();
        tokio::time::timeout(Duration::from_secs(3), wake.notified())
            .await
            .expect("the waiter was not woken within 3 s of the session's loss");
        assert!(
            slot().is_some_and(|(a, _)| a == next.acquisition),
            "the name did not go to the waiting acquisition"
        );
        left.held.release().await.expect("release");
    }

    /// A cleanup that carries another session (a lost one's, answered late) leaves
    /// the slot of the same acquisition under its current session alone: freed, the
    /// next local acquisition would put the same key name, find it there and take it
    /// as its own beside the holder (review helper-61).
    #[tokio::test]
    async fn a_lost_sessions_cleanup_leaves_the_next_sessions_slot() {
        let Some(etcd) = dlock_testkit::EtcdServer::start() else {
            return;
        };
        let b = backend(&etcd, "").await;
        let (req, held) = take(&b, "reclaimed").await;
        let dir = b.inner.dir(&req.name);
        let session = b.inner.session().await.expect("session").id;
        b.inner
            .free_slot(&dir, req.acquisition, session.wrapping_add(1));
        b.inner
            .free_slot_after_delete(&dir, req.acquisition, session.wrapping_sub(1));
        assert!(
            b.inner
                .slots()
                .get(&dir)
                .is_some_and(|s| s.acquisition == req.acquisition && s.held),
            "another session's cleanup freed the holder's slot"
        );
        held.release().await.expect("release");
        assert!(
            !b.inner.slots().contains_key(&dir),
            "the release kept the slot"
        );
    }

    /// A semaphore attempt whose put went unanswered leaves; the put lands after
    /// that: its key goes within about a second.
    #[tokio::test]
    async fn a_late_shared_put_is_swept() {
        let Some(etcd) = dlock_testkit::EtcdServer::start() else {
            return;
        };
        let b = backend(&etcd, "").await;
        let req = AcquireRequest {
            primitive: Primitive::Permit { permits: 2 },
            ..request("late-permit", 1)
        };
        let session = b.inner.session().await.expect("session");
        let dir = shared::dir(&b.inner, &req.name, req.primitive);
        let key = format!("{dir}{:x}-{:x}-1", session.id, req.acquisition.get());
        shared::keep_unanswered(&b.inner, &req, key.clone(), session);
        b.leave_queue(&req).await.expect("leave");
        assert_swept(&b, &key, "its attempt left").await;
    }
}
