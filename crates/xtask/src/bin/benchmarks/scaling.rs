//! BENCHMARKS.md's scaling section: `dlock bench --scenario scaling` on every backend
//! configuration (how one lock's latency grows with the names held, how hand-offs grow
//! with the waiters on one name), in two tables and one plot, a PNG next to the
//! document.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use dlock_testkit::Matrix;
use plotters::prelude::*;
use serde_json::Value;

// Runs per configuration (each figure is their median): as many as for the targets.
use crate::repeats::RUNS;
use crate::{dlock_bench, num};

/// The section's heading: everything from it to the next `## ` heading is this section.
pub const HEADING: &str = "## How cost grows";

/// The plot's file name, next to the document.
pub const PLOT: &str = "BENCHMARKS-scaling.png";

/// Where a TrueType font for the plot's text is looked for (Debian's fonts-dejavu-core,
/// which `scripts/install-servers` installs).
const FONTS: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// The configurations measured: one per backend, and the session modes, whose held
/// locks each pin a connection.
const TARGETS: [&str; 9] = [
    "sqlite",
    "redis (no persistence)",
    "redlock (5 nodes)",
    "etcd",
    "zookeeper",
    "postgres lease",
    "postgres advisory",
    "mariadb lease",
    "mariadb named",
];

/// The arguments every scaling run gets.
const ARGS: [&str; 10] = [
    "--scenario",
    "scaling",
    "--cycles",
    "1000",
    "--duration",
    "3s",
    "--scale-held",
    "1,1000,100000",
    "--scale-waiters",
    "1,10,100,1000",
];

/// One `dlock bench --scenario scaling --json` run on `url`: its `scaling` report.
fn bench(dlock: &Path, url: &str) -> Option<Value> {
    dlock_bench(dlock, url, &ARGS).map(|r| r["scaling"].clone())
}

/// The median of several reports' values of one shape, leaf by leaf: a number is the
/// median of the numbers (the lower middle one of an even count, so always a value some
/// run measured), anything else the first report's.
fn median_value(values: &[&Value]) -> Value {
    match values.first() {
        Some(Value::Object(first)) => Value::Object(
            first
                .keys()
                .map(|k| {
                    let leaves: Vec<&Value> = values.iter().map(|v| &v[k]).collect();
                    (k.clone(), median_value(&leaves))
                })
                .collect(),
        ),
        Some(Value::Number(_)) => {
            let mut numbers: Vec<&Value> =
                values.iter().copied().filter(|v| v.is_number()).collect();
            numbers.sort_by(|a, b| {
                let (a, b) = (a.as_f64().unwrap_or(0.0), b.as_f64().unwrap_or(0.0));
                a.total_cmp(&b)
            });
            numbers
                .get(crate::repeats::middle(numbers.len()))
                .map_or(Value::Null, |v| (*v).clone())
        }
        Some(other) => (*other).clone(),
        None => Value::Null,
    }
}

/// Several runs' reports of one configuration as one: each level is the median of the
/// runs that reached it, with `runs` (how many did), `range`, the lowest and highest
/// p50 of its `latency` ("acquire" or "handoff"), and `skipped`, the cycles all its runs
/// stepped over on an error, with the first one's message; a series stopped in any run
/// says how often and why (the first reason).
fn combine(reports: &[Value]) -> Value {
    let mut out = serde_json::Map::new();
    for (list, latency, stop) in [
        ("held", "acquire", "held_stopped"),
        ("waiters", "handoff", "waiters_stopped"),
    ] {
        let deepest = reports
            .iter()
            .map(|r| r[list].as_array().map_or(0, Vec::len))
            .max()
            .unwrap_or(0);
        let levels: Vec<Value> = (0..deepest)
            .map(|i| {
                let reached: Vec<&Value> = reports.iter().filter_map(|r| r[list].get(i)).collect();
                let mut level = median_value(&reached);
                let p50s: Vec<f64> = reached
                    .iter()
                    .filter_map(|l| l[latency]["p50_us"].as_f64())
                    .collect();
                let (low, high) = (
                    p50s.iter().copied().fold(f64::INFINITY, f64::min),
                    p50s.iter().copied().fold(0.0, f64::max),
                );
                level["runs"] = reached.len().into();
                // What the runs stepped over is added up, not a median.
                level["skipped"] = reached
                    .iter()
                    .filter_map(|l| l["skipped"]["count"].as_u64())
                    .sum::<u64>()
                    .into();
                level["first_skipped"] = reached
                    .iter()
                    .find_map(|l| l["skipped"]["first"].as_str())
                    .into();
                if !p50s.is_empty() {
                    level["range"] = serde_json::json!([low, high]);
                }
                level
            })
            .collect();
        out.insert(list.to_owned(), levels.into());
        let reasons: Vec<&str> = reports.iter().filter_map(|r| r[stop].as_str()).collect();
        if let Some(first) = reasons.first() {
            out.insert(
                stop.to_owned(),
                format!("in {} of {} runs: {first}", reasons.len(), reports.len()).into(),
            );
        }
    }
    if let Some(what) = reports.iter().find_map(|r| r["requests_counted"].as_str()) {
        out.insert("requests_counted".to_owned(), what.into());
    }
    Value::Object(out)
}

/// "low–high" of a level's p50 range, in µs.
fn range(level: &Value) -> String {
    match (level["range"][0].as_f64(), level["range"][1].as_f64()) {
        (Some(low), Some(high)) => format!("{low:.0}–{high:.0}"),
        _ => "–".to_owned(),
    }
}

fn us(v: &Value) -> String {
    v.as_u64().map_or("–".to_owned(), |u| u.to_string())
}

/// "p50 / p99" of a latency object.
fn p50_p99(l: &Value) -> String {
    format!("{} / {}", us(&l["p50_us"]), us(&l["p99_us"]))
}

/// The section (and the plot, written to `plot`), measured now. Each configuration's
/// run gets servers of its own, started for it: a run on a server an earlier run
/// filled with 100,000 rows measures that server's state too (with the test kit's
/// 32 MB buffer pool, a second 100,000 fill on one MariaDB did not finish in 60 s, the
/// first took 22 s).
pub fn section(dlock: &Path, plot: &Path) -> String {
    let mut reports: Vec<(&str, Vec<Value>)> = TARGETS.iter().map(|t| (*t, Vec::new())).collect();
    for run in 1..=RUNS {
        for (label, mine) in &mut reports {
            let Some(matrix) = Matrix::start() else {
                eprintln!("benchmarks: scaling run {run} on {label}: a server is missing");
                continue;
            };
            let Some(t) = matrix.targets.iter().find(|t| t.label == *label) else {
                continue;
            };
            eprintln!("benchmarks: scaling on {label} (run {run} of {RUNS}, fresh servers)");
            mine.extend(bench(dlock, &t.url));
        }
    }
    let runs: Vec<(String, Value)> = reports
        .into_iter()
        .filter(|(_, r)| !r.is_empty())
        .map(|(label, r)| (label.to_owned(), combine(&r)))
        .collect();
    let mut held_rows = String::new();
    let mut waiter_rows = String::new();
    let mut stopped = String::new();
    let mut skipped = String::new();
    for (label, s) in &runs {
        let levels = s["held"].as_array().cloned().unwrap_or_default();
        let first = levels.first().and_then(|l| l["acquire"]["p50_us"].as_f64());
        for l in &levels {
            let growth = match (l["acquire"]["p50_us"].as_f64(), first) {
                (Some(p), Some(f)) if f > 0.0 => format!("{:.2}×", p / f),
                _ => "–".to_owned(),
            };
            let _ = writeln!(
                held_rows,
                "| {label} | {} | {} | {} | {} | {} | {growth} | {} | {} |",
                l["held"],
                l["runs"],
                num(&l["fill_seconds"]),
                p50_p99(&l["acquire"]),
                range(l),
                p50_p99(&l["release"]),
                l["rss_per_held_lock_bytes"]
                    .as_f64()
                    .map_or("–".to_owned(), |b| format!("{b:.0}")),
            );
        }
        let counted = s["requests_counted"].as_str();
        for l in s["waiters"].as_array().into_iter().flatten() {
            let requests = match (l["requests_per_grant"].as_f64(), counted) {
                (Some(r), Some(what)) => format!("{r:.2} {what}"),
                _ => "–".to_owned(),
            };
            let _ = writeln!(
                waiter_rows,
                "| {label} | {} | {} | {} | {} | {} | {} | {requests} | {} |",
                l["waiters"],
                l["runs"],
                num(&l["grants_per_sec"]),
                num(&l["handoffs_per_sec"]),
                p50_p99(&l["handoff"]),
                range(l),
                num(&l["client_cpu_us_per_grant"]),
            );
        }
        for (series, key) in [
            ("held names", "held_stopped"),
            ("waiters", "waiters_stopped"),
        ] {
            if let Some(why) = s[key].as_str() {
                let _ = writeln!(stopped, "- {label}, {series}: stopped {why}");
            }
        }
        for (series, list) in [("held names", "held"), ("waiters", "waiters")] {
            for l in s[list].as_array().into_iter().flatten() {
                if let (Some(n @ 1..), Some(first)) =
                    (l["skipped"].as_u64(), l["first_skipped"].as_str())
                {
                    let _ = writeln!(
                        skipped,
                        "- {label}, {} {series}: {n} over its runs (the first: {first})",
                        l[list]
                    );
                }
            }
        }
    }
    let plot_line = match draw(&runs, plot) {
        Ok(()) => format!(
            "![acquire p50 against names held; hand-off p50 against waiters]({})\n\n",
            plot.file_name()
                .map_or(PLOT.into(), |n| n.to_string_lossy())
        ),
        Err(e) => {
            eprintln!("benchmarks: no plot: {e}");
            format!("(no plot: {e})\n\n")
        }
    };
    let stopped = if stopped.is_empty() {
        String::new()
    } else {
        format!("Levels not reached:\n\n{stopped}\n")
    };
    let skipped = if skipped.is_empty() {
        String::new()
    } else {
        format!(
            "Cycles stepped over on an error that trying again may mend (not timed; \
             `dlock bench` ends a run on any other error):\n\n{skipped}\n"
        )
    };
    // Regenerated alone (`--only-scaling`) it may come from another machine than the
    // rest of the file: it names its own.
    let machine = xtask::cpu_model();
    format!(
        "{HEADING}\n\n\
         Measured on {machine} (this section is regenerated alone with `--only-scaling`, \
         so it names its machine): \
         `dlock bench --scenario scaling --cycles 1000 --duration 3s --scale-held \
         1,1000,100000 --scale-waiters 1,10,100,1000`, three runs per configuration below, \
         each on servers started for that run: each figure is the median of the runs that reached the level (*runs*; of two, the \
         lower), and *p50 range* the lowest and highest p50 among them. **Names \
         held:** one `Locker` takes N other locks (auto-renewed, 64 tasks), then times \
         1,000 acquire + release cycles of one more lock (a level counts only if every one \
         of its locks was still held after them); *× at 1* is the acquire's p50 \
         over its p50 with one other lock held; RSS per held lock is the client's resident \
         memory growth over the locks held (from 1,000 on, read after glibc's \
         `malloc_trim`). A session mode (PostgreSQL \
         advisory and row, MariaDB named and row) pins one connection per held lock, so \
         the server's connection limit bounds the names one process can hold there. \
         **Waiters:** W tasks wait on one name behind its holder (the hand-off run with \
         W + 1 tasks of one process for 3 s); grants count every acquisition, the \
         releaser's own re-takes included; hand-offs only grants to a different task, \
         their latency from release to that grant; requests per grant as the server counts \
         them, where it keeps a count the bench reads; client CPU per grant from \
         `getrusage`.\n\n\
         {plot_line}\
         | backend | names held | runs | time to take the level's new ones (s) | acquire p50 / p99 µs | acquire p50 range µs | × at 1 | release p50 / p99 µs | RSS per held lock (B) |\n\
         |---|---|---|---|---|---|---|---|---|\n{held_rows}\n\
         | backend | waiters | runs | grants/s | hand-offs/s | hand-off p50 / p99 µs | hand-off p50 range µs | requests per grant | client CPU per grant (µs) |\n\
         |---|---|---|---|---|---|---|---|---|\n{waiter_rows}\n{stopped}{skipped}"
    )
}

/// The font for the plot's text, registered once.
fn font() -> Result<(), String> {
    let bytes = FONTS
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .ok_or_else(|| format!("no font at {}", FONTS.join(" or ")))?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into()))
        .map_err(|_| "the font cannot be read".to_owned())
}

/// A series of (x, y) points per backend from `runs`.
type Series = Vec<(String, Vec<(f64, f64)>)>;

fn series(runs: &[(String, Value)], list: &str, x: &str, y: (&str, &str)) -> Series {
    runs.iter()
        .map(|(label, s)| {
            let points = s[list]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|l| Some((l[x].as_f64()?, l[y.0][y.1].as_f64()?)))
                // A level without the figure (no hand-off at all) has no point on a log axis.
                .filter(|(_, v)| *v > 0.0)
                .collect();
            (label.clone(), points)
        })
        .filter(|(_, p): &(String, Vec<(f64, f64)>)| !p.is_empty())
        .collect()
}

/// Two panels: acquire p50 against names held, hand-off p50 against waiters; both axes
/// logarithmic.
fn draw(runs: &[(String, Value)], path: &Path) -> Result<(), String> {
    font()?;
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let root = BitMapBackend::new(path, (1400, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (left, right) = root.split_horizontally(700);
    let panels = [
        (
            left,
            "acquire p50 (µs) with N other names held",
            "names held",
            series(runs, "held", "held", ("acquire", "p50_us")),
        ),
        (
            right,
            "hand-off p50 (µs) with W waiters on one name",
            "waiters",
            series(runs, "waiters", "waiters", ("handoff", "p50_us")),
        ),
    ];
    for (area, title, x_label, data) in panels {
        let max_x = data
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.0))
            .fold(10.0, f64::max);
        let max_y = data
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.1))
            .fold(10.0, f64::max);
        let min_y = data
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.1))
            .fold(max_y, f64::min);
        let mut chart = ChartBuilder::on(&area)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(
                (1.0..max_x * 1.5).log_scale(),
                (min_y / 2.0..max_y * 2.0).log_scale(),
            )
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc("µs")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()
            .map_err(|x| e(&x))?;
        for (i, (label, points)) in data.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|x| e(&x))?
                .label(label.clone())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 16, y)], color.stroke_width(3))
                });
            chart
                .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
                .map_err(|x| e(&x))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

/// The plot's path: next to the document `out`.
pub fn plot_path(out: &str) -> PathBuf {
    Path::new(out)
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join(PLOT)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three runs make one report: medians per level over the runs that reached it,
    /// integers kept, the p50 range, how often a series stopped, and the cycles the
    /// runs stepped over added up.
    #[test]
    fn runs_are_combined_into_medians_per_level() {
        let level = |held: u64, p50: u64, rss: f64| serde_json::json!({"held": held, "fill_seconds": 0.5, "acquire": {"p50_us": p50, "p99_us": p50 * 2}, "rss_per_held_lock_bytes": rss});
        let reports = [
            serde_json::json!({"held": [level(1, 100, 0.0), level(1000, 300, 900.0)], "waiters": [], "held_stopped": "at 100000 held: slow"}),
            serde_json::json!({"held": [level(1, 120, 0.0), level(1000, 200, 800.0), level(100_000, 250, 700.0)], "waiters": [], "requests_counted": "commands"}),
            serde_json::json!({"held": [level(1, 90, 0.0)], "waiters": [], "held_stopped": "at 1000 held: lost"}),
        ];
        let mut reports = reports;
        reports[1]["held"][0]["skipped"] = serde_json::json!({"count": 2, "first": "no quorum"});
        reports[2]["held"][0]["skipped"] = serde_json::json!({"count": 3, "first": "later"});
        let c = combine(&reports);
        let held = c["held"].as_array().expect("held levels");
        assert_eq!(held.len(), 3);
        assert_eq!(held[0]["held"], 1);
        assert_eq!(held[0]["runs"], 3);
        assert_eq!(held[0]["acquire"]["p50_us"], 100);
        assert_eq!(range(&held[0]), "90–120");
        assert_eq!(held[0]["skipped"], 5, "added up, not a median");
        assert_eq!(held[0]["first_skipped"], "no quorum");
        assert_eq!(held[1]["skipped"], 0);
        // Two runs reached 1,000: the lower of the two.
        assert_eq!(held[1]["runs"], 2);
        assert_eq!(held[1]["acquire"]["p50_us"], 200);
        assert_eq!(held[1]["acquire"]["p99_us"], 400);
        assert_eq!(held[1]["rss_per_held_lock_bytes"], 800.0);
        assert_eq!(held[2]["runs"], 1);
        assert_eq!(held[2]["held"], 100_000);
        assert_eq!(c["held_stopped"], "in 2 of 3 runs: at 100000 held: slow");
        assert!(c.get("waiters_stopped").is_none());
        assert_eq!(c["requests_counted"], "commands");
    }

    /// The plot is drawn from reports as `dlock bench --scenario scaling --json` writes
    /// them: series of several levels, a backend with one level only, and a level
    /// without a hand-off (p50 0, which a log axis cannot show, is left out).
    #[test]
    fn the_plot_is_drawn_from_scaling_reports() {
        let level =
            |held: u64, p50: u64| serde_json::json!({"held": held, "acquire": {"p50_us": p50}});
        let waiters =
            |w: u64, p50: u64| serde_json::json!({"waiters": w, "handoff": {"p50_us": p50}});
        let runs = vec![
            (
                "a".to_owned(),
                serde_json::json!({
                    "held": [level(1, 90), level(1000, 95), level(100_000, 120)],
                    "waiters": [waiters(1, 0), waiters(10, 100), waiters(1000, 140)],
                }),
            ),
            (
                "b".to_owned(),
                serde_json::json!({"held": [level(1, 500)], "waiters": []}),
            ),
        ];
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join(PLOT);
        draw(&runs, &path).expect("the plot (fonts-dejavu-core: scripts/install-servers)");
        let png = std::fs::read(&path).expect("the plot's file");
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        assert!(png.len() > 10_000, "an empty picture: {} bytes", png.len());
        let points = series(&runs, "waiters", "waiters", ("handoff", "p50_us"));
        assert_eq!(points[0].1, [(10.0, 100.0), (1000.0, 140.0)]);
    }
}
