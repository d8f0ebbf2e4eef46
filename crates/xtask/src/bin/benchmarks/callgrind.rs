//! Client instructions per uncontended Redis cycle, dlock's and the floor's, counted by
//! callgrind (the instruction target; wall-clock ratios swing with the machine,
//! instruction counts do not).
//!
//! Two runs of `dlock bench --scenario uncontended`, with `SHORT` and `LONG` cycles; each
//! function's inclusive count in the second minus the first, over the difference in
//! cycles, cancels what the bench does besides its timed cycles (warm-up, the extra
//! cycles it counts requests over).

use std::path::Path;
use std::process::Command;

use dlock_testkit::find_binary;

const SHORT: u32 = 1000;
const LONG: u32 = 3000;
/// dlock's cycle (`lock` + `release`) and the floor's (`SET NX PX` + `EVALSHA`), as
/// `dlock bench` names them: renaming either function makes this say so, never guess.
const DLOCK_CYCLE: &str = "dlock::bench::take::Take::cycle::{{closure}}";
const FLOOR_CYCLE: &str = "dlock::bench::floor::Floor::exclusive::{{closure}}";

/// Instructions per cycle: (dlock, floor).
///
/// # Errors
/// Why there is no figure: valgrind missing, a run that failed, a function not found.
pub fn per_cycle(dlock: &Path, url: &str) -> Result<(f64, f64), String> {
    let valgrind = find_binary("valgrind").ok_or("valgrind is not installed")?;
    let annotate = find_binary("callgrind_annotate").ok_or("callgrind_annotate is missing")?;
    let dir = tempfile::tempdir().map_err(|e| format!("a temp dir: {e}"))?;
    let mut counts = Vec::new();
    for cycles in [SHORT, LONG] {
        let out = dir.path().join(format!("callgrind.{cycles}"));
        let status = Command::new(&valgrind)
            .arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(dlock)
            .args([
                "bench",
                "--url",
                url,
                "--scenario",
                "uncontended",
                "--cycles",
            ])
            .arg(cycles.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .map_err(|e| format!("valgrind: {e}"))?;
        if !status.success() {
            return Err(format!("dlock bench under valgrind exited with {status}"));
        }
        let listing = Command::new(&annotate)
            .arg("--inclusive=yes")
            .arg(&out)
            .output()
            .map_err(|e| format!("callgrind_annotate: {e}"))?;
        let text = String::from_utf8_lossy(&listing.stdout);
        counts.push((
            inclusive(&text, DLOCK_CYCLE)?,
            inclusive(&text, FLOOR_CYCLE)?,
        ));
    }
    let cycles = f64::from(LONG - SHORT);
    let per = |long: u64, short: u64| long.saturating_sub(short) as f64 / cycles;
    Ok((per(counts[1].0, counts[0].0), per(counts[1].1, counts[0].1)))
}

/// The largest inclusive count `callgrind_annotate` lists for `function` (inlined
/// copies are listed under other files, with smaller counts).
fn inclusive(listing: &str, function: &str) -> Result<u64, String> {
    listing
        .lines()
        .filter(|l| {
            let l = l.trim_end();
            let l = l.rsplit_once(" [").map_or(l, |(head, _)| head);
            l.ends_with(&format!(":{function}"))
        })
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|n| n.replace(',', "").parse::<u64>().ok())
        .max()
        .ok_or_else(|| format!("callgrind lists no {function}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_count_of_the_function_is_read() {
        let listing = "\
 9,000 (10.0%)  /a/take.rs:dlock::bench::take::Take::cycle::{{closure}} [/bin/dlock]
   500 ( 1.0%)  core/future.rs:dlock::bench::take::Take::cycle::{{closure}}
 1,000 ( 1.0%)  /a/take.rs:dlock::bench::take::Take::cycle::{{closure}}::{{closure}} [/bin/dlock]
";
        assert_eq!(inclusive(listing, DLOCK_CYCLE), Ok(9000));
        assert!(inclusive(listing, FLOOR_CYCLE).is_err());
    }
}
