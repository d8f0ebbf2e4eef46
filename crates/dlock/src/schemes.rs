//! The URL scheme table: which backends exist, which cargo feature provides each, and
//! opening one from a parsed URL.

use std::sync::Arc;

use crate::backend::{Backend, Capabilities};
use crate::error::Result;
use crate::url::ConnectUrl;

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
    /// Capabilities with default options, when available.
    pub capabilities: Option<Capabilities>,
}

/// Every scheme dlock knows, available or not.
#[must_use]
pub fn schemes() -> Vec<SchemeInfo> {
    let mut out = vec![SchemeInfo {
        scheme: "memory",
        feature: None,
        available: true,
        description: "in-process store (tests, tasks of one process)",
        capabilities: Some(crate::memory::MemoryBackend::default().capabilities()),
    }];
    out.push(SchemeInfo {
        scheme: "sqlite",
        feature: Some("sqlite"),
        available: cfg!(feature = "sqlite"),
        description: "embedded SQLite file: processes on one machine, no server (the default)",
        capabilities: sqlite_caps(),
    });
    for (scheme, description) in [
        (
            "redis",
            "single Redis; Redisson-compatible layout by default",
        ),
        (
            "rediss",
            "single Redis over TLS (ca_file, cert_file, key_file)",
        ),
        (
            "redis+cluster",
            "Redis Cluster; Redisson-compatible layout by default",
        ),
        (
            "redis+sentinel",
            "the master a set of Redis Sentinels names; re-resolved on failover",
        ),
        (
            "redlock",
            "Redlock over N independent Redis masters; node-redlock/redsync layout",
        ),
    ] {
        out.push(SchemeInfo {
            scheme,
            feature: Some("redis"),
            available: cfg!(feature = "redis"),
            description,
            capabilities: redis_caps(),
        });
    }
    for (scheme, description) in [
        (
            "etcd",
            "etcd v3: session lease, queue by create revision, etcdctl-lock layout",
        ),
        ("etcds", "etcd over TLS (ca_file, cert_file, key_file)"),
    ] {
        out.push(SchemeInfo {
            scheme,
            feature: Some("etcd"),
            available: cfg!(feature = "etcd"),
            description,
            capabilities: etcd_caps(),
        });
    }
    out.push(SchemeInfo {
        scheme: "zk",
        feature: Some("zookeeper"),
        available: cfg!(feature = "zookeeper"),
        description: "ZooKeeper: ephemeral sequential nodes, Curator InterProcessMutex layout",
        capabilities: cfg!(feature = "zookeeper")
            .then(|| Capabilities::queue_and_watch(crate::backend::DEFAULT_SESSION_TIMEOUT)),
    });
    for scheme in ["postgres", "postgresql"] {
        out.push(SchemeInfo {
            scheme,
            feature: Some("postgres"),
            available: cfg!(feature = "postgres"),
            description: "PostgreSQL: lease table (default), mode=advisory, mode=row; LISTEN/NOTIFY",
            capabilities: postgres_caps(),
        });
    }
    for scheme in ["mysql", "mariadb"] {
        out.push(SchemeInfo {
            scheme,
            feature: Some("mysql"),
            available: cfg!(feature = "mysql"),
            description: "MySQL/MariaDB: lease table (default), mode=named (GET_LOCK), mode=row",
            capabilities: mysql_caps(),
        });
    }
    out
}

#[cfg(feature = "postgres")]
fn postgres_caps() -> Option<Capabilities> {
    Some(crate::sql::postgres::capabilities(crate::sql::Mode::Lease))
}

#[cfg(not(feature = "postgres"))]
fn postgres_caps() -> Option<Capabilities> {
    None
}

#[cfg(feature = "mysql")]
fn mysql_caps() -> Option<Capabilities> {
    Some(crate::sql::mysql::capabilities(crate::sql::Mode::Lease))
}

#[cfg(not(feature = "mysql"))]
fn mysql_caps() -> Option<Capabilities> {
    None
}

#[cfg(feature = "sqlite")]
fn sqlite_caps() -> Option<Capabilities> {
    let mut caps = Capabilities::new(crate::backend::Fencing::Durable);
    caps.fifo = true;
    caps.reentrant = true;
    caps.cross_process = true;
    Some(caps)
}

/// Redis capabilities with the default layout; fencing is durable only when the server
/// persists every write (checked at connect time), so the table shows best effort.
#[cfg(feature = "redis")]
fn redis_caps() -> Option<Capabilities> {
    let mut caps = Capabilities::new(crate::backend::Fencing::BestEffort);
    caps.native_wait = true;
    caps.fifo = true;
    caps.reentrant = true;
    caps.cross_process = true;
    Some(caps)
}

#[cfg(feature = "etcd")]
fn etcd_caps() -> Option<Capabilities> {
    Some(Capabilities::queue_and_watch(
        crate::backend::DEFAULT_SESSION_TIMEOUT,
    ))
}

#[cfg(not(feature = "etcd"))]
fn etcd_caps() -> Option<Capabilities> {
    None
}

#[cfg(not(feature = "redis"))]
fn redis_caps() -> Option<Capabilities> {
    None
}

#[cfg(not(feature = "sqlite"))]
fn sqlite_caps() -> Option<Capabilities> {
    None
}

/// Open the backend named by `url`.
pub(crate) async fn open(url: ConnectUrl) -> Result<Arc<dyn Backend>> {
    match url.scheme() {
        "memory" => Ok(crate::memory::MemoryBackend::open(url)?),
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(crate::sqlite::SqliteBackend::open(url).await?),
        #[cfg(not(feature = "sqlite"))]
        "sqlite" => Err(crate::error::Error::BackendNotEnabled {
            scheme: "sqlite".into(),
            feature: "sqlite".into(),
        }),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel" => {
            Ok(crate::redis::RedisBackend::open(url).await?)
        }
        #[cfg(feature = "redis")]
        "redlock" => Ok(crate::redlock::RedlockBackend::open(url).await?),
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel" | "redlock" => {
            Err(crate::error::Error::BackendNotEnabled {
                scheme: url.scheme().to_owned(),
                feature: "redis".into(),
            })
        }
        #[cfg(feature = "etcd")]
        "etcd" | "etcds" => Ok(crate::etcd::EtcdBackend::open(url).await?),
        #[cfg(not(feature = "etcd"))]
        "etcd" | "etcds" => Err(crate::error::Error::BackendNotEnabled {
            scheme: url.scheme().to_owned(),
            feature: "etcd".into(),
        }),
        #[cfg(feature = "zookeeper")]
        "zk" => Ok(crate::zookeeper::ZkBackend::open(url).await?),
        #[cfg(not(feature = "zookeeper"))]
        "zk" => Err(crate::error::Error::BackendNotEnabled {
            scheme: "zk".into(),
            feature: "zookeeper".into(),
        }),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => crate::sql::postgres::PostgresBackend::open(url).await,
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => Err(crate::error::Error::BackendNotEnabled {
            scheme: url.scheme().to_owned(),
            feature: "postgres".into(),
        }),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => crate::sql::mysql::MysqlBackend::open(url).await,
        #[cfg(not(feature = "mysql"))]
        "mysql" | "mariadb" => Err(crate::error::Error::BackendNotEnabled {
            scheme: url.scheme().to_owned(),
            feature: "mysql".into(),
        }),
        other => Err(url.invalid(&format!(
            "unknown scheme {other:?} (known: {})",
            schemes()
                .iter()
                .map(|s| s.scheme)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}
