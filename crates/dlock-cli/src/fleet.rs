//! Worker processes: this same binary re-run with a hidden subcommand, reporting
//! progress as JSON lines on stdout. Used by `demo flash-sale` and `bench`.

use std::process::Stdio;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::exit::Failure;

/// A set of running worker processes (killed if dropped early).
pub struct Fleet {
    children: Vec<Child>,
    events: mpsc::UnboundedReceiver<(usize, Value)>,
}

impl Fleet {
    /// Start one worker per argument list.
    pub fn spawn(arg_lists: Vec<Vec<String>>) -> Result<Self, Failure> {
        let exe = std::env::current_exe()
            .map_err(|e| Failure::internal(format!("cannot find the dlock binary: {e}")))?;
        let (tx, events) = mpsc::unbounded_channel();
        let mut children = Vec::new();
        for (index, args) in arg_lists.into_iter().enumerate() {
            let mut child = Command::new(&exe)
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| Failure::internal(format!("cannot start a worker: {e}")))?;
            let stdout = child
                .stdout
                .take()
                .ok_or_else(|| Failure::internal("worker without stdout"))?;
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if let Ok(v) = serde_json::from_str::<Value>(&line)
                        && tx.send((index, v)).is_err()
                    {
                        break;
                    }
                }
            });
            children.push(child);
        }
        Ok(Fleet { children, events })
    }

    /// The next event from any worker; `None` when every worker's stdout has closed.
    pub async fn next(&mut self) -> Option<(usize, Value)> {
        self.events.recv().await
    }

    /// The process id of worker `index` (while it runs).
    pub fn pid(&self, index: usize) -> Option<u32> {
        self.children.get(index).and_then(Child::id)
    }

    /// Kill every worker still running and reap them all.
    pub async fn kill_all(mut self) {
        for child in &mut self.children {
            let _ = child.kill().await;
        }
    }

    /// Wait for every worker; fail if any failed.
    pub async fn wait(mut self) -> Result<(), Failure> {
        for (i, child) in self.children.iter_mut().enumerate() {
            let status = child
                .wait()
                .await
                .map_err(|e| Failure::internal(format!("worker {i}: {e}")))?;
            if !status.success() {
                return Err(Failure::internal(format!("worker {i} failed: {status}")));
            }
        }
        Ok(())
    }
}

/// Print one JSON event line (from inside a worker).
pub fn emit(v: &Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
}

/// Values of a JSON array of numbers.
pub fn numbers(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}
