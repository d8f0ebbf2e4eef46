//! A single-member etcd on free loopback ports (client and peer), data in a temp dir,
//! with `etcdctl` for raw commands and auth setup.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::restart::{Restartable, relaunch};
use crate::server::{ServerProcess, find_binary, free_port, listens_on, skip};
use crate::tls::TestCerts;

/// A running `etcd` (killed on Drop).
#[derive(Debug)]
pub struct EtcdServer {
    /// Held to kill the server on Drop.
    process: ServerProcess,
    /// Held to remove the data on Drop.
    dir: tempfile::TempDir,
    port: u16,
    peer_port: u16,
    binary: PathBuf,
    /// With TLS: the HTTPS client port (client certificates required) and the certs.
    tls: Option<(u16, TestCerts)>,
}

/// `GET /health` over plain HTTP: whether etcd says it is healthy.
fn healthy(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(300)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

impl EtcdServer {
    /// Start etcd, or skip when it is not installed (see [`skip`]).
    ///
    /// # Panics
    /// When etcd exists but does not come up after three tries.
    #[must_use]
    pub fn start() -> Option<Self> {
        Self::start_inner(false)
    }

    /// Start etcd with a second, HTTPS client port that requires client certificates
    /// (see [`EtcdServer::tls`]); the plain port stays for readiness and etcdctl.
    ///
    /// # Panics
    /// As [`EtcdServer::start`].
    #[must_use]
    pub fn start_tls() -> Option<Self> {
        Self::start_inner(true)
    }

    fn start_inner(tls: bool) -> Option<Self> {
        let Some(binary) = find_binary("etcd") else {
            return skip("etcd not found on PATH (apt-get install etcd-server)");
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let tls = tls.then(|| (free_port(), TestCerts::generate(dir.path())));
        let mut last = String::new();
        for _ in 0..3 {
            let (port, peer_port) = (free_port(), free_port());
            match Self::launch(&binary, dir.path(), port, peer_port, tls.as_ref()) {
                Ok(process) => {
                    return Some(EtcdServer {
                        process,
                        dir,
                        port,
                        peer_port,
                        binary,
                        tls,
                    });
                }
                Err(e) => last = e,
            }
        }
        panic!("etcd did not start: {last}");
    }

    fn launch(
        binary: &Path,
        dir: &Path,
        port: u16,
        peer_port: u16,
        tls: Option<&(u16, TestCerts)>,
    ) -> Result<ServerProcess, String> {
        let mut client = format!("http://127.0.0.1:{port}");
        if let Some((tls_port, _)) = tls {
            client.push_str(&format!(",https://127.0.0.1:{tls_port}"));
        }
        let peer = format!("http://127.0.0.1:{peer_port}");
        let mut cmd = Command::new(binary);
        cmd.current_dir(dir)
            .args(["--name", "dlock-test", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("dlock-test={peer}")])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--log-level", "warn"]);
        if let Some((_, certs)) = tls {
            cmd.arg("--cert-file")
                .arg(&certs.server_cert)
                .arg("--key-file")
                .arg(&certs.server_key)
                .arg("--trusted-ca-file")
                .arg(&certs.ca)
                .arg("--client-cert-auth");
        }
        let log = dir.join(format!("etcd-{port}.log"));
        let mut process =
            ServerProcess::spawn("etcd", cmd, &log).map_err(|e| format!("spawn: {e}"))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if process.has_exited() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("etcd exited (port taken?); log:\n{log}"));
            }
            if healthy(addr) {
                // Ready only when *our* process answers: another test's server may
                // have taken the port between free_port() and our bind (ours then
                // fails to bind; it is killed as it drops).
                match listens_on(process.pid(), port) {
                    Some(true) => return Ok(process),
                    Some(false) if !process.has_exited() => {
                        return Err(format!("port {port} answered by another process"));
                    }
                    Some(false) => continue,
                    None => {
                        // /proc cannot tell: a port taken by someone else makes our
                        // etcd exit, so look once more.
                        std::thread::sleep(Duration::from_millis(50));
                        if process.has_exited() {
                            continue;
                        }
                        return Ok(process);
                    }
                }
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("not healthy on port {port}; log:\n{log}"));
            }
            std::thread::sleep(Duration::from_millis(30));
        }
    }

    /// `127.0.0.1:port` (client).
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// With [`EtcdServer::start_tls`]: the HTTPS port and the certificates.
    #[must_use]
    pub fn tls(&self) -> Option<(u16, &TestCerts)> {
        self.tls.as_ref().map(|(p, c)| (*p, c))
    }

    /// The server's process id (for pausing it from outside).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// SIGSTOP etcd: it answers nothing until [`EtcdServer::resume`] (or its drop).
    pub fn pause(&self) {
        self.process.pause();
    }

    /// SIGCONT after [`EtcdServer::pause`].
    pub fn resume(&self) {
        self.process.resume();
    }

    /// SIGKILL etcd and start it again on the same ports and data dir (its keys and
    /// leases survive; etcd restarts every lease's countdown).
    ///
    /// # Panics
    /// When it does not come back.
    pub fn restart(&mut self) {
        let (binary, dir, port, peer) = (&self.binary, self.dir.path(), self.port, self.peer_port);
        let tls = self.tls.as_ref();
        relaunch(&mut self.process, || {
            Self::launch(binary, dir, port, peer, tls)
        });
    }

    /// `etcd://127.0.0.1:port`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.port)
    }

    /// An `etcdctl` command aimed at this server (API v3), not yet run.
    ///
    /// # Panics
    /// When `etcdctl` is not installed (it comes with the `etcd-client` package).
    #[must_use]
    pub fn etcdctl(&self) -> Command {
        let bin = find_binary("etcdctl").expect("etcdctl on PATH (apt-get install etcd-client)");
        let mut cmd = Command::new(bin);
        cmd.env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=127.0.0.1:{}", self.port));
        cmd
    }

    /// Run `etcdctl ARGS…` and return its stdout.
    ///
    /// # Panics
    /// When it fails.
    #[must_use]
    pub fn etcdctl_output(&self, args: &[&str]) -> String {
        let out = self.etcdctl().args(args).output().expect("run etcdctl");
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// How many keys exist (all of them).
    #[must_use]
    pub fn key_count(&self) -> usize {
        self.etcdctl_output(&["get", "", "--from-key", "--keys-only"])
            .lines()
            .filter(|l| !l.is_empty())
            .count()
    }
}

impl EtcdServer {
    /// Sum of the Prometheus samples on `/metrics` whose line starts with `metric`
    /// and contains every one of `labels` (e.g. `grpc_method="Txn"`).
    #[must_use]
    pub fn metric(&self, metric: &str, labels: &[&str]) -> f64 {
        let Ok(mut s) = TcpStream::connect_timeout(&self.addr(), Duration::from_secs(1)) else {
            return 0.0;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.lines()
            .filter(|l| l.starts_with(metric) && labels.iter().all(|lab| l.contains(lab)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Restartable for EtcdServer {
    fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    fn restart(&mut self) {
        EtcdServer::restart(self);
    }
}
