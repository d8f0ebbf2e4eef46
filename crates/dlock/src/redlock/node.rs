//! One independent Redis master of a Redlock set: a multiplexed connection made on
//! first use and remade after a connection error, every call bounded by a timeout.
//!
//! A node that refused a connection is not dialled again for [`RECONNECT_BACKOFF`]:
//! calls fail at once instead, so a dead node costs nothing per attempt.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, FromRedisValue, Pipeline, RedisResult, ScriptInvocation};

use crate::error::Error;

/// How long a node that refused a connection is left alone (short: a restarted node
/// must be back in the next retry round).
const RECONNECT_BACKOFF: Duration = Duration::from_millis(20);

/// One call, the same for every node.
pub(crate) enum Job {
    Script(ScriptInvocation<'static>),
    Pipe(Pipeline),
}

pub(crate) struct Node {
    client: redis::Client,
    /// `host:port`, for messages.
    pub(crate) shown: String,
    state: Mutex<State>,
    config: AsyncConnectionConfig,
}

#[derive(Default)]
struct State {
    conn: Option<MultiplexedConnection>,
    down_until: Option<Instant>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The client carries the password in its Debug output: never show it.
        f.debug_struct("Node")
            .field("addr", &self.shown)
            .finish_non_exhaustive()
    }
}

impl Node {
    pub(crate) fn new(client: redis::Client, shown: String, timeout: Duration) -> Self {
        Node {
            client,
            shown,
            state: Mutex::new(State::default()),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout)),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn connection(&self) -> Result<MultiplexedConnection, Error> {
        {
            let state = self.state();
            if let Some(c) = &state.conn {
                return Ok(c.clone());
            }
            if state.down_until.is_some_and(|t| Instant::now() < t) {
                return Err(Error::connection(
                    "redlock",
                    format!("{} refused a connection moments ago", self.shown),
                ));
            }
        }
        match self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await
        {
            Ok(c) => {
                let mut state = self.state();
                state.down_until = None;
                Ok(state.conn.get_or_insert(c).clone())
            }
            Err(e) => {
                self.state().down_until = Some(Instant::now() + RECONNECT_BACKOFF);
                Err(crate::redis::map_err(&e))
            }
        }
    }

    fn forget(&self) {
        self.state().conn = None;
    }

    /// Run `job` within `timeout`. Any failure — no connection, no answer in time, a
    /// server error — is an `Err`: for a quorum it is a node that did not answer.
    pub(crate) async fn run<T: FromRedisValue>(
        &self,
        timeout: Duration,
        job: &Job,
    ) -> Result<T, Error> {
        let attempt = async {
            let mut conn = self.connection().await?;
            let answer: RedisResult<T> = match job {
                Job::Script(inv) => inv.invoke_async(&mut conn).await,
                Job::Pipe(pipe) => pipe.query_async(&mut conn).await,
            };
            answer.map_err(|e| {
                if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
                    self.forget();
                }
                crate::redis::map_err(&e)
            })
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(answer) => answer,
            Err(_) => Err(Error::connection(
                "redlock",
                format!("{} did not answer within {timeout:?}", self.shown),
            )),
        }
    }

    /// `CONFIG GET append*`: whether this node fsyncs every write before answering.
    pub(crate) async fn persists_every_write(&self, timeout: Duration) -> bool {
        let mut pipe = redis::pipe();
        pipe.cmd("CONFIG").arg("GET").arg("append*");
        let answer: Result<(Vec<(String, String)>,), Error> =
            self.run(timeout, &Job::Pipe(pipe)).await;
        let Ok((pairs,)) = answer else {
            return false;
        };
        let value = |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        value("appendonly") == Some("yes") && value("appendfsync") == Some("always")
    }
}
