//! Latency summaries and fairness.

use std::time::Duration;

use hdrhistogram::Histogram;

/// p50 / p99 / p99.9 / max of samples in microseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Latency {
    pub count: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

impl Latency {
    pub fn of(samples_us: &[u64]) -> Self {
        // Bounded (1 µs .. 1 h): `saturating_record` does not grow an auto-resizing one.
        let Ok(mut h) = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3) else {
            return Latency::default();
        };
        for &s in samples_us {
            h.saturating_record(s.max(1));
        }
        if h.is_empty() {
            return Latency::default();
        }
        Latency {
            count: h.len(),
            p50_us: h.value_at_quantile(0.50),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
        }
    }

    /// The percentiles of a scenario row: `None` without samples (a run with no
    /// hand-off has no latency).
    pub fn percentiles(&self) -> Percentiles {
        let some = |v: u64| (self.count > 0).then_some(v);
        Percentiles {
            p50_us: some(self.p50_us),
            p99_us: some(self.p99_us),
            p999_us: some(self.p999_us),
        }
    }
}

/// p50 / p99 / p99.9 in microseconds, each `None` where the run has no latency.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Percentiles {
    pub p50_us: Option<u64>,
    pub p99_us: Option<u64>,
    pub p999_us: Option<u64>,
}

/// Show a microsecond figure in a readable unit.
pub fn show_us(us: u64) -> String {
    if us >= 10_000 {
        format!("{:.1} ms", us as f64 / 1000.0)
    } else if us >= 1000 {
        format!("{:.2} ms", us as f64 / 1000.0)
    } else {
        format!("{us} µs")
    }
}

/// Jain's fairness index of per-worker counts: 1.0 when all are equal.
pub fn jain(counts: &[u64]) -> f64 {
    let n = counts.len() as f64;
    let sum: f64 = counts.iter().map(|&c| c as f64).sum();
    let squares: f64 = counts.iter().map(|&c| (c as f64) * (c as f64)).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (n * squares)
}

pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_bounds() {
        assert!((jain(&[5, 5, 5, 5]) - 1.0).abs() < 1e-9);
        assert!((jain(&[20, 0, 0, 0]) - 0.25).abs() < 1e-9);
    }

    #[test]
    fn latency_percentiles() {
        let samples: Vec<u64> = (1..=100).map(|v| v * 1000).collect();
        let l = Latency::of(&samples);
        assert_eq!(l.count, 100);
        assert!((49_900..=50_100).contains(&l.p50_us), "{l:?}");
        assert!((98_900..=99_100).contains(&l.p99_us), "{l:?}");
        assert!((99_800..=100_100).contains(&l.p999_us), "{l:?}");
        assert!((99_900..=100_100).contains(&l.max_us), "{l:?}");
    }
}
