//! The uncontended floor: what the same backend does with the bare requests of one lock
//! cycle, through the same client crate, in the same run.
//!
//! - SQLite: two autocommitted writes on the same file with the same durability
//!   settings — insert a lease row (name, 32-character owner, expiry) synced to disk
//!   (`synchronous=FULL`, as a grant whose token must survive a power loss), delete it
//!   if the owner matches, written but not synced (`NORMAL`, as dlock's release). No
//!   separate limit: a lease that takes an ended row and draws its token does it in
//!   that one synced write, so it needs no sync the floor lacks (its extra statement
//!   work is not measured apart).
//! - Redis: `SET NX PX` + `EVALSHA` compare-and-delete; its limit (the least fenced
//!   lock, [`Floor::limit`]): a script that grants and draws the token, then the same
//!   compare-and-delete.
//! - etcd: put a key attached to a lease (granted once) + delete it.
//! - ZooKeeper: create an ephemeral node + delete it.
//! - PostgreSQL / MySQL: the bare statements of the URL's mode (see `raw_sql`).
//!
//! A counted grant (a permit, a read, a write: [`Shape::Counted`]) needs one more
//! thing: to see the others. Its floor is, on SQLite and SQL, a row inserted while
//! fewer than the limit are there (one statement) and deleted; on Redis, the npm
//! `redis-semaphore` package's acquire script (`ZREMRANGEBYSCORE`, `ZCARD`, `ZADD`) and
//! a `ZREM`; on etcd, put-with-lease, a range of the limit's oldest keys, delete; on
//! ZooKeeper, create an ephemeral sequential node, list its siblings, delete.
//!
//! [`measure`] alternates dlock's cycles and the floor's in rounds, so a change in the
//! machine's speed during the run (CPU frequency, other processes) lands on both sides.

use std::str::FromStr;
use std::time::{Duration, Instant};

use dlock::{LockOptions, Locker};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use zookeeper_client as zk;

use crate::bench::skips::Skips;
use crate::bench::stats::{Latency, micros};
use crate::bench::take::{Cycled, Shape, Take};
use crate::exit::Failure;

/// Rounds the measurement alternates dlock and the floor in.
const ROUNDS: u32 = 10;
/// Untimed cycles on each side first (connections, scripts, caches).
const WARM_UP: u32 = 20;

/// A connection ready to run bare lock cycles.
pub enum Floor {
    Sqlite {
        conn: sqlx::pool::PoolConnection<sqlx::Sqlite>,
        owner: dlock::Owner,
    },
    Redis {
        conn: redis::aio::ConnectionManager,
        /// The bare URL, for the command count's MONITOR connection.
        url: String,
        key: String,
        owner: dlock::Owner,
    },
    Etcd {
        client: dlock::etcd::RawClient,
        key: String,
        lease: i64,
    },
    Zk {
        client: zk::Client,
        node: String,
        /// The parent of the counted cycles' sequential nodes (made on first use).
        parent: Option<String>,
    },
    Sql(crate::bench::raw_sql::SqlFloor),
}

impl Floor {
    /// The floor for `url`'s backend; `None` where there is none (Redlock, Sentinel,
    /// Cluster, credentials the bare clients are not given, in-memory SQLite).
    pub async fn connect(url: &str) -> Result<Option<Self>, Failure> {
        if let Some(f) = sqlite(url).await? {
            return Ok(Some(f));
        }
        if let Some(bare) = crate::bench::raw_redis::bare_url(url) {
            let conn = crate::bench::raw_redis::connect(&bare).await?;
            let owner = dlock::Owner::random();
            let key = format!("dlock-bench-floor:{owner}");
            return Ok(Some(Floor::Redis {
                conn,
                url: bare,
                key,
                owner,
            }));
        }
        if let Some(f) = etcd(url).await? {
            return Ok(Some(f));
        }
        if let Some(f) = zookeeper(url).await? {
            return Ok(Some(f));
        }
        Ok(crate::bench::raw_sql::SqlFloor::connect(url)
            .await?
            .map(Floor::Sql))
    }

    /// One bare cycle of `shape` (`i` distinguishes cycles where a backend needs it).
    pub async fn cycle(&mut self, i: i64, shape: Shape) -> Result<(), Failure> {
        match (shape, &mut *self) {
            (Shape::Exclusive, _) => self.exclusive(i).await,
            (Shape::Counted(limit), _) => self.counted(i, limit).await,
            // The lock recipe is a counted grant of one: create, list, delete.
            (Shape::Fenced, Floor::Zk { .. }) => self.counted(i, 1).await,
            (Shape::Fenced, Floor::Sql(f)) => f.cycle(i, Shape::Fenced).await,
            (
                Shape::Fenced,
                Floor::Redis {
                    conn, key, owner, ..
                },
            ) => crate::bench::raw_redis::fenced_cycle(
                conn,
                key,
                &format!("{key}:token"),
                owner.as_str(),
            )
            .await
            .map_err(crate::bench::raw_redis::err),
            (Shape::Fenced, _) => self.exclusive(i).await,
        }
    }

    /// Where the bare floor of a lock cycle is not itself a fenced lock, what the least
    /// fenced lock does ([`Shape::Fenced`]), which may cost more or less than the
    /// floor; `None` where the floor already is that least (its fencing counter fits
    /// in the same requests).
    pub fn limit(&self) -> Option<&'static str> {
        match self {
            Floor::Zk { .. } => Some(
                "the lock recipe dlock shares with Curator and kazoo: create an ephemeral \
                 sequential node, list its siblings (is it the lowest?), delete it",
            ),
            Floor::Sql(f) => f.limit(),
            Floor::Redis { .. } => Some(
                "one script that grants a free key and draws its token from a counter, \
                 then the compare-and-delete",
            ),
            _ => None,
        }
    }

    /// One bare counted grant and its release (module docs).
    async fn counted(&mut self, i: i64, limit: u32) -> Result<(), Failure> {
        match self {
            Floor::Sqlite { conn, owner } => {
                let db = |e: sqlx::Error| Failure::internal(format!("floor: {e}"));
                sqlx::query(
                    "PRAGMA synchronous = FULL; \
                     INSERT INTO dlock_bench_floor_counted (name, owner, expires) \
                     SELECT 'floor', ?1, ?2 \
                     WHERE (SELECT count(*) FROM dlock_bench_floor_counted WHERE name = 'floor') < ?3",
                )
                .bind(owner.as_str())
                .bind(i)
                .bind(i64::from(limit))
                .execute(&mut **conn)
                .await
                .map_err(db)?;
                sqlite_release(conn, "dlock_bench_floor_counted", owner).await
            }
            Floor::Redis {
                conn, key, owner, ..
            } => {
                let now_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
                crate::bench::raw_redis::counted_cycle(
                    conn,
                    &format!("{key}:counted"),
                    owner.as_str(),
                    now_ms,
                    limit,
                )
                .await
                .map_err(crate::bench::raw_redis::err)
            }
            Floor::Etcd { client, key, lease } => {
                let dir = format!("{key}/counted/");
                let mine = format!("{dir}{i}");
                client.put(&mine, b"", *lease).await.map_err(etcd_err)?;
                client.oldest(&dir, limit).await.map_err(etcd_err)?;
                client.delete(&mine).await.map_err(etcd_err)?;
                Ok(())
            }
            Floor::Zk {
                client,
                node,
                parent,
            } => {
                let dir = match parent {
                    Some(p) => p.clone(),
                    None => {
                        let p = format!("{node}-counted");
                        let persistent =
                            zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                        match client.create(&p, b"", &persistent).await {
                            Ok(_) | Err(zk::Error::NodeExists) => {}
                            Err(e) => return Err(zk_err(e)),
                        }
                        parent.insert(p).clone()
                    }
                };
                let sequential =
                    zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
                let (_, seq) = client
                    .create(&format!("{dir}/c-"), b"", &sequential)
                    .await
                    .map_err(zk_err)?;
                client.list_children(&dir).await.map_err(zk_err)?;
                client
                    .delete(&format!("{dir}/c-{seq}"), None)
                    .await
                    .map_err(zk_err)?;
                Ok(())
            }
            Floor::Sql(f) => f.cycle(i, Shape::Counted(limit)).await,
        }
    }

    /// One bare lock cycle.
    async fn exclusive(&mut self, i: i64) -> Result<(), Failure> {
        match self {
            Floor::Sqlite { conn, owner } => {
                let db = |e: sqlx::Error| Failure::internal(format!("floor: {e}"));
                sqlx::query(
                    "PRAGMA synchronous = FULL; \
                     INSERT INTO dlock_bench_floor (name, owner, expires) VALUES ('floor', ?1, ?2)",
                )
                .bind(owner.as_str())
                .bind(i)
                .execute(&mut **conn)
                .await
                .map_err(db)?;
                sqlite_release(conn, "dlock_bench_floor", owner).await
            }
            Floor::Redis {
                conn, key, owner, ..
            } => crate::bench::raw_redis::floor_cycle(conn, key, owner.as_str())
                .await
                .map_err(crate::bench::raw_redis::err),
            Floor::Etcd { client, key, lease } => {
                client.put(key, b"", *lease).await.map_err(etcd_err)?;
                client.delete(key).await.map_err(etcd_err)?;
                Ok(())
            }
            Floor::Zk { client, node, .. } => {
                let ephemeral = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
                client.create(node, b"", &ephemeral).await.map_err(zk_err)?;
                client.delete(node, None).await.map_err(zk_err)?;
                Ok(())
            }
            Floor::Sql(f) => f.cycle(i, Shape::Exclusive).await,
        }
    }

    /// What `cycles` uncontended dlock cycles cost the server, counted by the server,
    /// per cycle: on Redis the commands clients sent (MONITOR; the calls scripts make
    /// left out), on etcd the writes (revisions). `None` on the other backends, and
    /// when a cycle was stepped over on an error (the count would mix in its requests):
    /// the run stops counting there.
    pub async fn requests_per_cycle(
        &mut self,
        locker: &Locker,
        (name, take): (&str, Take),
        opts: &LockOptions,
        (cycles, skips): (u32, &Skips),
    ) -> Result<Option<f64>, Failure> {
        // Whether every cycle was clean.
        let work = async || -> Result<bool, Failure> {
            for _ in 0..cycles {
                if take.cycle(locker, name, opts, skips).await? != Cycled::Done {
                    return Ok(false);
                }
            }
            Ok(true)
        };
        let n = f64::from(cycles.max(1));
        match self {
            Floor::Redis { url, .. } => {
                let (clean, sent) =
                    crate::bench::raw_redis::client_commands_during(url, work()).await?;
                Ok(clean.then(|| sent as f64 / n))
            }
            Floor::Etcd { client, key, .. } => {
                let before = etcd_revision(client, key).await?;
                let clean = work().await?;
                let after = etcd_revision(client, key).await?;
                Ok(clean.then(|| after.saturating_sub(before) as f64 / n))
            }
            _ => Ok(None),
        }
    }

    /// Give back what the floor holds on the server (the etcd lease, the ZooKeeper
    /// parent node).
    pub async fn close(self) {
        match self {
            Floor::Etcd { client, lease, .. } => {
                let _ = client.lease_revoke(lease).await;
            }
            Floor::Zk {
                client,
                parent: Some(p),
                ..
            } => {
                let _ = client.delete(&p, None).await;
            }
            // The limit's token counter (the lock key itself is deleted by each cycle).
            Floor::Redis { mut conn, key, .. } => {
                let _: redis::RedisResult<i64> = redis::cmd("DEL")
                    .arg(format!("{key}:token"))
                    .query_async(&mut conn)
                    .await;
            }
            _ => {}
        }
    }
}

/// One side of a measurement: cycles per second and per-cycle latency.
#[derive(Debug, Clone, Copy)]
pub struct Side {
    pub per_sec: f64,
    pub latency: Latency,
}

/// Timed samples of one side, gathered over rounds.
#[derive(Default)]
struct Samples {
    us: Vec<u64>,
    elapsed: Duration,
}

impl Samples {
    fn side(&self) -> Side {
        let secs = self.elapsed.as_secs_f64();
        Side {
            per_sec: if secs > 0.0 {
                self.us.len() as f64 / secs
            } else {
                0.0
            },
            latency: Latency::of(&self.us),
        }
    }
}

impl Samples {
    /// Run `cycle` `n` times, one at a time, timing each that did its work (`true`):
    /// one stepped over (`false`) is not a sample, but its time counts in the rate.
    async fn time(
        &mut self,
        n: u32,
        mut cycle: impl AsyncFnMut() -> Result<bool, Failure>,
    ) -> Result<(), Failure> {
        let start = Instant::now();
        for _ in 0..n {
            let t = Instant::now();
            if cycle().await? {
                self.us.push(micros(t.elapsed()));
            }
        }
        self.elapsed += start.elapsed();
        Ok(())
    }
}

/// `cycles` uncontended dlock cycles of `take` on `name` and, with a floor, as many
/// bare cycles of the given shape, alternating in [`ROUNDS`] rounds.
///
/// A dlock cycle that fails on a retryable error is stepped over into `skips`
/// (`skips.rs`): an acquisition that failed is not a sample, a release that failed
/// is, and the cycles after it take `name:1` (`:2`, …) instead, rather than wait for
/// the lease the failed release left behind. The floor's bare requests have no such
/// leeway: an error there ends the run, and so does a run whose every dlock cycle was
/// stepped over.
pub async fn measure(
    locker: &Locker,
    (name, take): (&str, Take),
    opts: &LockOptions,
    mut floor: Option<(&mut Floor, Shape)>,
    (cycles, skips): (u32, &Skips),
) -> Result<(Side, Option<Side>), Failure> {
    let has_floor = floor.is_some();
    let (mut ours, mut bare) = (Samples::default(), Samples::default());
    let mut next = 0i64;
    let (mut current, mut renamed) = (name.to_owned(), 0u32);
    let mut dlock_cycle = async || -> Result<bool, Failure> {
        Ok(match take.cycle(locker, &current, opts, skips).await? {
            Cycled::Done => true,
            Cycled::NotTaken => false,
            Cycled::StillHeld => {
                renamed += 1;
                current = format!("{name}:{renamed}");
                true
            }
        })
    };
    let mut floor_cycle = async || -> Result<bool, Failure> {
        if let Some((f, shape)) = floor.as_mut() {
            f.cycle(next, *shape).await?;
            next += 1;
        }
        Ok(true)
    };
    let floor_n = |n: u32| if has_floor { n } else { 0 };
    Samples::default().time(WARM_UP, &mut dlock_cycle).await?;
    Samples::default()
        .time(floor_n(WARM_UP), &mut floor_cycle)
        .await?;
    for round in 0..ROUNDS {
        let n = cycles / ROUNDS + u32::from(round < cycles % ROUNDS);
        ours.time(n, &mut dlock_cycle).await?;
        bare.time(floor_n(n), &mut floor_cycle).await?;
    }
    if ours.us.is_empty() && cycles > 0 {
        return Err(Failure::new(
            crate::exit::UNAVAILABLE,
            format!(
                "every measured cycle was stepped over on an error{}",
                skips
                    .tally()
                    .first
                    .map(|e| format!(" (the first: {e})"))
                    .unwrap_or_default()
            ),
        ));
    }
    Ok((ours.side(), has_floor.then(|| bare.side())))
}

/// The SQLite floor's release: its row deleted, written but not synced (as dlock's).
async fn sqlite_release(
    conn: &mut sqlx::pool::PoolConnection<sqlx::Sqlite>,
    table: &str,
    owner: &dlock::Owner,
) -> Result<(), Failure> {
    let sql = format!(
        "PRAGMA synchronous = NORMAL; DELETE FROM {table} WHERE name = 'floor' AND owner = ?1"
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(owner.as_str())
        .execute(&mut **conn)
        .await
        .map_err(|e| Failure::internal(format!("floor: {e}")))?;
    Ok(())
}

async fn sqlite(url: &str) -> Result<Option<Floor>, Failure> {
    let Some(path) = url.strip_prefix("sqlite://") else {
        return Ok(None);
    };
    if path.starts_with(':') || path.contains('?') {
        return Ok(None);
    }
    let db = |e: sqlx::Error| Failure::internal(format!("floor: {e}"));
    let opts = SqliteConnectOptions::from_str("sqlite://floor")
        .map_err(db)?
        .filename(path)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full);
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(opts)
        .await
        .map_err(db)?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS dlock_bench_floor \
         (name TEXT PRIMARY KEY, owner TEXT NOT NULL, expires INTEGER NOT NULL) WITHOUT ROWID",
    )
    .execute(&pool)
    .await
    .map_err(db)?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS dlock_bench_floor_counted \
         (name TEXT NOT NULL, owner TEXT NOT NULL, expires INTEGER NOT NULL, \
         PRIMARY KEY (name, owner)) WITHOUT ROWID",
    )
    .execute(&pool)
    .await
    .map_err(db)?;
    let conn = pool.acquire().await.map_err(db)?;
    Ok(Some(Floor::Sqlite {
        conn,
        owner: dlock::Owner::random(),
    }))
}

fn etcd_err(e: dlock::Error) -> Failure {
    Failure::internal(format!("bench's bare etcd client: {e}"))
}

/// The store's revision: it grows by one with every write.
pub async fn etcd_revision(client: &dlock::etcd::RawClient, key: &str) -> Result<i64, Failure> {
    client.revision(key).await.map_err(etcd_err)
}

fn zk_err(e: zk::Error) -> Failure {
    Failure::internal(format!("bench's bare ZooKeeper client: {e}"))
}

/// The host list of a URL without credentials; `None` with credentials.
fn plain_authority<'a>(url: &'a str, scheme: &str) -> Option<&'a str> {
    let rest = url.strip_prefix(scheme)?;
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    (!authority.contains('@')).then_some(authority)
}

/// A bare etcd client for an `etcd://` URL without credentials (`None` otherwise).
pub async fn etcd_client(url: &str) -> Result<Option<dlock::etcd::RawClient>, Failure> {
    let Some(authority) = plain_authority(url, "etcd://") else {
        return Ok(None);
    };
    let endpoints: Vec<String> = authority
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| format!("http://{h}"))
        .collect();
    dlock::etcd::RawClient::connect(&endpoints)
        .await
        .map(Some)
        .map_err(etcd_err)
}

async fn etcd(url: &str) -> Result<Option<Floor>, Failure> {
    let Some(client) = etcd_client(url).await? else {
        return Ok(None);
    };
    // Long enough for the whole interleaved measurement.
    let lease = client.lease_grant(3600).await.map_err(etcd_err)?;
    Ok(Some(Floor::Etcd {
        client,
        key: format!("dlock-bench-floor/{lease:x}"),
        lease,
    }))
}

async fn zookeeper(url: &str) -> Result<Option<Floor>, Failure> {
    let Some(authority) = plain_authority(url, "zk://") else {
        return Ok(None);
    };
    let client = zk::Client::connect(authority).await.map_err(zk_err)?;
    Ok(Some(Floor::Zk {
        client,
        node: format!("/dlock-bench-floor-{}", dlock::Owner::random()),
        parent: None,
    }))
}
