//! The targets table's figures as medians over several runs of `dlock bench` made for
//! them, with their spread. One run's ratio swings between runs on this machine (its loopback
//! round trip alone does), so a verdict read off one run flips from run to run; the
//! issue asks for the median of at least three.

use std::collections::HashMap;

use dlock_testkit::Target;
use serde_json::Value;

/// How many runs each target's figure is the median of, and each figure of the scaling
/// and primitives sections.
pub const RUNS: usize = 3;

/// Where the median of `len` sorted values is: the middle one, or the lower middle one
/// of an even count (always a value some run measured).
pub fn middle(len: usize) -> usize {
    len.saturating_sub(1) / 2
}

/// The scenarios the targets read, per backend; the other backends' targets read the
/// tables' run.
const READ_BY_TARGETS: [(&str, &[&str]); 8] = [
    (
        "redis (no persistence)",
        &["uncontended", "parallel", "handoff"],
    ),
    ("zookeeper", &["uncontended"]),
    ("postgres lease", &["uncontended", "handoff"]),
    ("postgres advisory", &["uncontended", "handoff"]),
    ("postgres row", &["uncontended"]),
    ("mariadb lease", &["uncontended", "handoff"]),
    ("mariadb named", &["uncontended", "handoff"]),
    ("mariadb row", &["uncontended"]),
];

/// The targets' own runs: [`RUNS`] rounds, each running every backend of
/// [`READ_BY_TARGETS`] in turn, with the same flags as the tables' run but only the
/// scenarios the targets read.
#[derive(Debug)]
pub struct Rounds {
    /// By label, one entry per round: `None` where that run failed.
    runs: HashMap<&'static str, Vec<Option<Value>>>,
}

impl Rounds {
    pub fn measure(
        targets: &[Target],
        mut bench: impl FnMut(&str, &[&str]) -> Option<Value>,
    ) -> Rounds {
        let mut runs: HashMap<&'static str, Vec<Option<Value>>> = HashMap::new();
        for round in 1..=RUNS {
            for (label, scenarios) in READ_BY_TARGETS {
                let Some(t) = targets.iter().find(|t| t.label == label) else {
                    eprintln!("benchmarks: no {label} to run for the targets");
                    continue;
                };
                eprintln!("benchmarks: targets' run {round} of {RUNS} on {label}");
                let args: Vec<&str> = scenarios.iter().flat_map(|s| ["--scenario", s]).collect();
                runs.entry(label).or_default().push(bench(&t.url, &args));
            }
        }
        Rounds { runs }
    }

    /// The reports of `label`'s runs that did not fail.
    pub fn of(&self, label: &str) -> Vec<&Value> {
        self.runs
            .get(label)
            .into_iter()
            .flatten()
            .filter_map(Option::as_ref)
            .collect()
    }

    /// Cycles all these runs stepped over on an error (`dlock bench`'s `skipped`,
    /// summed over every scenario of every run; `redlock-vs-one-node` repeats the
    /// uncontended row's count, so it is left out).
    pub fn skipped(&self) -> u64 {
        self.runs
            .values()
            .flatten()
            .flatten()
            .flat_map(|r| r["scenarios"].as_array().into_iter().flatten())
            .filter(|s| s["scenario"].as_str() != Some("redlock-vs-one-node"))
            .filter_map(|s| s["skipped"].as_u64())
            .sum()
    }

    /// `a`'s and `b`'s reports of each round where neither run failed.
    pub fn paired(&self, a: &str, b: &str) -> Vec<(&Value, &Value)> {
        let (Some(a), Some(b)) = (self.runs.get(a), self.runs.get(b)) else {
            return Vec::new();
        };
        a.iter()
            .zip(b)
            .filter_map(|(a, b)| a.as_ref().zip(b.as_ref()))
            .collect()
    }
}

/// A figure's median over the runs that gave it, and its lowest and highest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub low: f64,
    pub high: f64,
    pub runs: usize,
}

impl Spread {
    /// `None` when no run gave the figure (a value that is not finite counts as none).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Spread> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let (&low, &high) = (v.first()?, v.last()?);
        let median = v[middle(v.len())];
        Some(Spread {
            median,
            low,
            high,
            runs: v.len(),
        })
    }

    /// Whether every one of the [`RUNS`] runs gave the figure: a target is judged only
    /// then (the lower middle of an even count would favour a "≤" target).
    pub fn complete(&self) -> bool {
        self.runs >= RUNS
    }

    /// `ok(median)`, when the figure is [`complete`](Spread::complete); else not judged.
    pub fn judge(spread: Option<Spread>, ok: impl FnOnce(f64) -> bool) -> Option<bool> {
        spread.filter(Spread::complete).map(|s| ok(s.median))
    }

    /// The figure of each report that has it.
    pub fn over(reports: &[&Value], figure: impl Fn(&Value) -> Option<f64>) -> Option<Spread> {
        Spread::of(reports.iter().filter_map(|r| figure(r)))
    }

    /// `0.83× (0.80–0.86)`: [`Spread::show`] with two decimals.
    pub fn ratio(&self) -> String {
        self.show(2, "×")
    }

    /// The median with `decimals` and `unit`, then the lowest–highest in brackets, with
    /// the number of runs when it is not [`RUNS`]: `7589/s (7012–7702)`.
    pub fn show(&self, decimals: usize, unit: &str) -> String {
        let runs = if self.runs == RUNS {
            String::new()
        } else {
            format!(
                ", {} run{}",
                self.runs,
                if self.runs == 1 { "" } else { "s" }
            )
        };
        format!(
            "{:.decimals$}{unit} ({:.decimals$}–{:.decimals$}{runs})",
            self.median, self.low, self.high
        )
    }
}

#[cfg(test)]
mod tests {
    use super::Spread;

    #[test]
    fn medians_and_spreads() {
        let s = Spread::of([0.9, 0.8, 1.0]).expect("three runs");
        assert_eq!((s.median, s.low, s.high, s.runs), (0.9, 0.8, 1.0, 3));
        assert_eq!(s.ratio(), "0.90× (0.80–1.00)");
        let even = Spread::of([1.0, 4.0]).expect("two runs");
        assert_eq!(even.median, 1.0);
        assert_eq!(even.ratio(), "1.00× (1.00–4.00, 2 runs)");
        assert_eq!(
            Spread::of([7589.4]).expect("one run").show(0, "/s"),
            "7589/s (7589–7589, 1 run)"
        );
        assert!(s.complete() && !even.complete());
        assert_eq!(Spread::judge(Some(s), |m| m >= 0.9), Some(true));
        assert_eq!(Spread::judge(Some(even), |m| m <= 2.0), None);
        assert_eq!(Spread::of([f64::NAN]), None);
        assert_eq!(Spread::of([]), None);
    }
}
