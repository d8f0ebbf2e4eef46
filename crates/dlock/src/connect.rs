//! Backend options in code: one type per backend ([`SqliteOptions`], [`RedisOptions`],
//! [`RedlockOptions`], [`EtcdOptions`], [`ZkOptions`], [`PostgresOptions`],
//! [`MysqlOptions`]), each with a builder method per URL option and [`FromStr`] from
//! that backend's URL; [`Locker::with_options`](crate::Locker::with_options) connects.
//!
//! ```no_run
//! # #[cfg(feature = "redis")]
//! # async fn demo() -> dlock::Result<()> {
//! use std::time::Duration;
//! use dlock::connect::RedisOptions;
//! use dlock::redis::Layout;
//!
//! let opts = RedisOptions::new("cache.internal", 6379)
//!     .credentials("app", "s3cret")
//!     .layout(Layout::RedisPy)
//!     .prefix("billing:")
//!     .timeout(Duration::from_secs(2));
//! let locker = dlock::Locker::with_options(opts).await?;
//! # Ok(()) }
//! ```
//!
//! A typed value and its URL are the same thing: each backend reads its options in one
//! place, its URL parser (its module's docs list them), and a typed value is handed to
//! that parser as parts — host names, the password (never printed) and option values
//! are never pasted into a string, so nothing needs escaping. [`FromStr`] checks the
//! URL's grammar and its scheme at once; option values are checked when connecting,
//! exactly as for [`Locker::connect`](crate::Locker::connect). `to_url` shows a password
//! as `***`: parsing that text back gives the password `***`.
//!
//! Each type exists when its backend's feature is on.

// With only some backends compiled in, the shared pieces of the others go unused.
#![cfg_attr(
    not(all(
        feature = "sqlite",
        feature = "redis",
        feature = "etcd",
        feature = "zookeeper",
        feature = "postgres",
        feature = "mysql"
    )),
    allow(dead_code, unused_imports, unused_macros)
)]

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::url::{ConnectUrl, HostPort, Secret};

/// What every typed option value is made of: a URL's parts.
#[derive(Clone)]
struct Parts {
    scheme: &'static str,
    username: Option<String>,
    password: Option<Secret>,
    hosts: Vec<HostPort>,
    path: String,
    params: BTreeMap<String, String>,
    /// A combination no URL can express (e.g. TLS on a cluster): reported on connect.
    error: Option<String>,
}

impl Parts {
    fn new(scheme: &'static str, hosts: Vec<HostPort>, path: impl Into<String>) -> Self {
        Parts {
            scheme,
            username: None,
            password: None,
            hosts,
            path: path.into(),
            params: BTreeMap::new(),
            error: None,
        }
    }

    /// The parts of `url` when its scheme is one of `schemes`.
    fn parse(url: &str, schemes: &[&'static str]) -> Result<Self> {
        let parsed = ConnectUrl::parse(url)?;
        let Some(scheme) = schemes.iter().find(|s| **s == parsed.scheme()) else {
            return Err(parsed.invalid(&format!("expected a URL of scheme {}", schemes.join(", "))));
        };
        // SQLite reads the text after the scheme as a path (`sqlite::memory:`,
        // `sqlite:relative.db`, `sqlite:///abs.db`), not as hosts.
        let (hosts, path) = if *scheme == "sqlite" {
            let body = crate::url::percent_decode(parsed.body())
                .ok_or_else(|| parsed.invalid("bad percent-encoding in path"))?;
            (Vec::new(), body)
        } else {
            (parsed.hosts().to_vec(), parsed.path().to_owned())
        };
        Ok(Parts {
            scheme,
            username: parsed.username().map(str::to_owned),
            password: parsed.password().cloned(),
            hosts,
            path,
            params: parsed.params().clone(),
            error: None,
        })
    }

    fn set(&mut self, key: &str, value: impl ToString) {
        self.params.insert(key.to_owned(), value.to_string());
    }

    /// In the URL's duration syntax, exactly (whole milliseconds, else microseconds;
    /// below a microsecond it is rounded up, and a backend rejects it as it would the
    /// URL's).
    fn duration(&mut self, key: &str, d: Duration) {
        let text = if d.subsec_nanos().is_multiple_of(1_000_000) {
            format!("{}ms", d.as_millis())
        } else {
            format!("{}us", d.as_micros().max(1))
        };
        self.set(key, text);
    }

    /// A path option that must be absolute (etcd's prefix, ZooKeeper's root).
    fn absolute(path: &str) -> String {
        if path.starts_with('/') {
            path.to_owned()
        } else {
            format!("/{path}")
        }
    }

    /// The URL these parts make, whether or not the combination is allowed.
    fn parts_url(&self) -> ConnectUrl {
        ConnectUrl::from_parts(
            self.scheme,
            self.username.clone(),
            self.password.clone(),
            self.hosts.clone(),
            self.path.clone(),
            self.params.clone(),
        )
    }

    fn url(&self) -> Result<ConnectUrl> {
        let url = self.parts_url();
        match &self.error {
            Some(why) => Err(url.invalid(why)),
            None => Ok(url),
        }
    }

    /// The URL's text, password as `***` (also when the combination is refused).
    fn shown(&self) -> String {
        self.parts_url().to_string()
    }
}

#[cfg(any(
    feature = "redis",
    feature = "etcd",
    feature = "zookeeper",
    feature = "postgres",
    feature = "mysql"
))]
fn host(host: &str, port: u16) -> HostPort {
    // `[::1]` and `::1` name the same host; the brackets are the URL's, not the name's.
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    HostPort {
        host: host.to_owned(),
        port: Some(port),
    }
}

/// What [`Locker::with_options`](crate::Locker::with_options) accepts: any backend's
/// typed options, or a parsed [`ConnectUrl`].
pub trait IntoConnectUrl {
    /// The URL these options stand for.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for a combination no URL can express (e.g. TLS on a
    /// Redis cluster).
    fn into_connect_url(self) -> Result<ConnectUrl>;
}

impl IntoConnectUrl for ConnectUrl {
    fn into_connect_url(self) -> Result<ConnectUrl> {
        Ok(self)
    }
}

/// A builder method that sets a duration option.
macro_rules! duration_option {
    ($(#[$doc:meta])* $method:ident, $key:literal) => {
        $(#[$doc])*
        #[must_use]
        pub fn $method(mut self, value: Duration) -> Self {
            self.0.duration($key, value);
            self
        }
    };
}

/// A builder method that sets an option to a number or a text.
macro_rules! value_option {
    ($(#[$doc:meta])* $method:ident: $ty:ty, $key:literal) => {
        $(#[$doc])*
        #[must_use]
        pub fn $method(mut self, value: $ty) -> Self {
            self.0.set($key, value);
            self
        }
    };
}

/// The methods every backend's options share.
#[allow(unused_macros)]
macro_rules! common {
    ($ty:ident, $schemes:expr) => {
        impl $ty {
            duration_option!(
                /// The default lease of locks taken with [`Locker::lock`](crate::Locker::lock)
                /// and friends (the URL's `ttl=`).
                ttl, "ttl"
            );

            /// The URL these options stand for, password shown as `***`.
            #[must_use]
            pub fn to_url(&self) -> String {
                self.0.shown()
            }
        }

        impl FromStr for $ty {
            type Err = Error;

            fn from_str(url: &str) -> Result<Self> {
                Ok($ty(Parts::parse(url, $schemes)?))
            }
        }

        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_tuple(stringify!($ty))
                    .field(&self.to_url())
                    .finish()
            }
        }

        impl IntoConnectUrl for $ty {
            fn into_connect_url(self) -> Result<ConnectUrl> {
                self.0.url()
            }
        }
    };
}

/// The methods of backends that log in.
#[allow(unused_macros)]
macro_rules! credentials {
    ($ty:ident) => {
        impl $ty {
            /// Log in as `user` with `password` (kept as a [`Secret`]: never printed).
            #[must_use]
            pub fn credentials(mut self, user: &str, password: &str) -> Self {
                self.0.username = (!user.is_empty()).then(|| user.to_owned());
                self.0.password = Some(Secret::new(password));
                self
            }
        }
    };
}

/// The certificate options of backends that speak TLS (each has its own `tls()`).
#[allow(unused_macros)]
macro_rules! tls_files {
    ($ty:ident) => {
        impl $ty {
            /// The PEM file of the CA that signs the server (TLS).
            #[must_use]
            pub fn ca_file(mut self, path: impl AsRef<std::path::Path>) -> Self {
                self.0.set("ca_file", path.as_ref().display());
                self.tls()
            }

            /// A client certificate and its key (PEM files; mutual TLS).
            #[must_use]
            pub fn client_cert(
                mut self,
                cert: impl AsRef<std::path::Path>,
                key: impl AsRef<std::path::Path>,
            ) -> Self {
                self.0.set("cert_file", cert.as_ref().display());
                self.0.set("key_file", key.as_ref().display());
                self.tls()
            }
        }
    };
}

/// Options of the embedded SQLite backend (`sqlite://`, [`crate::sqlite`]).
#[cfg(feature = "sqlite")]
#[derive(Clone)]
pub struct SqliteOptions(Parts);
#[cfg(feature = "sqlite")]
common!(SqliteOptions, &["sqlite"]);

#[cfg(feature = "sqlite")]
impl SqliteOptions {
    /// The database file at `path` (absolute or relative; `":memory:"` for a store
    /// private to this locker).
    #[must_use]
    pub fn new(path: impl AsRef<std::path::Path>) -> Self {
        SqliteOptions(Parts::new(
            "sqlite",
            Vec::new(),
            path.as_ref().to_string_lossy().into_owned(),
        ))
    }

    /// `synchronous=normal` when `false` (faster; the last commits may be lost on
    /// power loss, so fencing is best effort); `full` (the default) when `true`.
    #[must_use]
    pub fn durable(mut self, durable: bool) -> Self {
        self.0
            .set("synchronous", if durable { "full" } else { "normal" });
        self
    }

    duration_option!(
        /// How often a waiter looks again for other processes' releases.
        poll, "poll"
    );

    duration_option!(
        /// How long a lease that ran out without a release keeps the lock from others.
        lock_delay, "lock_delay"
    );

    value_option!(
        /// The WAL size in pages at which a commit checkpoints it (SQLite's
        /// `wal_autocheckpoint`; default 1,000; 1 to 100,000).
        wal_autocheckpoint: u32, "wal_autocheckpoint"
    );
}

/// Options of a Redis server, cluster or Sentinel-named master (`redis://`,
/// `rediss://`, `redis+cluster://`, `redis+sentinel://`; [`crate::redis`]).
#[cfg(feature = "redis")]
#[derive(Clone)]
pub struct RedisOptions(Parts);
#[cfg(feature = "redis")]
common!(
    RedisOptions,
    &["redis", "rediss", "redis+cluster", "redis+sentinel"]
);
#[cfg(feature = "redis")]
credentials!(RedisOptions);
#[cfg(feature = "redis")]
tls_files!(RedisOptions);

#[cfg(feature = "redis")]
impl RedisOptions {
    /// A single Redis server.
    #[must_use]
    pub fn new(host_name: &str, port: u16) -> Self {
        RedisOptions(Parts::new("redis", vec![host(host_name, port)], ""))
    }

    /// A Redis Cluster reached through any of `nodes` (`(host, port)`).
    #[must_use]
    pub fn cluster<'a>(nodes: impl IntoIterator<Item = (&'a str, u16)>) -> Self {
        let hosts = nodes.into_iter().map(|(h, p)| host(h, p)).collect();
        RedisOptions(Parts::new("redis+cluster", hosts, ""))
    }

    /// The master that `sentinels` (`(host, port)`) name `master`.
    #[must_use]
    pub fn sentinel<'a>(sentinels: impl IntoIterator<Item = (&'a str, u16)>, master: &str) -> Self {
        let hosts = sentinels.into_iter().map(|(h, p)| host(h, p)).collect();
        RedisOptions(Parts::new("redis+sentinel", hosts, format!("/{master}")))
    }

    /// Over TLS (`rediss://`), the server verified by the system's roots or by
    /// [`RedisOptions::ca_file`].
    #[must_use]
    pub fn tls(mut self) -> Self {
        match self.0.scheme {
            "redis" | "rediss" => self.0.scheme = "rediss",
            other => {
                self.0.error = Some(format!(
                    "TLS is available on a single server (rediss://), not on {other}://"
                ));
            }
        }
        self
    }

    /// The database number.
    #[must_use]
    pub fn database(mut self, db: u32) -> Self {
        if self.0.scheme == "redis+sentinel" {
            self.0.set("db", db);
        } else {
            self.0.path = format!("/{db}");
        }
        self
    }

    /// The on-server layout (whose clients share the locks).
    #[must_use]
    pub fn layout(mut self, layout: crate::redis::Layout) -> Self {
        self.0.set("layout", layout.as_str());
        self
    }

    value_option!(
        /// Prepended to every lock name.
        prefix: &str, "prefix"
    );

    /// After each grant, `WAIT` until `replicas` replicas have it (at most `within`).
    #[must_use]
    pub fn min_replicas(mut self, replicas: u32, within: Duration) -> Self {
        self.0.set("min_replicas", replicas);
        self.0.duration("wait_timeout", within);
        self
    }

    duration_option!(
        /// Per command, and connecting.
        timeout, "timeout"
    );

    duration_option!(
        /// Re-poll interval of the plain layouts.
        poll, "poll"
    );

    value_option!(
        /// Most in-process hand-offs in a row (`0`: none).
        handoff_burst: u32, "handoff_burst"
    );
}

/// Options of Redlock over independent Redis masters (`redlock://`,
/// [`crate::redlock`]).
#[cfg(feature = "redis")]
#[derive(Clone)]
pub struct RedlockOptions(Parts);
#[cfg(feature = "redis")]
common!(RedlockOptions, &["redlock"]);
#[cfg(feature = "redis")]
credentials!(RedlockOptions);

#[cfg(feature = "redis")]
impl RedlockOptions {
    /// The masters (`(host, port)`; at least 3, 5 recommended).
    #[must_use]
    pub fn new<'a>(nodes: impl IntoIterator<Item = (&'a str, u16)>) -> Self {
        let hosts = nodes.into_iter().map(|(h, p)| host(h, p)).collect();
        RedlockOptions(Parts::new("redlock", hosts, ""))
    }

    duration_option!(
        /// Per node call.
        node_timeout, "node_timeout"
    );

    /// Clock drift allowed, as a fraction of the TTL (0 to < 0.5).
    #[must_use]
    pub fn drift_factor(mut self, factor: f64) -> Self {
        self.0.set("drift_factor", factor);
        self
    }

    value_option!(
        /// Rounds after the first when too few nodes answer.
        retries: u32, "retries"
    );

    duration_option!(
        /// Waiting: re-poll interval.
        poll, "poll"
    );

    value_option!(
        /// Prepended to every lock name.
        prefix: &str, "prefix"
    );

    duration_option!(
        /// Connecting.
        timeout, "timeout"
    );
}

/// Options of etcd (`etcd://`, `etcds://`; [`crate::etcd`]).
#[cfg(feature = "etcd")]
#[derive(Clone)]
pub struct EtcdOptions(Parts);
#[cfg(feature = "etcd")]
common!(EtcdOptions, &["etcd", "etcds"]);
#[cfg(feature = "etcd")]
credentials!(EtcdOptions);
#[cfg(feature = "etcd")]
tls_files!(EtcdOptions);

#[cfg(feature = "etcd")]
impl EtcdOptions {
    /// The cluster's client endpoints (`(host, port)`).
    #[must_use]
    pub fn new<'a>(endpoints: impl IntoIterator<Item = (&'a str, u16)>) -> Self {
        let hosts = endpoints.into_iter().map(|(h, p)| host(h, p)).collect();
        EtcdOptions(Parts::new("etcd", hosts, ""))
    }

    /// Over TLS (`etcds://`).
    #[must_use]
    pub fn tls(mut self) -> Self {
        self.0.scheme = "etcds";
        self
    }

    /// The key prefix of the locks (the URL path; default `/dlock/`).
    #[must_use]
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.0.path = Parts::absolute(prefix);
        self
    }

    duration_option!(
        /// The session lease: how long a dead holder's locks outlive it.
        session_ttl, "session_ttl"
    );

    /// Use names as they are (etcdctl's layout).
    #[must_use]
    pub fn raw_names(mut self, raw: bool) -> Self {
        self.0.set("raw_names", raw);
        self
    }

    duration_option!(
        /// Per request, and connecting.
        timeout, "timeout"
    );
}

/// Options of ZooKeeper (`zk://`, [`crate::zookeeper`]).
#[cfg(feature = "zookeeper")]
#[derive(Clone)]
pub struct ZkOptions(Parts);
#[cfg(feature = "zookeeper")]
common!(ZkOptions, &["zk"]);

#[cfg(feature = "zookeeper")]
impl ZkOptions {
    /// The ensemble's servers (`(host, port)`).
    #[must_use]
    pub fn new<'a>(servers: impl IntoIterator<Item = (&'a str, u16)>) -> Self {
        let hosts = servers.into_iter().map(|(h, p)| host(h, p)).collect();
        ZkOptions(Parts::new("zk", hosts, ""))
    }

    /// The node under which locks live (the URL path; default `/dlock`).
    #[must_use]
    pub fn root(mut self, root: &str) -> Self {
        self.0.path = Parts::absolute(root);
        self
    }

    duration_option!(
        /// The session timeout asked of the server.
        session_timeout, "session_timeout"
    );

    duration_option!(
        /// Connecting, and how long a connection may stay silent.
        timeout, "timeout"
    );
}

/// The options PostgreSQL and MySQL/MariaDB share.
#[allow(unused_macros)]
macro_rules! sql_common {
    ($ty:ident) => {
        impl $ty {
            /// How the lock is held on the server.
            #[must_use]
            pub fn mode(mut self, mode: crate::sql::Mode) -> Self {
                self.0.set("mode", mode.as_str());
                self
            }

            value_option!(
                /// Prefix of dlock's tables (a plain identifier).
                table_prefix: &str, "table_prefix"
            );

            duration_option!(
                /// Lease mode: how long a lease that ran out without a release keeps the
                /// lock from other owners.
                lock_delay, "lock_delay"
            );

            duration_option!(
                /// Waiting: re-poll interval.
                poll, "poll"
            );

            duration_option!(
                /// Connecting, and per statement.
                timeout, "timeout"
            );

            duration_option!(
                /// Session modes: ping interval of the pinned connection.
                heartbeat, "heartbeat"
            );

            value_option!(
                /// Connections for lease statements.
                pool: u32, "pool"
            );

            value_option!(
                /// Idle pinned connections kept for session modes.
                sessions: u32, "sessions"
            );

            /// The PEM file of the CA that signs the server.
            #[must_use]
            pub fn ssl_ca(mut self, path: impl AsRef<std::path::Path>) -> Self {
                self.0.set("ssl_ca", path.as_ref().display());
                self
            }
        }
    };
}

/// Options of PostgreSQL (`postgres://`, [`crate::sql::postgres`]).
#[cfg(feature = "postgres")]
#[derive(Clone)]
pub struct PostgresOptions(Parts);
#[cfg(feature = "postgres")]
common!(PostgresOptions, &["postgres", "postgresql"]);
#[cfg(feature = "postgres")]
credentials!(PostgresOptions);
#[cfg(feature = "postgres")]
sql_common!(PostgresOptions);

#[cfg(feature = "postgres")]
impl PostgresOptions {
    /// The database `database` on `host_name:port`.
    #[must_use]
    pub fn new(host_name: &str, port: u16, database: &str) -> Self {
        PostgresOptions(Parts::new(
            "postgres",
            vec![host(host_name, port)],
            format!("/{database}"),
        ))
    }

    value_option!(
        /// `disable`, `prefer` (the default), `require`, `verify-ca` or `verify-full`.
        sslmode: &str, "sslmode"
    );

    /// Advisory mode: the key is the name as a decimal `int8` (`true`) or the first
    /// 8 bytes of the name's SHA-256 (`false`, the default).
    #[must_use]
    pub fn numeric_advisory_keys(mut self, numeric: bool) -> Self {
        self.0
            .set("advisory_key", if numeric { "number" } else { "sha256" });
        self
    }
}

/// Options of MySQL or MariaDB (`mysql://`, `mariadb://`; [`crate::sql::mysql`]).
#[cfg(feature = "mysql")]
#[derive(Clone)]
pub struct MysqlOptions(Parts);
#[cfg(feature = "mysql")]
common!(MysqlOptions, &["mysql", "mariadb"]);
#[cfg(feature = "mysql")]
credentials!(MysqlOptions);
#[cfg(feature = "mysql")]
sql_common!(MysqlOptions);

#[cfg(feature = "mysql")]
impl MysqlOptions {
    /// The database `database` on `host_name:port`.
    #[must_use]
    pub fn new(host_name: &str, port: u16, database: &str) -> Self {
        MysqlOptions(Parts::new(
            "mysql",
            vec![host(host_name, port)],
            format!("/{database}"),
        ))
    }

    value_option!(
        /// `disabled`, `preferred` (the default), `required`, `verify_ca` or
        /// `verify_identity`.
        ssl_mode: &str, "ssl_mode"
    );
}
