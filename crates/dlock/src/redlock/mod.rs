//! `redlock://a:6379,b:6379,c:6379,d:6379,e:6379`: the Redlock algorithm over N
//! independent Redis masters (feature `redis`).
//!
//! # How a lock works here
//! An attempt sends a single-node acquire script (the plain layout: `SET name <owner>
//! NX PX`, plus dlock's token counter `dlock_token:{name}`) to every node at
//! once, each call bounded by `node_timeout` (far below the TTL). It succeeds iff at
//! least ⌊N/2⌋+1 nodes granted, a majority of nodes holding the grant stand at its
//! token (the write-back under *Fencing* below), **and** the validity `TTL − elapsed −
//! drift` (drift = `drift_factor` × TTL + 2 ms, default 1 %) is still positive after
//! that write-back. Otherwise the attempt gives the lock back on every node that granted or did
//! not answer, and:
//! - if the nodes that refused hold it for another owner in numbers that make a
//!   majority impossible, it is **busy**: waited for (polling with jitter), or `None`
//!   from `try_lock`;
//! - else (nodes unreachable, paused or too slow) it retries after a random delay, at
//!   most `retries` times, then fails with [`Error::NoQuorum`] — at once, no hang.
//!
//! The on-node layout is the one node-redlock, redsync and rslock use (the resource name
//! as key, a random value, `PX` lease), so they and dlock exclude each other.
//!
//! Renewal extends the lease on every node and succeeds on a majority (within the
//! validity); a node that lost the key (restarted empty) gets it back only then, unless
//! a break of that grant ran there (see *Breaking a lock*). If a
//! majority answers that the key is gone or held by another, the lock is lost. Release
//! goes to every node.
//!
//! # Fencing
//! Each granting node increments its counter in the acquire script; the client takes
//! T = the maximum of the values returned and writes T back, set-if-greater, to the
//! nodes that may hold the grant and did not return T. The guard is returned only once a majority of
//! nodes that *still hold this grant* stand at T or above (the nodes that returned T
//! count at once; a raise counts only where it found the grant). Any two majorities
//! intersect, so every later grant meets one of those nodes, where it can only be
//! granted after this grant's key is gone — after the raise — and gets a larger token.
//! (A raise acknowledged by a node that another grant reached first proves nothing:
//! that grant drew its counter value before the raise.) That holds
//! as long as no node loses an acknowledged write: every node must persist each write
//! before answering (`appendonly yes` + `appendfsync always`), or a node that restarts
//! empty must stay down for at least the longest TTL in use. dlock reports
//! [`Fencing::Durable`] only when every node says `appendfsync always` at connect time,
//! [`Fencing::BestEffort`] otherwise.
//!
//! [`crate::Locker::inspect`] (and an election's observers) reads the token most of
//! a majority's holding nodes record: while a grant's T is being written back, that
//! can be below T — an observer may see a leader's term rise once.
//!
//! Each round's grants carry a nonce in their metadata on every node: release, renewal
//! and the clean-up of a failed round act on that grant only, never on another task's
//! grant of the same owner. A renewal never shortens a lease. Renewals waiting at the
//! same moment go to each node as one script call (each grant still counts its own
//! quorum), so many held locks cost a node a few calls per tick.
//!
//! # Breaking a lock
//! [`Locker::break_lock`](crate::Locker::break_lock) finds the grant inspect shows
//! with that token (held by a majority: its owner and its metadata, which holds the
//! grant's nonce), deletes that grant wherever a node holds it, and raises every
//! answering node's counter to the token; it also leaves a mark there (the token, for
//! as long as the longest lease), so that a renewal of that grant under way when the
//! break came cannot put it back on a node the break emptied (a renewal re-seeds only
//! where no such mark is); the holder's next renewal finds a majority without it. It succeeds only once the nodes that have not answered the break are fewer than
//! a quorum, each that answered then without the grant (else [`Error::NoQuorum`]: the
//! holder's renewal could still extend it on a quorum).
//!
//! # Not guaranteed
//! Redlock assumes bounded clock drift and bounded pauses; a holder paused past its
//! validity is exactly the case fencing tokens exist for. No FIFO order, no unlock
//! notifications (waiters poll), no reentrancy. With a node SIGSTOPped, an acquire or
//! renewal returns as soon as the answers in decide it (a majority granted, or
//! refused, or no longer able to), but a release or a failed attempt waits up to
//! `node_timeout` for it.
//!
//! # Options
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `node_timeout` | 50 ms, at most a tenth of the TTL | per node call (a configured value is used as given: keep it far below your TTLs) |
//! | `drift_factor` | `0.01` | clock drift allowed, as a fraction of the TTL (0 to < 0.5) |
//! | `retries` | `3` | rounds after the first when too few nodes answer (0–100) |
//! | `poll` | `20ms` | waiting (jittered) |
//! | `prefix` | none | prepended to every lock name |
//! | `timeout` | `5s` | connecting |
//!
//! A password in the URL is used on every node. The on-node layout is node-redlock's,
//! redsync's and rslock's (the name as key, the owner as value, `SET NX PX`): they and
//! dlock exclude each other; dlock adds `dlock_token:{name}`, `dlock_fence:{name}` and
//! `dlock_meta:{name}`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::{FromRedisValue, Script};

use crate::backend::{
    AcquireRequest, Attempt, Backend, Capabilities, Fencing, HeldLock, LockInfo, PollingWaiter,
    Waiter,
};
use crate::error::{Error, Result};
use crate::lease::millis;
use crate::name::LockName;
use crate::options::Metadata;
use crate::redis::layout::{Layout, suffixed};
use crate::url::ConnectUrl;

mod node;
mod renewer;

use node::{Job, Node};
use renewer::{Grant, Renewer};

const SCHEME: &str = "redlock";

static ACQUIRE: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(include_str!("scripts/acquire.lua")));
static RAISE: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(include_str!("scripts/raise.lua")));
static RENEW: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(include_str!("scripts/renew.lua")));
static RESEED: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(include_str!("scripts/reseed.lua")));
static BREAK: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(include_str!("scripts/break.lua")));
/// How long a break's mark stays on a node (`break.lua`): a renewal under way when the
/// break came re-seeds only within its validity, at most the longest lease. The mark
/// never refuses a later grant: its token is above the mark (a break answered by more
/// than n - quorum nodes raised the counter on one node of every majority).
const BROKEN_MARK_LIFE: Duration = crate::MAX_TTL;

static RELEASE: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(include_str!("scripts/release.lua")));

/// The re-seed of a grant (`reseed.lua`) on a node that lost its key: `owner`'s grant
/// with `token` and `metadata`, for `lease_ms`.
fn reseed_call(
    keys: &Keys,
    owner: &str,
    lease_ms: u64,
    token: u64,
    metadata: &str,
) -> redis::ScriptInvocation<'static> {
    let mut reseed = RESEED.prepare_invoke();
    reseed
        .key(&keys.lock)
        .key(&keys.counter)
        .key(&keys.token)
        .key(&keys.meta)
        .key(&keys.broken)
        .arg(owner)
        .arg(lease_ms)
        .arg(token)
        .arg(metadata);
    reseed
}

/// The Redlock backend.
pub struct RedlockBackend {
    inner: Arc<Inner>,
}

struct Inner {
    nodes: Vec<Arc<Node>>,
    quorum: usize,
    prefix: String,
    /// Per node call; `None`: 50 ms, at most a tenth of the TTL.
    node_timeout: Option<Duration>,
    drift_factor: f64,
    retries: u32,
    poll: Duration,
    fencing: Fencing,
    shown: String,
    /// Renews every held grant, many per script call.
    renewer: Renewer,
}

impl std::fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("url", &self.inner.shown)
            .field("nodes", &self.inner.nodes.len())
            .field("quorum", &self.inner.quorum)
            .field("fencing", &self.inner.fencing)
            .finish_non_exhaustive()
    }
}

/// What Redlock guarantees with tokens of quality `fencing`: no FIFO order, no
/// notification (waiters poll), no reentrancy (the plain layout of its peers).
fn caps(fencing: Fencing) -> Capabilities {
    let mut caps = Capabilities::new(fencing);
    caps.cross_process = true;
    caps.release_reports_loss = true;
    caps
}

impl RedlockBackend {
    /// The capabilities on nodes that all persist every write (`durable`), or not.
    pub(crate) fn capabilities_with(durable: bool) -> Capabilities {
        caps(crate::redis::durable_if(durable))
    }
}

/// The keys of one lock on every node.
#[derive(Debug, Clone)]
struct Keys {
    lock: String,
    counter: String,
    meta: String,
    token: String,
    /// The highest token a break ended on this node, for a while (`break.lua`).
    broken: String,
}

/// How one round of an attempt ended.
enum Round {
    Granted(Box<RedlockHeld>),
    /// Another owner holds it on enough nodes that no majority is possible.
    Taken(Option<Duration>),
    /// Too few nodes answered in time.
    NoQuorum {
        granted: usize,
        unreachable: usize,
    },
    /// A majority granted, but after the validity ran out.
    TooSlow(Duration),
}

/// Between half and all of `d`.
fn jitter(d: Duration) -> Duration {
    let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(nanos / 2 + fastrand::u64(0..=nanos / 2))
}

impl RedlockBackend {
    pub(crate) async fn open(mut url: ConnectUrl) -> Result<Arc<Self>> {
        let node_timeout = match url.take_param("node_timeout") {
            None => None,
            Some(v) => {
                let d = crate::options::parse_duration("node_timeout", &v)?;
                if d.is_zero() {
                    return Err(url.invalid("node_timeout must be above zero"));
                }
                Some(d)
            }
        };
        let timeout = url.take_duration("timeout", Duration::from_secs(5))?;
        let poll = url.take_duration("poll", Duration::from_millis(20))?;
        let drift_factor = match url.take_param("drift_factor") {
            None => 0.01,
            Some(f) => f
                .parse::<f64>()
                .ok()
                .filter(|f| (0.0..0.5).contains(f))
                .ok_or_else(|| url.invalid("drift_factor must be a number from 0 to below 0.5"))?,
        };
        let retries = url.take_count("retries", 0..=100)?.unwrap_or(3);
        let prefix = url.take_param("prefix").unwrap_or_default();
        url.finish(&[
            "node_timeout",
            "timeout",
            "poll",
            "drift_factor",
            "retries",
            "prefix",
        ])?;
        if url.hosts().len() < 3 {
            return Err(url.invalid(
                "Redlock needs at least 3 independent nodes (5 recommended): redlock://a:6379,b:6379,c:6379",
            ));
        }
        // A node named twice would count twice towards every majority: its loss of a
        // write alone could then let a second holder in.
        let mut seen = std::collections::HashSet::new();
        for h in url.hosts() {
            let node = (h.host.to_ascii_lowercase(), h.port.unwrap_or(6379));
            if !seen.insert(node) {
                return Err(url.invalid(&format!(
                    "Redlock node {}:{} is named twice: each node counts once towards a majority",
                    h.host,
                    h.port.unwrap_or(6379)
                )));
            }
        }
        let mut nodes = Vec::with_capacity(url.hosts().len());
        for h in url.hosts() {
            let port = h.port.unwrap_or(6379);
            let info = crate::redis::connection_info(&url, h.host.clone(), port, false)?;
            let client = redis::Client::open(info).map_err(|e| crate::redis::map_err(&e))?;
            let shown = if h.host.contains(':') {
                format!("[{}]:{port}", h.host)
            } else {
                format!("{}:{port}", h.host)
            };
            nodes.push(Arc::new(Node::new(client, shown, timeout)));
        }
        let quorum = nodes.len() / 2 + 1;
        // Connect-time check: fail now, not on the first lock, when no majority answers;
        // the same round trip asks each node whether it persists every write.
        let persists: Vec<Option<bool>> = futures_util::future::join_all(nodes.iter().map(|n| {
            let n = &**n;
            async move {
                let mut ping = redis::pipe();
                ping.cmd("PING");
                let up: Result<(String,)> = n.run(timeout, &Job::Pipe(ping)).await;
                match up {
                    Ok(_) => Some(n.persists_every_write(timeout).await),
                    Err(_) => None,
                }
            }
        }))
        .await;
        let answered = persists.iter().flatten().count();
        if answered < quorum {
            return Err(Error::NoQuorum {
                granted: answered,
                needed: quorum,
                unreachable: nodes.len() - answered,
            });
        }
        let fencing = if persists.iter().all(|p| *p == Some(true)) {
            Fencing::Durable
        } else {
            Fencing::BestEffort
        };
        Ok(Arc::new(RedlockBackend {
            inner: Arc::new_cyclic(|inner| Inner {
                nodes,
                quorum,
                prefix,
                node_timeout,
                drift_factor,
                retries,
                poll,
                fencing,
                shown: url.to_string(),
                renewer: Renewer::start(inner.clone()),
            }),
        }))
    }
}

impl Inner {
    fn keys(&self, name: &LockName) -> Keys {
        let key = format!("{}{}", self.prefix, name.as_str());
        let plain = Layout::RedisPy.keys(&key);
        Keys {
            token: suffixed("dlock_fence", &key),
            broken: suffixed("dlock_broken", &key),
            counter: plain.counter(),
            meta: plain.meta().unwrap_or_default(),
            lock: key,
        }
    }

    /// `pipe` on every node: the answers, or `NoQuorum` when fewer than a majority
    /// answered.
    async fn read_majority<T: FromRedisValue + Send + 'static>(
        &self,
        pipe: redis::Pipeline,
        timeout: Duration,
    ) -> Result<Vec<T>> {
        let rows: Vec<T> = self
            .fan_out::<T>(&self.all(), timeout, Job::Pipe(pipe), |_| true, usize::MAX)
            .await
            .into_iter()
            .filter_map(|a| a.and_then(Result::ok))
            .collect();
        if rows.len() < self.quorum {
            return Err(Error::NoQuorum {
                granted: rows.len(),
                needed: self.quorum,
                unreachable: self.nodes.len() - rows.len(),
            });
        }
        Ok(rows)
    }

    fn drift(&self, ttl: Duration) -> Duration {
        ttl.mul_f64(self.drift_factor) + Duration::from_millis(2)
    }

    /// The per-node bound for a lock of `ttl`: by default 50 ms and at most a tenth of
    /// the lease; a configured value is honoured as it is (grants that come back too
    /// late are refused by the validity check).
    fn node_timeout(&self, ttl: Duration) -> Duration {
        match self.node_timeout {
            None => Duration::from_millis(50).min(ttl / 10),
            Some(d) => d,
        }
        .max(Duration::from_millis(1))
    }

    /// The bound for calls that are not about one lease (release, inspect).
    fn call_timeout(&self) -> Duration {
        self.node_timeout
            .unwrap_or(Duration::from_millis(50))
            .max(Duration::from_millis(50))
    }

    fn all(&self) -> Vec<usize> {
        (0..self.nodes.len()).collect()
    }

    /// Run `job` on the nodes `targets` at once, each call in a task of its own. Stops
    /// waiting as soon as `need` answers satisfy `counts` (the rest are `None`: not
    /// waited for, but still run to completion, so a grant still lands everywhere it
    /// can); with `need` above the number of targets it waits for every answer (each
    /// bounded by `timeout`).
    async fn fan_out<T: FromRedisValue + Send + 'static>(
        &self,
        targets: &[usize],
        timeout: Duration,
        job: Job,
        counts: impl Fn(&T) -> bool,
        need: usize,
    ) -> Vec<Option<Result<T>>> {
        self.fan_out_until(targets, timeout, job, |answers| {
            answers
                .iter()
                .filter(|a| matches!(a, Some(Ok(v)) if counts(v)))
                .count()
                >= need
        })
        .await
    }

    /// [`Inner::fan_out`], waiting until `enough` says the answers so far (one per
    /// node, `None` while it has not answered) settle the question.
    async fn fan_out_until<T: FromRedisValue + Send + 'static>(
        &self,
        targets: &[usize],
        timeout: Duration,
        job: Job,
        enough: impl Fn(&[Option<Result<T>>]) -> bool,
    ) -> Vec<Option<Result<T>>> {
        let mut out: Vec<Option<Result<T>>> = (0..self.nodes.len()).map(|_| None).collect();
        let job = Arc::new(job);
        let (tx, mut rx) = tokio::sync::mpsc::channel(targets.len().max(1));
        for &i in targets {
            let node = Arc::clone(&self.nodes[i]);
            let (job, tx) = (Arc::clone(&job), tx.clone());
            tokio::spawn(async move {
                let answer = node.run::<T>(timeout, &job).await;
                let _ = tx.send((i, answer)).await;
            });
        }
        drop(tx);
        while let Some((i, answer)) = rx.recv().await {
            out[i] = Some(answer);
            if enough(&out) {
                break;
            }
        }
        out
    }

    /// Release on `targets` what the grant with `nonce` holds there (never another
    /// grant of the same owner), waiting for each (bounded). Returns how many nodes
    /// answered, and how many of them still held this grant.
    async fn release_on(
        &self,
        targets: &[usize],
        keys: &Keys,
        owner: &str,
        nonce: &str,
    ) -> (usize, usize) {
        let mut inv = RELEASE.prepare_invoke();
        inv.key(&keys.lock)
            .key(&keys.meta)
            .key(&keys.token)
            .arg(owner)
            .arg(nonce);
        let timeout = self.call_timeout();
        let answers = self
            .fan_out::<i64>(targets, timeout, Job::Script(inv), |_| true, usize::MAX)
            .await;
        let answered = answers.iter().filter(|a| matches!(a, Some(Ok(_)))).count();
        let held = answers.iter().filter(|a| matches!(a, Some(Ok(1)))).count();
        (answered, held)
    }

    async fn round(self: &Arc<Self>, req: &AcquireRequest, keys: &Keys) -> Result<Round> {
        let n = self.nodes.len();
        let start = Instant::now();
        let timeout = self.node_timeout(req.ttl);
        let owner = req.owner.as_str();
        // Each round's grants carry a nonce of their own in their metadata: release and
        // renewal act on this grant only, never on another task's grant of one owner.
        let nonce = crate::hex::u128_32(u128::from_be_bytes(crate::random::bytes::<16>()));
        let metadata = crate::redis::StoredMetadata {
            metadata: &req.metadata,
            nonce: &nonce,
        }
        .to_json();
        let mut inv = ACQUIRE.prepare_invoke();
        inv.key(&keys.lock)
            .key(&keys.counter)
            .key(&keys.meta)
            .key(&keys.token)
            .arg(millis(req.ttl))
            .arg(owner)
            .arg(&metadata);
        let answers = self
            .fan_out::<(i64, i64)>(
                &self.all(),
                timeout,
                Job::Script(inv),
                |(g, _)| *g == 1,
                self.quorum,
            )
            .await;
        // (node, the counter value it returned) for each node that granted.
        let mut tokens: Vec<(usize, u64)> = Vec::new();
        let mut busy_pttl: Option<u64> = None;
        let mut unreachable = 0;
        // Nodes that may hold a grant of ours: those that granted, and those whose
        // answer we did not get (or did not wait for).
        let mut ours = Vec::new();
        for (i, a) in answers.iter().enumerate() {
            match a {
                Some(Ok((1, token))) => {
                    tokens.push((i, u64::try_from(*token).unwrap_or(0)));
                    ours.push(i);
                }
                Some(Ok((_, pttl))) => {
                    if let Ok(p) = u64::try_from(*pttl) {
                        busy_pttl = Some(busy_pttl.map_or(p, |b| b.min(p)));
                    }
                }
                Some(Err(_)) => {
                    unreachable += 1;
                    ours.push(i);
                }
                None => ours.push(i),
            }
        }
        let granted = tokens.len();
        let drift = self.drift(req.ttl);
        let valid = |at: Instant| req.ttl > at.duration_since(start) + drift;
        if granted >= self.quorum && valid(Instant::now()) {
            let token = tokens.iter().map(|&(_, t)| t).max().unwrap_or(0);
            // Each granting node's counter now equals the value it returned, and stays
            // at least that while it holds this grant. A majority of nodes holding the
            // grant with a counter at T makes every later grant come after T: a later
            // majority meets one of them, and is granted there only once this grant's
            // key is gone. Nodes that returned T count at once (the usual case: nodes
            // that saw the same grants agree); the others are raised, and count only
            // if they still held this grant when the raise landed (a node that answers
            // the raise but holds another grant — one that got there first — proves
            // nothing: that grant's counter value was drawn before the raise).
            let at_token = tokens.iter().filter(|&&(_, t)| t == token).count();
            let acks = if at_token >= self.quorum {
                self.quorum
            } else {
                // Every node that may hold the grant and is not known to stand at T:
                // those that returned less, and those whose answer was not awaited
                // (they may have granted since; the raise finds out).
                let behind: Vec<usize> = ours
                    .iter()
                    .copied()
                    .filter(|i| !tokens.iter().any(|&(n, t)| n == *i && t == token))
                    .collect();
                let mut raise = RAISE.prepare_invoke();
                raise
                    .key(&keys.counter)
                    .key(&keys.lock)
                    .key(&keys.token)
                    .key(&keys.meta)
                    .arg(token)
                    .arg(owner)
                    .arg(&nonce);
                let raised = self
                    .fan_out::<i64>(
                        &behind,
                        timeout,
                        Job::Script(raise),
                        |held| *held == 1,
                        self.quorum - at_token,
                    )
                    .await
                    .iter()
                    .filter(|a| matches!(a, Some(Ok(1))))
                    .count();
                at_token + raised
            };
            if acks >= self.quorum && valid(Instant::now()) {
                return Ok(Round::Granted(Box::new(RedlockHeld {
                    inner: Arc::clone(self),
                    name: req.name.clone(),
                    keys: keys.clone(),
                    owner: owner.to_owned(),
                    token,
                    nonce,
                    metadata,
                    released: AtomicBool::new(false),
                })));
            }
            self.release_on(&self.all(), keys, owner, &nonce).await;
            if acks < self.quorum {
                return Ok(Round::NoQuorum {
                    granted,
                    unreachable: n - acks,
                });
            }
            return Ok(Round::TooSlow(start.elapsed()));
        }
        if !ours.is_empty() {
            self.release_on(&ours, keys, owner, &nonce).await;
        }
        if granted >= self.quorum {
            return Ok(Round::TooSlow(start.elapsed()));
        }
        if granted + unreachable < self.quorum {
            // Another owner holds it on more than N − quorum nodes: no majority for us
            // until they release or it expires.
            let mut retry = jitter(self.poll);
            if let Some(p) = busy_pttl {
                retry = retry.min(Duration::from_millis(p.max(1)));
            }
            return Ok(Round::Taken(Some(retry)));
        }
        Ok(Round::NoQuorum {
            granted,
            unreachable,
        })
    }
}

#[async_trait]
impl Backend for RedlockBackend {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn capabilities(&self) -> Capabilities {
        caps(self.inner.fencing)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        let inner = &self.inner;
        let keys = inner.keys(&req.name);
        let started = Instant::now();
        let mut round = 0;
        loop {
            let outcome = inner.round(req, &keys).await?;
            let failure = match outcome {
                Round::Granted(held) => return Ok(Attempt::Acquired(held)),
                Round::Taken(retry_after) => return Ok(Attempt::Busy { retry_after }),
                Round::NoQuorum {
                    granted,
                    unreachable,
                } => Error::NoQuorum {
                    granted,
                    needed: inner.quorum,
                    unreachable,
                },
                Round::TooSlow(took) => Error::connection(
                    SCHEME,
                    format!(
                        "a majority granted, but only after {took:?}, past the validity of a {:?} lease: given back",
                        req.ttl
                    ),
                ),
            };
            // A bounded number of rounds, and none that would start past half the lease.
            if round >= inner.retries || started.elapsed() > req.ttl / 2 {
                return Err(failure);
            }
            round += 1;
            tracing::debug!(lock = %req.name, error = %failure, round, "redlock round failed; retrying");
            tokio::time::sleep(jitter(inner.poll)).await;
        }
    }

    async fn subscribe(&self, _req: &AcquireRequest) -> Result<Box<dyn Waiter>> {
        Ok(Box::new(PollingWaiter {
            interval: self.inner.poll,
        }))
    }

    async fn break_lock(&self, name: &LockName, fence: u64) -> Result<bool> {
        // Which grant carries `fence`: the owner and metadata (with its nonce) that the
        // nodes recording that token name. It is deleted wherever that very grant is
        // found; the holder's next renewal then finds a majority without it.
        let inner = &self.inner;
        let keys = inner.keys(name);
        let mut pipe = redis::pipe();
        pipe.get(&keys.lock).get(&keys.token).get(&keys.meta);
        type Row = (Option<String>, Option<u64>, Option<String>);
        let timeout = inner.call_timeout().max(Duration::from_millis(200));
        let rows: Vec<Row> = inner.read_majority(pipe, timeout).await?;
        // The grant inspect shows: held (owner and metadata, which carries its nonce)
        // by a majority, its token the one most of those nodes record. A node that
        // records `fence` for a later grant (its counter lagged) must not pick that one.
        let mut grants: Vec<(&str, &str, Vec<u64>)> = Vec::new();
        for (owner, token, meta) in &rows {
            let (Some(owner), Some(meta)) = (owner, meta) else {
                continue;
            };
            match grants.iter_mut().find(|(o, m, _)| o == owner && m == meta) {
                Some((_, _, tokens)) => tokens.extend(*token),
                None => grants.push((owner, meta, token.iter().copied().collect())),
            }
        }
        let shown = |tokens: &[u64]| {
            tokens
                .iter()
                .copied()
                .max_by_key(|t| (tokens.iter().filter(|x| *x == t).count(), *t))
        };
        let held_by = |owner: &str, meta: &str| {
            rows.iter()
                .filter(|r| r.0.as_deref() == Some(owner) && r.2.as_deref() == Some(meta))
                .count()
        };
        let Some((owner, meta, _)) = grants
            .iter()
            .find(|(o, m, tokens)| held_by(o, m) >= inner.quorum && shown(tokens) == Some(fence))
        else {
            return Ok(false);
        };
        let (owner, meta) = ((*owner).to_owned(), (*meta).to_owned());
        let mut inv = BREAK.prepare_invoke();
        inv.key(&keys.lock)
            .key(&keys.meta)
            .key(&keys.token)
            .key(&keys.counter)
            .key(&keys.broken)
            .arg(&owner)
            .arg(&meta)
            .arg(fence)
            .arg(millis(BROKEN_MARK_LIFE));
        // Every node that answers is without the grant once the script has run there
        // (deleted, or not there to begin with). Each node counts once, by its answer
        // to this call: not also by what the read above found, as a node found without
        // it then may have been given it back since (a renewal re-seeds a node that
        // lost its key) and counted a second time when the break deleted it there.
        let without = inner
            .fan_out::<i64>(
                &inner.all(),
                timeout,
                Job::Script(inv),
                |_| true,
                usize::MAX,
            )
            .await
            .into_iter()
            .filter(|a| matches!(a, Some(Ok(_))))
            .count();
        // Broken only once the nodes that did not answer are fewer than a quorum:
        // otherwise the holder's renewal could still extend it on a quorum.
        let n = inner.nodes.len();
        if without > n - inner.quorum {
            Ok(true)
        } else {
            Err(Error::NoQuorum {
                granted: without,
                needed: n - inner.quorum + 1,
                unreachable: n - without,
            })
        }
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>> {
        let inner = &self.inner;
        let keys = inner.keys(name);
        let mut pipe = redis::pipe();
        pipe.get(&keys.lock)
            .pttl(&keys.lock)
            .get(&keys.token)
            .get(&keys.meta);
        type Row = (Option<String>, i64, Option<u64>, Option<String>);
        let timeout = inner.call_timeout().max(Duration::from_millis(200));
        let rows: Vec<Row> = inner.read_majority(pipe, timeout).await?;
        // The holder is the owner a majority of nodes name.
        let Some(owner) = rows
            .iter()
            .filter_map(|r| r.0.as_ref())
            .find(|o| rows.iter().filter(|r| r.0.as_ref() == Some(*o)).count() >= inner.quorum)
        else {
            return Ok(None);
        };
        let held: Vec<&Row> = rows
            .iter()
            .filter(|r| r.0.as_ref() == Some(owner))
            .collect();
        // The token the most holding nodes record (a node that granted late may
        // record its own, different counter value).
        let recorded: Vec<u64> = held.iter().filter_map(|r| r.2).collect();
        let token = recorded
            .iter()
            .copied()
            .max_by_key(|t| (recorded.iter().filter(|r| *r == t).count(), *t))
            .unwrap_or(0);
        let mut info = LockInfo::new(name, owner.clone(), 1, token);
        info.metadata = held
            .iter()
            .find_map(|r| r.3.as_deref())
            .and_then(|m| serde_json::from_str::<Metadata>(m).ok())
            .unwrap_or_default();
        // A majority holds it at least as long as the median remaining lease.
        let mut remaining: Vec<u64> = held
            .iter()
            .filter_map(|r| u64::try_from(r.1).ok())
            .collect();
        remaining.sort_unstable();
        info.remaining = remaining
            .get(remaining.len().saturating_sub(inner.quorum))
            .map(|ms| Duration::from_millis(*ms));
        Ok(Some(info))
    }
}

struct RedlockHeld {
    inner: Arc<Inner>,
    name: LockName,
    keys: Keys,
    owner: String,
    token: u64,
    /// This grant's nonce (in its metadata on every node it holds).
    nonce: String,
    /// The stored metadata, for putting the lock back on a node that lost it.
    metadata: String,
    released: AtomicBool,
}

impl std::fmt::Debug for RedlockHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedlockHeld")
            .field("name", &self.name)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl HeldLock for RedlockHeld {
    fn fencing_token(&self) -> u64 {
        self.token
    }

    fn renews_in_batches(&self) -> bool {
        true
    }

    fn clock_drift(&self, ttl: Duration) -> Duration {
        self.inner.drift(ttl)
    }

    async fn renew(&self, ttl: Duration) -> Result<()> {
        let inner = &self.inner;
        let n = inner.nodes.len();
        let start = Instant::now();
        let timeout = inner.node_timeout(ttl);
        // Batched with the other grants' renewals waiting now (`renewer`).
        let grant = Grant {
            lock: self.keys.lock.clone(),
            meta: self.keys.meta.clone(),
            token: self.keys.token.clone(),
            owner: self.owner.clone(),
            nonce: self.nonce.clone(),
        };
        let answers = inner.renewer.renew(grant, ttl).await?;
        let extended = answers.iter().filter(|a| matches!(a, Some(Ok(1)))).count();
        let gone: Vec<usize> = (0..n)
            .filter(|&i| matches!(answers[i], Some(Ok(0))))
            .collect();
        let taken = answers.iter().filter(|a| matches!(a, Some(Ok(-1)))).count();
        let pending = answers.iter().filter(|a| a.is_none()).count();
        let verdict = renewer::Verdict::of(extended, gone.len() + taken, pending, n, inner.quorum);
        if verdict == renewer::Verdict::Held && start.elapsed() + inner.drift(ttl) < ttl {
            if !gone.is_empty() {
                // Still held by a majority: put it back where a node lost it.
                let reseed = reseed_call(
                    &self.keys,
                    &self.owner,
                    millis(ttl),
                    self.token,
                    &self.metadata,
                );
                inner
                    .fan_out::<i64>(&gone, timeout, Job::Script(reseed), |_| true, usize::MAX)
                    .await;
            }
            return Ok(());
        }
        if verdict == renewer::Verdict::Refused {
            // A majority no longer lists this owner: it can never extend again.
            return Err(Error::NotOwner {
                name: self.name.as_str().to_owned(),
            });
        }
        let answered = answers.iter().filter(|a| matches!(a, Some(Ok(_)))).count();
        Err(Error::NoQuorum {
            granted: extended,
            needed: inner.quorum,
            unreachable: n - answered,
        })
    }

    async fn release(&self) -> Result<()> {
        if self.released.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let inner = &self.inner;
        let (answered, held) = inner
            .release_on(&inner.all(), &self.keys, &self.owner, &self.nonce)
            .await;
        let refused = answered - held;
        let verdict = renewer::Verdict::of(held, refused, 0, inner.nodes.len(), inner.quorum);
        if verdict == renewer::Verdict::Refused {
            // So many nodes answered that this grant was not there (broken, or
            // expired and perhaps taken) that no quorum can hold it, as a renewal
            // tells it: each node's release is sent once, and a node that failed to
            // answer may still hold it.
            Err(Error::NotOwner {
                name: self.name.as_str().to_owned(),
            })
        } else if answered >= inner.quorum {
            // Nodes that did not answer let the key expire with its lease.
            Ok(())
        } else {
            self.released.store(false, Ordering::SeqCst);
            Err(Error::NoQuorum {
                granted: answered,
                needed: inner.quorum,
                unreachable: inner.nodes.len() - answered,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn refused(url: &str) -> Error {
        RedlockBackend::open(ConnectUrl::parse(url).expect("parses"))
            .await
            .expect_err(url)
    }

    /// Script calls a node has run (`EVALSHA`).
    async fn script_calls(side: &mut redis::aio::MultiplexedConnection) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(side)
            .await
            .expect("info");
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// Three fresh nodes and a backend over them with the URL options `query`.
    async fn three_nodes(query: &str) -> Option<(dlock_testkit::RedisNodes, Arc<RedlockBackend>)> {
        let nodes = dlock_testkit::RedisNodes::start(3, &dlock_testkit::RedisOptions::default())?;
        let url = format!("{}?{query}", nodes.url());
        let backend = RedlockBackend::open(ConnectUrl::parse(&url).expect("url"))
            .await
            .expect("open");
        Some((nodes, backend))
    }

    /// `name`, free on every node, taken for `owner` for `ttl`.
    async fn take(
        backend: &RedlockBackend,
        name: &LockName,
        owner: &crate::options::Owner,
        ttl: Duration,
    ) -> Box<dyn HeldLock> {
        let req = AcquireRequest::plain(name.clone(), owner.clone(), ttl);
        let Attempt::Acquired(held) = backend.try_acquire(&req).await.expect("acquire") else {
            panic!("{name} busy");
        };
        held
    }

    /// A connection of its own to node `i`, beside the backend's.
    async fn side(
        nodes: &mut dlock_testkit::RedisNodes,
        i: usize,
    ) -> redis::aio::MultiplexedConnection {
        let addr = nodes.node(i).addr();
        let client = redis::Client::open(format!("redis://{addr}")).expect("client");
        client
            .get_multiplexed_async_connection()
            .await
            .expect("side")
    }

    /// A renewal of a broken grant that landed on a majority just before the break
    /// (its extensions counted) may reach the nodes the break emptied only after it:
    /// it must not put the grant back there, or the holder keeps a majority while the
    /// break reported success. Run here as that renewal's re-seed, after the break.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_renewal_landing_after_a_break_does_not_put_the_grant_back() {
        let Some((mut nodes, backend)) = three_nodes("node_timeout=1s").await else {
            return;
        };
        let name = LockName::new("broken").expect("name");
        let owner = crate::options::Owner::random();
        let held = take(&backend, &name, &owner, Duration::from_secs(30)).await;
        let token = held.fencing_token();
        let keys = backend.inner.keys(&name);
        let mut sides = Vec::new();
        for i in 0..3 {
            sides.push(side(&mut nodes, i).await);
        }
        // The acquire returns once a majority granted: the third node's grant may land
        // a moment later (bounded). Then every node has the grant's metadata.
        let end = Instant::now() + Duration::from_secs(2);
        for side in &mut sides {
            loop {
                let meta: Option<String> = redis::cmd("GET")
                    .arg(&keys.meta)
                    .query_async(side)
                    .await
                    .expect("meta");
                if meta.is_some() || Instant::now() >= end {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let meta: String = redis::cmd("GET")
            .arg(&keys.meta)
            .query_async(&mut sides[0])
            .await
            .expect("meta");
        assert!(backend.break_lock(&name, token).await.expect("break"));
        for side in &mut sides {
            let reseed = reseed_call(&keys, owner.as_str(), 30_000, token, &meta);
            let put_back: i64 = reseed.invoke_async(side).await.expect("reseed");
            assert_eq!(put_back, 0, "the broken grant was put back");
            let held_by: Option<String> = redis::cmd("GET")
                .arg(&keys.lock)
                .query_async(side)
                .await
                .expect("get");
            assert_eq!(held_by, None);
        }
        // The next grant's token still comes after the broken one's.
        let next = AcquireRequest::plain(
            name,
            crate::options::Owner::random(),
            Duration::from_secs(30),
        );
        let Attempt::Acquired(next) = backend.try_acquire(&next).await.expect("acquire") else {
            panic!("busy after the break");
        };
        assert!(next.fencing_token() > token);
        let _ = held.release().await;
        next.release().await.expect("release");
    }

    /// A node that lost the key and whose counter moved on since (a contender's attempt
    /// was granted there and gave it back) still gets the grant back from its renewal:
    /// only a break's mark keeps a re-seed out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_renewal_reseeds_a_node_whose_counter_moved_on() {
        let Some((mut nodes, backend)) = three_nodes("node_timeout=1s").await else {
            return;
        };
        let name = LockName::new("moved-on").expect("name");
        let owner = crate::options::Owner::random();
        let held = take(&backend, &name, &owner, Duration::from_secs(30)).await;
        let keys = backend.inner.keys(&name);
        let mut node = side(&mut nodes, 2).await;
        let get = async |node: &mut redis::aio::MultiplexedConnection| -> Option<String> {
            redis::cmd("GET")
                .arg(&keys.lock)
                .query_async(node)
                .await
                .expect("get")
        };
        // The acquire returns once a majority granted: node 2's grant may land a
        // moment later (bounded).
        let end = Instant::now() + Duration::from_secs(2);
        while get(&mut node).await.is_none() && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let () = redis::cmd("DEL")
            .arg(&keys.lock)
            .query_async(&mut node)
            .await
            .expect("del");
        let moved = held.fencing_token() + 5;
        let () = redis::cmd("SET")
            .arg(&keys.counter)
            .arg(moved)
            .query_async(&mut node)
            .await
            .expect("set");
        // A renewal re-seeds the nodes that answered "gone" before its verdict was
        // settled: renew until node 2's answer came in time (bounded).
        let end = Instant::now() + Duration::from_secs(5);
        while get(&mut node).await.is_none() {
            assert!(Instant::now() < end, "never re-seeded");
            held.renew(Duration::from_secs(30)).await.expect("renew");
        }
        assert_eq!(get(&mut node).await.as_deref(), Some(owner.as_str()));
        held.release().await.expect("release");
    }

    /// A grant refused by a majority is told `NotOwner` even when an unreachable node
    /// answered (an error) before the last refusal came: an error settles nothing, so
    /// the batch waits for the refusal instead of reporting a missing quorum.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_majority_refusal_is_not_owner_though_a_node_failed_first() {
        let Some((mut nodes, backend)) = three_nodes("node_timeout=3s").await else {
            return;
        };
        let held = take(
            &backend,
            &LockName::new("refused").expect("name"),
            &crate::options::Owner::random(),
            Duration::from_secs(30),
        )
        .await;
        let mut sides = Vec::new();
        for i in [0, 2] {
            let mut side = side(&mut nodes, i).await;
            let () = redis::cmd("DEL")
                .arg("refused")
                .query_async(&mut side)
                .await
                .expect("del");
            sides.push(side);
        }
        // Node 1 fails at once; node 2's refusal comes last.
        nodes.node(1).process().kill();
        let () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(500)
            .arg("ALL")
            .query_async(&mut sides[1])
            .await
            .expect("pause");
        let answer = held.renew(Duration::from_secs(30)).await;
        assert!(
            matches!(answer, Err(Error::NotOwner { .. })),
            "refused by 2 of 3 nodes: {answer:?}"
        );
    }

    /// A renewal no answer still to come can decide returns at once: two of three
    /// nodes failed, the third (paused) can neither make a quorum nor refuse one, so
    /// `NoQuorum` comes without waiting out the node timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_renewal_nothing_can_decide_any_more_returns_at_once() {
        let Some((mut nodes, backend)) = three_nodes("node_timeout=20s&timeout=20s").await else {
            return;
        };
        let held = take(
            &backend,
            &LockName::new("undecided").expect("name"),
            &crate::options::Owner::random(),
            Duration::from_secs(60),
        )
        .await;
        nodes.node(0).process().kill();
        nodes.node(1).process().kill();
        nodes.node(2).process().pause();
        let started = Instant::now();
        let answer = held.renew(Duration::from_secs(60)).await;
        let took = started.elapsed();
        nodes.node(2).process().resume();
        assert!(
            matches!(answer, Err(Error::NoQuorum { .. })),
            "two nodes down: {answer:?}"
        );
        assert!(
            took < Duration::from_secs(10),
            "waited {took:?} for a node whose answer could change nothing"
        );
    }

    /// Renewals waiting together go to each node as one script call, and each grant
    /// answers for itself: one given back is refused, the others are renewed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiting_renewals_are_one_call_per_node_and_answer_each_for_itself() {
        const N: usize = 40;
        let Some((mut nodes, backend)) = three_nodes("node_timeout=8s").await else {
            return;
        };
        let mut held = Vec::new();
        for i in 0..N {
            let req = AcquireRequest::plain(
                LockName::new(&format!("batch-{i}")).expect("name"),
                crate::options::Owner::random(),
                Duration::from_secs(30),
            );
            match backend.try_acquire(&req).await.expect("acquire") {
                Attempt::Acquired(h) => held.push(Arc::new(h)),
                Attempt::Busy { .. } => panic!("busy"),
            }
        }
        let mut sides = Vec::new();
        for i in 0..3 {
            sides.push(side(&mut nodes, i).await);
        }
        // Loads the script on every node, so that each call below is one EVALSHA.
        for h in &held {
            h.renew(Duration::from_secs(30))
                .await
                .expect("warm-up renewal");
        }
        held[7].release().await.expect("release");
        let mut before = Vec::new();
        for side in &mut sides {
            before.push(script_calls(side).await);
        }
        // Every node holds its clients for a while: the first renewals, one after
        // another, are each a batch of their own (each seen taking its batch place
        // before the next is sent) and wait, taking every batch place; the others
        // queue behind them in the renewal task.
        for side in &mut sides {
            let () = redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(3_000)
                .arg("ALL")
                .query_async(side)
                .await
                .expect("pause");
        }
        let renew = |h: &Arc<Box<dyn HeldLock>>| {
            let h = Arc::clone(h);
            tokio::spawn(async move { h.renew(Duration::from_secs(60)).await })
        };
        let blocked = renewer::IN_FLIGHT;
        let mut tasks = Vec::new();
        let formed = || backend.inner.renewer.batches_formed();
        let base = formed();
        for (i, h) in held[..blocked].iter().enumerate() {
            tasks.push(renew(h));
            let deadline = Instant::now() + Duration::from_secs(2);
            while formed() < base + i + 1 {
                assert!(
                    Instant::now() < deadline,
                    "renewal {i} never became a batch"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        tasks.extend(held[blocked..].iter().map(renew));
        // Every request of the others reaches the renewal task while every batch
        // place is still taken (each is sent at its task's first poll).
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            formed(),
            base + blocked,
            "a batch place came free before the others queued: the pause was too short"
        );
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.expect("task"));
        }
        for (i, a) in answers.iter().enumerate() {
            if i == 7 {
                assert!(
                    matches!(a, Err(Error::NotOwner { .. })),
                    "the given-back grant: {a:?}"
                );
            } else {
                assert!(a.is_ok(), "grant {i}: {a:?}");
            }
        }
        // A batch stops waiting once a quorum answered: the last node may run its
        // call a moment after the answers came back.
        let settle = Instant::now() + Duration::from_secs(5);
        for (i, side) in sides.iter_mut().enumerate() {
            let mut calls = script_calls(side).await - before[i];
            while calls < blocked as u64 + 1 && Instant::now() < settle {
                tokio::time::sleep(Duration::from_millis(20)).await;
                calls = script_calls(side).await - before[i];
            }
            assert_eq!(
                calls,
                blocked as u64 + 1,
                "node {i}: {calls} script calls for {blocked} renewals alone and the {} behind them",
                N - blocked
            );
            let pttl: i64 = redis::cmd("PTTL")
                .arg("batch-3")
                .query_async(side)
                .await
                .expect("pttl");
            assert!(
                pttl > 45_000,
                "node {i}: batch-3 not renewed to 60 s: {pttl} ms left"
            );
        }
        for (i, h) in held.iter().enumerate() {
            if i != 7 {
                h.release().await.expect("release");
            }
        }
    }

    #[tokio::test]
    async fn bad_urls_are_refused_before_connecting() {
        for url in [
            "redlock://127.0.0.1:1,127.0.0.1:2",
            "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?drift_factor=0.7",
            "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?drift_factor=x",
            "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?retries=-1",
            "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?node_timeout=0s",
            "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?layout=redisson",
            // A node named twice would count twice towards a majority.
            "redlock://127.0.0.1:1,127.0.0.1:1,127.0.0.1:2",
            "redlock://LOCALHOST:7,localhost:7,127.0.0.1:2",
        ] {
            let e = refused(url).await;
            assert!(
                matches!(e, Error::InvalidUrl { .. } | Error::InvalidOption { .. }),
                "{url}: {e}"
            );
        }
    }

    #[tokio::test]
    async fn no_majority_at_connect_is_no_quorum() {
        // Free loopback ports: nothing listens there (connection refused).
        let ports: Vec<u16> = (0..3).map(|_| dlock_testkit::free_port()).collect();
        let e = refused(&format!(
            "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}?timeout=1s",
            ports[0], ports[1], ports[2]
        ))
        .await;
        assert!(
            matches!(
                e,
                Error::NoQuorum {
                    granted: 0,
                    needed: 2,
                    unreachable: 3
                }
            ),
            "{e}"
        );
    }
}
