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
        let redis = RedisServer::start_with(persistent.clone())?;
        let redlock = RedisNodes::start(5, &persistent)?;
        let etcd = EtcdServer::start()?;
        let zk = ZkServer::start()?;
        let pg = PgServer::start()?;
        let maria = MariaDbServer::start()?;
        let t = |label: &str, url: String| Target {
            label: label.to_owned(),
            url,
        };
        let targets = vec![
            t(
                "sqlite",
                format!("sqlite://{}", dir.path().join("locks.db").display()),
            ),
            t("redis", redis.url()),
            t("redlock (5 nodes)", redlock.url()),
            t("etcd", format!("{}?session_ttl=2s", etcd.url())),
            t(
                "zookeeper",
                format!("{}/locks?session_timeout=2s", zk.url()),
            ),
            t("postgres lease", pg.url()),
            t("postgres advisory", format!("{}?mode=advisory", pg.url())),
            t("postgres row", format!("{}?mode=row", pg.url())),
            t("mariadb lease", maria.url()),
            t("mariadb named", format!("{}?mode=named", maria.url())),
            t("mariadb row", format!("{}?mode=row", maria.url())),
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
