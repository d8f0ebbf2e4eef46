//! `zk://h1:2181[,h2:2181…][/root]`: locks on ZooKeeper (feature `zookeeper`), in the
//! layout of Curator's `InterProcessMutex`.
//!
//! # How a lock works here
//! The lock `NAME` is the node `<root>/<encoded NAME>` (root: the URL path, default
//! `/dlock`): `zk://h:2181/locks` + `orders` is `/locks/orders`, the same lock as
//! Curator's `new InterProcessMutex(client, "/locks/orders")`. A contender creates an
//! ephemeral sequential child `_c_<uuid>-lock-<sequence>` (Curator's protected name);
//! the holder is the child with the lowest sequence (the text after the last `lock-`,
//! as Curator sorts; kazoo's `__lock__` children are ordered the same way), and each
//! waiter watches **only its predecessor**. The fencing token is the `czxid` of the
//! holder's own node: zxids are global, persistent and increase with every write.
//!
//! - A free lock costs a create, a read of the children and a delete; the read is
//!   sent right behind the create, without waiting for its reply (the server answers
//!   a session's requests in order, so the listing includes the new node). A `try_lock`
//!   (or no-wait) attempt reads the children first, so on a held lock it writes nothing.
//! - A waiter queued right behind a node this process holds the lock with is granted
//!   as soon as that node's deletion is seen, without listing the children again: no
//!   node can sit below a holder, so the waiter is then the lowest. A predecessor that
//!   was only waiting (it may have given up with a holder still below it) is followed
//!   by a fresh listing, as before.
//! - Protected creation: when the connection drops during a create, the contender looks
//!   for its node by its uuid instead of leaving an orphan, after a `sync` (a follower
//!   may not have applied the create yet). Every other node with the uuid (a twin: a
//!   send the look missed, beside the one sent again) is deleted in the background;
//!   when the look finds two, the lowest is kept.
//! - Lock nodes (and the root) are created as containers, which ZooKeeper deletes once
//!   their last child is gone: no empty lock nodes pile up.
//!
//! # Elections
//! [`Locker::election`](crate::Locker::election) keeps Curator's `LeaderLatch` layout:
//! a candidate's node is `_c_<uuid>-latch-<sequence>` under the name's node, holding
//! its value alone (the latch's participant id), and the lowest node leads. A
//! `new LeaderLatch(client, "<root>/NAME", id)` and dlock's candidates are one queue:
//! each waits for the other's leader, and each sees the other's value (tested against
//! the real Curator jars).
//!
//! # Semaphores and read-write locks
//! Both in Curator's layouts, tested against the real Curator 5 jars
//! (`tests/zookeeper_curator.rs`), and both session-bound like the lock: a holder that
//! dies frees its permit or hold when its session expires.
//!
//! - **Semaphore** `NAME` of N permits = Curator's `new InterProcessSemaphoreV2(client,
//!   "<root>/%semaphore/NAME", N)` (no lock name encodes to `%semaphore`). An acquirer
//!   takes the mutex `…/locks` (an `InterProcessMutex`: FIFO, each waiter watching its
//!   predecessor), creates its lease `…/leases/_c_<uuid>-lease-<sequence>`, and holds it
//!   if there are at most N leases (its own counted, as Curator counts); else it keeps
//!   the mutex and waits for a lease to be returned (a watch on the leases' children),
//!   so the next permit goes to the earliest waiter. The token is the lease's `czxid`:
//!   leases are created one at a time under the mutex, so tokens increase with every
//!   grant. The permit count is the caller's, not stored (as in Curator):
//!   acquirers must agree on it.
//! - **Read-write lock** `NAME` = Curator's `new InterProcessReadWriteLock(client,
//!   "<root>/%rwlock/NAME")`: one ephemeral sequential child per read
//!   (`_c_<uuid>-__READ__<sequence>`) or write (`…-__WRIT__…`). kazoo's `__rlock__` and
//!   `__lock__` children count as reads and writes too; kazoo sees dlock's (and
//!   Curator's) only when given `extra_lock_patterns=["__WRIT__"]` (a `ReadLock`) or
//!   `["__WRIT__", "__READ__"]` (a `WriteLock`). **Order decides:** a read waits
//!   for every earlier write, a write for every earlier node, so a waiting writer is
//!   never starved and readers behind it wait for it. Owners refine the rule, never
//!   loosen it across owners: a node waits only for other owners' nodes, and a read
//!   passes its owner's earlier write only once that write is let in (a writer may read;
//!   its read's token is then the higher). An owner that holds a read and no write is
//!   refused a write ([`Error::UpgradeRefused`]). Unlike Curator, which lets a thread
//!   holding the write read past another client's waiting writer (that writer is then
//!   let in beside the read once the write is released), a read here waits for that
//!   writer; a task that reads again while a writer waits therefore waits for that
//!   writer too, even if its owner already reads or writes (and forever, if it holds
//!   what that writer waits for). The token is the node's `czxid`: a write's is above
//!   every token granted before it to another owner (a read passing its owner's write
//!   may hold a token above a later read of another owner). For the same reason a
//!   write is never downgraded past a waiting writer of another owner: the
//!   downgrade is refused and the write kept ([`crate::RwLock::downgrade`]).
//! - `fair` is accepted for both and changes nothing: they serve contenders in the
//!   order of their sequential nodes ([`crate::Primitives::fifo`]).
//!
//! # Breaking a lock
//! [`Locker::break_lock`](crate::Locker::break_lock) deletes the holder's node if its
//! `czxid` is the token shown; later nodes have higher zxids. A holder checks its node
//! at each renewal (one `exists`), so its `lost()` fires then. A holder whose node
//! keeps no dlock record (Curator, kazoo, an election's candidate) is refused: it
//! would never notice.
//!
//! # Sessions
//! One ZooKeeper session per backend (`session_timeout`, default 10 s). A holder that
//! dies frees its locks when the server expires its session. While the process lives:
//! a disconnection makes every lock *suspect* (logged); if the session is not back
//! before `session_timeout` minus the drift margin — before the server can expire it —
//! or the server reports it expired, `lost()` fires and the next acquisition opens a new
//! session. A lock's own TTL is kept by the live holder. A lost lock's node outlives
//! the loss by about one session timeout, even when the server kept hearing from the
//! client (its replies lost, or the connection back after the loss; the tests
//! `a_lock_lost_…_within_a_session_timeout` in `tests/zookeeper_features.rs` allow two,
//! with slack).
//!
//! Any client may create children under a lock's node: names that are not contenders
//! are ignored. A node whose session this process gave up on is still deleted on
//! release if the server kept the session; a release of a node that is gone reports the
//! loss.
//!
//! # Options
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `session_timeout` | `10s` | asked of the server, which clamps it to 2–20 ticks: how long a dead holder's locks outlive it |
//! | `timeout` | `5s` | connecting |
//!
//! `user:password@` authenticates with the `digest` scheme, and nodes are then created
//! with the creator-only ACL (a client without the credentials can neither list nor
//! delete them; tested). Names with `/`, `..` or unicode never leave the root.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::backend::{
    AcquireRequest, Attempt, Backend, Capabilities, HeldLock, LockInfo, Primitive, SessionTrust,
    Waiter,
};
use crate::error::{Error, LossReason, Result};
use crate::lease::trusted_until;
use crate::name::LockName;
use crate::queue::StoredHolder;
use crate::url::ConnectUrl;

mod shared;

const SCHEME: &str = "zk";

/// How long a queued waiter waits for its predecessor's deletion before it looks again.
const RECHECK: Duration = Duration::from_secs(10);

/// Errors after which a request may or may not have been applied (the connection
/// dropped: the client reports `ConnectionLoss`, or the I/O error itself).
fn uncertain(e: &zk::Error) -> bool {
    matches!(
        e,
        zk::Error::ConnectionLoss
            | zk::Error::Timeout
            | zk::Error::UnexpectedError(_)
            | zk::Error::Custom(_)
    )
}

/// Delete a contender's node; `Ok(false)` when it was already gone. The node lives as
/// long as the session, and the session outlives a reconnect: when the server cannot
/// be reached, the delete is finished in the background once it answers again (or the
/// session ends and takes the node).
async fn delete_node(session: &Arc<Session>, node: &str) -> Result<bool> {
    match session.client.delete(node, None).await {
        Ok(()) => Ok(true),
        Err(zk::Error::NoNode) => Ok(false),
        Err(e) => {
            let (session, node) = (Arc::clone(session), node.to_owned());
            crate::finish::release_later(
                session.lost.clone(),
                crate::finish::SESSION_RELEASE_RETRIES,
                move || {
                    let (session, node) = (Arc::clone(&session), node.clone());
                    async move {
                        matches!(
                            session.client.delete(&node, None).await,
                            Ok(()) | Err(zk::Error::NoNode)
                        )
                    }
                },
            );
            Err(map_err(&e))
        }
    }
}

/// Delete the children of `dir` whose names start with `mine` (a contender's
/// `_c_<uuid>-<base>`: `lock-`, `latch-`, `__READ__`, …), but `keep`; true once the
/// server has answered for all of them. The listing follows a `sync`
/// ([`synced_children`]), so it shows every create the ensemble has applied, even
/// when the server this session talks to is a follower that lags behind.
async fn delete_by_prefix(client: &zk::Client, dir: &str, mine: &str, keep: Option<&str>) -> bool {
    let children = match synced_children(client, dir).await {
        Some(Ok(c)) => c,
        Some(Err(zk::Error::NoNode)) => return true,
        _ => return false,
    };
    let mut done = true;
    for child in children
        .iter()
        .filter(|c| c.starts_with(mine) && Some(c.as_str()) != keep)
    {
        let node = format!("{dir}/{child}");
        if !matches!(
            client.delete(&node, None).await,
            Ok(()) | Err(zk::Error::NoNode)
        ) {
            done = false;
        }
    }
    done
}

/// The children of `dir`, listed after the server caught up with the leader
/// (ZooKeeper's `sync`), so a lagging follower shows every create the ensemble
/// applied: `None` when the sync could not reach the server (try again later). The
/// server does not look the path up; should it refuse the sync for another reason, the
/// listing goes ahead without it, as it did before this look-up synced.
async fn synced_children(
    client: &zk::Client,
    dir: &str,
) -> Option<std::result::Result<Vec<String>, zk::Error>> {
    match client.sync(dir).await {
        Ok(()) => {}
        Err(e) if uncertain(&e) || matches!(e, zk::Error::SessionExpired) => return None,
        Err(e) => {
            tracing::debug!(%dir, error = %e, "zookeeper: sync refused; listing without it");
        }
    }
    Some(client.list_children(dir).await)
}

fn map_err(e: &zk::Error) -> Error {
    if uncertain(e)
        || matches!(
            e,
            zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::NoHosts
        )
    {
        Error::connection(SCHEME, e)
    } else {
        Error::backend(SCHEME, e)
    }
}

/// One ZooKeeper session and what is known of its health.
struct Session {
    client: zk::Client,
    lost: CancellationToken,
    suspect: Arc<AtomicBool>,
    /// Until when the server keeps the session at least (see [`watch_session`]); the
    /// session's holds read it too.
    trust: SessionTrust,
}

impl Session {
    fn check(&self) -> Result<()> {
        if self.lost.is_cancelled() || self.trust.passed() {
            // For good: a probe answered after this must not revive a session its
            // holds were told is lost (its watcher stops on `lost`).
            self.trust.end();
            self.lost.cancel();
            return Err(Error::connection(
                SCHEME,
                "the ZooKeeper session expired (or could not be resumed in time)",
            ));
        }
        Ok(())
    }
}

/// Follow the session: suspect while disconnected; lost once the server reports it
/// expired, or when no probe has been answered for so long that the server may have
/// expired it. The server expires a session `timeout` after the last request it
/// received; a probe's send time is a lower bound for that, so the session is trusted
/// until `last answered probe's send time + timeout − margin`.
async fn watch_session(
    client: zk::Client,
    lost: CancellationToken,
    suspect: Arc<AtomicBool>,
    trust: SessionTrust,
    timeout: Duration,
) {
    let mut states = client.state_watcher();
    let every = timeout / 4;
    loop {
        let sent = Instant::now();
        let probe = tokio::time::timeout(
            trust.until().saturating_duration_since(sent),
            client.check_stat("/"),
        );
        tokio::select! {
            // Declared lost elsewhere (`Session::check` saw the trust pass): stop here,
            // so no answer extends its trust again.
            () = lost.cancelled() => {
                trust.end();
                return;
            }
            state = states.changed() => match state {
                zk::SessionState::Disconnected => {
                    tracing::warn!("ZooKeeper session disconnected: its locks are suspect");
                    suspect.store(true, Ordering::SeqCst);
                }
                zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                    suspect.store(false, Ordering::SeqCst);
                }
                state => {
                    tracing::warn!(%state, "ZooKeeper session ended: its locks are lost");
                    trust.end();
                    lost.cancel();
                    return;
                }
            },
            answer = probe => {
                // Never past the trust: the holds read it themselves, but the loss is
                // declared (and the session ended for them) right then.
                let pause = if matches!(answer, Ok(Ok(_))) {
                    trust.extend_to(trusted_until(sent, timeout));
                    suspect.store(false, Ordering::SeqCst);
                    every
                } else {
                    suspect.store(true, Ordering::SeqCst);
                    every.min(Duration::from_millis(100))
                };
                tokio::time::sleep_until((Instant::now() + pause).min(trust.until()).into()).await;
            }
        }
        if trust.passed() {
            tracing::warn!("ZooKeeper session unanswered past its timeout: its locks are lost");
            trust.end();
            lost.cancel();
            return;
        }
    }
}

/// A contender's node, just created.
struct Created {
    node: String,
    token: u64,
    /// The parent's children listed right after the create (`None` if that listing
    /// failed or the node was found after a lost reply).
    children: Option<Vec<String>>,
}

struct Queued {
    node: String,
    token: u64,
    session: Arc<Session>,
    predecessor: Option<String>,
    /// The predecessor is a node this process holds the lock with: once it is deleted
    /// this node is the lowest (nodes below a holder cannot appear), no listing needed.
    behind_holder: bool,
    /// The predecessor's deletion was seen (its watch fired `NodeDeleted`, or it was
    /// already gone when the watch was set).
    predecessor_gone: bool,
    /// A semaphore attempt that holds the semaphore's mutex (`node`): its lease node
    /// and token, once created.
    lease: Option<(String, u64)>,
    /// A semaphore attempt waiting for a lease to be returned: the leases' parent and
    /// how many children it had when last listed.
    pool: Option<(String, usize)>,
}

impl Queued {
    fn new(created: Created, session: Arc<Session>) -> Self {
        Queued {
            node: created.node,
            token: created.token,
            session,
            predecessor: None,
            behind_holder: false,
            predecessor_gone: false,
            lease: None,
            pool: None,
        }
    }
}

struct Inner {
    cluster: String,
    session_timeout: Duration,
    /// The session timeout the server granted last (ms), 0 before the first session.
    negotiated_ms: AtomicU64,
    timeout: Duration,
    auth: Option<String>,
    root: String,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    /// This backend's queued contenders, by lock and acquisition (never by owner: two
    /// waiting tasks of one owner each have a node of their own).
    queued: Mutex<BTreeMap<(String, u64), Queued>>,
    /// The owner stored in read-write lock nodes already read (node names are never
    /// reused, so an entry never goes stale); cleared when it grows large.
    owners: Mutex<std::collections::HashMap<String, Option<Arc<str>>>>,
    shown: String,
}

/// The ZooKeeper backend.
pub struct ZkBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ZkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkBackend")
            .field("url", &self.inner.shown)
            .field("root", &self.inner.root)
            .finish_non_exhaustive()
    }
}

/// The sequence number of a lock child: the text after the last `lock-` (Curator),
/// else after the last `__lock__` (kazoo), else its last ten characters. Any other
/// client may create children here: a name that is none of these is not a contender
/// (and never a panic, whatever its characters).
fn sequence(child: &str) -> Option<u64> {
    let tail = if let Some(i) = child.rfind("lock-") {
        child.get(i + 5..)?
    } else if let Some(i) = child.rfind("__lock__") {
        child.get(i + 8..)?
    } else {
        child.get(child.len().saturating_sub(10)..)?
    };
    if tail.is_empty() || !tail.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    tail.parse().ok()
}

/// Children that are lock contenders, lowest sequence first.
fn contenders(mut children: Vec<String>) -> Vec<String> {
    children.retain(|c| sequence(c).is_some());
    children.sort_by_key(|c| sequence(c).unwrap_or(u64::MAX));
    children
}

/// A fresh uuid in the usual 8-4-4-4-12 form (version 4 bits set).
fn uuid() -> String {
    // Unique across processes too (a forked child included): a node name made with
    // another's uuid would be taken for that process's own after a reconnection.
    let r = u128::from_be_bytes(crate::random::bytes::<16>());
    let hex = crate::hex::u128_32(r);
    format!(
        "{}-{}-4{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[13..16],
        &hex[16..20],
        &hex[20..32]
    )
}

impl ZkBackend {
    pub(crate) async fn open(mut url: ConnectUrl) -> Result<Arc<Self>> {
        let session_timeout =
            url.take_duration("session_timeout", crate::queue::DEFAULT_SESSION_TIMEOUT)?;
        let timeout = url.take_duration("timeout", Duration::from_secs(5))?;
        url.finish(&["session_timeout", "timeout"])?;
        let mut root = url.path().trim_end_matches('/').to_owned();
        if root.is_empty() {
            root = "/dlock".into();
        }
        if root
            .split('/')
            .skip(1)
            .any(|seg| seg.is_empty() || seg == "." || seg == "..")
        {
            return Err(url.invalid("the path must be a ZooKeeper path such as /locks"));
        }
        let hosts: Vec<String> = if url.hosts().is_empty() {
            // No silent default address (a forgotten host is a usage error).
            return Err(url.invalid("name the server: zk://HOST[:PORT][,HOST[:PORT]...]/PATH"));
        } else {
            url.hosts()
                .iter()
                .map(|h| format!("{}:{}", h.host, h.port.unwrap_or(2181)))
                .collect()
        };
        let auth = url.username().map(|u| {
            format!(
                "{u}:{}",
                url.password()
                    .map(|p| p.expose().to_owned())
                    .unwrap_or_default()
            )
        });
        let backend = ZkBackend {
            inner: Arc::new(Inner {
                cluster: hosts.join(","),
                session_timeout,
                negotiated_ms: AtomicU64::new(0),
                timeout,
                auth,
                root,
                session: tokio::sync::Mutex::new(None),
                queued: Mutex::new(BTreeMap::new()),
                owners: Mutex::new(std::collections::HashMap::new()),
                shown: url.to_string(),
            }),
        };
        // Fail now, not on the first lock, when nothing answers.
        backend.inner.session().await?;
        Ok(Arc::new(backend))
    }
}

impl Inner {
    fn dir(&self, name: &LockName) -> String {
        format!("{}/{}", self.root, name.encoded())
    }

    /// The node an attempt's queue entry is kept under: the lock's node, a read-write
    /// lock's node, or a semaphore's mutex.
    fn slot_dir(&self, req: &AcquireRequest) -> String {
        match req.primitive {
            Primitive::Lock => self.dir(&req.name),
            Primitive::Permit { .. } => shared::semaphore_paths(self, &req.name).locks,
            _ => shared::rwlock_dir(self, &req.name),
        }
    }

    fn queued(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, u64), Queued>> {
        self.queued
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The holder's node `node` is about to be deleted: a waiter of this process queued
    /// right behind it will be the lowest once the deletion is seen.
    /// Visits only this lock's waiters: the map is ordered by lock, then acquisition.
    fn holder_leaving(&self, dir: &str, node: &str) {
        let mut queued = self.queued();
        let this_lock = queued
            .range_mut((dir.to_owned(), 0)..)
            .take_while(|((d, _), _)| d == dir);
        for (_, q) in this_lock {
            if q.predecessor.as_deref() == Some(node) {
                q.behind_holder = true;
            }
        }
    }

    fn acls(&self) -> zk::Acls<'static> {
        if self.auth.is_some() {
            zk::Acls::creator_all()
        } else {
            zk::Acls::anyone_all()
        }
    }

    /// Before the first session: when every server refuses a TCP connection, say so
    /// at once (the client would retry until its timeout). A server that accepts, or
    /// does not answer, is left to the client.
    async fn refuse_early(&self) -> Result<()> {
        let hosts: Vec<&str> = self
            .cluster
            .split('/')
            .next()
            .unwrap_or_default()
            .split(',')
            .collect();
        for host in &hosts {
            let tried = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(*host),
            )
            .await;
            match tried {
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                _ => return Ok(()),
            }
        }
        Err(Error::connection(
            SCHEME,
            format!("cannot connect to {}: connection refused", hosts.join(",")),
        ))
    }

    async fn session(&self) -> Result<Arc<Session>> {
        let mut current = self.session.lock().await;
        if let Some(s) = current.as_ref()
            && s.check().is_ok()
        {
            return Ok(Arc::clone(s));
        }
        let mut connector = zk::Client::connector()
            .with_session_timeout(self.session_timeout)
            .with_connection_timeout(self.timeout);
        if let Some(auth) = &self.auth {
            connector = connector.with_auth("digest", auth.as_bytes());
        }
        if self.negotiated_ms.load(Ordering::Relaxed) == 0 {
            self.refuse_early().await?;
        }
        let connecting = Instant::now();
        let client = tokio::time::timeout(self.timeout, connector.connect(&self.cluster))
            .await
            .map_err(|_| {
                Error::connection(SCHEME, format!("connecting to {} timed out", self.shown))
            })?
            .map_err(|e| map_err(&e))?;
        self.negotiated_ms.store(
            u64::try_from(client.session_timeout().as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let lost = CancellationToken::new();
        let suspect = Arc::new(AtomicBool::new(false));
        let trust = SessionTrust::new(trusted_until(connecting, client.session_timeout()));
        tokio::spawn(watch_session(
            client.clone(),
            lost.clone(),
            Arc::clone(&suspect),
            trust.clone(),
            client.session_timeout(),
        ));
        let s = Arc::new(Session {
            client,
            lost,
            suspect,
            trust,
        });
        *current = Some(Arc::clone(&s));
        Ok(s)
    }

    /// The lock's children, or none when the lock node does not exist.
    async fn children(session: &Session, dir: &str) -> Result<Vec<String>> {
        match session.client.list_children(dir).await {
            Ok(c) => Ok(contenders(c)),
            Err(zk::Error::NoNode) => Ok(Vec::new()),
            Err(e) => Err(map_err(&e)),
        }
    }

    /// Create this contender's node (the lock node and root as containers if needed),
    /// finding it by its uuid if the connection dropped mid-create. After any create
    /// whose outcome was unknown, a background task (retried until the server answers)
    /// deletes every node with the uuid but the one returned — all of them when the
    /// create failed. Such a node lives as long as this (live) session, and would
    /// queue every other contender behind it for as long as the process lives: one
    /// nobody knows of when the search could not finish, or a twin when a send the
    /// search missed (a lagging follower) did land beside the one sent again. The
    /// task runs after a found create too: when a resent create was also cut off, the
    /// search finds both sends' nodes and keeps the lowest.
    async fn create(
        &self,
        session: &Arc<Session>,
        dir: &str,
        base: &str,
        data: &[u8],
    ) -> Result<Created> {
        let mine = format!("_c_{}-{base}", uuid());
        let mut maybe_created = false;
        let created = self
            .create_protected(session, dir, &mine, data, &mut maybe_created)
            .await;
        if maybe_created {
            let (session, dir) = (Arc::clone(session), dir.to_owned());
            let keep = created
                .as_ref()
                .ok()
                .and_then(|c| c.node.rsplit('/').next())
                .map(str::to_owned);
            crate::finish::release_later(
                session.lost.clone(),
                crate::finish::SESSION_RELEASE_RETRIES,
                move || {
                    let (session, dir) = (Arc::clone(&session), dir.clone());
                    let (mine, keep) = (mine.clone(), keep.clone());
                    async move { delete_by_prefix(&session.client, &dir, &mine, keep.as_deref()).await }
                },
            );
        }
        created
    }

    async fn create_protected(
        &self,
        session: &Session,
        dir: &str,
        mine: &str,
        data: &[u8],
        maybe_created: &mut bool,
    ) -> Result<Created> {
        let prefix = format!("{dir}/{mine}");
        let acls = self.acls();
        let options = zk::CreateMode::EphemeralSequential.with_acls(acls);
        for round in 0..4 {
            // The client sends a request when its future is made, and the server
            // answers a session's requests in order: the listing asked for right behind
            // the create sees our node, and costs no round trip of its own.
            let create = session.client.create(&prefix, data, &options);
            let listing = session.client.list_children(dir);
            let sent = create.await;
            if sent.as_ref().is_err_and(uncertain) {
                *maybe_created = true;
            }
            match sent {
                Ok((stat, seq)) => {
                    return Ok(Created {
                        node: format!("{prefix}{seq}"),
                        token: stat.czxid.unsigned_abs(),
                        children: listing.await.ok(),
                    });
                }
                Err(zk::Error::NoNode) if round < 3 => {
                    let parents = zk::CreateMode::Container.with_acls(acls);
                    match session.client.mkdir(dir, &parents).await {
                        Ok(()) | Err(zk::Error::NodeExists) => {}
                        Err(e) => return Err(map_err(&e)),
                    }
                }
                Err(e) if uncertain(&e) && round < 3 => {
                    // Protected creation: did the create happen before the drop? Look
                    // for our uuid; create again only once the list says it did not.
                    let mut listed = None;
                    // After a `sync`: the server may be a follower that has not yet
                    // applied a create the ensemble did apply, and a create sent again
                    // on its empty answer would leave a twin (see `create`).
                    for wait in [0u64, 50, 100, 200, 400, 800, 1000, 1000, 1000] {
                        tokio::time::sleep(Duration::from_millis(wait)).await;
                        if let Some(Ok(children)) = synced_children(&session.client, dir).await {
                            listed = Some(children);
                            break;
                        }
                    }
                    let Some(children) = listed else {
                        return Err(map_err(&e));
                    };
                    // Two with the uuid (a twin of an earlier round, see `create`): the
                    // first send's, which queued first; `create` deletes the other.
                    let found = children
                        .iter()
                        .filter(|c| c.starts_with(mine))
                        .min_by_key(|c| sequence(c));
                    if let Some(found) = found {
                        let node = format!("{dir}/{found}");
                        let stat = session
                            .client
                            .check_stat(&node)
                            .await
                            .map_err(|e| map_err(&e))?
                            .ok_or_else(|| Error::connection(SCHEME, "node vanished"))?;
                        return Ok(Created {
                            node,
                            token: stat.czxid.unsigned_abs(),
                            children: None,
                        });
                    }
                }
                Err(e) => return Err(map_err(&e)),
            }
        }
        Err(Error::connection(
            SCHEME,
            format!("could not create a node under {dir}"),
        ))
    }

    fn granted(self: &Arc<Self>, dir: &str, q: Queued) -> Attempt {
        self.held(dir, q.node, q.token, q.session, true)
    }

    /// A grant of `node`; `mutex`: a lock's node, whose release may let a waiter of
    /// this process queued right behind it in without listing the children.
    fn held(
        self: &Arc<Self>,
        dir: &str,
        node: String,
        token: u64,
        session: Arc<Session>,
        mutex: bool,
    ) -> Attempt {
        Attempt::Acquired(Box::new(ZkHeld {
            inner: Arc::clone(self),
            dir: dir.to_owned(),
            node,
            token,
            session,
            mutex,
            released: AtomicBool::new(false),
        }))
    }
}

#[async_trait]
impl Backend for ZkBackend {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn capabilities(&self) -> Capabilities {
        // The server may have raised the timeout asked for (2 to 20 ticks).
        let negotiated = Duration::from_millis(self.inner.negotiated_ms.load(Ordering::Relaxed));
        Self::capabilities_of(self.inner.session_timeout.max(negotiated))
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        let inner = &self.inner;
        match req.primitive {
            Primitive::Lock => {}
            Primitive::Read | Primitive::Write => return shared::try_rwlock(inner, req).await,
            Primitive::Permit { permits } => {
                return shared::try_permit(inner, req, permits).await;
            }
        }
        let dir = inner.dir(&req.name);
        let slot = (dir.clone(), req.acquisition.get());
        let existing = inner.queued().remove(&slot);
        let mut listed = None;
        let mut q = match existing {
            Some(q) => {
                if let Err(e) = q.session.check() {
                    // Keep the entry: `leave_queue` still tries to delete the node (the
                    // server may not have expired a session this process gave up on).
                    inner.queued().insert(slot, q);
                    return Err(e);
                }
                if q.behind_holder && q.predecessor_gone {
                    // Our predecessor held the lock in this process and is gone.
                    return Ok(inner.granted(&dir, q));
                }
                q
            }
            None => {
                let session = inner.session().await?;
                if req.attempt == 0
                    && !req.will_wait
                    && !Inner::children(&session, &dir).await?.is_empty()
                {
                    // Held or queued, and the caller will not wait: write nothing.
                    return Ok(Attempt::Busy {
                        retry_after: Some(RECHECK),
                    });
                }
                // A candidate's node is a `LeaderLatch` participant holding its value.
                let (base, data) = match &req.campaign {
                    Some(value) => ("latch-", value.as_bytes().to_vec()),
                    None => ("lock-", StoredHolder::encode(req)),
                };
                let mut created = inner.create(&session, &dir, base, &data).await?;
                listed = created.children.take().map(contenders);
                Queued::new(created, session)
            }
        };
        let mine = q.node.rsplit('/').next().unwrap_or_default();
        // The listing taken with the create, if it came back and shows our node.
        let listed = listed.filter(|c| c.iter().any(|c| c == mine));
        let children = match listed {
            Some(c) => c,
            None => match Inner::children(&q.session, &dir).await {
                Ok(c) => c,
                Err(e) => {
                    // Keep the entry: `leave_queue` deletes the node.
                    inner.queued().insert(slot, q);
                    return Err(e);
                }
            },
        };
        let mine = q.node.rsplit('/').next().unwrap_or_default();
        let Some(pos) = children.iter().position(|c| c == mine) else {
            return Err(Error::connection(
                SCHEME,
                "our lock node is gone (the session expired while waiting)",
            ));
        };
        if pos == 0 {
            return Ok(inner.granted(&dir, q));
        }
        if !req.will_wait {
            // The caller will not wait: do not stay queued (a delete that cannot get
            // through now is finished in the background: the node must not outlive
            // this attempt under a live session).
            if let Err(e) = delete_node(&q.session, &q.node).await {
                tracing::debug!(node = %q.node, error = %e, "deleting a no-wait contender later");
            }
            return Ok(Attempt::Busy {
                retry_after: Some(RECHECK),
            });
        }
        q.predecessor = Some(format!("{dir}/{}", children[pos - 1]));
        q.behind_holder = false;
        q.predecessor_gone = false;
        inner.queued().insert(slot, q);
        Ok(Attempt::Busy {
            retry_after: Some(RECHECK),
        })
    }

    async fn subscribe(&self, req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        Ok(Box::new(ZkWaiter {
            inner: Arc::clone(&self.inner),
            slot: (self.inner.slot_dir(req), req.acquisition.get()),
        }))
    }

    async fn leave_queue(&self, req: &AcquireRequest) -> Result<()> {
        let slot = (self.inner.slot_dir(req), req.acquisition.get());
        let Some(q) = self.inner.queued().remove(&slot) else {
            return Ok(());
        };
        // A semaphore attempt's lease first: whoever takes the mutex next must not
        // count it.
        if let Some((lease, _)) = &q.lease
            && let Err(e) = delete_node(&q.session, lease).await
        {
            tracing::debug!(node = %lease, error = %e, "deleting a lease later");
        }
        delete_node(&q.session, &q.node).await.map(drop)
    }

    async fn holders(&self, name: &LockName, primitive: Primitive) -> Result<Vec<LockInfo>> {
        shared::holders(&self.inner, name, primitive).await
    }

    async fn break_lock(&self, name: &LockName, fence: u64) -> Result<bool> {
        // The holder's node, deleted only if its czxid is the token shown. The next
        // node created gets a higher zxid, and the holder's next renewal finds its node
        // gone.
        let session = self.inner.session().await?;
        let dir = self.inner.dir(name);
        let Some(first) = Inner::children(&session, &dir).await?.into_iter().next() else {
            return Ok(false);
        };
        let node = format!("{dir}/{first}");
        let (data, stat) = match session.client.get_data(&node).await {
            Ok(d) => d,
            Err(zk::Error::NoNode) => return Ok(false),
            Err(e) => return Err(map_err(&e)),
        };
        if stat.czxid.unsigned_abs() != fence {
            return Ok(false);
        }
        if StoredHolder::decode(&data).is_none() {
            return Err(crate::queue::break_unnoticed());
        }
        match session.client.delete(&node, None).await {
            Ok(()) => Ok(true),
            Err(zk::Error::NoNode) => Ok(false),
            Err(e) => Err(map_err(&e)),
        }
    }

    async fn names(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        // Every lock is a node `<root>/<encoded name>` (kept after release).
        let session = self.inner.session().await?;
        let children = match session.client.list_children(&self.inner.root).await {
            Ok(c) => c,
            Err(zk::Error::NoNode) => Vec::new(),
            Err(e) => return Err(map_err(&e)),
        };
        let mut names: Vec<String> = children
            .iter()
            .filter_map(|c| crate::name::decode(c))
            .filter(|n| n.starts_with(prefix))
            .collect();
        names.sort_unstable();
        names.truncate(limit);
        Ok(names)
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let session = self.inner.session().await?;
        let dir = self.inner.dir(name);
        let children = Inner::children(&session, &dir).await?;
        for (i, child) in children.iter().enumerate() {
            let node = format!("{dir}/{child}");
            let (data, stat) = match session.client.get_data(&node).await {
                Ok(d) => d,
                Err(zk::Error::NoNode) => continue,
                Err(e) => return Err(map_err(&e)),
            };
            let stored = StoredHolder::decode(&data);
            let owner = stored
                .as_ref()
                .map_or_else(|| child.clone(), |s| s.owner.clone());
            let mut info = LockInfo::new(name, owner, 1, stat.czxid.unsigned_abs());
            match stored {
                Some(s) => info.metadata = s.metadata,
                // A `LeaderLatch` participant's id, or another client's data: the note.
                None if !data.is_empty() => {
                    info.metadata.note = Some(String::from_utf8_lossy(&data).into_owned());
                }
                None => {}
            }
            info.waiters = Some(children.len() - i - 1);
            return Ok(Some(info));
        }
        Ok(None)
    }
}

impl ZkBackend {
    /// The capabilities with the default session timeout, as long as the server grants
    /// it (tokens are zxids: always durable).
    pub(crate) fn capabilities_with(_durable: bool) -> Capabilities {
        Self::capabilities_of(crate::queue::DEFAULT_SESSION_TIMEOUT)
    }

    fn capabilities_of(session_timeout: Duration) -> Capabilities {
        let mut caps = crate::queue::capabilities(session_timeout);
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

/// Waits for the predecessor's deletion.
struct ZkWaiter {
    inner: Arc<Inner>,
    slot: (String, u64),
}

impl std::fmt::Debug for ZkWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkWaiter")
            .field("lock", &self.slot.0)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Waiter for ZkWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        let ours = self.inner.queued().get(&self.slot).map(|q| {
            (
                q.predecessor.clone(),
                q.pool.clone(),
                Arc::clone(&q.session),
            )
        });
        if let Some((_, Some((pool, seen)), session)) = &ours {
            // A semaphore attempt holding the mutex: wait for a lease to come back.
            let changed = async {
                match session.client.list_and_watch_children(pool).await {
                    Ok((children, watcher)) if children.len() == *seen => {
                        watcher.changed().await;
                    }
                    _ => {}
                }
            };
            return tokio::select! {
                () = session.lost.cancelled() => Err(Error::connection(
                    SCHEME,
                    "the ZooKeeper session expired while waiting",
                )),
                () = tokio::time::sleep(max) => Ok(()),
                () = changed => Ok(()),
            };
        }
        let Some((Some(predecessor), _, session)) = ours else {
            // Not queued (yet): a first attempt found the lock busy; look again soon.
            tokio::time::sleep(max.min(Duration::from_millis(20))).await;
            return Ok(());
        };
        let watched = async {
            let gone = match session.client.check_and_watch_stat(&predecessor).await {
                Ok((None, _)) => true,
                Err(_) => false,
                Ok((Some(_), watcher)) => {
                    watcher.changed().await.event_type == zk::EventType::NodeDeleted
                }
            };
            if gone
                && let Some(q) = self.inner.queued().get_mut(&self.slot)
                && q.predecessor.as_deref() == Some(predecessor.as_str())
            {
                q.predecessor_gone = true;
            }
        };
        tokio::select! {
            () = session.lost.cancelled() => Err(Error::connection(
                SCHEME,
                "the ZooKeeper session expired while waiting",
            )),
            () = tokio::time::sleep(max) => Ok(()),
            () = watched => Ok(()),
        }
    }
}

struct ZkHeld {
    inner: Arc<Inner>,
    dir: String,
    node: String,
    token: u64,
    session: Arc<Session>,
    /// A lock's node (not a permit's or a read-write lock's).
    mutex: bool,
    released: AtomicBool,
}

impl std::fmt::Debug for ZkHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkHeld")
            .field("node", &self.node)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl HeldLock for ZkHeld {
    fn fencing_token(&self) -> u64 {
        self.token
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        // The session is the lease; this reports whether it still holds, and whether
        // the node is still there (an operator's `break_lock` deletes it).
        let not_owner = || Error::NotOwner {
            name: self.dir.clone(),
        };
        if self.session.check().is_err() {
            return Err(not_owner());
        }
        if self.session.suspect.load(Ordering::SeqCst) {
            tracing::warn!(node = %self.node, "ZooKeeper disconnected: lock suspect");
            return Ok(());
        }
        // Bounded well inside the renewal's budget: a slow answer is no loss.
        let check = self.session.client.check_stat(&self.node);
        match tokio::time::timeout(ttl / 4, check).await {
            Ok(Ok(None)) => Err(not_owner()),
            Ok(Ok(Some(_))) => Ok(()),
            // Unanswered: the session's watcher decides whether the hold is lost.
            Ok(Err(e)) => {
                tracing::debug!(node = %self.node, error = %e, "ZooKeeper renewal check unanswered");
                Ok(())
            }
            Err(_) => Ok(()),
        }
    }

    async fn release(&self) -> Result<()> {
        if self.released.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let lost = || Error::LockLost {
            name: self.dir.clone(),
            reason: LossReason::SessionLost(
                "the ZooKeeper session (and the lock's node) expired before the release".into(),
            ),
        };
        if self.session.lost.is_cancelled() {
            // Given up on locally; the server may still keep the session (the client
            // reconnects on its own): delete the node if it is still there.
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                self.session.client.delete(&self.node, None),
            )
            .await;
            return Err(lost());
        }
        if self.mutex {
            self.inner.holder_leaving(&self.dir, &self.node);
        }
        if delete_node(&self.session, &self.node).await? {
            Ok(())
        } else if self.session.lost.is_cancelled() {
            // Our ephemeral node was gone with the session.
            Err(lost())
        } else {
            // Our ephemeral node was gone while the session answered: an operator
            // broke the lock (`break_lock` deletes the node). (The delete is sent once:
            // its "no node" is not its own doing.)
            Err(Error::NotOwner {
                name: self.dir.clone(),
            })
        }
    }

    fn loss_signal(&self) -> Option<CancellationToken> {
        Some(self.session.lost.clone())
    }

    fn suspect_flag(&self) -> Option<Arc<AtomicBool>> {
        Some(Arc::clone(&self.session.suspect))
    }

    fn session_trust(&self) -> Option<SessionTrust> {
        Some(self.session.trust.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sweep after an uncertain create, on a real server: of three nodes with one
    /// uuid it keeps the one named (here the highest: the create sent again, its lower
    /// twin a first send a lagging follower did not show), leaves another uuid's node
    /// and a node of another base alone, and deletes the rest.
    #[tokio::test]
    async fn the_sweep_keeps_the_node_returned_and_deletes_its_twins() {
        let Some(server) = dlock_testkit::ZkServer::start() else {
            return;
        };
        let client = zk::Client::connect(&server.addr().to_string())
            .await
            .expect("connect");
        let dir = "/sweep";
        let open = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        client.create(dir, b"", &open).await.expect("dir");
        let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        let make = async |stem: &str| {
            let (_, seq) = client
                .create(&format!("{dir}/{stem}"), b"", &options)
                .await
                .expect("create");
            format!("{stem}{seq}")
        };
        let mine = "_c_11111111-2222-4333-8444-555555555555-lock-";
        let twins = [make(mine).await, make(mine).await];
        let other = make("_c_66666666-2222-4333-8444-555555555555-lock-").await;
        let latch = make("_c_11111111-2222-4333-8444-555555555555-latch-").await;
        let kept = make(mine).await;
        assert!(delete_by_prefix(&client, dir, mine, Some(&kept)).await);
        let mut left = client.list_children(dir).await.expect("list");
        left.sort();
        let mut expected = vec![kept, other, latch];
        expected.sort();
        assert_eq!(left, expected, "twins were {twins:?}");
        // After a failed create nothing is kept.
        assert!(delete_by_prefix(&client, dir, mine, None).await);
        let left = client.list_children(dir).await.expect("list");
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(left.iter().all(|c| !c.starts_with(mine)), "{left:?}");
    }

    #[test]
    fn sequence_follows_curator_and_kazoo_names() {
        assert_eq!(sequence("_c_8d9f-lock-0000000012"), Some(12));
        assert_eq!(sequence("4f1e0c__lock__0000000003"), Some(3));
        assert_eq!(sequence("lock-0000000007"), Some(7));
        assert_eq!(sequence("not a lock"), None);
        // Any client may create children under a lock node: names with multi-byte
        // characters where a byte offset would split one must not panic.
        assert_eq!(sequence("€€€€"), None);
        assert_eq!(sequence("x€€€€€€€€€€"), None);
        assert_eq!(sequence("lock-€"), None);
        assert_eq!(sequence("__lock__"), None);
        assert_eq!(sequence("lock--5"), None);
        let sorted = contenders(vec![
            "_c_a-lock-0000000005".into(),
            "b7__lock__0000000002".into(),
            "junk".into(),
            "_c_c-lock-0000000009".into(),
        ]);
        assert_eq!(
            sorted,
            [
                "b7__lock__0000000002",
                "_c_a-lock-0000000005",
                "_c_c-lock-0000000009"
            ]
        );
    }

    #[test]
    fn uuids_have_the_usual_shape() {
        let u = uuid();
        let parts: Vec<&str> = u.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('4'));
    }
}
