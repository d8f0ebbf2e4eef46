//! BENCHMARKS.md's last section: the primitives beyond the mutex (a permit, a read, a
//! write, leadership) on every backend that offers them, against the floor of their
//! shape, measured by `dlock bench --primitive` in the same run.

use std::fmt::Write as _;
use std::path::Path;

use dlock_testkit::Matrix;
use serde_json::Value;

// Runs per backend and primitive (the table shows the median run, by ratio): as many
// as for the targets.
use crate::repeats::{RUNS, middle};
use crate::{dlock_bench, num, row, stepped_over};

/// The section's heading: everything from it to the end of the file is this section.
pub const HEADING: &str = "## Primitives beyond the mutex";

const PRIMITIVES: [&str; 4] = ["semaphore", "read", "write", "election"];

/// One `dlock bench --json --primitive` run on `url`.
fn bench(dlock: &Path, url: &str, primitive: &str) -> Option<Value> {
    let args = [
        "--primitive",
        primitive,
        "--permits",
        "3",
        "--cycles",
        "1000",
        "--processes",
        "8",
        "--duration",
        "2s",
        "--scenario",
        "uncontended,contended",
    ];
    dlock_bench(dlock, url, &args)
}

/// The section, measured now.
pub fn section(dlock: &Path, matrix: &Matrix) -> String {
    let mut rows = String::new();
    for t in matrix
        .targets
        .iter()
        .filter(|t| xtask::PRIMITIVE_BACKENDS.contains(&t.label.as_str()))
    {
        for primitive in PRIMITIVES {
            if t.label.starts_with("redlock") && primitive != "election" {
                let _ = writeln!(
                    rows,
                    "| {} | {primitive} | refused (`Unsupported`) | | | | | | | |",
                    t.label
                );
                continue;
            }
            eprintln!("benchmarks: {primitive} on {}", t.label);
            let mut runs: Vec<Value> = (0..RUNS)
                .filter_map(|_| bench(dlock, &t.url, primitive))
                .collect();
            let ratio = |r: &Value| row(r, "uncontended-1-task").and_then(|s| s["ratio"].as_f64());
            runs.sort_by(|a, b| {
                ratio(a)
                    .partial_cmp(&ratio(b))
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
            let spread = match (runs.first().and_then(ratio), runs.last().and_then(ratio)) {
                (Some(lo), Some(hi)) => format!("{lo:.2}–{hi:.2}"),
                _ => "–".to_owned(),
            };
            let Some(median) = runs.get(middle(runs.len())) else {
                let _ = writeln!(rows, "| {} | {primitive} | (failed) | | | | | | |", t.label);
                continue;
            };
            let null = Value::Null;
            let u = row(median, "uncontended-1-task").unwrap_or(&null);
            let c = row(median, "contended-8-processes").unwrap_or(&null);
            let _ = writeln!(
                rows,
                "| {} | {primitive} | {} | {} | {} | {spread} | {} | {} | {} | {} |",
                t.label,
                ops_cell(u),
                num(&u["floor_ops_per_sec"]),
                num(&u["ratio"]),
                num(&u["p50_us"]),
                num(&u["p99_us"]),
                ops_cell(c),
                num(&c["p50_us"]),
            );
        }
    }
    format!(
        "{HEADING}\n\n\
         `dlock bench --primitive P --permits 3 --cycles 1000 --processes 8 --duration 2s \
         --scenario uncontended,contended`, {RUNS} runs per row; the row is the run with \
         the median ratio, *spread* the lowest and highest ratio of the {RUNS}. A cycle \
         takes and gives back a permit of a semaphore of 3, a read or a write of a \
         read-write lock, or leadership (campaign + resign). The floor has the shape of \
         the grant: leadership's is the lock's (above); a permit's, a read's and a \
         write's is a bare grant counted against a limit — SQLite and SQL: a row \
         inserted while fewer than the limit are there (one statement), then deleted; \
         Redis: the npm `redis-semaphore` package's acquire script (`ZREMRANGEBYSCORE`, \
         `ZCARD`, `ZADD`) and a `ZREM`; etcd: put-with-lease, a range of the limit's oldest \
         keys, delete; ZooKeeper: create an ephemeral sequential node, list its siblings, \
         delete. dlock does more than that floor for these grants: it keeps a fencing \
         counter, holder metadata and a wake-up for waiters, and on ZooKeeper follows \
         Curator's recipes (a semaphore takes a mutex first). SQL primitives keep rows in \
         every mode, so one mode is measured. Contended: 8 processes on one name; \
         acquisitions/s and the wait's p50.\n\n\
         | backend | primitive | cycles/s | floor cycles/s | ratio | spread | p50 µs | p99 µs | contended acq/s | wait p50 µs |\n\
         |---|---|---|---|---|---|---|---|---|---|\n{rows}"
    )
}

/// A scenario's operations per second (cycles, acquisitions), and the cycles its run
/// stepped over on an error, if any.
fn ops_cell(c: &Value) -> String {
    format!("{}{}", num(&c["ops_per_sec"]), stepped_over(c))
}
