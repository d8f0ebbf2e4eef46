//! The SQL backend over any [`Dialect`]: the modes, the holds, the pinned sessions,
//! waiting and `inspect`, written once for PostgreSQL and MySQL/MariaDB.

use std::sync::Arc;
use std::time::Duration;

use super::session::SessionConn as _;
use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use super::dialect::{Dialect, Hold, HolderRow, LeaseAnswer, LeaseReleased, RowLock};
use super::renewer::LeaseRenewer;
use super::session::{IdleConns, Pinned, Session};
use super::{
    LocalHold, LocalHolds, LocalMark, Mode, SqlOptions, SqlWaiter, hex, lock_key, metadata_from,
};
use crate::backend::{
    AcquireRequest, Attempt, Backend, Capabilities, HeldLock, LockInfo, Primitive, Waiter,
};
use crate::error::{Error, Result};
use crate::name::LockName;
use crate::notify::WakeOne;

/// A PostgreSQL or MySQL backend: one [`Dialect`] and what every mode shares.
pub(crate) struct SqlBackend<D: Dialect> {
    dialect: Arc<D>,
    opts: SqlOptions,
    /// Wakes this process's waiters of a released key.
    hub: Arc<WakeOne<[u8; 32]>>,
    idle: Arc<IdleConns<D::Conn>>,
    /// The server flushes every commit: fencing tokens survive a crash.
    durable: bool,
    /// The semaphore and read-write lock tables exist (made on first use).
    shared_ready: tokio::sync::OnceCell<()>,
    /// Renews lease-mode holds, many per statement.
    renewer: LeaseRenewer,
    /// The lease-mode locks held here now and the attempts at them in flight (counted
    /// only where releases notify): their waiters need no mark ([`LocalMark`]).
    local: Arc<LocalHolds>,
}

impl<D: Dialect> std::fmt::Debug for SqlBackend<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The dialect's Debug never prints connect options (they hold the password).
        f.debug_struct("SqlBackend")
            .field("dialect", &self.dialect)
            .field("mode", &self.opts.mode)
            .field("prefix", &self.opts.prefix)
            .finish_non_exhaustive()
    }
}

/// A row-mode attempt's holder record ([`Dialect::ROW_FORGET`]), from the row's lock
/// until the attempt returns its hold. Dropped before that (the attempt failed: its
/// token's statement, or the ping after it), it has the record cleared of the
/// attempt's session in the background ([`Dialect::row_forget`]): that session ends
/// with the attempt, and until a later holder writes its own record, `inspect` would
/// take it for the row's holder while a transaction outside dlock holds the row.
/// Cleared by the session's id and the owner, so a record a later holder wrote stays
/// as it is (across a server restart, which numbers sessions anew, unless it is of the
/// same owner).
struct RowRecord<D: Dialect> {
    dialect: Arc<D>,
    key: [u8; 32],
    session: i64,
    owner: crate::Owner,
    /// The attempt returned its hold: the record is that hold's.
    kept: bool,
}

impl<D: Dialect> Drop for RowRecord<D> {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        // No runtime (the attempt dropped as one shuts down): the record stays, as a
        // crashed client's would.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (dialect, key, session) = (Arc::clone(&self.dialect), self.key, self.session);
            let owner = self.owner.clone();
            runtime.spawn(async move { dialect.row_forget(&key, session, &owner).await });
        }
    }
}

impl<D: Dialect> SqlBackend<D> {
    /// `hub` is the one the dialect's release listener (if any) wakes; idle pinned
    /// connections are dropped after `max_idle`, before the server's idle timeout.
    pub(crate) fn new(
        dialect: D,
        opts: SqlOptions,
        hub: Arc<WakeOne<[u8; 32]>>,
        durable: bool,
        max_idle: Duration,
    ) -> Self {
        let dialect = Arc::new(dialect);
        SqlBackend {
            renewer: LeaseRenewer::start(
                Arc::clone(&dialect),
                super::renewer::in_flight(opts.pool),
            ),
            dialect,
            idle: Arc::new(IdleConns::new(opts.sessions, max_idle)),
            opts,
            hub,
            durable,
            shared_ready: tokio::sync::OnceCell::new(),
            local: Arc::default(),
        }
    }

    async fn session_conn(&self) -> Result<D::Conn> {
        match self.idle.pop() {
            Some(c) => Ok(c),
            None => self.dialect.connect_session().await,
        }
    }

    /// The session side of a hold of `name`, whose [`lock_key`] is `key`, on `conn`
    /// whose last answered statement was sent at `proven`.
    fn session(
        &self,
        conn: D::Conn,
        name: &LockName,
        key: [u8; 32],
        proven: std::time::Instant,
    ) -> Session<D::Conn> {
        Session {
            pinned: Pinned::new(
                conn,
                self.opts.heartbeat,
                self.opts.timeout,
                self.dialect.session_silence(),
                proven,
            ),
            idle: Arc::clone(&self.idle),
            hub: Arc::clone(&self.hub),
            key,
            name: name.as_str().to_owned(),
            timeout: self.opts.timeout,
            backend: D::BACKEND,
        }
    }

    fn hold(&self, req: &AcquireRequest, key: [u8; 32], fence: u64) -> Hold {
        Hold {
            key,
            key_hex: hex(&key),
            owner: req.owner.clone(),
            fence,
        }
    }

    async fn acquire_lease(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = lock_key(&req.name);
        // Counted until the answer is in, and dropped with it if the caller gives up;
        // from here on it counts for a hand-off under way, if one is (the waiter a
        // release here woke, most often).
        let counted = D::NATIVE_WAIT.then(|| self.local.enter(key));
        match self.dialect.lease_acquire(req, &key).await? {
            LeaseAnswer::Granted(fence) => Ok(Attempt::Acquired(Box::new(LeaseHeld {
                dialect: Arc::clone(&self.dialect),
                renewer: self.renewer.clone(),
                hub: Arc::clone(&self.hub),
                hold: Arc::new(self.hold(req, key, fence)),
                lock_delay: !self.opts.lock_delay.is_zero(),
                local: std::sync::Mutex::new(D::NATIVE_WAIT.then(|| self.local.enter(key))),
                released: std::sync::atomic::AtomicBool::new(false),
            }))),
            LeaseAnswer::Busy
                if req.attempt > 0 && !self.local.here_besides(&key, counted.is_some()) =>
            {
                // How long the wait may last should no release be announced (a holder
                // gone without one), asked in a round trip of its own: so only by a
                // waiter (a first attempt's answer only makes the locker subscribe and
                // ask again at once), and only of a key no other hold or attempt of
                // this backend has. A hold of it wakes the waiter here when it
                // releases, and an attempt in flight is most often the hand-off under
                // way, which then holds; asked on every busy try, the hint cost each
                // waiter that a woken one beat a round trip. A hint only:
                // without it the waiter looks again within `poll` or a second, whichever
                // is shorter.
                let retry_after = match self.dialect.lease_busy_left(&key).await {
                    Ok(left) => left,
                    Err(e) => {
                        tracing::debug!(error = %e, "no remaining lease for a busy name");
                        None
                    }
                };
                Ok(Attempt::Busy { retry_after })
            }
            LeaseAnswer::Busy => Ok(Attempt::Busy { retry_after: None }),
        }
    }

    async fn acquire_session(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = lock_key(&req.name);
        let skey = self.dialect.session_key(&req.name, &key)?;
        let mut conn = self.session_conn().await?;
        let sent = std::time::Instant::now();
        let locked = self.bounded(self.dialect.session_lock(&mut conn, req, &key, &skey));
        match locked.await? {
            Some(fence) => Ok(Attempt::Acquired(Box::new(SessionHeld {
                dialect: Arc::clone(&self.dialect),
                hold: self.hold(req, key, fence),
                session: self.session(conn, &req.name, key, sent),
                unlock: Unlock::Session(skey),
            }))),
            None => {
                self.idle.put(conn);
                Ok(Attempt::Busy { retry_after: None })
            }
        }
    }

    /// A statement of an attempt on its pinned connection, given the backend's
    /// `timeout` like every other statement. Cut off, the attempt fails and drops the
    /// connection (never put back idle), which ends its session on the server, and
    /// with it a lock the statement may have taken there unheard; till the server
    /// hears of the close (at once, unless the network is cut too), that lock stays
    /// taken by a session nobody uses, as a crashed client's would.
    async fn bounded<T>(&self, statement: impl Future<Output = Result<T>>) -> Result<T> {
        tokio::time::timeout(self.opts.timeout, statement)
            .await
            .unwrap_or_else(|_| Err(super::no_answer(D::BACKEND, self.opts.timeout)))
    }

    /// Row mode. Any error drops the connection, which ends its session and with it a
    /// transaction (and row lock) this attempt may have opened.
    async fn acquire_row(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = lock_key(&req.name);
        let mut conn = self.session_conn().await?;
        for _ in 0..2 {
            let locked_at = std::time::Instant::now();
            match self.bounded(self.dialect.row_lock(&mut conn, &key)).await? {
                RowLock::Locked { session, xact } => {
                    // From here until the hold is returned, an attempt that ends any
                    // other way (an error, or its task gone with the runtime) ends its
                    // session, and the record it may have written would name that
                    // session.
                    let mut record = D::ROW_FORGET.then(|| RowRecord {
                        dialect: Arc::clone(&self.dialect),
                        key,
                        session,
                        owner: req.owner.clone(),
                        kept: false,
                    });
                    let fence = self.dialect.row_holder(req, &key, session, xact).await?;
                    // The token comes from another connection: it is this hold's only if the
                    // pinned session still held the row lock after the token was taken.
                    // (A session that ended first lets another holder lock the row and
                    // take a lower token before this one: a fenced resource would then
                    // reject the real holder.) Its transaction keeps the row lock for as
                    // long as the session lives, so one answered ping proves it, unless
                    // the token's statement already checked that transaction.
                    let (alive, proven) = if xact.is_some() {
                        (true, locked_at)
                    } else {
                        let sent = std::time::Instant::now();
                        let ping = super::timed(D::BACKEND, self.opts.timeout, conn.ping());
                        (ping.await.is_ok(), sent)
                    };
                    if !alive {
                        // Its record names a dead session with a token no one holds;
                        // `record` has it cleared as it drops.
                        return Err(Error::connection(
                            D::BACKEND,
                            "the session holding the row lock ended while its token was taken",
                        ));
                    }
                    if let Some(r) = &mut record {
                        r.kept = true;
                    }
                    return Ok(Attempt::Acquired(Box::new(SessionHeld {
                        dialect: Arc::clone(&self.dialect),
                        hold: self.hold(req, key, fence),
                        session: self.session(conn, &req.name, key, proven),
                        unlock: Unlock::Row,
                    })));
                }
                // First use of this name: create its row, then try again (bounded by
                // the dialect, on a connection that may not be the pinned one).
                RowLock::Missing => self.dialect.row_ensure(&mut conn, &key).await?,
                RowLock::Busy => {
                    self.idle.put(conn);
                    return Ok(Attempt::Busy { retry_after: None });
                }
            }
        }
        Err(Error::backend(
            D::BACKEND,
            "the lock row vanished while locking it",
        ))
    }

    fn info(&self, name: &LockName, r: HolderRow) -> LockInfo {
        if r.owner.is_empty() && self.opts.mode.is_session() {
            let session = if r.session == 0 {
                // A row lock whose holder is not known (MySQL: no record).
                format!("{} transaction", D::PRODUCT)
            } else {
                format!("{} {} {}", D::PRODUCT, D::SESSION, r.session)
            };
            return super::foreign_holder(name, session);
        }
        let mut info = LockInfo::new(name, r.owner, r.holds, r.fence);
        info.metadata = metadata_from(&r.metadata);
        info.remaining = r.remaining;
        info
    }
}

#[async_trait]
impl<D: Dialect> Backend for SqlBackend<D> {
    fn scheme(&self) -> &'static str {
        D::BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        super::capabilities(
            self.opts.mode,
            D::NATIVE_WAIT,
            self.durable,
            self.opts.heartbeat,
        )
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        if req.primitive != Primitive::Lock {
            self.shared_ready
                .get_or_try_init(|| self.dialect.shared_schema())
                .await?;
            return super::shared::acquire(&self.dialect, &self.hub, req).await;
        }
        if req.fair {
            return Err(Error::Unsupported(format!(
                "fair (FIFO) mode is not offered by the {} backend yet",
                D::PRODUCT
            )));
        }
        match self.opts.mode {
            Mode::Lease => self.acquire_lease(req).await,
            Mode::Row => self.acquire_row(req).await,
            _ => self.acquire_session(req).await,
        }
    }

    async fn subscribe(&self, req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        let key = lock_key(&req.name);
        // Watching locally first, then marked on the server: a release after the mark
        // announces itself, and the watch is woken once the mark is taken, so the
        // attempt after that sees any release that stayed silent before.
        let watch = self.hub.watch(&key, waiter_class(req.primitive));
        // A lease-mode lock held here is released here, which wakes this watch: its
        // mark waits until the key is neither held nor being taken here ([`LocalMark`]).
        let local =
            (D::NATIVE_WAIT && self.opts.mode == Mode::Lease && req.primitive == Primitive::Lock)
                .then(|| {
                    let dialect = Arc::clone(&self.dialect);
                    LocalMark {
                        key,
                        here: Arc::clone(&self.local),
                        take: Box::new(move || dialect.mark_waiting(&key)),
                    }
                });
        let mut waiter = SqlWaiter {
            watch: Some(watch),
            poll: self.opts.poll,
            jitter: D::POLL_JITTER,
            mark: None,
            local,
        };
        match waiter.local {
            Some(_) => waiter.mark_as_needed(),
            None => waiter.mark = self.dialect.mark_waiting(&key),
        }
        Ok(Box::new(waiter))
    }

    async fn holders(&self, name: &LockName, primitive: Primitive) -> Result<Vec<LockInfo>> {
        let at = super::shared::SharedKey::named(name, primitive, 0);
        let rows = self.dialect.shared_holders(&at).await?;
        Ok(rows
            .into_iter()
            .filter_map(|(kind, owner, fence, left, metadata)| {
                let kind = crate::shared_holds::EntryKind::parse(&kind)?;
                Some(crate::shared_holds::holder_info(
                    name,
                    kind,
                    owner,
                    fence,
                    Some(Duration::from_millis(left.max(0).unsigned_abs())),
                    metadata_from(&metadata),
                ))
            })
            .collect())
    }

    async fn leave_queue(&self, req: &AcquireRequest) -> Result<()> {
        if req.primitive == Primitive::Write && req.enqueue.is_some() {
            return super::shared::leave(&*self.dialect, &self.hub, req).await;
        }
        Ok(())
    }

    async fn break_lock(&self, name: &LockName, fence: u64) -> Result<bool> {
        if self.opts.mode != Mode::Lease {
            return Err(Error::Unsupported(format!(
                "breaking a lock in mode={} would mean ending the holder's {} session; \
                 only mode=lease locks can be broken",
                self.opts.mode.as_str(),
                D::PRODUCT
            )));
        }
        let key = lock_key(name);
        let broke = self.dialect.lease_break(&key, fence).await?;
        if broke {
            self.hub.wake(&key);
        }
        Ok(broke)
    }

    async fn names(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        self.dialect.names(self.opts.mode, prefix, limit).await
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let row = self
            .dialect
            .inspect(self.opts.mode, name, &lock_key(name))
            .await?;
        Ok(row.map(|r| self.info(name, r)))
    }
}

/// A lease-mode hold: a row the statements renew and release by (owner, token).
struct LeaseHeld<D> {
    dialect: Arc<D>,
    renewer: LeaseRenewer,
    hub: Arc<WakeOne<[u8; 32]>>,
    hold: Arc<Hold>,
    lock_delay: bool,
    /// Counted among the backend's local holds until it is released or dropped
    /// ([`LocalMark`]).
    local: std::sync::Mutex<Option<LocalHold>>,
    /// Set by the first release, never reset: the row counts the holds of an owner, so
    /// a release sent again after an unanswered one could drop another task's hold.
    released: std::sync::atomic::AtomicBool,
}

impl<D> std::fmt::Debug for LeaseHeld<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseHeld")
            .field("hold", &self.hold)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<D: Dialect> HeldLock for LeaseHeld<D> {
    fn fencing_token(&self) -> u64 {
        self.hold.fence
    }

    fn renews_in_batches(&self) -> bool {
        true
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        if self.renewer.renew(&self.hold, ttl).await? {
            Ok(())
        } else {
            Err(Error::NotOwner {
                name: String::new(),
            })
        }
    }

    async fn release(&self) -> Result<()> {
        if self
            .released
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Ok(());
        }
        let released = self.dialect.lease_release(&self.hold).await;
        // Uncounted before the wake-up: the task woken must not find the key still
        // held here and wait unmarked behind a holder that has gone. The key then
        // counts as being handed on until the next attempt here (the woken task's,
        // most often) is counted instead, so that no waiter here marks it in between
        // ([`LocalHold::hand_on`]).
        // A release that failed may have freed the row too: a waiter looks.
        // A release that found the hold gone changed nothing, but the key may be free
        // (broken): a waiter looks too.
        let counted = self.take_counted();
        match (&released, counted) {
            (Ok(LeaseReleased::Free), Some(counted)) => counted.hand_on(&self.hub),
            (Ok(LeaseReleased::StillHeld), counted) => drop(counted),
            (_, counted) => {
                drop(counted);
                self.hub.wake(&self.hold.key);
            }
        }
        match released? {
            LeaseReleased::Free | LeaseReleased::StillHeld => Ok(()),
            LeaseReleased::NotHeld => Err(Error::NotOwner {
                name: String::new(),
            }),
        }
    }

    fn keeps_lock_delay(&self) -> bool {
        self.lock_delay
    }

    fn lost(&self) {
        // Another process may take the key now (after the lease, and any lock-delay,
        // with no release here): a waiter woken looks again and marks it.
        if self.uncount() {
            self.hub.wake(&self.hold.key);
        }
    }
}

impl<D> LeaseHeld<D> {
    /// No longer counted among the backend's local holds; whether it still was.
    fn uncount(&self) -> bool {
        self.take_counted().is_some()
    }

    /// The hold's count among the backend's local holds, if it still has it.
    fn take_counted(&self) -> Option<LocalHold> {
        self.local
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

/// How a session hold lets go.
#[derive(Debug)]
enum Unlock<K> {
    /// Advisory / named lock under this server-side name.
    Session(K),
    /// Row mode: commit the transaction that holds the row.
    Row,
}

/// A hold in a session mode: the lock lives as long as the pinned connection's session.
struct SessionHeld<D: Dialect> {
    dialect: Arc<D>,
    hold: Hold,
    session: Session<D::Conn>,
    unlock: Unlock<D::SessionKey>,
}

impl<D: Dialect> std::fmt::Debug for SessionHeld<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionHeld")
            .field("hold", &self.hold)
            .field("unlock", &self.unlock)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<D: Dialect> HeldLock for SessionHeld<D> {
    fn fencing_token(&self) -> u64 {
        self.hold.fence
    }

    async fn renew(&self, _ttl: Duration) -> Result<()> {
        self.session.renew().await
    }

    async fn release(&self) -> Result<()> {
        let (d, hold) = (&*self.dialect, &self.hold);
        self.session
            .end(|mut conn| async move {
                let r = match &self.unlock {
                    Unlock::Session(skey) => d.session_unlock(&mut conn, skey, hold).await,
                    Unlock::Row => d.row_unlock(&mut conn, hold).await,
                };
                (conn, r)
            })
            .await
    }

    fn prove_alive_every(&self) -> Option<Duration> {
        Some(self.session.prove_alive_every())
    }

    fn watch_alone(&self) {
        self.session.watch_alone();
    }

    fn loss_signal(&self) -> Option<CancellationToken> {
        self.session.loss_signal()
    }

    fn session_trust(&self) -> Option<crate::backend::SessionTrust> {
        Some(self.session.trust())
    }
}

/// The poller class of a waiter for `primitive` ([`WakeOne`]): a permit or a read may
/// come free where a lock or a write may not, so each class polls for itself.
fn waiter_class(primitive: Primitive) -> u8 {
    match primitive {
        Primitive::Lock => super::LOCK_CLASS,
        Primitive::Permit { .. } => 1,
        Primitive::Read => 2,
        Primitive::Write => 3,
    }
}
