//! A userspace TCP proxy on loopback that injects faults between a client and a server.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// What the proxy does to traffic. Applies to data read after the change.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything.
    None,
    /// Hold every chunk this long before forwarding it (both directions).
    Delay(Duration),
    /// Accept and read, forward nothing, keep connections open (a partition).
    Blackhole,
    /// Forward client → server, drop server → client (requests run, replies vanish).
    DropReplies,
    /// As [`Fault::DropReplies`], and a client's close never reaches the server: the
    /// server sees a client that sent its requests and stopped (a paused process),
    /// its connection open until the server ends it. A connection whose client
    /// closed under it stays open to the server until the server closes it,
    /// [`FaultProxy::reset_all`], the proxy's drop, or (after a [`FaultProxy::set`] to
    /// a fault that forwards replies) the server's next reply.
    Stalled,
    /// Reset (RST) a connection once it has carried this many bytes in total.
    ResetAfter(usize),
}

#[derive(Debug)]
struct Shared {
    fault: Mutex<Fault>,
    /// Bumped by [`FaultProxy::reset_all`]; connections watching it reset themselves.
    generation: watch::Sender<u64>,
}

impl Shared {
    fn fault(&self) -> Fault {
        *self
            .fault
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A running proxy; stops (and drops every connection) on Drop.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    tasks: JoinSet<()>,
}

impl FaultProxy {
    /// Listen on a free 127.0.0.1 port and forward to `upstream`.
    ///
    /// # Errors
    /// When the listening socket cannot be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            fault: Mutex::new(Fault::None),
            generation: watch::channel(0).0,
        });
        let mut tasks = JoinSet::new();
        let s = Arc::clone(&shared);
        tasks.spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let s = Arc::clone(&s);
                        conns.spawn(async move { let _ = serve(client, upstream, s).await; });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(FaultProxy {
            addr,
            upstream,
            shared,
            tasks,
        })
    }

    /// Where clients connect.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where traffic goes.
    #[must_use]
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Change the fault for all connections, existing and new.
    pub fn set(&self, fault: Fault) {
        *self
            .shared
            .fault
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fault;
    }

    /// Reset every open connection now (new ones are accepted as usual).
    pub fn reset_all(&self) {
        self.shared.generation.send_modify(|g| *g += 1);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

async fn serve(
    client: TcpStream,
    upstream: SocketAddr,
    shared: Arc<Shared>,
) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream).await?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let mut generation = shared.generation.subscribe();
    let carried = Arc::new(Mutex::new(0usize));
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = pump(&mut cr, &mut sw, &shared, &carried, false);
    let down = pump(&mut sr, &mut cw, &shared, &carried, true);
    let reset = tokio::select! {
        r = up => r.is_err(),
        r = down => r.is_err(),
        _ = generation.changed() => true,
    };
    if reset {
        // Dropping with zero linger sends RST to both sides.
        if let (Ok(c), Ok(s)) = (cr.reunite(cw), sr.reunite(sw)) {
            let _ = c.set_zero_linger();
            let _ = s.set_zero_linger();
        }
    }
    Ok(())
}

/// Copy `from` → `to` applying the current fault. `Err` means "reset the connection".
async fn pump(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    shared: &Shared,
    carried: &Mutex<usize>,
    is_reply: bool,
) -> Result<(), ()> {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await.map_err(|_| ())?;
        if n == 0 {
            if !is_reply && shared.fault() == Fault::Stalled {
                // Keep the server's side open; the server's close (or the proxy's
                // drop) ends the connection.
                return std::future::pending().await;
            }
            let _ = to.shutdown().await;
            return Ok(());
        }
        match shared.fault() {
            Fault::None => {}
            Fault::Delay(d) => tokio::time::sleep(d).await,
            Fault::Blackhole => continue,
            Fault::DropReplies | Fault::Stalled if is_reply => continue,
            Fault::DropReplies | Fault::Stalled => {}
            Fault::ResetAfter(limit) => {
                let mut c = carried
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                *c += n;
                if *c > limit {
                    return Err(());
                }
            }
        }
        to.write_all(&buf[..n]).await.map_err(|_| ())?;
    }
}
