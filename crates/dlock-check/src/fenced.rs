//! A fenced store on loopback: per lock a value, a version and the highest fencing token
//! seen. `dlock check` workers read and write it through the lock under test.
//!
//! Protocol (one line each way, ASCII):
//! - `R <worker> <lock> <token>` → `OK <value> <version>` or `STALE <highest>`
//! - `W <worker> <lock> <token> <version read> <value>` → `OK <new version>` or
//!   `STALE <highest>`
//!
//! Fenced: an operation whose token is below the highest seen for that lock is rejected;
//! reads raise the highest too (otherwise a stale write could slip in between the new
//! holder's grant and its first write). Unfenced: everything is accepted, and the log
//! still says which operations were stale, so the checker measures what the lock alone
//! provides. Every operation is logged with the store's own monotonic clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the store did with one operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoreOp {
    /// Nanoseconds since the store started (its own monotonic clock).
    pub at_ns: u64,
    pub worker: u32,
    pub lock: String,
    pub token: u64,
    /// `true` for a write, `false` for a read.
    pub write: bool,
    /// The version the writer had read (writes only).
    pub version_read: u64,
    /// The token was below the highest seen for the lock.
    pub stale: bool,
    /// The store accepted it.
    pub accepted: bool,
    /// An accepted write whose version read was no longer current: an update lost.
    pub lost_update: bool,
}

#[derive(Debug, Default)]
struct Cell {
    value: u64,
    version: u64,
    highest: u64,
}

#[derive(Debug)]
struct State {
    started: Instant,
    fenced: bool,
    cells: HashMap<String, Cell>,
    log: Vec<StoreOp>,
}

/// The running store (stopped on Drop).
#[derive(Debug)]
pub struct FencedStore {
    addr: std::net::SocketAddr,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl Drop for FencedStore {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn locked(s: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    s.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl State {
    fn apply(&mut self, line: &str) -> String {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| parts.get(i).and_then(|p| p.parse::<u64>().ok());
        let (write, worker, lock, token) = match (parts.first(), num(1), parts.get(2), num(3)) {
            (Some(&"R"), Some(w), Some(l), Some(t)) => (false, w, *l, t),
            (Some(&"W"), Some(w), Some(l), Some(t)) => (true, w, *l, t),
            _ => return "ERR bad request".into(),
        };
        let (version_read, value) = if write {
            match (num(4), num(5)) {
                (Some(v), Some(x)) => (v, x),
                _ => return "ERR bad write".into(),
            }
        } else {
            (0, 0)
        };
        let at_ns = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let fenced = self.fenced;
        let cell = self.cells.entry(lock.to_owned()).or_default();
        let stale = token < cell.highest;
        let accepted = !(fenced && stale);
        let mut lost_update = false;
        let reply = if !accepted {
            format!("STALE {}", cell.highest)
        } else {
            cell.highest = cell.highest.max(token);
            if write {
                lost_update = version_read != cell.version;
                cell.value = value;
                cell.version += 1;
                format!("OK {}", cell.version)
            } else {
                format!("OK {} {}", cell.value, cell.version)
            }
        };
        self.log.push(StoreOp {
            at_ns,
            worker: u32::try_from(worker).unwrap_or(u32::MAX),
            lock: lock.to_owned(),
            token,
            write,
            version_read,
            stale,
            accepted,
            lost_update,
        });
        reply
    }
}

impl FencedStore {
    /// Start on a free 127.0.0.1 port; `fenced` turns token checks on.
    ///
    /// # Errors
    /// When no loopback port can be bound.
    pub async fn start(fenced: bool) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            started: Instant::now(),
            fenced,
            cells: HashMap::new(),
            log: Vec::new(),
        }));
        let s = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    let (r, mut w) = sock.into_split();
                    let mut lines = BufReader::new(r).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        let reply = locked(&s).apply(&line);
                        if w.write_all(format!("{reply}\n").as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Ok(FencedStore { addr, state, task })
    }

    /// Where workers connect.
    #[must_use]
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Every operation so far, in the store's order.
    #[must_use]
    pub fn log(&self) -> Vec<StoreOp> {
        locked(&self.state).log.clone()
    }

    /// (value, version, highest token) of `lock`.
    #[must_use]
    pub fn cell(&self, lock: &str) -> (u64, u64, u64) {
        locked(&self.state)
            .cells
            .get(lock)
            .map_or((0, 0, 0), |c| (c.value, c.version, c.highest))
    }
}

/// A worker's connection to the store.
#[derive(Debug)]
pub struct StoreClient {
    lines: tokio::io::Lines<BufReader<tokio::net::tcp::OwnedReadHalf>>,
    w: tokio::net::tcp::OwnedWriteHalf,
    worker: u32,
}

/// The store's answer to one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreReply {
    /// Read: value and version. Write: the new version (value 0).
    Ok { value: u64, version: u64 },
    /// Rejected: a higher token was seen.
    Stale { highest: u64 },
}

impl StoreClient {
    /// Connect as `worker`.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn connect(addr: std::net::SocketAddr, worker: u32) -> std::io::Result<Self> {
        let sock = tokio::net::TcpStream::connect(addr).await?;
        sock.set_nodelay(true)?;
        let (r, w) = sock.into_split();
        Ok(StoreClient {
            lines: BufReader::new(r).lines(),
            w,
            worker,
        })
    }

    async fn ask(&mut self, line: String) -> std::io::Result<StoreReply> {
        self.w.write_all(line.as_bytes()).await?;
        let reply = self
            .lines
            .next_line()
            .await?
            .ok_or_else(|| std::io::Error::other("store closed"))?;
        let parts: Vec<u64> = reply
            .split_whitespace()
            .skip(1)
            .filter_map(|p| p.parse().ok())
            .collect();
        match (reply.split_whitespace().next(), parts.as_slice()) {
            (Some("OK"), [value, version]) => Ok(StoreReply::Ok {
                value: *value,
                version: *version,
            }),
            (Some("OK"), [version]) => Ok(StoreReply::Ok {
                value: 0,
                version: *version,
            }),
            (Some("STALE"), [highest]) => Ok(StoreReply::Stale { highest: *highest }),
            _ => Err(std::io::Error::other(format!("store said {reply:?}"))),
        }
    }

    /// Read `lock` with `token`.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn read(&mut self, lock: &str, token: u64) -> std::io::Result<StoreReply> {
        self.ask(format!("R {} {lock} {token}\n", self.worker))
            .await
    }

    /// Write `value` to `lock` with `token`, having read `version`.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn write(
        &mut self,
        lock: &str,
        token: u64,
        version: u64,
        value: u64,
    ) -> std::io::Result<StoreReply> {
        self.ask(format!(
            "W {} {lock} {token} {version} {value}\n",
            self.worker
        ))
        .await
    }
}
