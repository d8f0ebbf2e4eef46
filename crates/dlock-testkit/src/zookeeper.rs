//! A standalone ZooKeeper (Debian's `zookeeper` package, run with `java` directly:
//! `QuorumPeerMain`) on a free loopback port, data in a temp dir, a small tick so
//! sessions can be short, and container nodes cleaned up every second.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::restart::{Restartable, relaunch};
use crate::server::{ServerProcess, find_binary, free_port, skip};

/// Where Debian installs ZooKeeper's jar.
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";

/// A running ZooKeeper (killed on Drop).
#[derive(Debug)]
pub struct ZkServer {
    /// Held to kill the server on Drop.
    process: ServerProcess,
    /// Held to remove the data on Drop.
    dir: tempfile::TempDir,
    port: u16,
    java: PathBuf,
}

/// Send a four-letter command and return the answer.
///
/// # Errors
/// When the server cannot be reached.
pub fn zk_four_letters(addr: SocketAddr, cmd: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(cmd.as_bytes())?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

impl ZkServer {
    /// Start ZooKeeper, or skip when java or the jar is missing (see [`skip`]).
    ///
    /// # Panics
    /// When it exists but does not come up after three tries.
    #[must_use]
    pub fn start() -> Option<Self> {
        let Some(java) = find_binary("java") else {
            return skip("java not found on PATH (apt-get install zookeeper)");
        };
        if !Path::new(ZOOKEEPER_JAR).exists() {
            return skip("zookeeper.jar not found (apt-get install zookeeper)");
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let mut last = String::new();
        for _ in 0..3 {
            let port = free_port();
            match Self::launch(&java, dir.path(), port) {
                Ok(process) => {
                    return Some(ZkServer {
                        process,
                        dir,
                        port,
                        java,
                    });
                }
                Err(e) => last = e,
            }
        }
        panic!("ZooKeeper did not start: {last}");
    }

    fn launch(java: &Path, dir: &Path, port: u16) -> Result<ServerProcess, String> {
        let data = dir.join("data");
        std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
        let cfg = dir.join("zoo.cfg");
        // tickTime 200 ms: sessions from 0.4 s (up to 30 s).
        std::fs::write(
            &cfg,
            format!(
                "tickTime=200\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 admin.enableServer=false\n4lw.commands.whitelist=*\nmaxClientCnxns=0\n\
                 maxSessionTimeout=30000\n",
                data.display()
            ),
        )
        .map_err(|e| e.to_string())?;
        let mut cmd = Command::new(java);
        cmd.current_dir(dir)
            .arg("-Xmx256m")
            .arg("-XX:+UseSerialGC")
            .arg(format!("-Dzookeeper.log.dir={}", dir.display()))
            .arg("-Dznode.container.checkIntervalMs=500")
            .arg("-Dznode.container.maxPerMinute=100000")
            .arg("-cp")
            .arg(format!("/etc/zookeeper/conf:{ZOOKEEPER_JAR}"))
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(&cfg);
        let log = dir.join(format!("zookeeper-{port}.log"));
        let mut process =
            ServerProcess::spawn("zookeeper", cmd, &log).map_err(|e| format!("spawn: {e}"))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let ours = format!("user.dir={}", dir.display());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if process.has_exited() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("exited; log:\n{log}"));
            }
            if zk_four_letters(addr, "ruok").is_ok_and(|a| a == "imok") {
                // Ready only when *our* server answers (its working dir is ours).
                let env = zk_four_letters(addr, "envi").unwrap_or_default();
                if env.contains(&ours) {
                    return Ok(process);
                }
                return Err(format!("port {port} answered by another server"));
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("not ready on port {port}; log:\n{log}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `127.0.0.1:port`.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The server's process id (for pausing it from outside).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// SIGKILL ZooKeeper and start it again on the same port and data dir (its znodes
    /// and sessions survive; a session whose timeout passed meanwhile expires).
    ///
    /// # Panics
    /// When it does not come back.
    pub fn restart(&mut self) {
        let (java, dir, port) = (&self.java, self.dir.path(), self.port);
        relaunch(&mut self.process, || Self::launch(java, dir, port));
    }

    /// `zk://127.0.0.1:port`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("zk://127.0.0.1:{}", self.port)
    }

    /// The number of znodes (`mntr`'s `zk_znode_count`).
    #[must_use]
    pub fn znode_count(&self) -> usize {
        usize::try_from(self.mntr("zk_znode_count")).unwrap_or(0)
    }

    /// One numeric `mntr` value (0 when absent).
    #[must_use]
    pub fn mntr(&self, key: &str) -> u64 {
        zk_four_letters(self.addr(), "mntr")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('\t'))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Restartable for ZkServer {
    fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    fn restart(&mut self) {
        ZkServer::restart(self);
    }
}
