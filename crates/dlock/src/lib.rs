//! # dlock — distributed locks over the servers you already run
//!
//! One async API (tokio) over several lock services, chosen by URL at run time. Every
//! grant carries a **fencing token** that strictly increases per lock; every holder is
//! **told when it loses** the lock ([`LockGuard::lost`]); waiting is by notification
//! where the backend can notify.
//!
//! ```no_run
//! # async fn demo() -> dlock::Result<()> {
//! let locker = dlock::Locker::connect("sqlite:///tmp/locks.db").await?;
//! let guard = locker.lock("orders:42").await?;
//! let token = guard.fencing_token(); // hand it to the protected resource
//! tokio::select! {
//!     _ = async { /* the critical section, using `token` */ } => {}
//!     err = guard.lost() => return Err(err), // renewal failed / lease gone
//! }
//! guard.release().await?; // or drop it: released in the background
//! # Ok(()) }
//! ```
//!
//! ## Beside the lock
//!
//! [`Locker::semaphore`] (at most N holders, each with a leased permit of its own),
//! [`Locker::rwlock`] (readers together or one writer; a waiting writer goes first) and
//! [`Locker::lock_all`] (several locks, all or none, never a deadlock between
//! overlapping sets), and [`Locker::election`] (campaign, resign, observe; the term is
//! the fencing token) on every backend. A permit or a read/write hold is a [`LockGuard`] like a lock's:
//! fencing token, renewal, `lost()`, cancel-safe acquisition. Which backends offer
//! which: [`Capabilities::primitives`] (memory, SQLite, Redis, PostgreSQL and
//! MySQL/MariaDB so far; Redlock, etcd and ZooKeeper refuse with [`Error::Unsupported`]).
//!
//! ## Backends
//!
//! | URL | backend | feature |
//! |---|---|---|
//! | `sqlite:///abs/path.db`, `sqlite://rel/path.db`, `sqlite::memory:` | embedded SQLite (default) | `sqlite` |
//! | `memory://`, `memory://STORE` | in-process | always |
//! | `redis://[user:pass@]host:port[/db]`, `rediss://…?ca_file=PEM`, `redis+cluster://n1:p,n2:p`, `redis+sentinel://s1:p,s2:p/master` | Redis, Redisson-compatible | `redis` |
//! | `redlock://a:p,b:p,c:p,d:p,e:p` | Redlock over independent Redis masters | `redis` |
//! | `etcd://h1:p,h2:p[/prefix]`, `etcds://…` | etcd v3, `etcdctl lock` layout | `etcd` |
//! | `zk://h1:p,h2:p[/root]` | ZooKeeper, Curator's layouts | `zookeeper` |
//! | `postgres://user:pass@host:5432/db[?mode=lease\|advisory\|row]` | PostgreSQL | `postgres` |
//! | `mysql://user:pass@host:3306/db[?mode=lease\|named\|row]`, `mariadb://…` | MySQL / MariaDB | `mysql` |
//!
//! Query parameters carry options (`?ttl=30s`); an unknown parameter is an error. Each
//! backend's module lists its options. In code, the typed options of [`connect`]
//! (`RedisOptions`, `PostgresOptions`, …) say the same without assembling a string:
//! [`Locker::with_options`]. Metrics and spans: [`telemetry`].
//!
//! ## What is guaranteed
//!
//! A lease lock alone cannot guarantee mutual exclusion: a holder paused past its lease
//! keeps running while the next holder starts. dlock fires [`LockGuard::lost`] before
//! the lease can run out on the server (its local deadline is `send time + TTL − 1 % −
//! 2 ms`, on the monotonic clock), and a resource that rejects fencing tokens lower than
//! the highest it has seen never accepts a stale operation, on every backend whose
//! [`Capabilities::fencing`] is [`Fencing::Durable`].

#![warn(missing_docs, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod connect;
mod election;
mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
mod finish;
mod guard;
mod hex;
mod keeper;
mod lease;
mod locker;
pub mod memory;
mod multi;
pub mod name;
mod notify;
mod options;
mod owner_waits;
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
mod queue;
mod random;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
pub mod redlock;
#[cfg(any(
    feature = "sqlite",
    feature = "redis",
    feature = "postgres",
    feature = "mysql"
))]
mod renewals;
mod rwlock;
mod schemes;
mod semaphore;
mod shared_holds;
#[cfg(any(feature = "zookeeper", feature = "etcd"))]
mod shared_order;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub mod sql;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod telemetry;
pub mod url;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

pub use backend::{
    AcquisitionId, Capabilities, Fencing, HoldKind, LockInfo, Primitive, Primitives, SessionTrust,
};
pub use election::{Election, Leader, LeaderWatch, Leadership};
pub use error::{Error, LossReason, Result};
pub use guard::{LockContext, LockGuard};
pub use locker::Locker;
pub use multi::MultiGuard;
pub use options::{
    DEFAULT_QUEUE_ENTRY_TTL, DEFAULT_TTL, LockOptions, MAX_TTL, MIN_TTL, Metadata, Owner, Renewal,
    Wait,
};
pub use rwlock::{NotDowngraded, RwLock};
pub use schemes::{SchemeInfo, schemes};
pub use semaphore::Semaphore;

/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
