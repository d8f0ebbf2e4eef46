//! Client instructions per uncontended Redis cycle, dlock's and the floor's, counted by
//! callgrind (the instruction target; wall-clock ratios swing with the machine,
//! instruction counts do not).
//!
//! Each side is counted with `--toggle-collect` on its cycle function: every instruction
//! run while that function is on the stack, whatever it calls or inlines. The work of
//! other tasks is left out on both sides (the client's connection task, which parses
//! the replies, and dlock's keeper, which a cycle only touches through its own calls).
//! Two runs per side of `dlock bench --scenario uncontended`, with `SHORT` and `LONG`
//! cycles: the difference in count over the difference in cycles cancels what the
//! bench does besides (warm-up, the extra cycles it counts requests over). dlock's
//! cycle also runs in the bench's second alternating run against the limit, when there
//! is one: its report says so, and the count is divided accordingly.

use std::path::Path;
use std::process::Command;

use dlock_testkit::find_binary;

const SHORT: u32 = 1000;
const LONG: u32 = 3000;
/// dlock's cycle (`lock` + `release`) and the floor's (`SET NX PX` + `EVALSHA`), as
/// `dlock bench` names them: renaming either makes this say it found nothing.
const DLOCK_CYCLE: &str = "dlock::bench::take::Take::cycle::{{closure}}";
const FLOOR_CYCLE: &str = "dlock::bench::floor::Floor::exclusive::{{closure}}";

/// Instructions per cycle: (dlock, floor).
///
/// # Errors
/// Why there is no figure: valgrind missing, a run that failed, nothing counted.
pub fn per_cycle(dlock: &Path, url: &str) -> Result<(f64, f64), String> {
    let valgrind = find_binary("valgrind").ok_or("valgrind is not installed")?;
    let dir = tempfile::tempdir().map_err(|e| format!("a temp dir: {e}"))?;
    let count = |function: &str, cycles: u32| -> Result<(u64, bool), String> {
        let out = dir.path().join("callgrind.out");
        let run = Command::new(&valgrind)
            .arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(format!("--toggle-collect={function}"))
            .arg(dlock)
            .args(["bench", "--json", "--url", url, "--scenario", "uncontended"])
            .arg("--cycles")
            .arg(cycles.to_string())
            .env_remove("DLOCK_URL")
            .output()
            .map_err(|e| format!("valgrind: {e}"))?;
        if !run.status.success() {
            return Err(format!(
                "dlock bench under valgrind exited with {}",
                run.status
            ));
        }
        let limit = super::json_line(&run).is_some_and(|r| !r["uncontended"]["limit"].is_null());
        let text = std::fs::read_to_string(&out).map_err(|e| format!("callgrind's output: {e}"))?;
        Ok((total(&text).ok_or("callgrind counted nothing")?, limit))
    };
    let per = |function: &str| -> Result<f64, String> {
        let (short, _) = count(function, SHORT)?;
        let (long, limit) = count(function, LONG)?;
        // dlock's cycle runs once per bench cycle, twice when a limit is measured too.
        let runs = if function == DLOCK_CYCLE && limit {
            2.0
        } else {
            1.0
        };
        let counted = long.checked_sub(short).filter(|d| *d > 0);
        let counted = counted.ok_or_else(|| format!("no instructions counted in {function}"))?;
        Ok(counted as f64 / (f64::from(LONG - SHORT) * runs))
    };
    Ok((per(DLOCK_CYCLE)?, per(FLOOR_CYCLE)?))
}

/// The instructions callgrind counted: its `totals:` line (`summary:` in older files).
fn total(callgrind_out: &str) -> Option<u64> {
    callgrind_out.lines().find_map(|l| {
        l.strip_prefix("totals:")
            .or_else(|| l.strip_prefix("summary:"))
            .and_then(|n| n.split_whitespace().next())
            .and_then(|n| n.parse().ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_is_read_from_either_line() {
        assert_eq!(
            total("events: Ir\nfl=x\ntotals: 92889758\n"),
            Some(92_889_758)
        );
        assert_eq!(total("events: Ir\nsummary: 12 \n"), Some(12));
        assert_eq!(total("events: Ir\n"), None);
    }
}
