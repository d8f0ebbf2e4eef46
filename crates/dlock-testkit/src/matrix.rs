//! Every backend at once, for the runs that cover them all (`dlock check`'s CI tier
//! and the RELIABILITY.md generator): one server of each kind on loopback, and the
//! URLs (with short sessions, so a dead holder's session ends in seconds).

use std::any::Any;

use crate::{EtcdServer, MariaDbServer, PgServer, RedisNodes, RedisOptions, RedisServer, ZkServer};

/// One backend configuration under test.
#[derive(Debug, Clone)]
pub struct Target {
    /// Short label, e.g. `postgres advisory`.
    pub label: String,
    /// The URL.
    pub url: String,
    /// The server process to pause (`--fault pause-server`); `None` for SQLite, one
    /// node (a minority) for Redlock.
    pub server_pid: Option<u32>,
}

/// Running servers and the targets they serve (servers stop on Drop).
pub struct Matrix {
    /// Every backend configuration.
    pub targets: Vec<Target>,
    /// Redlock's nodes, for node-loss faults.
    pub redlock: RedisNodes,
    /// The servers and the SQLite dir, stopped / removed on Drop.
    _keep: Vec<Box<dyn Any + Send>>,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matrix")
            .field("targets", &self.targets)
            .finish_non_exhaustive()
    }
}

impl Matrix {
    /// Start every server (or skip, see [`crate::skip`], when one is missing).
    /// Redis and the Redlock nodes persist every write (`appendfsync always`), so their
    /// tokens are durable.
    #[must_use]
    pub fn start() -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let persistent = RedisOptions {
            persistent: true,
            ..RedisOptions::default()
        };
        let mut redis = RedisServer::start_with(persistent.clone())?;
        let mut redlock = RedisNodes::start(5, &persistent)?;
        let etcd = EtcdServer::start()?;
        let zk = ZkServer::start()?;
        let mut pg = PgServer::start()?;
        let mut maria = MariaDbServer::start()?;
        let (redis_pid, node_pid) = (redis.process().pid(), redlock.node(2).process().pid());
        let (pg_pid, maria_pid) = (pg.process().pid(), maria.process().pid());
        let t = |label: &str, url: String, pid: Option<u32>| Target {
            label: label.to_owned(),
            url,
            server_pid: pid,
        };
        let sqlite = format!("sqlite://{}", dir.path().join("locks.db").display());
        let (pg_url, maria_url) = (pg.url(), maria.url());
        let targets = vec![
            t("sqlite", sqlite, None),
            t("redis", redis.url(), Some(redis_pid)),
            t("redlock (5 nodes)", redlock.url(), Some(node_pid)),
            t(
                "etcd",
                format!("{}?session_ttl=2s", etcd.url()),
                Some(etcd.pid()),
            ),
            t(
                "zookeeper",
                format!("{}/locks?session_timeout=2s", zk.url()),
                Some(zk.pid()),
            ),
            t("postgres lease", pg_url.clone(), Some(pg_pid)),
            t(
                "postgres advisory",
                format!("{pg_url}?mode=advisory"),
                Some(pg_pid),
            ),
            t("postgres row", format!("{pg_url}?mode=row"), Some(pg_pid)),
            t("mariadb lease", maria_url.clone(), Some(maria_pid)),
            t(
                "mariadb named",
                format!("{maria_url}?mode=named"),
                Some(maria_pid),
            ),
            t(
                "mariadb row",
                format!("{maria_url}?mode=row"),
                Some(maria_pid),
            ),
        ];
        Some(Matrix {
            targets,
            redlock,
            _keep: vec![
                Box::new(dir),
                Box::new(redis),
                Box::new(etcd),
                Box::new(zk),
                Box::new(pg),
                Box::new(maria),
            ],
        })
    }
}
