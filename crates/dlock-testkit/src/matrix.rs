//! Every backend at once, for the runs that cover them all (`dlock check`'s CI tier
//! and the RELIABILITY.md generator): one server of each kind on loopback, and the
//! URLs (with short sessions, so a dead holder's session ends in seconds).

use std::any::Any;
use std::sync::{Arc, Mutex};

use crate::restart::{SharedServer, lock_server};
use crate::{EtcdServer, MariaDbServer, PgServer, RedisOptions, RedisServer, ZkServer};

/// One backend configuration under test.
#[derive(Clone)]
pub struct Target {
    /// Short label, e.g. `postgres advisory`.
    pub label: String,
    /// The URL.
    pub url: String,
    /// The server to pause or restart (`--fault pause-server|restart-server`); `None`
    /// for SQLite, one node (a minority) for Redlock.
    pub server: Option<SharedServer>,
}

impl Target {
    /// A target without a server to fault.
    #[must_use]
    pub fn new(label: &str, url: String) -> Self {
        Target {
            label: label.to_owned(),
            url,
            server: None,
        }
    }

    /// The server's current process id (it changes when the server is restarted).
    #[must_use]
    pub fn server_pid(&self) -> Option<u32> {
        self.server.as_ref().map(|s| lock_server(s).process().pid())
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("label", &self.label)
            .field("url", &self.url)
            .field("server_pid", &self.server_pid())
            .finish()
    }
}

/// Running servers and the targets they serve (servers stop on Drop).
pub struct Matrix {
    /// Every backend configuration.
    pub targets: Vec<Target>,
    /// Redlock's five nodes, for node-loss faults.
    pub redlock_nodes: Vec<Arc<Mutex<RedisServer>>>,
    /// `redlock://` over the five nodes.
    pub redlock_url: String,
    /// The SQLite dir, removed on Drop (the servers stop when their last handle goes).
    _keep: Vec<Box<dyn Any + Send>>,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matrix")
            .field("targets", &self.targets)
            .finish_non_exhaustive()
    }
}

fn shared<T: crate::Restartable + 'static>(server: T) -> Arc<Mutex<T>> {
    Arc::new(Mutex::new(server))
}

impl Matrix {
    /// Start every server (or skip, see [`crate::skip`], when one is missing).
    /// Redis and the Redlock nodes persist every write (`appendfsync always`), so their
    /// tokens are durable; a second Redis runs without persistence, Redis's default.
    /// PostgreSQL's three modes share one server, as MariaDB's do.
    #[must_use]
    pub fn start() -> Option<Self> {
        Self::start_with(false)
    }

    /// As [`Matrix::start`], but each PostgreSQL and MariaDB mode has a server of its
    /// own, so runs that fault a server can go on in every mode at once.
    #[must_use]
    pub fn start_apart() -> Option<Self> {
        Self::start_with(true)
    }

    fn start_with(apart: bool) -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let persistent = RedisOptions {
            persistent: true,
            ..RedisOptions::default()
        };
        let redis = shared(RedisServer::start_with(persistent.clone())?);
        let volatile = shared(RedisServer::start()?);
        let mut redlock_nodes = Vec::new();
        for _ in 0..5 {
            redlock_nodes.push(shared(RedisServer::start_with(persistent.clone())?));
        }
        let etcd = shared(EtcdServer::start()?);
        let zk = shared(ZkServer::start()?);
        let (mut pg, mut maria) = (Vec::new(), Vec::new());
        for _ in 0..if apart { 3 } else { 1 } {
            pg.push(shared(PgServer::start()?));
            maria.push(shared(MariaDbServer::start()?));
        }
        // The server of mode `i` (0: lease, 1: advisory or named, 2: row).
        let (pg, maria) = (
            |i: usize| pg[i.min(pg.len() - 1)].clone(),
            |i: usize| maria[i.min(maria.len() - 1)].clone(),
        );
        let node_addrs: Vec<String> = redlock_nodes
            .iter()
            .map(|n| lock_server(n).addr().to_string())
            .collect();
        let redlock_url = format!("redlock://{}", node_addrs.join(","));
        let t = |label: &str, url: String, server: SharedServer| Target {
            label: label.to_owned(),
            url,
            server: Some(server),
        };
        let pg_url = |i: usize| lock_server(&pg(i)).url();
        let maria_url = |i: usize| lock_server(&maria(i)).url();
        let (etcd_url, zk_url) = (lock_server(&etcd).url(), lock_server(&zk).url());
        let sqlite = format!("sqlite://{}", dir.path().join("locks.db").display());
        let targets = vec![
            Target::new("sqlite", sqlite),
            t("redis", lock_server(&redis).url(), redis.clone()),
            t(
                "redis (no persistence)",
                lock_server(&volatile).url(),
                volatile.clone(),
            ),
            t(
                "redlock (5 nodes)",
                redlock_url.clone(),
                redlock_nodes[2].clone(),
            ),
            t("etcd", format!("{etcd_url}?session_ttl=2s"), etcd.clone()),
            t(
                "zookeeper",
                format!("{zk_url}/locks?session_timeout=2s"),
                zk.clone(),
            ),
            t("postgres lease", pg_url(0), pg(0)),
            t(
                "postgres advisory",
                format!("{}?mode=advisory", pg_url(1)),
                pg(1),
            ),
            t("postgres row", format!("{}?mode=row", pg_url(2)), pg(2)),
            t("mariadb lease", maria_url(0), maria(0)),
            t(
                "mariadb named",
                format!("{}?mode=named", maria_url(1)),
                maria(1),
            ),
            t(
                "mariadb row",
                format!("{}?mode=row", maria_url(2)),
                maria(2),
            ),
        ];
        Some(Matrix {
            targets,
            redlock_nodes,
            redlock_url,
            _keep: vec![Box::new(dir)],
        })
    }
}
