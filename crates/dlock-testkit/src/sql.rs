//! PostgreSQL and MariaDB on free loopback ports, data in temp dirs, killed on Drop.
//!
//! PostgreSQL refuses to run as root, so when the tests run as root its `initdb` and
//! `postgres` run as the `postgres` user (which Debian's package creates). Debian keeps
//! the PostgreSQL binaries in `/usr/lib/postgresql/<version>/bin`, off PATH: they are
//! looked for on PATH first, then there (highest version first).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::restart::{Restartable, relaunch};
use crate::server::{ServerProcess, find_binary, free_port, skip};

/// Set by [`sql_servers_at_default_sizes`].
static DEFAULT_SIZES: AtomicBool = AtomicBool::new(false);

/// From now on, the PostgreSQL and MariaDB servers this process starts keep their own
/// default memory sizes rather than the test kit's small ones, which let dozens of
/// servers run at once but measure a MariaDB's redo-log checkpoints more than dlock
/// once it holds 100,000 lease rows. For the benchmarks generator only, never from a
/// test: the setting is process-wide, so it would resize the servers of every test
/// running beside it. A server keeps the sizes it started with across restarts.
pub fn sql_servers_at_default_sizes() {
    DEFAULT_SIZES.store(true, Ordering::SeqCst);
}

/// How the PostgreSQL and MariaDB servers started now run, in words, for a report to
/// say: their durability settings and memory sizes (see
/// [`sql_servers_at_default_sizes`]).
#[must_use]
pub fn sql_server_settings() -> String {
    let sizes = SqlSizes::now();
    let pg: Vec<&str> = PG_DURABILITY
        .iter()
        .chain(sizes.pg())
        .copied()
        .filter(|a| *a != "-c")
        .collect();
    let maria: Vec<&str> = MARIADB_DURABILITY
        .iter()
        .chain(sizes.mariadb())
        .copied()
        .collect();
    let memory = if sizes.small {
        ""
    } else {
        ", both at their own default memory sizes"
    };
    format!(
        "PostgreSQL runs with `{}`, MariaDB with `{}`{memory}",
        pg.join(" "),
        maria.join(" ")
    )
}

/// What the test kit trades for speed: a write is not synced (PostgreSQL) or synced
/// once a second (MariaDB), and MariaDB keeps no binary log.
const PG_DURABILITY: [&str; 4] = ["-c", "fsync=off", "-c", "full_page_writes=off"];
const MARIADB_DURABILITY: [&str; 2] = ["--skip-log-bin", "--innodb-flush-log-at-trx-commit=2"];

/// The test kit's small sizes (see [`sql_servers_at_default_sizes`]). MariaDB's data
/// directory is made with the small redo log; at its default size the server resizes
/// the log when it starts.
const PG_SMALL: [&str; 2] = ["-c", "shared_buffers=32MB"];
const MARIADB_SMALL_REDO: &str = "--innodb-log-file-size=8M";
const MARIADB_SMALL: [&str; 2] = ["--innodb-buffer-pool-size=32M", MARIADB_SMALL_REDO];

/// Small or default sizes, as read when a server starts.
#[derive(Debug, Clone, Copy)]
struct SqlSizes {
    small: bool,
}

impl SqlSizes {
    fn now() -> Self {
        SqlSizes {
            small: !DEFAULT_SIZES.load(Ordering::SeqCst),
        }
    }

    fn pg(self) -> &'static [&'static str] {
        if self.small { &PG_SMALL } else { &[] }
    }

    fn mariadb(self) -> &'static [&'static str] {
        if self.small { &MARIADB_SMALL } else { &[] }
    }
}

/// `binary` on PATH, else in Debian's versioned PostgreSQL directory.
fn find_pg_binary(binary: &str) -> Option<PathBuf> {
    if let Some(p) = find_binary(binary) {
        return Some(p);
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    dirs.sort_by_key(|d| {
        d.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(0)
    });
    dirs.iter()
        .rev()
        .map(|d| d.join("bin").join(binary))
        .find(|p| p.is_file())
}

/// When running as root: the `postgres` user's uid and gid.
fn postgres_user() -> Result<Option<(u32, u32)>, String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Ok(None);
    }
    match nix::unistd::User::from_name("postgres") {
        Ok(Some(u)) => Ok(Some((u.uid.as_raw(), u.gid.as_raw()))),
        _ => Err("running as root and there is no `postgres` user to run PostgreSQL".into()),
    }
}

/// Wait until `log` contains `ready` (or the process exits, or 30 s pass).
fn wait_for_log(process: &mut ServerProcess, log: &Path, ready: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(ready) {
            return Ok(());
        }
        if process.has_exited() {
            return Err(format!("{} exited; log:\n{text}", process.name()));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} not ready after 30 s; log:\n{text}",
                process.name()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The superuser password of every test PostgreSQL (connections over TCP must give
/// it: SCRAM authentication, so tests can prove passwords stay out of output).
pub const PG_PASSWORD: &str = "dlock-test-pw";

/// A running PostgreSQL (killed on Drop). Superuser `postgres` with password
/// [`PG_PASSWORD`] (SCRAM) on 127.0.0.1, `fsync=off`.
#[derive(Debug)]
pub struct PgServer {
    process: ServerProcess,
    dir: tempfile::TempDir,
    port: u16,
    postgres: PathBuf,
    user: Option<(u32, u32)>,
    sizes: SqlSizes,
}

impl PgServer {
    /// Start PostgreSQL, or skip when it is not installed (see [`skip`]).
    ///
    /// # Panics
    /// When PostgreSQL exists but does not come up after three tries.
    #[must_use]
    pub fn start() -> Option<Self> {
        let (Some(initdb), Some(postgres)) = (find_pg_binary("initdb"), find_pg_binary("postgres"))
        else {
            return skip("PostgreSQL (initdb, postgres) not found (apt-get install postgresql)");
        };
        let user = match postgres_user() {
            Ok(u) => u,
            Err(e) => panic!("{e}"),
        };
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| {
            let uid = user.map_or_else(|| nix::unistd::Uid::effective().as_raw(), |(u, _)| u);
            let removed = crate::sysv_shm::remove_orphans(uid, &crate::sysv_shm::registry());
            if removed > 0 {
                eprintln!("removed {removed} shared memory segments of killed PostgreSQL servers");
            }
        });
        let dir = tempfile::tempdir().expect("temp dir");
        if let Some((uid, gid)) = user {
            nix::unistd::chown(
                dir.path(),
                Some(nix::unistd::Uid::from_raw(uid)),
                Some(nix::unistd::Gid::from_raw(gid)),
            )
            .expect("chown the PostgreSQL dir");
        }
        // initdb once per machine (see `template`), as the user that runs the server.
        crate::template::copy_of("postgres", &initdb, &dir.path().join("data"), |staging| {
            if let Some((uid, gid)) = user {
                nix::unistd::chown(
                    staging,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(gid)),
                )
                .map_err(|e| format!("chown the PostgreSQL staging dir: {e}"))?;
            }
            let pwfile = staging.join("pw");
            std::fs::write(&pwfile, PG_PASSWORD).map_err(|e| format!("password file: {e}"))?;
            if let Some((uid, gid)) = user {
                let _ = nix::unistd::chown(
                    &pwfile,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(gid)),
                );
            }
            let mut cmd = Command::new(&initdb);
            cmd.arg("-D")
                .arg(staging.join("data"))
                .args(["-U", "postgres", "-E", "UTF8", "--no-sync", "--locale=C"])
                .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
                .arg(format!("--pwfile={}", pwfile.display()));
            if let Some((uid, gid)) = user {
                cmd.uid(uid).gid(gid);
            }
            let out = cmd.output().map_err(|e| format!("run initdb: {e}"))?;
            let _ = std::fs::remove_file(&pwfile);
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "initdb failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let mut last = String::new();
        let sizes = SqlSizes::now();
        for _ in 0..3 {
            let port = free_port();
            match Self::launch(&postgres, dir.path(), (port, sizes), user) {
                Ok(process) => {
                    return Some(PgServer {
                        process,
                        dir,
                        port,
                        postgres,
                        user,
                        sizes,
                    });
                }
                Err(e) => {
                    // A server that came up too slowly was killed with its segment.
                    crate::sysv_shm::remove_segment_of(&dir.path().join("data"));
                    last = e;
                }
            }
        }
        panic!("PostgreSQL did not start: {last}");
    }

    fn launch(
        postgres: &Path,
        dir: &Path,
        (port, sizes): (u16, SqlSizes),
        user: Option<(u32, u32)>,
    ) -> Result<ServerProcess, String> {
        let mut cmd = Command::new(postgres);
        cmd.arg("-D")
            .arg(dir.join("data"))
            .args(["-p", &port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", dir.display()))
            .args(PG_DURABILITY)
            .args(["-c", "max_connections=300"])
            .args(sizes.pg())
            // In the data dir, not /dev/shm: a killed server cannot remove its segments,
            // and /dev/shm filled up with them.
            .args(["-c", "dynamic_shared_memory_type=mmap"]);
        if let Some((uid, gid)) = user {
            cmd.uid(uid).gid(gid);
        }
        let log = dir.join(format!("postgres-{port}.log"));
        let mut process =
            ServerProcess::spawn("postgres", cmd, &log).map_err(|e| format!("spawn: {e}"))?;
        wait_for_log(
            &mut process,
            &log,
            "database system is ready to accept connections",
        )?;
        crate::sysv_shm::record_segment_of(&dir.join("data"), &crate::sysv_shm::registry());
        Ok(process)
    }

    /// `postgres://postgres:PASSWORD@127.0.0.1:PORT/postgres`.
    #[must_use]
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres:{PG_PASSWORD}@127.0.0.1:{}/postgres",
            self.port
        )
    }

    /// The port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server process (pause, resume, kill).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// Kill the server and start it again on the same port and data.
    ///
    /// # Panics
    /// When it does not come back.
    pub fn restart(&mut self) {
        let (postgres, dir, user) = (&self.postgres, self.dir.path(), self.user);
        let at = (self.port, self.sizes);
        relaunch(&mut self.process, || Self::launch(postgres, dir, at, user));
    }

    /// Start `psql` running `sql` in one session, in the background (e.g. a foreign
    /// holder: `SELECT pg_advisory_lock(7); SELECT pg_sleep(30)`). Kill it to end the
    /// session.
    ///
    /// # Panics
    /// When psql is missing or cannot be started.
    #[must_use]
    pub fn psql_session(&self, sql: &str) -> std::process::Child {
        let psql = find_pg_binary("psql").expect("psql");
        Command::new(psql)
            .env("PGPASSWORD", PG_PASSWORD)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", "postgres", "-At", "-q"])
            .args(["-c", sql])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start psql")
    }

    /// Run SQL through `psql` as the superuser; returns stdout (unaligned, tuples only).
    ///
    /// # Panics
    /// When psql is missing or the SQL fails.
    #[must_use]
    pub fn psql(&self, sql: &str) -> String {
        let psql = find_pg_binary("psql").expect("psql");
        let out = Command::new(psql)
            .env("PGPASSWORD", PG_PASSWORD)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args([
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-At",
                "-v",
                "ON_ERROR_STOP=1",
            ])
            .args(["-c", sql])
            .output()
            .expect("run psql");
        assert!(
            out.status.success(),
            "psql {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        // Killed, its System V segment stays unless removed (see `sysv_shm`).
        self.process.resume();
        self.process.kill();
        crate::sysv_shm::remove_segment_of(&self.dir.path().join("data"));
    }
}

impl Restartable for PgServer {
    fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    fn restart(&mut self) {
        PgServer::restart(self);
    }
}

/// A running MariaDB (killed on Drop). User `root` without a password on 127.0.0.1,
/// binary log off, `innodb_flush_log_at_trx_commit=2`.
#[derive(Debug)]
pub struct MariaDbServer {
    process: ServerProcess,
    dir: tempfile::TempDir,
    port: u16,
    server: PathBuf,
    sizes: SqlSizes,
}

impl MariaDbServer {
    /// Start MariaDB, or skip when it is not installed (see [`skip`]).
    ///
    /// # Panics
    /// When MariaDB exists but does not come up after three tries.
    #[must_use]
    pub fn start() -> Option<Self> {
        let (Some(install), Some(server)) = (
            find_binary("mariadb-install-db"),
            find_binary("mariadbd").or_else(|| find_binary("/usr/sbin/mariadbd")),
        ) else {
            return skip(
                "MariaDB (mariadb-install-db, mariadbd) not found (apt-get install mariadb-server)",
            );
        };
        let dir = tempfile::tempdir().expect("temp dir");
        // Each server gets its own tmpdir: parallel bootstraps sharing /tmp clash on
        // temporary table file names.
        std::fs::create_dir(dir.path().join("tmp")).expect("tmp dir");
        // Bootstrapped once per machine (see `template`).
        crate::template::copy_of("mariadb", &install, &dir.path().join("data"), |staging| {
            let tmp = staging.join("tmp");
            std::fs::create_dir(&tmp).map_err(|e| format!("tmp dir: {e}"))?;
            let mut cmd = Command::new(&install);
            cmd.arg("--no-defaults")
                .arg(format!("--datadir={}", staging.join("data").display()))
                .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
                .args([MARIADB_SMALL_REDO, "--innodb-use-native-aio=0"])
                .arg(format!("--tmpdir={}", tmp.display()));
            if nix::unistd::Uid::effective().is_root() {
                cmd.arg("--user=root");
            }
            let out = cmd
                .output()
                .map_err(|e| format!("run mariadb-install-db: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "mariadb-install-db failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let mut last = String::new();
        let sizes = SqlSizes::now();
        for _ in 0..3 {
            let port = free_port();
            match Self::launch(&server, dir.path(), (port, sizes)) {
                Ok(process) => {
                    let me = MariaDbServer {
                        process,
                        dir,
                        port,
                        server,
                        sizes,
                    };
                    let _ = me.sql("CREATE DATABASE IF NOT EXISTS dlock");
                    return Some(me);
                }
                Err(e) => last = e,
            }
        }
        panic!("MariaDB did not start: {last}");
    }

    fn launch(
        server: &Path,
        dir: &Path,
        (port, sizes): (u16, SqlSizes),
    ) -> Result<ServerProcess, String> {
        let log = dir.join(format!("mariadb-{port}.log"));
        let _ = std::fs::remove_file(&log);
        let mut cmd = Command::new(server);
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg(format!("--port={port}"))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", dir.join("mariadb.sock").display()))
            .arg(format!("--log-error={}", log.display()))
            .arg(format!("--tmpdir={}", dir.join("tmp").display()))
            .args(MARIADB_DURABILITY)
            .args(sizes.mariadb())
            .args(["--performance-schema=OFF", "--max-connections=400"])
            // Linux AIO contexts are a machine-wide limit that parallel tests exhaust.
            .arg("--innodb-use-native-aio=0");
        if nix::unistd::Uid::effective().is_root() {
            cmd.arg("--user=root");
        }
        let mut process = ServerProcess::spawn("mariadbd", cmd, &dir.join("stdout.log"))
            .map_err(|e| format!("spawn: {e}"))?;
        wait_for_log(&mut process, &log, "ready for connections")?;
        Ok(process)
    }

    /// `mariadb://root@127.0.0.1:PORT/dlock`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("mariadb://root@127.0.0.1:{}/dlock", self.port)
    }

    /// The port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server process (pause, resume, kill).
    pub fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// Kill the server and start it again on the same port and data.
    ///
    /// # Panics
    /// When it does not come back.
    pub fn restart(&mut self) {
        let (server, dir, at) = (&self.server, self.dir.path(), (self.port, self.sizes));
        relaunch(&mut self.process, || Self::launch(server, dir, at));
    }

    /// Run SQL through the `mariadb` client as root; returns stdout (tab-separated, no
    /// column names).
    ///
    /// # Panics
    /// When the client is missing or the SQL fails.
    #[must_use = "the output of the statement"]
    pub fn sql(&self, sql: &str) -> String {
        let client = find_binary("mariadb").expect("mariadb client");
        let out = Command::new(client)
            .args([
                "-h",
                "127.0.0.1",
                "-P",
                &self.port.to_string(),
                "-u",
                "root",
            ])
            .args(["-N", "-B", "-e", sql])
            .output()
            .expect("run mariadb");
        assert!(
            out.status.success(),
            "mariadb {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

impl Restartable for MariaDbServer {
    fn process(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    fn restart(&mut self) {
        MariaDbServer::restart(self);
    }
}
