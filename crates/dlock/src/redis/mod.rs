//! `redis://[user:password@]host:port[/db]`: a single Redis server (`rediss://` over
//! TLS: `ca_file=PEM` to verify the server, `cert_file`/`key_file` for mutual TLS),
//! `redis+cluster://n1:port,n2:port,…`: a Redis Cluster, and
//! `redis+sentinel://s1:26379,s2:26379/master[?db=N]`: the master that Sentinel names,
//! re-resolved after a connection error or a READONLY answer (feature `redis`).
//!
//! # Options
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `layout` | `redisson` | the on-server layout: `redisson`, `redis-py`, `python-redis-lock` (below) |
//! | `prefix` | none | prepended to every lock name |
//! | `min_replicas` | none | after each grant, `WAIT` for this many replicas; else give the grant back and fail with `NoQuorum` |
//! | `wait_timeout` | `1s` | how long `min_replicas` waits |
//! | `timeout` | `5s` | per command, and connecting |
//! | `poll` | `50ms` | re-poll interval of the plain layouts (no unlock messages) |
//! | `handoff_burst` | `16` | most in-process hand-offs in a row (below); `0` turns them off |
//! | `ca_file`, `cert_file`, `key_file` | system roots | `rediss://` only: the CA that signs the server, a client certificate |
//! | `db` | `0` | `redis+sentinel://` only (elsewhere the path names the database) |
//!
//! # Layouts: the same lock as other languages' clients
//!
//! | layout | keys | compatible with |
//! |---|---|---|
//! | `redisson` | hash at the name, field `<owner>` → hold count, PEXPIRE lease; token `redisson_lock_token:{name}` (INCR); release publishes `0` on `redisson_lock__channel:{name}` | Redisson `RLock` / `RFencedLock` (Java): each side's release wakes the other's waiters |
//! | `redis-py` | `SET name <owner> NX PX`; compare-and-delete release | redis-py `Lock`, redsync, rslock, node-redlock (no reentrancy) |
//! | `python-redis-lock` | `SET lock:name <owner> NX`; release pushes one element to `lock-signal:name` (expires 1 s) | python-redis-lock (not on a cluster: two hash slots) |
//!
//! dlock and each peer exclude each other on the same name (tested against raw commands
//! and the real Python peers). In the plain layouts dlock keeps its token counter at
//! `dlock_token:{key}` and the holder's metadata at `dlock_meta:{key}`; a foreign holder
//! has no token. A plain-layout release or renewal acts only while the counter still
//! shows the grant's token: a stale grant of an owner never touches a newer one. On a
//! cluster every key of one lock shares the name's hash slot (Redisson's naming rule).
//!
//! # How a lock works here
//! Acquire, renew and release are Lua scripts (EVALSHA; on NOSCRIPT, SCRIPT LOAD and
//! EVALSHA again), so every check-and-set is atomic on the server: an uncontended
//! cycle is two commands. Every
//! acquire carries a nonce: if the connection drops after the server ran it but before
//! the reply arrived, the retry finds that grant instead of orphaning it or taking a
//! second hold; if the retries run out too, a task in the background gives back
//! whatever grant the nonce got, looking again for a while in case a try lands late.
//! On the Redisson layout a release whose connection failed under it (dropped, reset,
//! refused; not timed out) is sent again, 3 tries in all: each hold has a field of its
//! own, which the first copy to run deletes, so a later copy gives back nothing else.
//! An in-process hand-off (below) cut off by a connection error or a timeout is
//! followed by the same release, which does nothing if the hand-off ran and otherwise
//! frees the lock for everyone. dlock does not send a plain-layout release again (a
//! foreign client sharing the owner may hold the key by then), though the Sentinel and
//! Cluster connections may resend any command themselves (Sentinel once after a
//! connection error or a timeout, a Cluster up to twice). After a release that failed,
//! the lock is free when its lease ends.
//! A renewal never shortens a lease (reentrant holds share it). Renewals
//! due together go to Redis as one script over up to 512 keys.
//!
//! # Waiting
//! A waiter subscribes to the lock's unlock channel before its second attempt, on one
//! pub/sub connection shared by the whole backend (dropped 250 ms after the last waiter
//! leaves), and wakes on the unlock message — or at the holder's remaining lease (PTTL)
//! at the latest. Each message wakes one local waiter, in arrival order. After the
//! pub/sub connection was lost, the next wait subscribes again and looks at once; a user
//! without channel rights waits by polling.
//!
//! **In-process hand-off** (Redisson layout, unfair locks): when a holder releases a
//! lock that other tasks of the same `Locker` wait for, one script gives the lock
//! straight to the task that has waited longest, with a new fencing token and that
//! task's own lease — no unlock message, no race with the releaser's next attempt.
//! A hand-off whose reply was lost is recovered by its waiter, by the hand-off's nonce;
//! a waiter that gives up on it first (the lock was still the releaser's, or it left)
//! voids it, so that if it still runs it releases to everyone instead.
//! While a task of the process holds the lock, another task of it sends no attempt (a
//! holding owner re-entering does). After `handoff_burst` hand-offs in a row, if another
//! connection listens for the unlock message (a waiter in another process), the lock is
//! released to everyone and this process's waiters hold back 5 ms. Across processes the
//! lock stays unfair; `fair` gives FIFO order: a list of waiters with deadlines on the
//! server's clock (`dlock_lock_queue:{name}`, `dlock_lock_timeout:{name}`; not
//! Redisson's RFairLock keys); a dead waiter blocks the queue only until its deadline,
//! at most [`LockOptions::queue_entry_ttl`](crate::LockOptions::queue_entry_ttl) after
//! its last refresh (default 5 s; the test `a_dead_fair_waiter_stalls_the_next_at_most_
//! its_queue_entry_ttl` measures it).
//!
//! # Semaphores and read-write locks
//! dlock's own layout, whatever `layout=` says. The peers' layouts were read and not
//! followed, for safety: the npm `redis-semaphore` package keeps a permit as a
//! sorted-set member scored by when it was taken or refreshed, and every caller
//! drops the members older than *its own* timeout — a caller with a shorter timeout
//! removes the permits of holders with longer leases, who learn of it only at their
//! next refresh, and more than N are inside meanwhile; nor does it keep a fencing
//! counter. Here every entry carries its own expiry. A semaphore `NAME` keeps its entries in the hash
//! `dlock_semaphore:{NAME}` (acquisition → `kind token owner`), their expiries on the
//! server's clock in the sorted set `dlock_semaphore_expiry:{NAME}`, its tokens in
//! `dlock_semaphore_token:{NAME}` (`INCR`: fencing as the lock's), and publishes
//! releases on `dlock_semaphore_channel:{NAME}` (one local waiter woken per message).
//! A read-write lock uses the same keys with `dlock_rwlock`. One script decides each
//! attempt; an attempt whose reply was lost is undone by its acquisition in the
//! background (the conformance behaviour `primitives_under_faults` drops replies and
//! resets connections under a crowd of permits, reads and writes).
//!
//! # Fencing
//! Tokens come from an INCR counter beside the lock, bumped in the acquire script. They
//! are durable only if the server persists every write before answering (`appendonly
//! yes` + `appendfsync always`); dlock checks with `CONFIG GET` and reports
//! [`Fencing::BestEffort`] otherwise (also when CONFIG is not permitted). A restart
//! without persistence, or a failover to a replica that missed the last INCR, can hand
//! out a token again: a Sentinel or Cluster failover is best effort, and the failover
//! test shows what happens to a held lock.
//!
//! # Least privilege
//! This ACL rule is enough (tested): `ACL SETUSER dlock on >PASSWORD ~* &* -@all
//! +evalsha +eval +script|load +publish +subscribe +unsubscribe +ping +hgetall +pttl +get
//! +wait +exists +incr +hset +hexists +hincrby +hget +hmget +hdel +pexpire +del +set
//! +lpush +zcard +lindex +lpop +lrem +rpush +zscore +zrem +zadd +time +pubsub|numsub
//! +zrange +zrangebyscore +zremrangebyscore` (the last three: semaphores and read-write
//! locks).
//! Without `+pubsub|numsub` a hand-off streak always ends with a release to everyone;
//! without `+config|get` fencing is reported as best effort; without channel rights
//! waiters poll.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo};

use crate::backend::{
    AcquireRequest, Attempt, Backend, Capabilities, Fencing, HeldLock, LockInfo, PollingWaiter,
    Waiter,
};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::options::{Metadata, Owner};
use crate::url::ConnectUrl;

mod call;
mod conn;
mod handoff;
pub(crate) mod layout;
mod renewer;
mod shared;
mod subscriber;
mod tls;

use conn::Conn;

pub use layout::Layout;
use layout::{Key, Keys};
use subscriber::{Source, Subscriber, Watch};

const SCHEME: &str = "redis";

pub(crate) fn map_err(e: &redis::RedisError) -> Error {
    // During a Sentinel failover no node may be confirmed master for a moment: that is
    // "unreachable for now", worth a retry, like a refused connection.
    let no_master = matches!(
        e.kind(),
        redis::ErrorKind::MasterNameNotFoundBySentinel
            | redis::ErrorKind::NoValidReplicasFoundBySentinel
    );
    if no_master
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_timeout()
        || e.is_connection_refusal()
    {
        Error::connection(SCHEME, e)
    } else if e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"))
    {
        Error::denied(SCHEME, e)
    } else {
        Error::backend(SCHEME, e)
    }
}

/// Errors after which the server may or may not have run the command.
pub(crate) fn uncertain(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_timeout()
}

/// Whether a Redisson-layout release that failed with `e` is sent again: its connection
/// failed under it (dropped, reset, refused: it may or may not have run), but it did
/// not time out — a timed-out release has taken the whole timeout already, and a
/// release to an unreachable server would keep its caller several of them. Why a copy
/// sent again is safe there and not on the plain layouts: the module's *How a lock
/// works here*.
fn worth_resending(e: &redis::RedisError) -> bool {
    !e.is_timeout() && (e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal())
}

/// Whether `e` proves the command never reached the server: a refused connection, on a
/// single server's connection (the cluster and Sentinel connections send a command
/// again after a dropped connection and answer with the last error, so a refusal there
/// may hide a first send that ran).
fn nothing_sent(inner: &Inner, e: &redis::RedisError) -> bool {
    matches!(inner.conn, Conn::Single(_)) && e.is_connection_refusal()
}

/// Whether an acquire script may find a grant already made for its nonce (its
/// `ARGV[5]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recovery {
    /// A first try with a fresh nonce.
    No,
    /// A try after this attempt's reply was lost.
    Retry,
    /// Recovering an in-process hand-off whose reply was lost (the nonce is the
    /// hand-off's): if it has not run and the lock is another owner's, the script
    /// voids it (on a free lock it takes the lock, and for an owner holding it
    /// already it re-enters, as any attempt would).
    HandOff,
}

impl Recovery {
    fn arg(self) -> &'static str {
        match self {
            Recovery::No => "0",
            Recovery::Retry => "1",
            Recovery::HandOff => "2",
        }
    }
}

/// How long at most a give-back ([`Inner::abandon_later`]) goes on looking for a hold no
/// guard owns.
const GIVE_BACK_WATCH: Duration = Duration::from_secs(60);

/// At most this many give-backs of one backend go on looking at once: an outage that
/// fails many attempts must not leave a crowd polling the server when it returns.
const MAX_WATCHING: usize = 256;

/// A give-back's place among [`Inner::watching`] (when `.1`), given up on drop.
struct Seat(Arc<Inner>, bool);

impl Drop for Seat {
    fn drop(&mut self) {
        if self.1 {
            self.0
                .watching
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// A hold that no guard owns, for [`Inner::abandon`].
#[derive(Debug, Clone, Copy)]
enum Orphan {
    /// An in-process hand-off, uncertain, whose waiter left without recovering it.
    Left,
    /// What an attempt that failed (after a lost reply, or while recovering) may have
    /// been granted.
    Failed(Recovery),
}

struct Inner {
    conn: Conn,
    renewer: renewer::Renewer,
    cluster: bool,
    subscriber: Arc<Subscriber>,
    layout: Layout,
    prefix: String,
    fencing: Fencing,
    min_replicas: Option<(u32, Duration)>,
    poll: Duration,
    shown: String,
    /// In-process hand-offs (Redisson layout, unfair locks, no `min_replicas`).
    handoffs: Option<handoff::Handoffs<RedisHeld>>,
    /// Give-backs of failed attempts still looking for a late grant (at most
    /// [`MAX_WATCHING`]; beyond, a give-back stops at the server's first answer).
    watching: std::sync::atomic::AtomicUsize,
}

/// The single-node Redis backend.
pub struct RedisBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The connection objects carry the password in their Debug output: never show them.
        f.debug_struct("RedisBackend")
            .field("url", &self.inner.shown)
            .field("layout", &self.inner.layout)
            .field("fencing", &self.inner.fencing)
            .finish_non_exhaustive()
    }
}

impl RedisBackend {
    pub(crate) async fn open(mut url: ConnectUrl) -> Result<Arc<Self>> {
        let cluster = url.scheme() == "redis+cluster";
        let sentinel = url.scheme() == "redis+sentinel";
        let tls = tls::TlsFiles::take(&mut url)?;
        let layout = match url.take_param("layout") {
            None => Layout::Redisson,
            Some(l) => Layout::parse(&l).ok_or_else(|| {
                url.invalid(&format!(
                    "layout={l:?}: expected redisson, redis-py or python-redis-lock"
                ))
            })?,
        };
        let prefix = url.take_param("prefix").unwrap_or_default();
        let min_replicas = url.take_count("min_replicas", 1..=64)?;
        let wait_timeout = url.take_duration("wait_timeout", Duration::from_secs(1))?;
        let timeout = url.take_duration("timeout", Duration::from_secs(5))?;
        let sentinel_db = match url.take_param("db") {
            None => 0,
            Some(d) if sentinel => d
                .parse::<i64>()
                .ok()
                .filter(|d| *d >= 0)
                .ok_or_else(|| url.invalid("db must be a database number"))?,
            Some(_) => {
                return Err(url.invalid(
                    "db= is for redis+sentinel://; elsewhere the path names the database",
                ));
            }
        };
        let poll = url.take_duration("poll", Duration::from_millis(50))?;
        let handoff_burst = url
            .take_count("handoff_burst", 0..=100_000)?
            .unwrap_or(DEFAULT_HANDOFF_BURST);
        url.finish(&[
            "layout",
            "prefix",
            "min_replicas",
            "wait_timeout",
            "timeout",
            "poll",
            "handoff_burst",
            "db",
            "ca_file",
            "cert_file",
            "key_file",
        ])?;
        if sentinel {
            let conn = sentinel_conn(&url, sentinel_db, timeout)?;
            return Self::finish_open(
                url,
                Conn::Sentinel(conn.clone()),
                Source::Sentinel(conn),
                Settings {
                    cluster: false,
                    layout,
                    prefix,
                    min_replicas: min_replicas.map(|n| (n, wait_timeout)),
                    poll,
                    timeout,
                    handoff_burst,
                },
            )
            .await;
        }

        if cluster && layout == Layout::PythonRedisLock {
            return Err(url.invalid(
                "layout=python-redis-lock cannot run on a cluster: its signal list lives in another hash slot",
            ));
        }
        if cluster && min_replicas.is_some() {
            return Err(Error::Unsupported(
                "min_replicas on redis+cluster:// is not implemented yet".into(),
            ));
        }

        let nodes = node_infos(&url, cluster, tls.is_some())?;
        // Pub/sub goes to the first node: in a cluster PUBLISH reaches every node.
        let client = match &tls {
            None => redis::Client::open(nodes[0].clone()),
            Some(files) => redis::Client::build_with_tls(nodes[0].clone(), files.load(&url)?),
        }
        .map_err(|e| map_err(&e))?;
        let connecting = async {
            if cluster {
                let mut builder = redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .retries(2);
                if let Some(user) = url.username() {
                    builder = builder.username(user);
                }
                if let Some(pw) = url.password() {
                    builder = builder.password(pw.expose());
                }
                let c = builder.build()?;
                Ok(Conn::Cluster(c.get_async_connection().await?))
            } else {
                let config = ConnectionManagerConfig::new()
                    .set_response_timeout(Some(timeout))
                    .set_connection_timeout(Some(timeout))
                    .set_number_of_retries(2);
                Ok(Conn::Single(
                    ConnectionManager::new_with_config(client.clone(), config).await?,
                ))
            }
        };
        let conn = tokio::time::timeout(timeout, connecting)
            .await
            .map_err(|_| Error::connection(SCHEME, format!("connecting to {url} timed out")))?
            .map_err(|e: redis::RedisError| map_err(&e))?;
        Self::finish_open(
            url,
            conn,
            Source::Fixed(client),
            Settings {
                cluster,
                layout,
                prefix,
                min_replicas: min_replicas.map(|n| (n, wait_timeout)),
                poll,
                timeout,
                handoff_burst,
            },
        )
        .await
    }

    async fn finish_open(
        url: ConnectUrl,
        conn: Conn,
        source: Source,
        settings: Settings,
    ) -> Result<Arc<Self>> {
        // Fail at connect time, not on the first lock, when nothing answers.
        let ping: redis::RedisResult<String> = tokio::time::timeout(
            settings.timeout,
            redis::cmd("PING").query_async(&mut conn.clone()),
        )
        .await
        .unwrap_or_else(|_| Err(redis::RedisError::from((redis::ErrorKind::Io, "timed out"))));
        ping.map_err(|e| map_err(&e))?;
        let fencing = probe_fencing(&conn).await;
        let handoffs = (settings.layout == Layout::Redisson
            && settings.min_replicas.is_none()
            && settings.handoff_burst > 0)
            .then(|| handoff::Handoffs::new(settings.handoff_burst));
        Ok(Arc::new(RedisBackend {
            inner: Arc::new(Inner {
                renewer: renewer::Renewer::start(conn.clone(), settings.layout, settings.cluster),
                conn,
                cluster: settings.cluster,
                subscriber: Subscriber::new(source),
                layout: settings.layout,
                prefix: settings.prefix,
                fencing,
                min_replicas: settings.min_replicas,
                poll: settings.poll,
                shown: url.to_string(),
                handoffs,
                watching: std::sync::atomic::AtomicUsize::new(0),
            }),
        }))
    }
}

/// What a Redis backend guarantees in `layout`, with tokens of quality `fencing`, on a
/// single server (`single`: where no command is sent twice without dlock asking; on
/// Cluster the client library, and on Sentinel dlock's connection, send one again
/// after a lost connection or a failover) or not.
fn caps(layout: Layout, fencing: Fencing, single: bool) -> Capabilities {
    Capabilities {
        fencing,
        fifo: layout == Layout::Redisson,
        native_wait: layout.publishes(),
        session_bound: false,
        reentrant: layout.reentrant(),
        cross_process: true,
        max_ttl: None,
        queued_waiting: false,
        session_timeout: None,
        connection_loss_notice: None,
        release_reports_loss: single,
        primitives: crate::backend::Primitives::ALL,
    }
}

impl RedisBackend {
    /// The capabilities of the default layout on a server that persists every write
    /// before answering (`durable`), or not.
    pub(crate) fn capabilities_with(durable: bool) -> Capabilities {
        caps(Layout::Redisson, durable_if(durable), true)
    }

    /// [`RedisBackend::capabilities_with`] where a command may be sent more than once
    /// without dlock asking (Cluster, Sentinel).
    pub(crate) fn capabilities_resending(durable: bool) -> Capabilities {
        caps(Layout::Redisson, durable_if(durable), false)
    }
}

/// Durable fencing if the token source is, best effort otherwise.
pub(crate) fn durable_if(durable: bool) -> Fencing {
    if durable {
        Fencing::Durable
    } else {
        Fencing::BestEffort
    }
}

/// What `open` decided, handed to `finish_open`.
struct Settings {
    cluster: bool,
    layout: Layout,
    prefix: String,
    min_replicas: Option<(u32, Duration)>,
    poll: Duration,
    timeout: Duration,
    handoff_burst: u32,
}

/// Most consecutive in-process hand-offs of one lock before it is released to everyone.
const DEFAULT_HANDOFF_BURST: u32 = 16;

/// A connection to the master that the URL's Sentinels name (path: the master name).
fn sentinel_conn(url: &ConnectUrl, db: i64, timeout: Duration) -> Result<conn::SentinelConn> {
    let master = url.path().trim_start_matches('/');
    if master.is_empty() || master.contains('/') {
        return Err(url.invalid(
            "redis+sentinel:// needs the master name as its path: redis+sentinel://s1:26379,s2:26379/mymaster",
        ));
    }
    if url.hosts().is_empty() {
        return Err(
            url.invalid("name the Sentinels: redis+sentinel://HOST:26379[,HOST:26379...]/MASTER")
        );
    }
    let sentinels: Vec<ConnectionAddr> = url
        .hosts()
        .iter()
        .map(|h| ConnectionAddr::Tcp(h.host.clone(), h.port.unwrap_or(26379)))
        .collect();
    let mut builder = redis::sentinel::SentinelClientBuilder::new(
        sentinels,
        master,
        redis::sentinel::SentinelServerType::Master,
    )
    .map_err(|e| map_err(&e))?
    .set_client_to_redis_db(db);
    if let Some(user) = url.username() {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(pw) = url.password() {
        builder = builder.set_client_to_redis_password(pw.expose());
    }
    let client = builder.build().map_err(|e| map_err(&e))?;
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(timeout))
        .set_connection_timeout(Some(timeout));
    Ok(conn::SentinelConn::new(client, config))
}

/// Connection settings for every host of the URL (one, unless a cluster).
fn node_infos(url: &ConnectUrl, cluster: bool, tls: bool) -> Result<Vec<redis::ConnectionInfo>> {
    let hosts: Vec<(String, u16)> = match url.hosts() {
        // No silent default address: a forgotten host is a usage error, not an
        // unreachable server somewhere else.
        [] => return Err(url.invalid("name the server: redis://HOST[:PORT]")),
        [h] => vec![(h.host.clone(), h.port.unwrap_or(6379))],
        many if cluster => many
            .iter()
            .map(|h| (h.host.clone(), h.port.unwrap_or(6379)))
            .collect(),
        _ => {
            return Err(url.invalid(
                "redis:// takes one host; use redis+cluster:// for a cluster or redlock:// for independent nodes",
            ));
        }
    };
    if cluster && !matches!(url.path().trim_start_matches('/'), "" | "0") {
        return Err(url.invalid("a cluster has only database 0"));
    }
    hosts
        .into_iter()
        .map(|(host, port)| connection_info(url, host, port, tls))
        .collect()
}

pub(crate) fn connection_info(
    url: &ConnectUrl,
    host: String,
    port: u16,
    tls: bool,
) -> Result<redis::ConnectionInfo> {
    let db = match url.path().trim_start_matches('/') {
        "" => 0,
        d => d
            .parse::<i64>()
            .ok()
            .filter(|d| *d >= 0)
            .ok_or_else(|| url.invalid("the path must be a database number, e.g. /0"))?,
    };
    let mut settings = RedisConnectionInfo::default().set_db(db);
    if let Some(user) = url.username() {
        settings = settings.set_username(user);
    }
    if let Some(pw) = url.password() {
        settings = settings.set_password(pw.expose());
    }
    let addr = if tls {
        ConnectionAddr::TcpTls {
            host,
            port,
            insecure: false,
            tls_params: None,
        }
    } else {
        ConnectionAddr::Tcp(host, port)
    };
    Ok(addr
        .into_connection_info()
        .map_err(|e| map_err(&e))?
        .set_redis_settings(settings))
}

/// Durable only when every write is fsynced before the reply (on a cluster, the node
/// CONFIG GET is routed to decides: report best effort unless it says always).
async fn probe_fencing(conn: &Conn) -> Fencing {
    // One round trip: `append*` names appendonly and appendfsync (among others).
    let pairs: redis::RedisResult<Vec<(String, String)>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("append*")
        .query_async(&mut conn.clone())
        .await;
    let pairs = pairs.unwrap_or_default();
    let value = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    match (value("appendonly"), value("appendfsync")) {
        (Some("yes"), Some("always")) => Fencing::Durable,
        _ => Fencing::BestEffort,
    }
}

/// An acquisition's place in the fair-mode queue: its owner and the acquisition, so
/// two waiters of one owner never share (or take each other's) place.
fn queue_entry(req: &AcquireRequest) -> String {
    format!("{}/{}", req.owner.as_str(), req.acquisition)
}

/// The holder's metadata as the plain layouts store it (their metadata key), carrying
/// the attempt's nonce: their acquire scripts find a retry's grant by it.
#[derive(serde::Serialize)]
pub(crate) struct StoredMetadata<'a> {
    #[serde(flatten)]
    pub(crate) metadata: &'a Metadata,
    pub(crate) nonce: &'a str,
}

impl StoredMetadata<'_> {
    /// The stored JSON. This process's own metadata (the default) is serialized once;
    /// each attempt then only appends its nonce.
    pub(crate) fn to_json(&self) -> String {
        let plain = |b: u8| b.is_ascii_alphanumeric() || b == b':';
        if let Some(own) = self.metadata.own_json()
            && self.nonce.bytes().all(plain)
            && let Some(fields) = own.strip_suffix('}')
        {
            let mut out = String::with_capacity(fields.len() + self.nonce.len() + 12);
            out.push_str(fields);
            if fields != "{" {
                out.push(',');
            }
            out.push_str("\"nonce\":\"");
            out.push_str(self.nonce);
            out.push_str("\"}");
            return out;
        }
        serde_json::to_string(self).unwrap_or_else(|_| "{}".into())
    }
}

/// The nonce of the attempt (or in-process hand-off) that took a hold. On the Redisson
/// layout each hold has a field of its own on the server, named by it
/// (`scripts/redisson_acquire.lua`), which its release deletes. Kept inline: a nonce is
/// 32 hex digits, a hand-off's two more.
#[derive(Clone)]
enum GrantNonce {
    Inline {
        len: u8,
        bytes: [u8; 34],
    },
    /// Longer than any nonce this crate makes; kept whole all the same.
    Other(Box<str>),
}

impl GrantNonce {
    fn new(nonce: &str) -> Self {
        let mut bytes = [0u8; 34];
        match (bytes.get_mut(..nonce.len()), u8::try_from(nonce.len())) {
            (Some(inline), Ok(len)) => {
                inline.copy_from_slice(nonce.as_bytes());
                GrantNonce::Inline { len, bytes }
            }
            _ => GrantNonce::Other(nonce.into()),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            GrantNonce::Inline { len, bytes } => bytes
                .get(..usize::from(*len))
                .and_then(|b| std::str::from_utf8(b).ok())
                .unwrap_or_default(),
            GrantNonce::Other(s) => s,
        }
    }
}

/// The nonce an in-process hand-off to the waiter of an attempt writes: derived from
/// the attempt's, and never equal to any attempt's.
fn handoff_nonce(attempt: &str) -> String {
    format!("{attempt}:h")
}

impl Inner {
    fn keys(&self, name: &LockName) -> Keys {
        if self.prefix.is_empty() {
            self.layout.keys_of(name.shared())
        } else {
            self.layout.keys(&self.prefixed(name))
        }
    }

    /// `name` with the configured key prefix (borrowed when there is none: hot path).
    fn prefixed<'a>(&self, name: &'a LockName) -> std::borrow::Cow<'a, str> {
        if self.prefix.is_empty() {
            std::borrow::Cow::Borrowed(name.as_str())
        } else {
            std::borrow::Cow::Owned(format!("{}{}", self.prefix, name.as_str()))
        }
    }

    fn signal_kind(&self) -> &'static str {
        if self.layout.publishes() {
            "publish"
        } else {
            "list"
        }
    }

    /// Give back the hold `nonce` took (see [`GrantNonce`]).
    async fn release(
        &self,
        keys: &Keys,
        owner: &str,
        fence: u64,
        nonce: &str,
    ) -> redis::RedisResult<i64> {
        let (lock, signal) = (Key::Plain(&keys.lock), keys.signal_key());
        let script = self.layout.release_script();
        let call = match keys.meta_key() {
            None => {
                // Redisson: the hold's own field goes with it.
                let mut call = call::Call::new(script, &[lock, signal], 3);
                call.arg(owner).arg(fence).arg(layout::GrantField(nonce));
                call
            }
            Some(meta) => {
                let keys = [lock, signal, meta, keys.counter_key()];
                let mut call = call::Call::new(script, &keys, 3);
                call.arg(owner).arg(self.signal_kind()).arg(fence);
                call
            }
        };
        call.run(&self.conn).await
    }

    /// Give back a hold that no guard owns (see `redisson_abandon.lua`): `Left`, a
    /// hand-off to `owner` whose reply was lost and whose waiter has gone; `Failed`,
    /// the grant an attempt with `nonce` may have got before it failed after a lost
    /// reply. Returns whether a hold was given back.
    async fn abandon(&self, keys: &Keys, owner: &str, nonce: &str, what: Orphan) -> Result<bool> {
        let call = match keys.meta_key() {
            None => {
                let (own, void) = match what {
                    Orphan::Left => ("0", "1"),
                    Orphan::Failed(Recovery::HandOff) => ("1", "1"),
                    Orphan::Failed(_) => ("1", "0"),
                };
                let keys = [Key::Plain(&keys.lock), keys.signal_key()];
                let mut call = call::Call::new(&layout::REDISSON_ABANDON, &keys, 4);
                call.arg(owner).arg(nonce).arg(own).arg(void);
                call
            }
            Some(meta) => {
                let keys = [Key::Plain(&keys.lock), keys.signal_key(), meta];
                let mut call = call::Call::new(&layout::PLAIN_ABANDON, &keys, 3);
                call.arg(owner).arg(nonce).arg(self.signal_kind());
                call
            }
        };
        let given_back: i64 = call.run(&self.conn).await.map_err(|e| map_err(&e))?;
        Ok(given_back == 1)
    }

    /// [`Inner::abandon`] in the background ([`crate::finish::release_later`]), tried
    /// again on errors. For a failed attempt (`Orphan::Failed`) it goes on looking until
    /// `watch` has passed, even after it found nothing or gave a hold back: a try still
    /// on its way may land later (the client library may send it again on a new
    /// connection, and a paused server runs what it had read when it resumes), and
    /// tries cannot be voided as hand-offs are. A leaving waiter's (`Orphan::Left`) is
    /// done once it ran: a hand-off that lands later finds itself voided.
    fn abandon_later(
        self: &Arc<Self>,
        keys: Keys,
        owner: Owner,
        nonce: String,
        what: Orphan,
        watch: Duration,
    ) {
        if tokio::runtime::Handle::try_current().is_err() {
            tracing::warn!(lock = %keys.lock, "no runtime to give back a hold no guard owns; it expires with its lease");
            return;
        }
        // Beyond MAX_WATCHING, a failed attempt's give-back stops at the server's first
        // answer, as a leaving waiter's does.
        let seated = matches!(what, Orphan::Failed(_))
            && self
                .watching
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                < MAX_WATCHING;
        // Counted among the watching until the task ends (it drops the closure).
        let seat = Seat(Arc::clone(self), matches!(what, Orphan::Failed(_)));
        let watch = if seated {
            watch.min(GIVE_BACK_WATCH)
        } else {
            Duration::ZERO
        };
        let start = std::time::Instant::now();
        let attempt = move || {
            let (inner, keys, owner, nonce) = (
                Arc::clone(&seat.0),
                keys.clone(),
                owner.clone(),
                nonce.clone(),
            );
            async move {
                match inner.abandon(&keys, owner.as_str(), &nonce, what).await {
                    Ok(given_back) => {
                        if given_back {
                            tracing::debug!(lock = %keys.lock, "gave back a hold no guard owned");
                        }
                        start.elapsed() >= watch
                    }
                    Err(e) => {
                        tracing::debug!(lock = %keys.lock, error = %e, "could not look for a hold no guard owns yet");
                        false
                    }
                }
            }
        };
        let within = (watch * 2).max(GIVE_BACK_WATCH);
        let never = tokio_util::sync::CancellationToken::new();
        crate::finish::release_later(never, within, attempt);
    }

    /// After a grant: wait for replicas, or give the grant back and fail; with `true`
    /// when that release failed too (the grant may still be there).
    async fn await_replicas(
        &self,
        keys: &Keys,
        owner: &str,
        fence: u64,
        nonce: &str,
    ) -> std::result::Result<(), (Error, bool)> {
        let Err(e) = self.wait_replicas().await else {
            return Ok(());
        };
        let released = self.release(keys, owner, fence, nonce).await;
        Err((e, released.is_err()))
    }

    /// With `min_replicas`: wait until that many replicas have every write so far
    /// (`WAIT`); [`Error::NoQuorum`] when fewer acknowledged in time. The caller gives
    /// its grant back on error.
    pub(super) async fn wait_replicas(&self) -> Result<()> {
        let Some((needed, timeout)) = self.min_replicas else {
            return Ok(());
        };
        let acked: u32 = redis::cmd("WAIT")
            .arg(needed)
            .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| map_err(&e))?;
        if acked < needed {
            return Err(Error::NoQuorum {
                granted: usize::try_from(acked).unwrap_or(0),
                needed: usize::try_from(needed).unwrap_or(0),
                unreachable: usize::try_from(needed - acked).unwrap_or(0),
            });
        }
        Ok(())
    }
}

impl Inner {
    /// The URL scheme this backend was opened with.
    fn scheme(&self) -> &'static str {
        if self.cluster {
            "redis+cluster"
        } else if matches!(self.conn, Conn::Sentinel(_)) {
            "redis+sentinel"
        } else if self.shown.starts_with("rediss:") {
            "rediss"
        } else {
            SCHEME
        }
    }
}

#[async_trait]
impl Backend for RedisBackend {
    fn scheme(&self) -> &'static str {
        self.inner.scheme()
    }

    fn capabilities(&self) -> Capabilities {
        caps(
            self.inner.layout,
            self.inner.fencing,
            matches!(self.inner.conn, Conn::Single(_)),
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        if req.primitive != crate::backend::Primitive::Lock {
            // Boxed, and so are the other rare paths below: inline, their state would
            // make every lock attempt's future too large for the allocator's per-thread
            // cache (over 1 KiB: a slower malloc and free on every acquisition).
            return Box::pin(shared::try_acquire(&self.inner, req)).await;
        }
        let inner = &self.inner;
        let keys = inner.keys(&req.name);
        // A nonce per attempt: if the connection drops after the server ran the script
        // but before its reply arrived, the retry finds this attempt's grant instead of
        // leaving it orphaned (or taking a second hold).
        // Unique per attempt, across processes too (a forked child included).
        let fresh = crate::hex::encode_16(&crate::random::bytes::<16>());
        let mut nonce = crate::hex::ascii(&fresh);
        let stored = |nonce: &str| {
            if inner.layout == Layout::Redisson {
                // The metadata alone: each hold's nonce has a field of its own there.
                req.metadata.to_json()
            } else {
                Cow::Owned(
                    StoredMetadata {
                        metadata: &req.metadata,
                        nonce,
                    }
                    .to_json(),
                )
            }
        };
        let mut metadata = stored(&nonce);
        let mut recovering = Recovery::No;
        // When a grant found by recovery was made, at the latest (see `handoff`).
        let mut granted_at = None;
        if let Some(handoffs) = inner.handoffs.as_ref().filter(|_| !req.fair) {
            // A hand-off writes a nonce of its own, never this attempt's: the attempt
            // may land too (re-entering after the hand-off, or on a free lock after a
            // hand-off that never ran), and undoing a lost hand-off must not give back
            // the attempt's hold.
            let want = || handoff::Want {
                ttl: req.ttl,
                metadata: metadata.clone().into_owned(),
                nonce: handoff_nonce(&nonce),
            };
            match handoffs.before_attempt(&keys.lock, req.acquisition, req.owner.as_str(), want) {
                handoff::Before::Granted(held) => return Ok(Attempt::Acquired(Box::new(held))),
                handoff::Before::Recover(lost, sent_at) => {
                    // A hand-off to this acquisition may have landed: find it by its
                    // nonce; if it did, its lease runs from when it was sent.
                    metadata = stored(&lost);
                    nonce = Cow::Owned(lost);
                    recovering = Recovery::HandOff;
                    granted_at = Some(sent_at);
                }
                handoff::Before::Yield(pause) => {
                    return Ok(Attempt::Busy {
                        retry_after: Some(pause),
                    });
                }
                handoff::Before::Ask => {}
            }
        }
        // A fresh acquisition queues behind this process's waiters instead of barging
        // past the one an unlock message is about to wake. (Its re-check right after
        // subscribing does go to the server: a waiter whose subscription was not yet
        // confirmed when the lock was released relies on exactly that re-check.)
        // A local holder re-entering (reentrant layout) always asks the server: it
        // must not queue behind waiters for a lock it holds.
        // Asked last, after the cheap tests: it takes the hand-off table's lock.
        let barging_is_waiting = || match &inner.handoffs {
            Some(h) => !h.is_local_holder(&keys.lock, req.owner.as_str()),
            None => !inner.layout.reentrant(),
        };
        if req.attempt == 0
            && !req.fair
            && inner.layout.publishes()
            && inner.subscriber.watching_any()
            && inner.subscriber.watchers(&keys.signal()) > 0
            && barging_is_waiting()
        {
            return Ok(Attempt::Busy { retry_after: None });
        }
        let ttl_ms = u64::try_from(req.ttl.as_millis()).unwrap_or(u64::MAX);
        let started = std::time::Instant::now();
        let mut round = 0u32;
        // A try whose reply was lost may have run, or may still run (sent again by
        // the client library, or late by a paused server); a refused connection sent
        // nothing.
        let mut in_doubt = false;
        let fair_keys = if req.fair { keys.queue() } else { None };
        let answer: i64 = loop {
            let fair_queue = fair_keys.as_ref();
            let script = match fair_queue {
                Some(_) => &*layout::REDISSON_FAIR_ACQUIRE,
                None => inner.layout.acquire_script(),
            };
            // KEYS: the lock, its counter, then the metadata key (plain layouts) or
            // the queue and its deadlines (fair mode). Not kept while the call runs:
            // this future must stay small.
            let mut call = {
                let mut names = [
                    Key::Plain(&keys.lock),
                    keys.counter_key(),
                    Key::Plain(""),
                    Key::Plain(""),
                    Key::Plain(""),
                ];
                let mut count = 2;
                let more = keys.meta_key().into_iter().chain(
                    fair_queue
                        .into_iter()
                        .flat_map(|(q, d)| [Key::Plain(q), Key::Plain(d)]),
                );
                for key in more {
                    names[count] = key;
                    count += 1;
                }
                call::Call::new(script, &names[..count], 7)
            };
            call.arg(ttl_ms).arg(req.owner.as_str()).arg(&*metadata);
            if inner.layout == Layout::Redisson {
                call.arg(layout::GrantField(&nonce));
            } else {
                call.arg(&*nonce);
            }
            call.arg(recovering.arg());
            if fair_queue.is_some() {
                let life = req
                    .enqueue
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
                call.arg(life).arg(queue_entry(req));
            }
            match call.run(&inner.conn).await {
                Ok(answer) => break answer,
                Err(e) if uncertain(&e) && round < 3 => {
                    tracing::debug!(lock = %req.name, error = %e, "acquire reply lost; retrying with the same nonce");
                    in_doubt |= !nothing_sent(inner, &e);
                    if recovering == Recovery::No {
                        recovering = Recovery::Retry;
                    }
                    round += 1;
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(round))).await;
                }
                Err(e) => {
                    in_doubt |= uncertain(&e) && !nothing_sent(inner, &e);
                    if in_doubt || recovering == Recovery::HandOff {
                        // A try that ran may have been granted (or, recovering, claimed a
                        // hand-off): no guard will own it, so give it back once the
                        // server answers again (a hand-off that has not run yet is
                        // voided). The nonce is this attempt's, or the hand-off's it
                        // recovered, which no other attempt uses (its slot moved on).
                        inner.abandon_later(
                            keys,
                            req.owner.clone(),
                            nonce.into_owned(),
                            Orphan::Failed(recovering),
                            req.ttl,
                        );
                    }
                    return Err(map_err(&e));
                }
            }
        };
        let fence = match layout::Answer::of(answer) {
            layout::Answer::Granted { token } => token,
            layout::Answer::Held { lease } => {
                if in_doubt {
                    // An earlier try may still land on the lock once it is free.
                    inner.abandon_later(
                        keys,
                        req.owner.clone(),
                        nonce.into_owned(),
                        Orphan::Failed(recovering),
                        req.ttl,
                    );
                }
                let mut retry_after = lease;
                if inner.layout != Layout::Redisson {
                    // Foreign clients of plain layouts announce nothing: re-poll often.
                    retry_after = Some(retry_after.map_or(inner.poll, |d| d.min(inner.poll)));
                }
                return Ok(Attempt::Busy { retry_after });
            }
        };
        if inner.min_replicas.is_some() {
            let waited = Box::pin(inner.await_replicas(&keys, req.owner.as_str(), fence, &nonce));
            if let Err((e, maybe_left)) = waited.await {
                // Its release of the grant failed too (the connection may be down), or
                // an earlier try may still land: look again in the background.
                if maybe_left || in_doubt {
                    let what = Orphan::Failed(recovering);
                    let nonce = nonce.into_owned();
                    inner.abandon_later(keys, req.owner.clone(), nonce, what, req.ttl);
                }
                return Err(e);
            }
        }
        let held = RedisHeld {
            inner: Arc::clone(inner),
            name: req.name.clone(),
            keys,
            owner: req.owner.clone(),
            fence,
            nonce: GrantNonce::new(&nonce),
            released: std::sync::atomic::AtomicBool::new(false),
            granted_at,
            counted: std::sync::atomic::AtomicBool::new(inner.handoffs.is_some()),
            in_doubt,
        };
        if let Some(h) = &inner.handoffs {
            h.note_held(&held.keys.lock, held.owner.as_str(), started + req.ttl);
        }
        Ok(Attempt::Acquired(Box::new(held)))
    }

    async fn subscribe(&self, req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        let inner = &self.inner;
        if req.primitive != crate::backend::Primitive::Lock {
            let keys = shared::SharedKeys::new(inner, &req.name, req.primitive);
            let watch = inner.subscriber.watch(&keys.channel).await.ok();
            return Ok(Box::new(RedisWaiter {
                watch,
                poll: inner.poll,
                slot: None,
            }));
        }
        if !inner.layout.publishes() {
            return Ok(Box::new(PollingWaiter {
                interval: inner.poll,
            }));
        }
        let keys = inner.keys(&req.name);
        // Without pub/sub (e.g. an ACL user without channel rights, or the connection
        // cannot be made now) waiting falls back to polling: never a failed lock().
        let watch = match inner.subscriber.watch(&keys.signal()).await {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::debug!(lock = %req.name, error = %e, "no unlock messages; polling");
                None
            }
        };
        let slot = inner
            .handoffs
            .as_ref()
            .map(|h| h.register(&keys.lock, req.acquisition, &req.owner));
        Ok(Box::new(RedisWaiter {
            watch,
            poll: inner.poll,
            slot: slot.map(|slot| (Arc::clone(inner), keys, slot)),
        }))
    }

    async fn holders(
        &self,
        name: &LockName,
        primitive: crate::backend::Primitive,
    ) -> Result<Vec<LockInfo>> {
        shared::holders(&self.inner, name, primitive).await
    }

    async fn break_lock(&self, name: &LockName, fence: u64) -> Result<bool> {
        let inner = &self.inner;
        let keys = inner.keys(name);
        let mut inv = inner.layout.break_script().prepare_invoke();
        inv.key(&*keys.lock).key(keys.signal());
        if let Some(meta) = &keys.meta() {
            inv.key(meta).key(keys.counter());
        }
        inv.arg(fence).arg(inner.signal_kind());
        let broke: i64 = inv
            .invoke_async(&mut inner.conn.clone())
            .await
            .map_err(|e| map_err(&e))?;
        Ok(broke == 1)
    }

    async fn leave_queue(&self, req: &AcquireRequest) -> Result<()> {
        if req.primitive == crate::backend::Primitive::Write && req.enqueue.is_some() {
            return shared::leave(&self.inner, req).await;
        }
        if !req.fair {
            return Ok(());
        }
        let keys = self.inner.keys(&req.name);
        let Some((queue, deadlines)) = &keys.queue() else {
            return Ok(());
        };
        let _: i64 = layout::REDISSON_LEAVE_QUEUE
            .key(queue)
            .key(deadlines)
            .key(keys.signal())
            .arg(queue_entry(req))
            .invoke_async(&mut self.inner.conn.clone())
            .await
            .map_err(|e| map_err(&e))?;
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let inner = &self.inner;
        let keys = inner.keys(name);
        let mut conn = inner.conn.clone();
        let info = if inner.layout == Layout::Redisson {
            let deadlines = keys.queue().map(|q| q.1).unwrap_or_default();
            let (fields, pttl, counter, waiters): (Vec<(String, String)>, i64, Option<u64>, usize) =
                redis::pipe()
                    .hgetall(&*keys.lock)
                    .pttl(&*keys.lock)
                    .get(keys.counter())
                    .zcard(&deadlines)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| map_err(&e))?;
            let Some((owner, holds)) = fields.iter().find(|(k, _)| !k.starts_with("dlock:")) else {
                return Ok(None);
            };
            let field = |k: &str| fields.iter().find(|(f, _)| f == k).map(|(_, v)| v.clone());
            let fence = field("dlock:fence")
                .and_then(|f| f.parse().ok())
                .or(counter)
                .unwrap_or(0);
            let mut info = LockInfo::new(name, owner.clone(), holds.parse().unwrap_or(1), fence);
            // Each hold's own field keeps the metadata its acquisition sent: show a
            // hold's (with several, of one owner, any of theirs). A hold an earlier
            // build of dlock took (a rolling upgrade) has '1' there and its metadata
            // in a `dlock:meta` field.
            info.metadata = fields
                .iter()
                .filter(|(f, _)| f.starts_with("dlock:g:"))
                .find_map(|(_, m)| serde_json::from_str::<Metadata>(m).ok())
                .or_else(|| serde_json::from_str::<Metadata>(&field("dlock:meta")?).ok())
                .unwrap_or_default();
            info.remaining = u64::try_from(pttl).ok().map(Duration::from_millis);
            info.waiters = Some(waiters);
            info
        } else {
            let meta_key = keys.meta().unwrap_or_default();
            let (owner, pttl, counter, meta): (Option<String>, i64, Option<u64>, Option<String>) =
                redis::pipe()
                    .get(&*keys.lock)
                    .pttl(&*keys.lock)
                    .get(keys.counter())
                    .get(&meta_key)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| map_err(&e))?;
            let Some(owner) = owner else {
                return Ok(None);
            };
            // Without dlock's metadata key the holder is a foreign client (redis-py,
            // python-redis-lock, …), which counts no tokens: token 0, never the
            // counter a past dlock grant left.
            let token = if meta.is_some() {
                counter.unwrap_or(0)
            } else {
                0
            };
            let mut info = LockInfo::new(name, owner, 1, token);
            info.metadata = meta
                .and_then(|m| serde_json::from_str::<Metadata>(&m).ok())
                .unwrap_or_default();
            info.remaining = u64::try_from(pttl).ok().map(Duration::from_millis);
            info
        };
        Ok(Some(info))
    }
}

struct RedisWaiter {
    /// Unlock messages; `None` when pub/sub is unavailable (then: polling).
    watch: Option<Watch>,
    poll: Duration,
    /// Where an in-process hand-off to this waiter lands.
    slot: Option<(Arc<Inner>, Keys, Arc<handoff::Slot<RedisHeld>>)>,
}

impl std::fmt::Debug for RedisWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisWaiter")
            .field("watch", &self.watch)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Waiter for RedisWaiter {
    async fn changed(&mut self, max: Duration) -> Result<()> {
        let poll = self.poll;
        let message = async {
            match self.watch.as_mut() {
                Some(w) => w.changed(max).await,
                None => {
                    tokio::time::sleep(max.min(poll)).await;
                    Ok(())
                }
            }
        };
        match &self.slot {
            None => message.await,
            Some((_, _, slot)) => {
                tokio::select! {
                    r = message => r,
                    () = slot.handed() => Ok(()),
                }
            }
        }
    }
}

impl Drop for RedisWaiter {
    fn drop(&mut self) {
        let Some((inner, keys, slot)) = self.slot.take() else {
            return;
        };
        let Some(handoffs) = inner.handoffs.as_ref() else {
            return;
        };
        let Some(leftover) = handoffs.leave(&keys.lock, &slot) else {
            return;
        };
        // A hand-off reached this waiter after it stopped waiting: give the lock back.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        match leftover {
            handoff::Leftover::Grant(held) => {
                rt.spawn(async move {
                    if let Err(e) = held.give_back().await {
                        tracing::warn!(lock = %keys.lock, error = %e, "could not give back a lock handed to a waiter that left; it expires with its lease");
                    }
                });
            }
            // Tried again while the connection is down, as it likely is: the hand-off's
            // reply was lost.
            handoff::Leftover::Maybe { owner, nonce } => {
                inner.abandon_later(keys, owner, nonce, Orphan::Left, GIVE_BACK_WATCH);
            }
        }
    }
}

struct RedisHeld {
    inner: Arc<Inner>,
    name: LockName,
    keys: Keys,
    owner: Owner,
    fence: u64,
    /// The nonce of the attempt or hand-off that took this hold.
    nonce: GrantNonce,
    released: std::sync::atomic::AtomicBool,
    /// Set on a grant handed over in-process: when the hand-off was sent.
    granted_at: Option<std::time::Instant>,
    /// Counted among this process's holders of the lock (see `handoff`).
    counted: std::sync::atomic::AtomicBool,
    /// Granted after a lost reply: an earlier try may still land, even after this
    /// hold's release, so the release leaves a give-back behind.
    in_doubt: bool,
}

/// How many times in all a Redisson-layout release is sent when its connection failed
/// under it (see `RedisHeld::release`), and the pause after the first failure
/// (doubled after each next one).
const RELEASE_TRIES: u32 = 3;
const RELEASE_PAUSE: Duration = Duration::from_millis(50);

impl Drop for RedisHeld {
    fn drop(&mut self) {
        if self
            .counted
            .swap(false, std::sync::atomic::Ordering::SeqCst)
            && let Some(h) = &self.inner.handoffs
        {
            h.note_gone(&self.keys.lock, self.owner.as_str());
        }
    }
}

impl std::fmt::Debug for RedisHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisHeld")
            .field("name", &self.name)
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

/// What a release's in-process hand-off did ([`RedisHeld::hand_off`]).
enum HandOff {
    /// This hold was given back (and the lock handed over, or released to everyone).
    Done,
    /// The script found this hold gone: nothing was given back, nor handed over.
    NotHeld,
    /// The script did not run: the release gives the hold back itself.
    NotRun,
}

impl RedisHeld {
    /// Release a hold no guard owns (handed to a waiter that left): one found gone
    /// (broken meanwhile) is given back already, not an error.
    async fn give_back(&self) -> Result<()> {
        match self.release().await {
            Err(Error::NotOwner { .. }) => Ok(()),
            done => done,
        }
    }

    /// Release by handing the lock to the waiter of `offer`: one script, which gives
    /// back this hold and, if it was the last, makes the waiter the holder with a new
    /// fencing token (or, at the end of a streak with listeners elsewhere, releases it
    /// to everyone). An error that [`Error::is_retryable`]: cut off, it may or may not
    /// have run.
    async fn hand_off(
        &self,
        handoffs: &handoff::Handoffs<RedisHeld>,
        offer: handoff::Offer<RedisHeld>,
    ) -> Result<HandOff> {
        let sent_at = std::time::Instant::now();
        let want = &offer.want;
        let keys = [
            Key::Plain(&self.keys.lock),
            self.keys.counter_key(),
            self.keys.signal_key(),
        ];
        let answer: redis::RedisResult<(i64, u64)> =
            call::Call::new(&layout::REDISSON_HANDOFF, &keys, 8)
                .arg(self.owner.as_str())
                .arg(self.fence)
                .arg(offer.owner().as_str())
                .arg(u64::try_from(want.ttl.as_millis()).unwrap_or(u64::MAX))
                .arg(&want.metadata)
                .arg(&want.nonce)
                .arg(if offer.last { "1" } else { "0" })
                .arg(self.nonce.as_str())
                .run(&self.inner.conn)
                .await;
        match answer {
            Ok((0, fence)) => {
                let grant = RedisHeld {
                    inner: Arc::clone(&self.inner),
                    name: self.name.clone(),
                    keys: self.keys.clone(),
                    owner: offer.owner().clone(),
                    fence,
                    nonce: GrantNonce::new(&want.nonce),
                    released: std::sync::atomic::AtomicBool::new(false),
                    granted_at: Some(sent_at),
                    counted: std::sync::atomic::AtomicBool::new(true),
                    in_doubt: false,
                };
                handoffs.note_held(&self.keys.lock, offer.owner().as_str(), sent_at + want.ttl);
                match handoffs.deliver(&self.keys.lock, offer, grant) {
                    Ok(()) => crate::telemetry::handoff(self.inner.scheme()),
                    // The waiter left while the hand-off was on its way: its hold goes
                    // back, if not now then in the background (still marked as the
                    // hand-off's, it is the one `redisson_abandon.lua` gives back).
                    // This hold was handed over either way: not an error of its release.
                    Err(grant) => {
                        if let Err(e) = grant.give_back().await {
                            tracing::warn!(lock = %self.name, error = %e, "a hand-off's waiter left and its hold could not be given back yet; trying in the background");
                            self.inner.abandon_later(
                                self.keys.clone(),
                                grant.owner.clone(),
                                grant.nonce.as_str().to_owned(),
                                Orphan::Left,
                                GIVE_BACK_WATCH,
                            );
                        }
                    }
                }
                Ok(HandOff::Done)
            }
            Ok((-2, _)) => {
                handoffs.released_to_everyone(&self.keys.lock, offer);
                Ok(HandOff::Done)
            }
            Ok((-1, _)) => {
                // No longer ours: nothing was handed over, nor given back.
                handoffs.decline(offer);
                Ok(HandOff::NotHeld)
            }
            Ok(_) => {
                // Not the last hold: given back, nothing handed over.
                handoffs.decline(offer);
                Ok(HandOff::Done)
            }
            Err(e) if uncertain(&e) => {
                if let Some((owner, nonce)) = handoffs.uncertain(offer, sent_at) {
                    // Its waiter left meanwhile: nobody will recover it.
                    let keys = self.keys.clone();
                    let what = Orphan::Left;
                    self.inner
                        .abandon_later(keys, owner, nonce, what, GIVE_BACK_WATCH);
                }
                Err(map_err(&e))
            }
            Err(e) => {
                // Refused (e.g. a script the ACL does not allow): nothing ran.
                tracing::debug!(lock = %self.name, error = %e, "hand-off refused; releasing");
                handoffs.decline(offer);
                Ok(HandOff::NotRun)
            }
        }
    }
}

#[async_trait]
impl HeldLock for RedisHeld {
    fn fencing_token(&self) -> u64 {
        self.fence
    }

    /// On one server (or through Sentinel) one renew script carries many holds; on a
    /// cluster each renewal is a command of its own.
    fn renews_in_batches(&self) -> bool {
        !self.inner.cluster
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let sent = std::time::Instant::now();
        let held = self
            .inner
            .renewer
            .renew(&self.keys, &self.owner, self.fence, ttl)
            .await?;
        if held {
            if let Some(h) = &self.inner.handoffs {
                h.note_renewed(&self.keys.lock, sent + ttl);
            }
            Ok(())
        } else {
            Err(Error::NotOwner {
                name: self.name.as_str().to_owned(),
            })
        }
    }

    fn granted_at(&self) -> Option<std::time::Instant> {
        self.granted_at
    }

    async fn release(&self) -> Result<()> {
        use std::sync::atomic::Ordering;
        if self.released.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let handed = match &self.inner.handoffs {
            Some(handoffs) => {
                match handoffs.offer(
                    &self.keys.lock,
                    self.counted
                        .swap(false, Ordering::SeqCst)
                        .then_some(self.owner.as_str()),
                ) {
                    // Boxed: inline, the hand-off's state would make every
                    // release's future too large for the allocator's per-thread cache.
                    Some(offer) => Box::pin(self.hand_off(handoffs, offer)).await,
                    None => Ok(HandOff::NotRun),
                }
            }
            None => Ok(HandOff::NotRun),
        };
        // Whether a "not held" is this release's own answer: on a single server (where
        // the client library sends each command once), to the first send of the only
        // script that ran (a hand-off cut off may have given the hold back already).
        let single = matches!(self.inner.conn, Conn::Single(_));
        let certain = single && handed.is_ok();
        // Ok(whether the hold was found), as far as this release can tell.
        let released = match handed {
            Ok(HandOff::Done) => Ok(true),
            Ok(HandOff::NotHeld) => Ok(!single),
            Err(e) if !e.is_retryable() => Err(e),
            // Not handed over, or the hand-off was cut off (`hand_off`'s only retryable
            // error: it may or may not have run): this hold's own release. After a
            // hand-off that ran, this hold's field is gone and the release does
            // nothing; if it did not run, the lock goes to everyone, its waiter woken
            // by the unlock message rather than at the end of the lease; a hand-off
            // that runs after it finds this hold's field gone and hands over nothing.
            // On the Redisson layout, sent again up to `RELEASE_TRIES` in all when
            // `worth_resending`. (Inline, not a function of its own: one more future
            // level costs every release about 110 instructions.)
            Ok(HandOff::NotRun) | Err(_) => {
                let tries = if self.keys.meta_key().is_none() {
                    RELEASE_TRIES
                } else {
                    1
                };
                let (mut tried, mut pause) = (1, RELEASE_PAUSE);
                loop {
                    match self
                        .inner
                        .release(
                            &self.keys,
                            self.owner.as_str(),
                            self.fence,
                            self.nonce.as_str(),
                        )
                        .await
                    {
                        Ok(left) => break Ok(left >= 0 || !certain || tried > 1),
                        Err(e) if tried < tries && worth_resending(&e) => {
                            tracing::debug!(error = %e, "redis: release failed; sending it again");
                            tokio::time::sleep(pause).await;
                            (tried, pause) = (tried + 1, pause.saturating_mul(2));
                        }
                        Err(e) => break Err(map_err(&e)),
                    }
                }
            }
        };
        match released {
            Ok(found) => {
                if self.in_doubt {
                    // A try of this acquisition that is still on its way would take a
                    // hold no guard owns, now that this one is gone.
                    self.inner.abandon_later(
                        self.keys.clone(),
                        self.owner.clone(),
                        self.nonce.as_str().to_owned(),
                        Orphan::Failed(Recovery::Retry),
                        GIVE_BACK_WATCH,
                    );
                }
                if found {
                    Ok(())
                } else {
                    Err(Error::NotOwner {
                        name: self.name.as_str().to_owned(),
                    })
                }
            }
            Err(e) => {
                self.released.store(false, Ordering::SeqCst);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redisson-layout scripts run by hand on the lock `l` (counter `c`, channel `s`).
    struct Scripts(redis::aio::MultiplexedConnection);

    impl Scripts {
        async fn run(&mut self, script: &redis::Script, keys: &[&str], args: &[&str]) {
            let mut inv = script.prepare_invoke();
            for k in keys {
                inv.key(*k);
            }
            for a in args {
                inv.arg(*a);
            }
            let _: redis::Value = inv.invoke_async(&mut self.0).await.expect("script");
        }

        /// A Redis server of its own and a connection to it (`None`: no server here,
        /// which `DLOCK_REQUIRE_SERVERS` makes a failure).
        async fn start() -> Option<(dlock_testkit::RedisServer, Self)> {
            let server = dlock_testkit::RedisServer::start()?;
            let client = redis::Client::open(server.url()).expect("client");
            let conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("connect");
            Some((server, Scripts(conn)))
        }

        async fn acquire(&mut self, owner: &str, nonce: &str, recovering: bool) {
            self.take(false, owner, nonce, recovering).await;
        }

        /// A waiter that left with an uncertain hand-off (`Orphan::Left`).
        async fn abandon(&mut self, owner: &str, nonce: &str) {
            let args = [owner, nonce, "0", "1"];
            self.run(&layout::REDISSON_ABANDON, &["l", "s"], &args)
                .await;
        }

        /// An attempt that failed after a lost reply (`Orphan::Failed`); `handed`: it
        /// was recovering a hand-off.
        async fn give_back(&mut self, owner: &str, nonce: &str, handed: bool) {
            let args = [owner, nonce, "1", if handed { "1" } else { "0" }];
            self.run(&layout::REDISSON_ABANDON, &["l", "s"], &args)
                .await;
        }

        /// A waiter recovers a hand-off whose reply was lost (`Recovery::HandOff`).
        async fn recover_hand_off(&mut self, owner: &str, handed: &str) {
            let field = format!("dlock:g:{handed}");
            let args = ["10000", owner, "{}", &field, Recovery::HandOff.arg()];
            self.run(&layout::REDISSON_ACQUIRE, &["l", "c"], &args)
                .await;
        }

        /// `R`'s last hold (nonce `r`) handed to `to` with nonce `handed`.
        async fn hand_off(&mut self, to: &str, handed: &str) -> (i64, u64) {
            let fence: String = self.cmd(&["HGET", "l", "dlock:fence"]).await;
            layout::REDISSON_HANDOFF
                .key("l")
                .key("c")
                .key("s")
                .arg(&["R", &fence, to, "10000", "{}", handed, "0", "r"])
                .invoke_async(&mut self.0)
                .await
                .expect("hand-off")
        }

        async fn exists(&mut self) -> bool {
            let n: i64 = self.cmd(&["EXISTS", "l"]).await;
            n == 1
        }

        async fn cmd<T: redis::FromRedisValue>(&mut self, args: &[&str]) -> T {
            redis::cmd(args[0])
                .arg(&args[1..])
                .query_async(&mut self.0)
                .await
                .expect("command")
        }

        async fn holds(&mut self, owner: &str) -> Option<i64> {
            self.cmd(&["HGET", "l", owner]).await
        }

        /// The holds' own fields on `l`, sorted.
        async fn grants(&mut self) -> Vec<String> {
            let fields: Vec<String> = self.cmd(&["HKEYS", "l"]).await;
            let mut grants: Vec<String> = fields
                .into_iter()
                .filter(|f| f.starts_with("dlock:g:"))
                .collect();
            grants.sort();
            grants
        }

        /// An acquisition by `owner` with `nonce`, fair or not.
        async fn take(&mut self, fair: bool, owner: &str, nonce: &str, recovering: bool) {
            let recovering = if recovering { "1" } else { "0" };
            let field = format!("dlock:g:{nonce}");
            if fair {
                let args = ["10000", owner, "{}", &field, recovering, "0", nonce];
                self.run(&layout::REDISSON_FAIR_ACQUIRE, &["l", "c", "q", "d"], &args)
                    .await;
            } else {
                let args = ["10000", owner, "{}", &field, recovering];
                self.run(&layout::REDISSON_ACQUIRE, &["l", "c"], &args)
                    .await;
            }
        }

        async fn release(&mut self, owner: &str, nonce: &str) {
            let fence: String = self.cmd(&["HGET", "l", "dlock:fence"]).await;
            let script = Layout::Redisson.release_script();
            let field = format!("dlock:g:{nonce}");
            self.run(script, &["l", "s"], &[owner, &fence, &field])
                .await;
        }
    }

    #[test]
    fn stored_metadata_is_what_serde_writes() {
        let own = Metadata::this_process();
        let noted = Metadata::this_process().with_note("a \"quoted\" note");
        let empty = Metadata::default();
        for metadata in [&own, &noted, &empty] {
            for nonce in ["0123456789abcdef0123456789abcdef", "00ff:h", "", "a\"b"] {
                let stored = StoredMetadata { metadata, nonce };
                let json = stored.to_json();
                assert_eq!(json, serde_json::to_string(&stored).expect("json"));
                let back: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
                assert_eq!(back["nonce"], nonce);
            }
        }
    }

    /// Task A's grant lands but its reply is lost; before A retries, task B, which
    /// shares the owner, re-enters. A's retry must find its own grant, not count a
    /// third hold that no guard would give back (the lock would stay taken, unrenewed,
    /// until its lease ran out).
    #[tokio::test]
    async fn a_retry_finds_its_grant_after_a_shared_owners_re_entry() {
        let Some((_server, mut r)) = Scripts::start().await else {
            return;
        };
        for fair in [false, true] {
            let () = r.cmd(&["DEL", "l", "q", "d"]).await;
            r.take(fair, "O", "a", false).await;
            r.take(fair, "O", "b", false).await;
            assert_eq!(r.holds("O").await, Some(2), "fair: {fair}");
            r.take(fair, "O", "a", true).await;
            assert_eq!(r.holds("O").await, Some(2), "one hold each (fair: {fair})");
            assert_eq!(r.grants().await, ["dlock:g:a", "dlock:g:b"]);
            r.release("O", "b").await;
            assert_eq!(r.grants().await, ["dlock:g:a"]);
            // A's reply is lost again after B left: still its one hold.
            r.take(fair, "O", "a", true).await;
            assert_eq!(r.holds("O").await, Some(1), "fair: {fair}");
            r.release("O", "a").await;
            let exists: i64 = r.cmd(&["EXISTS", "l"]).await;
            assert_eq!(exists, 0, "both released, the lock is free (fair: {fair})");
        }
    }

    /// The client library may send a command again after a dropped connection (the
    /// cluster client does), without the recovery flag: an acquisition sent twice takes
    /// one hold, and a release or hand-off sent twice gives back one, never the hold of
    /// another task sharing the owner.
    #[tokio::test]
    async fn a_command_sent_twice_takes_and_gives_back_one_hold() {
        let Some((_server, mut r)) = Scripts::start().await else {
            return;
        };
        for fair in [false, true] {
            let () = r.cmd(&["DEL", "l", "q", "d"]).await;
            for _ in 0..2 {
                r.take(fair, "O", "a", false).await;
                assert_eq!(r.holds("O").await, Some(1), "fair: {fair}");
            }
            for _ in 0..2 {
                r.take(fair, "O", "b", false).await;
                assert_eq!(r.holds("O").await, Some(2), "fair: {fair}");
            }
            for _ in 0..2 {
                r.release("O", "b").await;
                assert_eq!(r.holds("O").await, Some(1), "A's hold stays (fair: {fair})");
            }
            assert_eq!(r.grants().await, ["dlock:g:a"]);
            r.release("O", "a").await;
            let exists: i64 = r.cmd(&["EXISTS", "l"]).await;
            assert_eq!(exists, 0, "fair: {fair}");
        }
        // A hand-off from R to O, sent twice: O has one hold, with the hand-off's field,
        // and the second answer is the first (the waiter gets the hold it made).
        r.acquire("R", "r", false).await;
        let mut answers = Vec::new();
        for _ in 0..2 {
            answers.push(r.hand_off("O", "h").await);
            assert_eq!(r.holds("O").await, Some(1));
            assert_eq!(r.grants().await, ["dlock:g:h"]);
        }
        assert_eq!(answers[0].0, 0, "handed over: {answers:?}");
        assert_eq!(answers[0], answers[1]);
    }

    /// A hand-off to waiter `O` whose reply was lost, raced by O's own attempt: undoing
    /// the hand-off gives back exactly its hold, never the attempt's (which a guard
    /// holds), and recovering it twice takes one hold, not two.
    #[tokio::test]
    async fn a_lost_hand_off_is_undone_without_touching_the_attempts_hold() {
        let Some((_server, mut r)) = Scripts::start().await else {
            return;
        };
        let attempt = "F";
        let handed = handoff_nonce(attempt);
        assert_ne!(handed, attempt);
        for case in 0..4 {
            let () = r.cmd(&["DEL", "l"]).await;
            // R holds; its release hands the lock to waiter O (case 3: the hand-off never
            // ran, R's hold ran out and O's own attempt took the lock).
            r.acquire("R", "r", false).await;
            let fence: String = r.cmd(&["HGET", "l", "dlock:fence"]).await;
            if case == 3 {
                let () = r.cmd(&["DEL", "l"]).await;
            } else {
                let args = ["R", &fence, "O", "10000", "{}", &handed, "0", "r"];
                r.run(&layout::REDISSON_HANDOFF, &["l", "c", "s"], &args)
                    .await;
            }
            match case {
                0 => {
                    // O's attempt lands after the hand-off, re-entering: a guard holds it.
                    r.acquire("O", attempt, false).await;
                    assert_eq!(r.holds("O").await, Some(2));
                    r.abandon("O", &handed).await;
                    assert_eq!(r.holds("O").await, Some(1), "the attempt's hold stays");
                    // ... with its own field; the hand-off's and R's are gone.
                    assert_eq!(r.grants().await, ["dlock:g:F"]);
                }
                1 => {
                    // O recovers the hand-off, and its recovery's reply is lost too.
                    for _ in 0..2 {
                        r.recover_hand_off("O", &handed).await;
                        assert_eq!(r.holds("O").await, Some(1), "one hold, not two");
                    }
                    // Picked up: a late undo finds nothing to give back.
                    r.abandon("O", &handed).await;
                    assert_eq!(r.holds("O").await, Some(1));
                }
                2 => {
                    // O left without an attempt after the hand-off: the lock goes.
                    r.abandon("O", &handed).await;
                    let exists: i64 = r.cmd(&["EXISTS", "l"]).await;
                    assert_eq!(exists, 0);
                }
                _ => {
                    r.acquire("O", attempt, false).await;
                    r.abandon("O", &handed).await;
                    let left = r.holds("O").await;
                    assert_eq!(left, Some(1), "a hand-off that never ran undoes nothing");
                }
            }
        }
    }

    /// An attempt fails after lost replies (or while recovering a hand-off), and a
    /// try may have been granted: no guard owns that hold, so it is given back by its
    /// nonce, and only it (another task sharing the owner keeps its hold). Given back
    /// twice, or for a try that never landed, nothing more goes.
    #[tokio::test]
    async fn a_failed_attempts_grant_is_given_back_and_nothing_else() {
        let Some((_server, mut r)) = Scripts::start().await else {
            return;
        };
        for fair in [false, true] {
            let () = r.cmd(&["DEL", "l", "q", "d"]).await;
            r.take(fair, "O", "a", false).await;
            r.take(fair, "O", "b", false).await;
            for _ in 0..2 {
                r.give_back("O", "a", false).await;
                assert_eq!(r.holds("O").await, Some(1), "fair: {fair}");
                assert_eq!(r.grants().await, ["dlock:g:b"], "fair: {fair}");
            }
            r.give_back("O", "never", false).await;
            assert_eq!(r.holds("O").await, Some(1), "fair: {fair}");
            r.give_back("O", "b", false).await;
            assert!(
                !r.exists().await,
                "the last hold given back frees it (fair: {fair})"
            );
        }
        // Recovering a hand-off claimed it, then failed: the claimed hold goes too.
        r.acquire("R", "r", false).await;
        assert_eq!(r.hand_off("O", "h").await.0, 0);
        r.recover_hand_off("O", "h").await;
        r.give_back("O", "h", true).await;
        assert!(!r.exists().await, "the claimed hand-off was given back");
        // Plain layouts: the grant is the attempt's while the metadata names its nonce.
        let plain = |nonce: &str| {
            let mut inv = layout::PLAIN_ABANDON.prepare_invoke();
            inv.key("p").key("p:signal").key("p:meta");
            inv.arg("O").arg(nonce).arg("publish");
            inv
        };
        let () = r.cmd(&["SET", "p", "O", "PX", "10000"]).await;
        let () = r
            .cmd(&["SET", "p:meta", r#"{"nonce":"b"}"#, "PX", "10000"])
            .await;
        let kept: i64 = plain("a").invoke_async(&mut r.0).await.expect("abandon");
        assert_eq!(kept, 0, "a later grant of the same owner stays");
        let gone: i64 = plain("b").invoke_async(&mut r.0).await.expect("abandon");
        assert_eq!(gone, 1);
        let left: i64 = r.cmd(&["EXISTS", "p", "p:meta"]).await;
        assert_eq!(left, 0);
    }

    /// A failed attempt's give-back goes on looking: a try that lands after its first
    /// look (sent again by the client library on a new connection, or run late by a
    /// paused server) is given back too, long before its lease would end.
    #[tokio::test]
    async fn a_give_back_finds_a_try_that_lands_late() {
        let Some((server, mut r)) = Scripts::start().await else {
            return;
        };
        let url = ConnectUrl::parse(&server.url()).expect("url");
        let backend = RedisBackend::open(url).await.expect("open");
        let inner = &backend.inner;
        let keys = inner.keys(&LockName::new("l").expect("name"));
        let owner: Owner = "O".parse().expect("owner");
        let what = Orphan::Failed(Recovery::Retry);
        let watch = Duration::from_secs(20);
        inner.abandon_later(keys, owner, "late".into(), what, watch);
        // Its first look finds nothing; then the late try lands.
        tokio::time::sleep(Duration::from_millis(400)).await;
        r.acquire("O", "late", false).await;
        // Well before its 10 s lease ends (the give-back looks at least once a second).
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while r.exists().await {
            assert!(
                std::time::Instant::now() < end,
                "the late grant was never given back"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A try's reply is lost and the retry is answered busy: the first try may still
    /// land once the lock is free, so the attempt leaves a give-back looking for it;
    /// it leaves its place among the watching when done.
    #[tokio::test]
    async fn a_busy_answer_after_a_lost_reply_leaves_a_give_back() {
        use dlock_testkit::{Fault, FaultProxy};
        use std::sync::atomic::Ordering;
        let Some((server, mut r)) = Scripts::start().await else {
            return;
        };
        let proxy = FaultProxy::start(server.addr()).await.expect("proxy");
        let url = format!("redis://{}?timeout=2s", proxy.addr());
        let backend = RedisBackend::open(ConnectUrl::parse(&url).expect("url"))
            .await
            .expect("open");
        let backend = Arc::new(backend);
        let owner: Owner = "O".parse().expect("owner");
        let req = |name: &str| {
            let name = LockName::new(name).expect("name");
            AcquireRequest::plain(name, owner.clone(), Duration::from_secs(1))
        };
        // The acquire script is loaded through the proxy first.
        match backend.try_acquire(&req("warm-up")).await.expect("warm-up") {
            Attempt::Acquired(held) => held.release().await.expect("release"),
            Attempt::Busy { .. } => panic!("warm-up: busy"),
        }
        r.acquire("X", "x", false).await;
        proxy.set(Fault::DropReplies);
        let attempt = tokio::spawn({
            let backend = Arc::clone(&backend);
            let req = req("l");
            async move { backend.try_acquire(&req).await }
        });
        // The connection is reset while replies are still dropped (a reply the proxy
        // had not read yet must not slip through), then replies flow again.
        let reset = || async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            proxy.reset_all();
            tokio::time::sleep(Duration::from_millis(100)).await;
            proxy.set(Fault::None);
        };
        reset().await;
        let answer = attempt.await.expect("join").expect("the retry is answered");
        assert!(matches!(answer, Attempt::Busy { .. }), "X holds the lock");
        let inner = &backend.inner;
        assert_eq!(
            inner.watching.load(Ordering::Relaxed),
            1,
            "a give-back looks on"
        );
        // Its watch is the lease (1 s): then it ends and gives its place back.
        let until_none_watch = || async {
            let end = std::time::Instant::now() + Duration::from_secs(10);
            while inner.watching.load(Ordering::Relaxed) > 0 {
                assert!(std::time::Instant::now() < end, "the give-back never ended");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        until_none_watch().await;
        // Granted after a lost reply: the retry finds the grant and a guard owns it, so
        // nothing looks on; its release leaves a give-back for a try still on its way.
        proxy.set(Fault::DropReplies);
        let attempt = tokio::spawn({
            let backend = Arc::clone(&backend);
            let req = req("m");
            async move { backend.try_acquire(&req).await }
        });
        reset().await;
        let answer = attempt.await.expect("join").expect("the retry is answered");
        let Attempt::Acquired(held) = answer else {
            panic!("the lost reply's grant is recovered");
        };
        assert_eq!(inner.watching.load(Ordering::Relaxed), 0, "a guard owns it");
        held.release().await.expect("release");
        assert_eq!(
            inner.watching.load(Ordering::Relaxed),
            1,
            "released: looks on"
        );
    }

    /// A hand-off whose reply was lost may still run after its waiter gave up on it:
    /// its recovery found the lock still another's, it left, or its recovery failed.
    /// Then it must release to everyone, not leave the waiter's owner a hold that no
    /// guard owns (the lock would stay taken until its lease ran out).
    #[tokio::test]
    async fn a_hand_off_run_after_its_waiter_gave_up_releases_instead() {
        let Some((_server, mut r)) = Scripts::start().await else {
            return;
        };
        for case in 0..4 {
            let () = r.cmd(&["DEL", "l"]).await;
            r.acquire("R", "r", false).await;
            match case {
                0 => r.recover_hand_off("O", "h").await,
                1 => r.abandon("O", "h").await,
                2 => r.give_back("O", "h", true).await,
                // Nobody gave up: the hand-off goes through.
                _ => {}
            }
            assert_eq!(r.holds("R").await, Some(1), "case {case}: R's hold stays");
            let answer = r.hand_off("O", "h").await;
            if case < 3 {
                assert_eq!(answer, (-2, 0), "case {case}: released to everyone");
                assert!(!r.exists().await, "case {case}: no hold left");
            } else {
                assert_eq!(answer.0, 0);
                assert_eq!(r.holds("O").await, Some(1));
                assert_eq!(r.grants().await, ["dlock:g:h"]);
            }
        }
        // Releaser and waiter share the owner: the recovery re-enters (a hold of its own,
        // which its guard gives back), and the late hand-off gives back the releaser's.
        let () = r.cmd(&["DEL", "l"]).await;
        r.acquire("R", "r", false).await;
        r.recover_hand_off("R", "h").await;
        assert_eq!(r.holds("R").await, Some(2));
        assert_eq!(r.hand_off("R", "h").await, (1, 0), "not the last hold");
        assert_eq!(r.grants().await, ["dlock:g:h"]);
        r.release("R", "h").await;
        assert!(!r.exists().await);
    }

    async fn refused(url: &str) -> Error {
        RedisBackend::open(ConnectUrl::parse(url).expect("parses"))
            .await
            .expect_err(url)
    }

    /// Combinations that cannot work are refused before any connection is made.
    #[tokio::test]
    async fn impossible_combinations_are_refused_up_front() {
        // python-redis-lock's signal list lives in another hash slot than its lock.
        let e = refused("redis+cluster://127.0.0.1:1?layout=python-redis-lock").await;
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
        let e = refused("redis+cluster://127.0.0.1:1?min_replicas=1").await;
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        let e = refused("redis://127.0.0.1:1?db=2").await;
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
        let e = refused("redis://127.0.0.1:1,127.0.0.1:2").await;
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
        let e = refused("redis+sentinel://127.0.0.1:1").await;
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
        // TLS files belong to rediss:// only, a key needs its certificate, and a file
        // that cannot be read is named.
        let e = refused("redis://127.0.0.1:1?ca_file=/x").await;
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
        let e = refused("rediss://127.0.0.1:1?key_file=/x").await;
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
        let e = refused("rediss://127.0.0.1:1?ca_file=/nonexistent/ca.pem").await;
        assert!(e.to_string().contains("ca_file"), "{e}");
        let e = refused("redis://127.0.0.1:1?layout=redlock").await;
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
        let e = refused("redis://127.0.0.1:1?min_replicas=0").await;
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e}");
    }
}
