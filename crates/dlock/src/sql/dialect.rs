//! What differs between PostgreSQL and MySQL/MariaDB: the driver, the statements, and
//! how a server error reads. Each server implements [`Dialect`] in its own module;
//! everything else — the modes, holds, sessions, waiting and `inspect` — is written
//! once in [`super::engine`].

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::Mode;
use super::shared::{SharedKey, SharedRemove, SharedRow};
use crate::backend::AcquireRequest;
use crate::error::Result;
use crate::name::LockName;
use crate::options::Owner;
use crate::shared_holds::EntryKind;

/// One hold, as the statements that renew and release it need it.
#[derive(Debug)]
pub(crate) struct Hold {
    pub key: [u8; 32],
    /// `key` in hex: the release notification's payload (PostgreSQL only).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub key_hex: String,
    pub owner: Owner,
    pub fence: u64,
}

/// What a lease-mode acquire statement answered.
#[derive(Debug)]
pub(crate) enum LeaseAnswer {
    /// Granted with this fencing token.
    Granted(u64),
    /// Held by another owner (how long its lease has left is asked apart:
    /// [`Dialect::lease_busy_left`]).
    Busy,
}

/// What a lease-mode release found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseReleased {
    /// The hold was dropped and the lock is free now, or may be (MySQL does not say
    /// whether other holds of its owner remain).
    Free,
    /// The hold was dropped; other holds of its owner remain.
    #[cfg_attr(
        not(feature = "postgres"),
        expect(dead_code, reason = "only PostgreSQL tells the holds left")
    )]
    StillHeld,
    /// This grant held nothing any more: broken, or its lease ended and the lock was
    /// taken. Nothing changed.
    NotHeld,
}

/// What the locking read of a name's row (row mode) found.
#[derive(Debug)]
pub(crate) enum RowLock {
    /// Locked, in a transaction now open on the connection.
    Locked {
        /// The server's id of that session.
        session: i64,
        /// That transaction's id, where the server can tell from another session
        /// whether it is still open (PostgreSQL's `txid_status`); `None` on MySQL.
        xact: Option<i64>,
    },
    /// The name has no row yet (the transaction was rolled back).
    Missing,
    /// Another session holds the row (the transaction was rolled back).
    Busy,
}

/// A holder as `inspect` reads it back.
#[derive(Debug)]
pub(crate) struct HolderRow {
    /// Empty: the server reports the lock taken with no dlock record (a foreign holder).
    pub owner: String,
    pub holds: u32,
    pub fence: u64,
    /// Stored metadata (JSON text).
    pub metadata: String,
    /// Lease mode: the lease left by the server's clock.
    pub remaining: Option<Duration>,
    /// Session modes: the server's id of the holding session.
    pub session: i64,
}

/// The statements of one SQL server, and its error classification (which errors mean
/// "busy", which are retried). Every method runs under the backend's statement timeout
/// unless it says otherwise.
#[async_trait]
pub(crate) trait Dialect: Send + Sync + std::fmt::Debug + 'static {
    /// A connection pinned to a session-mode hold.
    type Conn: super::session::SessionConn;
    /// How a session-mode lock is named on the server (an advisory key, a `GET_LOCK`
    /// name).
    type SessionKey: std::fmt::Debug + Send + Sync + 'static;
    /// The scheme, in errors and metrics.
    const BACKEND: &'static str;
    /// The product, in messages.
    const PRODUCT: &'static str;
    /// What the server calls a session's id ("backend pid"), in messages.
    const SESSION: &'static str;
    /// Releases are pushed to waiters by the server (PostgreSQL's `NOTIFY`).
    const NATIVE_WAIT: bool;
    /// Waiters jitter their polls (no notifications to spread them).
    const POLL_JITTER: bool;
    /// Row mode: a failed attempt's holder record names its dead session until cleared
    /// ([`Dialect::row_forget`]); without, `inspect` checks the recorded session itself.
    const ROW_FORGET: bool = false;

    /// Session modes: how long the server keeps a pinned session that sends nothing
    /// (the idle limits it is opened with) — at most: a holder whose session was not
    /// proven alive for this long counts as lost.
    fn session_silence(&self) -> Duration;

    /// Lease mode: grant, re-enter or refuse, in one autocommitted statement.
    async fn lease_acquire(&self, req: &AcquireRequest, key: &[u8; 32]) -> Result<LeaseAnswer>;
    /// Lease mode: how long the lease of a name found busy has left, lock delay
    /// included, where the server can tell in a statement of its own (`None`: it
    /// cannot, or the row is gone).
    async fn lease_busy_left(&self, _key: &[u8; 32]) -> Result<Option<Duration>> {
        Ok(None)
    }
    /// Lease mode: extend to at least `ttl` from now (never shorten); `false` when the
    /// hold is gone.
    async fn lease_renew(&self, hold: &Hold, ttl: Duration) -> Result<bool>;
    /// Lease mode: [`Dialect::lease_renew`] for several holds at once (at most
    /// [`super::renewer::MAX_BATCH`]), in as few statements as the server allows; one
    /// answer per hold, in order.
    async fn lease_renew_many(&self, holds: &[Arc<Hold>], ttl: Duration) -> Result<Vec<bool>>;
    /// Lease mode: an operator's forced release of the hold granted with `fence`
    /// (`false`: it is not the one held); wakes waiters in other processes where the
    /// server can.
    async fn lease_break(&self, key: &[u8; 32], fence: u64) -> Result<bool>;
    /// Lease mode: give one hold back, by one statement sent once.
    async fn lease_release(&self, hold: &Hold) -> Result<LeaseReleased>;

    /// A new connection for a session mode, set up for it.
    async fn connect_session(&self) -> Result<Self::Conn>;
    /// The server-side name of `name`'s session lock, checked before any I/O; `key`
    /// is the name's [`super::lock_key`].
    ///
    /// # Errors
    /// [`crate::Error::InvalidName`] when the name cannot be one.
    fn session_key(&self, name: &LockName, key: &[u8; 32]) -> Result<Self::SessionKey>;
    /// Session lock (advisory, named) on `conn`, recording the holder: the token when
    /// granted, `None` when busy. No timeout of its own: the engine bounds it, and
    /// drops `conn` (which ends its session) when it is cut off or fails.
    async fn session_lock(
        &self,
        conn: &mut Self::Conn,
        req: &AcquireRequest,
        key: &[u8; 32],
        skey: &Self::SessionKey,
    ) -> Result<Option<u64>>;
    /// Let go of a session lock on its pinned connection.
    async fn session_unlock(
        &self,
        conn: &mut Self::Conn,
        skey: &Self::SessionKey,
        hold: &Hold,
    ) -> std::result::Result<(), sqlx::Error>;

    /// Row mode: begin and lock the name's row without waiting.
    async fn row_lock(&self, conn: &mut Self::Conn, key: &[u8; 32]) -> Result<RowLock>;
    /// Row mode: create the name's row (its first use).
    async fn row_ensure(&self, conn: &mut Self::Conn, key: &[u8; 32]) -> Result<()>;
    /// Row mode: record the holder (session `session`) and take a token. With `xact`
    /// (which only a dialect's own `row_lock` gives), the same statement must also
    /// check, after the token was taken, that the transaction holding the row is still
    /// open, and fail if not; without it, the caller proves that (one answered ping on
    /// that session).
    async fn row_holder(
        &self,
        req: &AcquireRequest,
        key: &[u8; 32],
        session: i64,
        xact: Option<i64>,
    ) -> Result<u64>;
    /// Row mode: a record that names session `session` and `owner` names no holder any
    /// more. Best effort, in the background, after an attempt that locked the row but
    /// failed from `row_holder` on (its session is gone with it, and it may never have
    /// heard its token), so that `inspect` does not take that session for the holder
    /// of the row. A token's statement the server is still running holds the record's
    /// row, and this waits for it; one that reaches the server later still leaves the
    /// record until the next holder writes its own. Only called where
    /// [`Dialect::ROW_FORGET`].
    async fn row_forget(&self, _key: &[u8; 32], _session: i64, _owner: &Owner) {}
    /// Row mode: commit (which unlocks the row) and mark the record released.
    async fn row_unlock(
        &self,
        conn: &mut Self::Conn,
        hold: &Hold,
    ) -> std::result::Result<(), sqlx::Error>;

    /// Names beginning with `prefix` that have a record in `mode`'s table (held or
    /// not), at most `limit`, in byte order.
    async fn names(&self, mode: Mode, prefix: &str, limit: usize) -> Result<Vec<String>>;

    /// Tell the server that this process waits for `key` until the returned mark is
    /// dropped. The caller already watches the key locally: if the mark is not taken
    /// at once, the watch is woken when it is (a release before that may have stayed
    /// silent). PostgreSQL's releases notify only marked keys; a server without
    /// notifications needs no mark.
    fn mark_waiting(&self, _key: &[u8; 32]) -> Option<Box<dyn std::any::Any + Send + Sync>> {
        None
    }

    /// An open transaction of a semaphore's or read-write lock's attempt, on a
    /// connection of the backend's own. [`Dialect::shared_commit`] and
    /// [`Dialect::shared_rollback`] end it and give the connection back; dropped
    /// instead (an error, a caller that gave up), it closes the connection (and the
    /// set's idle ones, see `own_conns`), and the server rolls the transaction back.
    type SharedTx: Send;
    /// Create the semaphore and read-write lock tables unless they exist.
    async fn shared_schema(&self) -> Result<()>;
    /// In one round trip: begin, lock the name's gate row (creating it) and draw its
    /// next token, delete its dead rows and read the live ones. The token is spent
    /// only if the transaction commits.
    async fn shared_begin(&self, at: &SharedKey) -> Result<(Self::SharedTx, u64, Vec<SharedRow>)>;
    /// Write the acquisition's row of `kind` for `ttl`, with `fence` (a hold's token
    /// from [`Dialect::shared_begin`]; 0 for a waiting writer's row).
    async fn shared_put(
        &self,
        tx: &mut Self::SharedTx,
        req: &AcquireRequest,
        at: &SharedKey,
        kind: EntryKind,
        fence: u64,
        ttl: Duration,
    ) -> Result<()>;
    /// Commit.
    async fn shared_commit(&self, tx: Self::SharedTx) -> Result<()>;
    /// Roll back: nothing of the attempt stays, the gate row is free.
    async fn shared_rollback(&self, tx: Self::SharedTx) -> Result<()>;
    /// Extend a live hold to at least `ttl` from now; `false` when it is gone.
    async fn shared_renew(&self, at: &SharedKey, fence: u64, ttl: Duration) -> Result<bool>;
    /// Remove the acquisition's row as `what` says (and tell waiters in other
    /// processes, where the server can); `true` when a row went.
    async fn shared_remove(&self, at: &SharedKey, what: SharedRemove) -> Result<bool>;

    /// Every live hold of the name and family: (kind, owner, token, lease left in ms,
    /// metadata JSON), in token order.
    async fn shared_holders(
        &self,
        at: &SharedKey,
    ) -> Result<Vec<(String, String, u64, i64, String)>>;

    /// Who holds `name` in `mode`, asked the way the acquire asks.
    async fn inspect(
        &self,
        mode: Mode,
        name: &LockName,
        key: &[u8; 32],
    ) -> Result<Option<HolderRow>>;
}
