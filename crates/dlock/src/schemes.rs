//! The URL scheme table: which backends exist, which cargo feature provides each, what
//! each guarantees — asked of the backend type itself, never kept here a second time —
//! and opening one from a parsed URL.

use std::sync::Arc;

use crate::backend::{Backend, Capabilities};
use crate::error::{Error, Result};
use crate::url::ConnectUrl;

/// A backend type's capabilities with default URL options, on a server whose token
/// source is durable (`true`) or not.
type CapsFn = fn(bool) -> Capabilities;

/// One URL scheme dlock knows.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub struct SchemeInfo {
    /// The scheme, e.g. `sqlite`.
    pub scheme: &'static str,
    /// Cargo feature that provides it (`None`: always compiled).
    pub feature: Option<&'static str>,
    /// Whether this build can open it.
    pub available: bool,
    /// One line about it.
    pub description: &'static str,
    /// Capabilities with default URL options on a server in its default configuration
    /// (e.g. Redis without `appendfsync always`: best-effort tokens), when available.
    pub capabilities: Option<Capabilities>,
    caps: Option<CapsFn>,
}

impl SchemeInfo {
    /// The capabilities a locker of this scheme with default URL options reports on a
    /// server whose token source is `durable` (a Redis that fsyncs every write, a
    /// PostgreSQL with `fsync=on`, …) or not. `None` when the backend is not compiled in.
    #[must_use]
    pub fn capabilities_on(&self, durable: bool) -> Option<Capabilities> {
        self.caps.map(|f| f(durable))
    }
}

/// `Some(f)` when `$feature` is compiled in.
macro_rules! caps_of {
    ($feature:literal, $f:path) => {{
        #[cfg(feature = $feature)]
        let caps: Option<CapsFn> = Some($f);
        #[cfg(not(feature = $feature))]
        let caps: Option<CapsFn> = None;
        caps
    }};
}

/// (scheme, feature, whether a server in its default configuration gives durable
/// tokens, description, capabilities).
type Row = (
    &'static str,
    Option<&'static str>,
    bool,
    &'static str,
    Option<CapsFn>,
);

fn rows() -> Vec<Row> {
    let memory: Option<CapsFn> = Some(crate::memory::MemoryBackend::capabilities_with);
    let sqlite = caps_of!("sqlite", crate::sqlite::SqliteBackend::capabilities_with);
    let redis = caps_of!("redis", crate::redis::RedisBackend::capabilities_with);
    let redis_resending = caps_of!("redis", crate::redis::RedisBackend::capabilities_resending);
    let redlock = caps_of!("redis", crate::redlock::RedlockBackend::capabilities_with);
    let etcd = caps_of!("etcd", crate::etcd::EtcdBackend::capabilities_with);
    let zk = caps_of!("zookeeper", crate::zookeeper::ZkBackend::capabilities_with);
    let postgres = caps_of!("postgres", crate::sql::postgres::capabilities_with);
    let mysql = caps_of!("mysql", crate::sql::mysql::capabilities_with);
    vec![
        (
            "memory",
            None,
            true,
            "in-process store (tests, tasks of one process)",
            memory,
        ),
        (
            "sqlite",
            Some("sqlite"),
            true,
            "embedded SQLite file: processes on one machine, no server (the default)",
            sqlite,
        ),
        (
            "redis",
            Some("redis"),
            false,
            "single Redis; Redisson-compatible layout by default",
            redis,
        ),
        (
            "rediss",
            Some("redis"),
            false,
            "single Redis over TLS (ca_file, cert_file, key_file)",
            redis,
        ),
        (
            "redis+cluster",
            Some("redis"),
            false,
            "Redis Cluster; Redisson-compatible layout by default",
            redis_resending,
        ),
        (
            "redis+sentinel",
            Some("redis"),
            false,
            "the master a set of Redis Sentinels names; re-resolved on failover",
            redis_resending,
        ),
        (
            "redlock",
            Some("redis"),
            false,
            "Redlock over N independent Redis masters; node-redlock/redsync layout",
            redlock,
        ),
        (
            "etcd",
            Some("etcd"),
            true,
            "etcd v3: session lease, queue by create revision, etcdctl-lock layout",
            etcd,
        ),
        (
            "etcds",
            Some("etcd"),
            true,
            "etcd over TLS (ca_file, cert_file, key_file)",
            etcd,
        ),
        (
            "zk",
            Some("zookeeper"),
            true,
            "ZooKeeper: ephemeral sequential nodes, Curator InterProcessMutex layout",
            zk,
        ),
        (
            "postgres",
            Some("postgres"),
            true,
            "PostgreSQL: lease table (default), mode=advisory, mode=row; LISTEN/NOTIFY",
            postgres,
        ),
        (
            "postgresql",
            Some("postgres"),
            true,
            "PostgreSQL (alias of postgres://)",
            postgres,
        ),
        (
            "mysql",
            Some("mysql"),
            true,
            "MySQL/MariaDB: lease table (default), mode=named (GET_LOCK), mode=row",
            mysql,
        ),
        (
            "mariadb",
            Some("mysql"),
            true,
            "MariaDB (alias of mysql://)",
            mysql,
        ),
    ]
}

/// Every scheme dlock knows, available or not.
#[must_use]
pub fn schemes() -> Vec<SchemeInfo> {
    rows()
        .into_iter()
        .map(|(scheme, feature, durable, description, caps)| SchemeInfo {
            scheme,
            feature,
            available: caps.is_some(),
            description,
            capabilities: caps.map(|f| f(durable)),
            caps,
        })
        .collect()
}

/// Check `name` against `url` without any I/O: a valid lock name, and one the URL's
/// options can map (`postgres://…?mode=advisory&advisory_key=number` takes the
/// canonical decimal spelling of an int8 only).
pub(crate) fn check_name(url: &str, name: &str) -> Result<()> {
    let name = crate::name::LockName::new(name)?;
    #[cfg_attr(not(feature = "postgres"), allow(unused_mut))]
    let mut url = ConnectUrl::parse(url)?;
    #[cfg(feature = "postgres")]
    if matches!(url.scheme(), "postgres" | "postgresql")
        && url.take_param("mode").as_deref() == Some("advisory")
        && url.take_param("advisory_key").as_deref() == Some("number")
    {
        crate::sql::postgres::AdvisoryKey::Number.key(&name)?;
    }
    let _ = (url, name);
    Ok(())
}

/// Open the backend named by `url`. A connection error names the address(es) tried
/// when the driver's message does not.
pub(crate) async fn open(url: ConnectUrl) -> Result<Arc<dyn Backend>> {
    let tried: Vec<String> = url.hosts().iter().map(ToString::to_string).collect();
    open_scheme(url).await.map_err(|e| match e {
        Error::Connection { backend, message }
            if !tried.is_empty() && !tried.iter().any(|h| message.contains(h.as_str())) =>
        {
            Error::Connection {
                backend,
                message: format!("cannot connect to {}: {message}", tried.join(",")),
            }
        }
        other => other,
    })
}

/// Each backend's opening is boxed: unboxed, this future (and every caller's) would be
/// as large as the largest of them, on the stack of whoever opens a `Locker` — pages a
/// short-lived process (`dlock run`) touches for nothing.
async fn open_scheme(url: ConnectUrl) -> Result<Arc<dyn Backend>> {
    match url.scheme() {
        "memory" => Ok(crate::memory::MemoryBackend::open(url)?),
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(Box::pin(crate::sqlite::SqliteBackend::open(url)).await?),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel" => {
            Ok(Box::pin(crate::redis::RedisBackend::open(url)).await?)
        }
        #[cfg(feature = "redis")]
        "redlock" => Ok(Box::pin(crate::redlock::RedlockBackend::open(url)).await?),
        #[cfg(feature = "etcd")]
        "etcd" | "etcds" => Ok(Box::pin(crate::etcd::EtcdBackend::open(url)).await?),
        #[cfg(feature = "zookeeper")]
        "zk" => Ok(Box::pin(crate::zookeeper::ZkBackend::open(url)).await?),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Box::pin(crate::sql::postgres::open(url)).await,
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => Box::pin(crate::sql::mysql::open(url)).await,
        other => match rows().into_iter().find(|r| r.0 == other) {
            Some((scheme, Some(feature), ..)) => Err(Error::BackendNotEnabled {
                scheme: scheme.to_owned(),
                feature: feature.to_owned(),
            }),
            _ => Err(url.invalid(&format!(
                "unknown scheme {other:?} (known: {})",
                rows().iter().map(|r| r.0).collect::<Vec<_>>().join(", ")
            ))),
        },
    }
}
