//! Connections of a SQL backend's own for the statements every lease acquisition runs
//! (and, in a set of their own, those of semaphores and read-write locks).
//!
//! sqlx's pool tests each connection it gets back with a round trip of its own (a
//! ping, in a task of its own): one more request for the server and a few more
//! wake-ups for the client per statement. A connection here comes back only after a
//! statement that succeeded (or a transaction that ended with a `COMMIT` or `ROLLBACK`
//! that did), so it needs no test; any error, timeout or cancelled caller drops it,
//! which closes its socket — and all the idle ones with it: what broke one (a server
//! restart, a proxy or a network that reset them) has most likely broken those too,
//! and each would otherwise fail one more statement (a release tried again in the
//! background would spend a try, and its backoff, on each). That purge runs at most
//! once a second (an error that repeats must not have every statement connect again),
//! so one that came just before a restart can leave dead ones for up to a second. At
//! most `max` are open at once (lent or idle: as many as the pool would lend); a
//! caller waits for a place and a connection at most the backend's timeout. An idle
//! one older than `max_idle` is dropped when the stack reaches it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::session::IdleConns;
use crate::error::{Error, Result};

/// The connections, idle and lent.
#[derive(Debug)]
pub(crate) struct OwnConns<C> {
    idle: Arc<IdleConns<C>>,
    permits: Arc<Semaphore>,
}

/// A connection lent out, with its place among the `max`.
#[derive(Debug)]
pub(crate) struct OwnConn<C> {
    pub conn: C,
    lent: Lent<C>,
}

/// A connection's place among the `max` while it is lent; a connection that is not
/// given back (dropped on an error, a timeout or a cancelled caller) takes the idle
/// ones with it.
#[derive(Debug)]
struct Lent<C> {
    _permit: OwnedSemaphorePermit,
    idle: Arc<IdleConns<C>>,
    given_back: bool,
}

impl<C> Drop for Lent<C> {
    fn drop(&mut self) {
        if !self.given_back {
            self.idle.purge();
        }
    }
}

impl<C> OwnConns<C> {
    /// At most `max` connections open at once; an idle one is not lent after
    /// `max_idle`.
    pub(crate) fn new(max: u32, max_idle: Duration) -> Self {
        OwnConns {
            idle: Arc::new(IdleConns::new(max, max_idle)),
            permits: Arc::new(Semaphore::new(max.max(1) as usize)),
        }
    }

    /// An idle connection, or a new one from `connect`: a free place and the
    /// connection within `timeout` in all.
    ///
    /// # Errors
    /// A connection error when that took longer than `timeout`, or what `connect`
    /// returned.
    pub(crate) async fn get<F>(
        &self,
        backend: &'static str,
        timeout: Duration,
        connect: impl FnOnce() -> F,
    ) -> Result<OwnConn<C>>
    where
        F: Future<Output = Result<C>>,
    {
        let lend = async {
            let permit = Arc::clone(&self.permits)
                .acquire_owned()
                .await
                // Never closed: an error here cannot happen.
                .map_err(|_| Error::connection(backend, "connection permits closed"))?;
            let conn = match self.idle.pop() {
                Some(c) => c,
                // Boxed: a connection's setup is a future of several KB, which would
                // otherwise be part of every statement's future (copied into its box
                // and allocated past the allocator's per-thread cache on every
                // statement), while it runs only when no idle connection is left.
                None => Box::pin(connect()).await?,
            };
            Ok(OwnConn {
                conn,
                lent: Lent {
                    _permit: permit,
                    idle: Arc::clone(&self.idle),
                    given_back: false,
                },
            })
        };
        tokio::time::timeout(timeout, lend)
            .await
            .unwrap_or_else(|_| {
                Err(Error::connection(
                    backend,
                    format!("no connection within {timeout:?}"),
                ))
            })
    }

    /// End a transaction on `c` with `statement` (`COMMIT`, `ROLLBACK`) within
    /// `timeout`, then give `c` back; on an error it is dropped.
    ///
    /// # Errors
    /// The statement's error, or a connection error when it had no answer in time.
    pub(crate) async fn end(
        &self,
        mut c: OwnConn<C>,
        backend: &'static str,
        timeout: Duration,
        statement: &'static str,
    ) -> Result<()>
    where
        C: sqlx::Connection,
        for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
    {
        super::timed(
            backend,
            timeout,
            sqlx::raw_sql(statement).execute(&mut c.conn),
        )
        .await?;
        self.put(c);
        Ok(())
    }

    /// Give back a connection whose statement succeeded.
    pub(crate) fn put(&self, c: OwnConn<C>) {
        // Into the stack of the set it was lent from, whatever set this is.
        let OwnConn { conn, mut lent } = c;
        lent.given_back = true;
        lent.idle.put(conn);
    }
}
