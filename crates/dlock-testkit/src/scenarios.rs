//! The `dlock check` scenarios every backend goes through, and running one.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::Target;
use crate::restart::{SharedServer, lock_server};

/// Run `cmd` to the end, restarting `server` whenever it has died meanwhile.
fn supervised(mut cmd: Command, server: &SharedServer) -> std::process::Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("run dlock check");
    // Read the pipes on threads so a full pipe cannot stall the child.
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for dlock check") {
            break status;
        }
        {
            let mut s = lock_server(server);
            if s.process().has_exited() {
                s.restart();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// One scenario: a fault, against a fenced or an unfenced store.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    pub fault: &'static str,
    pub fenced: bool,
}

/// Fault-free, kill-holder, pause-holder, pause-server, restart-server, partition,
/// latency and reset against the fenced store, and pause-holder and restart-server
/// against the unfenced store (what the lock alone gives). See [`Scenario::applies`].
pub const SCENARIOS: [Scenario; 10] = [
    Scenario {
        fault: "none",
        fenced: true,
    },
    Scenario {
        fault: "kill-holder",
        fenced: true,
    },
    Scenario {
        fault: "pause-holder",
        fenced: true,
    },
    Scenario {
        fault: "pause-holder",
        fenced: false,
    },
    Scenario {
        fault: "pause-server",
        fenced: true,
    },
    Scenario {
        fault: "restart-server",
        fenced: true,
    },
    Scenario {
        fault: "restart-server",
        fenced: false,
    },
    Scenario {
        fault: "partition",
        fenced: true,
    },
    Scenario {
        fault: "latency",
        fenced: true,
    },
    Scenario {
        fault: "reset",
        fenced: true,
    },
];

impl Scenario {
    /// Whether the scenario can run on `target`: pause-server and restart-server need a
    /// server process; partition, latency and reset put a proxy in front of a single
    /// host (not SQLite, not Redlock's five).
    #[must_use]
    pub fn applies(&self, target: &Target) -> bool {
        match self.fault {
            "pause-server" | "restart-server" => target.server.is_some(),
            "partition" | "latency" | "reset" => {
                !target.url.starts_with("sqlite:") && !target.url.starts_with("redlock:")
            }
            _ => true,
        }
    }
}

/// Run `dlock check --json` on `url`; returns the exit code and the report. Under
/// `restart-server`, this plays the supervisor: when `dlock check` has killed the
/// server, it starts it again on the same port and data dir.
///
/// # Panics
/// When the binary cannot be run or prints no JSON report.
#[must_use]
pub fn run_check(
    dlock: &Path,
    target: &Target,
    s: Scenario,
    ops: u32,
    extra: &[&str],
) -> (i32, Value) {
    let url = target.url.as_str();
    let ops_n = ops;
    let ops = ops.to_string();
    let mut cmd = Command::new(dlock);
    cmd.args([
        "check",
        "--url",
        url,
        "--json",
        "--ttl",
        "1s",
        "--workers",
        "4",
    ])
    .args(["--faults", "2", "--ops", &ops, "--fault", s.fault])
    .args(extra)
    .env_remove("DLOCK_URL");
    if !s.fenced {
        cmd.arg("--unfenced");
    }
    if let Some(pid) = target.server_pid() {
        cmd.args(["--server-pid", &pid.to_string()]);
    }
    if !extra.contains(&"--max-time") {
        // Long runs (the 100k tier) get time in proportion.
        let secs = (u64::from(ops_n) / 200).max(90);
        cmd.args(["--max-time", &format!("{secs}s")]);
    }
    let out = match (&target.server, s.fault) {
        (Some(server), "restart-server") => supervised(cmd, server),
        _ => cmd.output().expect("run dlock check"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| {
            panic!(
                "{url} {s:?}: no JSON report; stdout {stdout}; stderr {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    (out.status.code().unwrap_or(-1), report)
}
