//! The targets table's figures as medians over several runs of `dlock bench`, with
//! their spread. One run's ratio swings between runs on this machine (its loopback
//! round trip alone does), so a verdict read off one run flips from run to run; the
//! issue asks for the median of at least three.

use std::collections::HashMap;

use dlock_testkit::Target;
use serde_json::Value;

/// How many runs each target's figure is the median of (the main table's run and
/// `RUNS - 1` more), and each figure of the scaling section.
pub const RUNS: usize = 3;

/// The scenarios the targets read, per backend; the other backends are not run again.
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

/// The extra runs, by target label (a run that failed is left out, and said on stderr).
pub fn more_runs(
    targets: &[Target],
    mut bench: impl FnMut(&str, &[&str]) -> Option<Value>,
) -> HashMap<String, Vec<Value>> {
    let mut runs: HashMap<String, Vec<Value>> = HashMap::new();
    for round in 1..RUNS {
        for (label, scenarios) in READ_BY_TARGETS {
            let Some(t) = targets.iter().find(|t| t.label == label) else {
                continue;
            };
            eprintln!(
                "benchmarks: run {} of {RUNS} for the targets on {label}",
                round + 1
            );
            let args: Vec<&str> = scenarios.iter().flat_map(|s| ["--scenario", s]).collect();
            if let Some(r) = bench(&t.url, &args) {
                runs.entry(label.to_owned()).or_default().push(r);
            }
        }
    }
    runs
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
        // The lower middle one of an even count (as the scaling section's medians): always
        // a value some run measured.
        let median = v[(v.len() - 1) / 2];
        Some(Spread {
            median,
            low,
            high,
            runs: v.len(),
        })
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

/// Where the reports of one backend are: the main run's and the extra ones.
pub fn all_runs<'a>(main: Option<&'a Value>, more: Option<&'a Vec<Value>>) -> Vec<&'a Value> {
    main.into_iter().chain(more.into_iter().flatten()).collect()
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
        assert_eq!(Spread::of([f64::NAN]), None);
        assert_eq!(Spread::of([]), None);
    }
}
