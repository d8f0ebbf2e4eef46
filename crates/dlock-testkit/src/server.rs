//! Real servers from PATH on free loopback ports, in temp dirs, killed on Drop.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::restart::{Restartable, relaunch};
use crate::tls::TestCerts;

/// Whether tests must fail instead of skipping when a server binary is missing
/// (`DLOCK_REQUIRE_SERVERS=1`, as the README's test command and CI set it).
#[must_use]
pub fn servers_required() -> bool {
    std::env::var("DLOCK_REQUIRE_SERVERS").is_ok_and(|v| v == "1")
}

/// The full path of `binary` if it is on PATH (or an absolute path that exists).
#[must_use]
pub fn find_binary(binary: &str) -> Option<PathBuf> {
    let p = Path::new(binary);
    if p.is_absolute() {
        return p.is_file().then(|| p.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
}

/// Report a missing prerequisite: print "skipped: …" and return `None`, or panic when
/// servers are required.
///
/// # Panics
/// When `DLOCK_REQUIRE_SERVERS=1`.
#[must_use]
pub fn skip<T>(reason: &str) -> Option<T> {
    assert!(!servers_required(), "DLOCK_REQUIRE_SERVERS=1 but {reason}");
    eprintln!("skipped: {reason}");
    None
}

/// A port that was free on 127.0.0.1 a moment ago. Another process may take it before
/// we use it; starters retry on a fresh port when the server fails to come up.
///
/// # Panics
/// When no loopback port can be bound at all.
#[must_use]
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral loopback port");
    l.local_addr().expect("local addr").port()
}

/// Whether process `pid` holds a socket listening on 127.0.0.1:`port` (read from
/// `/proc`): the server answering there is that process, not another test's that took
/// the port between [`free_port`] and its own bind. `None` when `/proc` cannot tell
/// (not mounted, or the process's descriptors unreadable). For servers that cannot
/// name themselves over their protocol (redis and ZooKeeper can, and are asked
/// instead).
#[must_use]
pub fn listens_on(pid: u32, port: u16) -> Option<bool> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    // 127.0.0.1 as the kernel prints it: in host byte order.
    let local = [
        format!("0100007F:{port:04X}"),
        format!("7F000001:{port:04X}"),
    ];
    // Columns: sl, local_address, rem_address, st (0A: LISTEN), …, inode (10th).
    let sockets: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let listening = cols.get(3) == Some(&"0A");
            let here = cols.get(1).is_some_and(|a| local.iter().any(|l| l == a));
            (listening && here)
                .then(|| cols.get(9).map(|inode| format!("socket:[{inode}]")))
                .flatten()
        })
        .collect();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    Some(fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| sockets.iter().any(|s| target.as_os_str() == s.as_str()))
    }))
}

/// Set by [`servers_die_with_this_thread`].
static DIE_WITH_STARTER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// From now on, every server this process starts is SIGKILLed by the kernel when the
/// thread that started it ends (`PR_SET_PDEATHSIG`), as well as on Drop: a program
/// killed by a signal, which runs no Drop, leaves no server behind. Only for a program
/// that starts every server from one thread that lives as long as it does, such as the
/// benchmarks generator's main thread; tests start servers from threads that end
/// before the servers are done with.
pub fn servers_die_with_this_thread() {
    DIE_WITH_STARTER.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// A child server process with its temp dir; SIGKILLed and reaped on Drop.
#[derive(Debug)]
pub struct ServerProcess {
    child: Option<Child>,
    name: String,
}

impl ServerProcess {
    /// Spawn `cmd` with stdout/stderr sent to `log` inside its dir.
    ///
    /// # Errors
    /// When the process cannot be spawned.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> std::io::Result<Self> {
        let out = std::fs::File::create(log)?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        if DIE_WITH_STARTER.load(std::sync::atomic::Ordering::SeqCst) {
            let starter = std::process::id();
            // SAFETY: between fork and exec the closure only calls async-signal-safe
            // functions (prctl, getppid) and allocates nothing.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The starter died before the signal was armed: nobody would kill
                    // this server.
                    if u32::try_from(libc::getppid()).ok() != Some(starter) {
                        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                    }
                    Ok(())
                });
            }
        }
        Ok(ServerProcess {
            child: Some(cmd.spawn()?),
            name: name.to_owned(),
        })
    }

    /// Process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn signal(&self, sig: Signal) {
        if let Some(c) = &self.child {
            let pid = i32::try_from(c.id()).unwrap_or(i32::MAX);
            let _ = kill(Pid::from_raw(pid), sig);
        }
    }

    /// SIGSTOP: the server freezes, connections stay open. Returns once every thread
    /// of the server shows as stopped (at most 2 s): `kill` returns before a thread
    /// running on another CPU has stopped, and a request sent in that instant could
    /// still be answered.
    pub fn pause(&self) {
        self.signal(Signal::SIGSTOP);
        if let Some(c) = &self.child {
            let deadline = Instant::now() + Duration::from_secs(2);
            while !all_stopped(c.id()) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// SIGCONT after [`ServerProcess::pause`].
    pub fn resume(&self) {
        self.signal(Signal::SIGCONT);
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the process has exited.
    pub fn has_exited(&mut self) -> bool {
        match &mut self.child {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => true,
        }
    }

    /// The server's name (for messages).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        // A paused process must be resumed to die promptly on some kernels' views of
        // accounting; SIGKILL works on stopped processes, but continue anyway.
        self.resume();
        self.kill();
    }
}

/// Send a Redis inline `PING` to `addr` and wait for `+PONG`.
///
/// # Errors
/// Connection errors, timeouts, or any other answer.
pub fn redis_ping(addr: SocketAddr, timeout: Duration) -> std::io::Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(b"PING\r\n")?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf)?;
    if buf[..n].starts_with(b"+PONG") {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "unexpected answer {:?}",
            String::from_utf8_lossy(&buf[..n])
        )))
    }
}

/// Send one Redis command (as a RESP array) to `addr` and return the raw reply bytes.
///
/// # Errors
/// Connection errors and timeouts.
pub fn redis_command(
    addr: SocketAddr,
    args: &[&str],
    timeout: Duration,
) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut req = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        req.extend_from_slice(format!("${}\r\n{a}\r\n", a.len()).as_bytes());
    }
    s.write_all(&req)?;
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf)?;
    buf.truncate(n);
    Ok(buf)
}

/// Subscribers on `channel` of the Redis at `addr`, as the server counts them
/// (`PUBSUB NUMSUB`).
///
/// # Errors
/// Connection errors and timeouts, or a reply without a count.
pub fn redis_subscribers(addr: SocketAddr, channel: &str) -> std::io::Result<u64> {
    let reply = redis_command(addr, &["PUBSUB", "NUMSUB", channel], Duration::from_secs(2))?;
    // *2 $len channel :count
    String::from_utf8_lossy(&reply)
        .lines()
        .find_map(|l| l.strip_prefix(':')?.trim().parse().ok())
        .ok_or_else(|| std::io::Error::other("PUBSUB NUMSUB: no count in the reply"))
}

/// Options for [`RedisServer::start_with`].
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// Append-only file with `appendfsync always` (durable writes).
    pub persistent: bool,
    /// Start as a cluster node (cluster bus on another free port).
    pub cluster: bool,
    /// Also listen with TLS on another free port (certificates from [`TestCerts`];
    /// client certificates optional unless `extra_args` says `--tls-auth-clients yes`).
    pub tls: bool,
    /// More `--name value` arguments for redis-server.
    pub extra_args: Vec<String>,
}

/// A `redis-server` on a free loopback port.
#[derive(Debug)]
pub struct RedisServer {
    process: ServerProcess,
    dir: tempfile::TempDir,
    port: u16,
    binary: PathBuf,
    options: RedisOptions,
    tls: Option<(u16, TestCerts)>,
}

impl RedisServer {
    /// Start a throwaway Redis (no persistence), or skip (see [`skip`]).
    ///
    /// # Panics
    /// When redis-server exists but does not come up after three tries.
    #[must_use]
    pub fn start() -> Option<Self> {
        Self::start_with(RedisOptions::default())
    }

    /// Start Redis with `options`, or skip.
    ///
    /// # Panics
    /// When redis-server exists but does not come up after three tries.
    #[must_use]
    pub fn start_with(mut options: RedisOptions) -> Option<Self> {
        let Some(binary) = find_binary("redis-server") else {
            return skip("redis-server not found on PATH (apt-get install redis-server)");
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let tls = options.tls.then(|| {
            let certs = TestCerts::generate(dir.path());
            let port = free_port();
            let path = |p: &Path| p.display().to_string();
            let mut args = vec![
                "--tls-port".to_owned(),
                port.to_string(),
                "--tls-cert-file".to_owned(),
                path(&certs.server_cert),
                "--tls-key-file".to_owned(),
                path(&certs.server_key),
                "--tls-ca-cert-file".to_owned(),
                path(&certs.ca),
                "--tls-auth-clients".to_owned(),
                "optional".to_owned(),
            ];
            args.append(&mut options.extra_args);
            options.extra_args = args;
            (port, certs)
        });
        let mut last_err = String::new();
        for _ in 0..3 {
            let port = free_port();
            match Self::launch(&binary, dir.path(), port, &options) {
                Ok(process) => {
                    return Some(RedisServer {
                        process,
                        dir,
                        port,
                        binary,
                        options,
                        tls,
                    });
                }
                Err(e) => last_err = e,
            }
        }
        panic!("redis-server did not start: {last_err}");
    }

    fn launch(
        binary: &Path,
        dir: &Path,
        port: u16,
        options: &RedisOptions,
    ) -> Result<ServerProcess, String> {
        let mut cmd = Command::new(binary);
        cmd.current_dir(dir)
            .arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir);
        if options.persistent {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        if options.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "3000"])
                .arg("--cluster-config-file")
                .arg(format!("nodes-{port}.conf"))
                .arg("--cluster-port")
                .arg(free_port().to_string());
        }
        cmd.args(&options.extra_args);
        let log = dir.join(format!("redis-{port}.log"));
        let mut process =
            ServerProcess::spawn("redis-server", cmd, &log).map_err(|e| format!("spawn: {e}"))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // Ready only when *our* process answers: another test's server may have
            // taken the port between free_port() and our bind.
            if redis_ping(addr, Duration::from_millis(500)).is_ok() {
                let info = redis_command(addr, &["INFO", "server"], Duration::from_millis(500))
                    .unwrap_or_default();
                let ours = format!("process_id:{}\r", process.pid());
                if String::from_utf8_lossy(&info).contains(&ours) {
                    return Ok(process);
                }
                return Err(format!("port {port} answered by another process"));
            }
            if process.has_exited() || Instant::now() > deadline {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("not ready on port {port}; log:\n{log}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `127.0.0.1:port`.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `redis://127.0.0.1:port`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The process (pause, resume, kill).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// With [`RedisOptions::tls`]: the TLS port and the certificates.
    #[must_use]
    pub fn tls(&self) -> Option<(u16, &TestCerts)> {
        self.tls.as_ref().map(|(port, certs)| (*port, certs))
    }

    /// SIGKILL the server and start it again on the same port and data dir (with
    /// persistence the data survives).
    ///
    /// # Panics
    /// When it does not come back.
    pub fn restart(&mut self) {
        let (binary, dir, port, options) =
            (&self.binary, self.dir.path(), self.port, &self.options);
        relaunch(&mut self.process, || {
            Self::launch(binary, dir, port, options)
        });
    }
}

impl Restartable for RedisServer {
    fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    fn restart(&mut self) {
        RedisServer::restart(self);
    }
}

/// N independent Redis masters (for Redlock) on free loopback ports.
#[derive(Debug)]
pub struct RedisNodes {
    nodes: Vec<RedisServer>,
}

impl RedisNodes {
    /// Start `n` independent servers with `options` each, or skip.
    ///
    /// # Panics
    /// When a server exists but does not come up.
    #[must_use]
    pub fn start(n: usize, options: &RedisOptions) -> Option<Self> {
        let mut nodes = Vec::with_capacity(n);
        for _ in 0..n {
            nodes.push(RedisServer::start_with(options.clone())?);
        }
        Some(RedisNodes { nodes })
    }

    /// `redlock://127.0.0.1:p1,127.0.0.1:p2,…`.
    #[must_use]
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.addr().port()))
            .collect();
        format!("redlock://{}", hosts.join(","))
    }

    /// Node `i` (kill, pause, restart).
    ///
    /// # Panics
    /// When `i` is out of range.
    pub fn node(&mut self, i: usize) -> &mut RedisServer {
        &mut self.nodes[i]
    }

    /// How many nodes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// A Redis Cluster of `masters` nodes (no replicas) on free loopback ports.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Start the nodes, join them with `redis-cli --cluster create`, and wait until
    /// every node reports `cluster_state:ok`; or skip (see [`skip`]).
    ///
    /// # Panics
    /// When the binaries exist but the cluster does not form.
    #[must_use]
    pub fn start(masters: usize) -> Option<Self> {
        let Some(cli) = find_binary("redis-cli") else {
            return skip("redis-cli not found on PATH (apt-get install redis-tools)");
        };
        let mut nodes = Vec::new();
        for _ in 0..masters {
            nodes.push(RedisServer::start_with(RedisOptions {
                cluster: true,
                ..RedisOptions::default()
            })?);
        }
        let mut create = Command::new(cli);
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(n.addr().to_string());
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &nodes {
            loop {
                let info = redis_command(n.addr(), &["CLUSTER", "INFO"], Duration::from_secs(2))
                    .unwrap_or_default();
                if String::from_utf8_lossy(&info).contains("cluster_state:ok") {
                    break;
                }
                assert!(Instant::now() < deadline, "cluster never reached state ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(RedisCluster { nodes })
    }

    /// `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,…`.
    #[must_use]
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(|n| n.addr().to_string()).collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// The nodes.
    pub fn nodes(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }
}

/// A master, one replica and three Sentinels watching them (quorum 2, down after
/// 1 s), all on free loopback ports. The master's name for clients is `mymaster`.
#[derive(Debug)]
pub struct RedisSentinel {
    /// Master first, then the replica.
    servers: Vec<RedisServer>,
    sentinels: Vec<(ServerProcess, u16)>,
    _dir: tempfile::TempDir,
}

impl RedisSentinel {
    /// The master name Sentinels know.
    pub const MASTER: &'static str = "mymaster";

    /// Start everything and wait until all three Sentinels see the master and the
    /// replica; or skip (see [`skip`]).
    ///
    /// # Panics
    /// When the binaries exist but the setup does not come up.
    #[must_use]
    pub fn start() -> Option<Self> {
        let Some(binary) = find_binary("redis-server") else {
            return skip("redis-server not found on PATH (apt-get install redis-server)");
        };
        let master = RedisServer::start()?;
        let replica = RedisServer::start_with(RedisOptions {
            extra_args: vec![
                "--replicaof".into(),
                "127.0.0.1".into(),
                master.addr().port().to_string(),
            ],
            ..RedisOptions::default()
        })?;
        let synced = Instant::now() + Duration::from_secs(15);
        loop {
            let info = redis_command(
                replica.addr(),
                &["INFO", "replication"],
                Duration::from_secs(1),
            )
            .unwrap_or_default();
            if String::from_utf8_lossy(&info).contains("master_link_status:up") {
                break;
            }
            assert!(Instant::now() < synced, "the replica never synced");
            std::thread::sleep(Duration::from_millis(20));
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let conf = dir.path().join(format!("sentinel-{i}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                     sentinel monitor {name} 127.0.0.1 {mport} 2\n\
                     sentinel down-after-milliseconds {name} 1000\n\
                     sentinel failover-timeout {name} 5000\n\
                     sentinel parallel-syncs {name} 1\n",
                    dir = dir.path().display(),
                    name = Self::MASTER,
                    mport = master.addr().port(),
                ),
            )
            .expect("write sentinel.conf");
            let mut cmd = Command::new(&binary);
            cmd.arg(&conf).arg("--sentinel").current_dir(dir.path());
            let log = dir.path().join(format!("sentinel-{i}.log"));
            let process =
                ServerProcess::spawn("redis-sentinel", cmd, &log).expect("spawn sentinel");
            sentinels.push((process, port));
        }
        let this = RedisSentinel {
            servers: vec![master, replica],
            sentinels,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        for (_, port) in &this.sentinels {
            let addr = SocketAddr::from(([127, 0, 0, 1], *port));
            loop {
                let replicas = redis_command(
                    addr,
                    &["SENTINEL", "REPLICAS", Self::MASTER],
                    Duration::from_secs(1),
                )
                .unwrap_or_default();
                let text = String::from_utf8_lossy(&replicas);
                if text.contains(&this.servers[1].addr().port().to_string())
                    && text.contains("slave")
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "sentinel on {port} never saw the replica: {text}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Some(this)
    }

    /// `redis+sentinel://127.0.0.1:s1,127.0.0.1:s2,127.0.0.1:s3/mymaster`.
    #[must_use]
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|(_, p)| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+sentinel://{}/{}", hosts.join(","), Self::MASTER)
    }

    /// The data servers: master first, then the replica (as started).
    pub fn servers(&mut self) -> &mut [RedisServer] {
        &mut self.servers
    }

    /// The address Sentinels currently report for the master.
    #[must_use]
    pub fn master_addr(&self) -> Option<SocketAddr> {
        for (_, port) in &self.sentinels {
            let addr = SocketAddr::from(([127, 0, 0, 1], *port));
            let Ok(reply) = redis_command(
                addr,
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", Self::MASTER],
                Duration::from_secs(1),
            ) else {
                continue;
            };
            let text = String::from_utf8_lossy(&reply);
            let parts: Vec<&str> = text
                .split("\r\n")
                .filter(|l| !l.starts_with(['*', '$']))
                .collect();
            if let [host, port, ..] = parts.as_slice()
                && let Ok(port) = port.parse::<u16>()
                && let Ok(ip) = host.parse::<std::net::IpAddr>()
            {
                return Some(SocketAddr::new(ip, port));
            }
        }
        None
    }
}

/// Keeps a loopback port taken after its server was killed, so that no other test's
/// server can start there and answer in its place: every connection is accepted and
/// closed at once (the client sees a reset, as from a dead host that still routes).
#[derive(Debug)]
pub struct PortHolder {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    port: u16,
}

impl PortHolder {
    /// Hold `port` (waits briefly for the killed server's socket to go away).
    ///
    /// # Panics
    /// When the port cannot be bound within two seconds.
    #[must_use]
    pub fn hold(port: u16) -> Self {
        let end = Instant::now() + Duration::from_secs(2);
        let listener = loop {
            match TcpListener::bind(("127.0.0.1", port)) {
                Ok(l) => break l,
                Err(e) if Instant::now() > end => panic!("cannot hold port {port}: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                match listener.accept() {
                    Ok((s, _)) => drop(s),
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        PortHolder { stop, port }
    }

    /// The held port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for PortHolder {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether every thread of process `pid` is stopped (`T`, or `t` when traced), as
/// `/proc` shows it; `false` if it cannot be read.
fn all_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            return false;
        };
        // The state follows the command's name, which is in parentheses.
        let state = stat
            .rfind(')')
            .and_then(|end| stat[end + 1..].trim_start().chars().next());
        if !matches!(state, Some('T' | 't')) {
            return false;
        }
        any = true;
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener of this process is found as this process's; the same port is not
    /// another process's, and once closed it is nobody's.
    #[test]
    fn listens_on_tells_whose_port_it_is() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        assert_eq!(listens_on(std::process::id(), port), Some(true));
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let others = listens_on(other.id(), port);
        let _ = other.kill();
        let _ = other.wait();
        assert_eq!(others, Some(false), "another process owns this test's port");
        drop(listener);
        assert_eq!(listens_on(std::process::id(), port), Some(false));
    }
}
