//! The `dlock check` scenarios every backend goes through, and running one.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::Target;

/// One scenario: a fault, against a fenced or an unfenced store.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    pub fault: &'static str,
    pub fenced: bool,
}

/// Fault-free, kill-holder, pause-holder, pause-server, partition and latency against
/// the fenced store, and pause-holder against the unfenced store (what the lock alone
/// gives). See [`Scenario::applies`].
pub const SCENARIOS: [Scenario; 7] = [
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
        fault: "partition",
        fenced: true,
    },
    Scenario {
        fault: "latency",
        fenced: true,
    },
];

impl Scenario {
    /// Whether the scenario can run on `target`: pause-server needs a server process;
    /// partition and latency put a proxy in front of a single host (not SQLite, not
    /// Redlock's five).
    #[must_use]
    pub fn applies(&self, target: &Target) -> bool {
        match self.fault {
            "pause-server" => target.server_pid.is_some(),
            "partition" | "latency" => {
                !target.url.starts_with("sqlite:") && !target.url.starts_with("redlock:")
            }
            _ => true,
        }
    }
}

/// Run `dlock check --json` on `url`; returns the exit code and the report.
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
    if let Some(pid) = target.server_pid {
        cmd.args(["--server-pid", &pid.to_string()]);
    }
    if !extra.contains(&"--max-time") {
        cmd.args(["--max-time", "90s"]);
    }
    let out = cmd.output().expect("run dlock check");
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
