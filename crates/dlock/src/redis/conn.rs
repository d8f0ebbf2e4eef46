//! One command connection over every deployment: a single server (reconnecting
//! `ConnectionManager`), a Cluster (slot-routing `ClusterConnection`), or a master found
//! through Sentinel (re-resolved after a connection error or a READONLY answer, which
//! is what a failover looks like from here).

use std::sync::{Arc, Mutex};

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::SentinelClient;
use redis::{
    AsyncConnectionConfig, Cmd, FromRedisValue, Pipeline, RedisFuture, RedisResult, Value,
};

/// A cheap-to-clone command connection.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(SentinelConn),
}

/// The current master's connection, found (and re-found) through Sentinel.
#[derive(Clone)]
pub(crate) struct SentinelConn {
    sentinel: Arc<tokio::sync::Mutex<SentinelClient>>,
    current: Arc<Mutex<Option<MultiplexedConnection>>>,
    config: AsyncConnectionConfig,
}

impl SentinelConn {
    pub(crate) fn new(sentinel: SentinelClient, config: AsyncConnectionConfig) -> Self {
        SentinelConn {
            sentinel: Arc::new(tokio::sync::Mutex::new(sentinel)),
            current: Arc::new(Mutex::new(None)),
            config,
        }
    }

    /// A client for the master Sentinel reports now.
    pub(crate) async fn master_client(&self) -> RedisResult<redis::Client> {
        self.sentinel.lock().await.async_get_client().await
    }

    async fn connection(&self) -> RedisResult<MultiplexedConnection> {
        let cached = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if let Some(c) = cached {
            return Ok(c);
        }
        let client = self.master_client().await?;
        let c = client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        *self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(c.clone());
        Ok(c)
    }

    fn forget(&self) {
        *self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// Whether an error means "ask Sentinel for the master again".
fn stale(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.code() == Some("READONLY")
}

impl Conn {
    /// Sends `cmd` and reads its answer as `T` (a server's error answer as an error),
    /// as `Cmd::query_async` does — but on a single server without boxing the
    /// connection manager's future (`ConnectionLike::req_packed_command` allocates one
    /// of over a kilobyte per command, most of the client's allocation cost per lock
    /// cycle).
    pub(crate) async fn send<T: FromRedisValue>(&mut self, cmd: &Cmd) -> RedisResult<T> {
        let value = match self {
            Conn::Single(c) => c.send_packed_command(cmd).await?,
            other => other.req_packed_command(cmd).await?,
        };
        Ok(redis::from_redis_value(value.extract_error()?)?)
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Sentinel(s) => {
                let s = s.clone();
                Box::pin(async move {
                    let mut c = s.connection().await?;
                    match c.req_packed_command(cmd).await {
                        Err(e) if stale(&e) => {
                            // Failover: ask Sentinel for the master again, try once more.
                            s.forget();
                            s.connection().await?.req_packed_command(cmd).await
                        }
                        other => other,
                    }
                })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(s) => {
                let s = s.clone();
                Box::pin(async move {
                    let mut c = s.connection().await?;
                    match c.req_packed_commands(pipeline, offset, count).await {
                        Err(e) if stale(&e) => {
                            s.forget();
                            s.connection()
                                .await?
                                .req_packed_commands(pipeline, offset, count)
                                .await
                        }
                        other => other,
                    }
                })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Sentinel(_) => 0,
        }
    }
}
