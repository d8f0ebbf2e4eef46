//! `dlock status` and `dlock backends`.

use dlock::Locker;
use serde::Serialize;

use crate::args::{BackendsArgs, StatusArgs};
use crate::exit::{self, Failure};
use crate::output::outln;

#[derive(Serialize)]
struct StatusLine {
    name: String,
    held: bool,
    #[serde(flatten)]
    info: Option<dlock::LockInfo>,
}

pub async fn status(args: StatusArgs) -> Result<i32, Failure> {
    let url = exit::resolve_url(args.url.url.as_deref())?;
    let locker = Locker::connect(&url).await?;
    let mut lines = Vec::new();
    for name in &args.names {
        let info = locker.inspect(name).await?;
        lines.push(StatusLine {
            name: name.clone(),
            held: info.is_some(),
            info,
        });
    }
    if args.json {
        let text =
            serde_json::to_string_pretty(&lines).map_err(|e| Failure::internal(e.to_string()))?;
        outln!("{text}");
        return Ok(0);
    }
    for line in &lines {
        match &line.info {
            None => outln!("{}: free", line.name),
            Some(i) => {
                let remaining = i.remaining.map_or_else(
                    || "unknown".to_owned(),
                    |d| format!("{:.1}s", d.as_secs_f64()),
                );
                let holder = match (&i.metadata.host, i.metadata.pid) {
                    (Some(h), Some(p)) => format!("{h} pid {p}"),
                    (Some(h), None) => h.clone(),
                    (None, Some(p)) => format!("pid {p}"),
                    (None, None) => "unknown".to_owned(),
                };
                outln!(
                    "{}: held by {holder} (owner {}, holds {}), fencing token {}, lease {remaining} left{}{}",
                    line.name,
                    i.owner,
                    i.holds,
                    i.fencing_token,
                    i.waiters
                        .map(|w| format!(", {w} queued"))
                        .unwrap_or_default(),
                    i.metadata
                        .note
                        .as_deref()
                        .map(|n| format!(" — {n}"))
                        .unwrap_or_default(),
                );
            }
        }
    }
    Ok(0)
}

#[derive(Serialize)]
struct BackendLine {
    scheme: &'static str,
    available: bool,
    feature: Option<&'static str>,
    description: &'static str,
    capabilities: Option<dlock::Capabilities>,
}

pub fn backends(args: &BackendsArgs) -> Result<i32, Failure> {
    let lines: Vec<BackendLine> = dlock::schemes()
        .into_iter()
        .map(|s| BackendLine {
            scheme: s.scheme,
            available: s.available,
            feature: s.feature,
            description: s.description,
            capabilities: s.capabilities,
        })
        .collect();
    if args.json {
        let text =
            serde_json::to_string_pretty(&lines).map_err(|e| Failure::internal(e.to_string()))?;
        outln!("{text}");
        return Ok(0);
    }
    outln!(
        "{:<18} {:<10} {:<12} {:<5} {:<6} {:<8} {:<10} description",
        "scheme",
        "available",
        "fencing",
        "fifo",
        "notify",
        "session",
        "reentrant"
    );
    let yes = |b: bool| if b { "yes" } else { "no" };
    for l in &lines {
        match &l.capabilities {
            Some(c) => outln!(
                "{:<18} {:<10} {:<12} {:<5} {:<6} {:<8} {:<10} {}",
                format!("{}://", l.scheme),
                yes(l.available),
                c.fencing.to_string(),
                yes(c.fifo),
                yes(c.native_wait),
                yes(c.session_bound),
                yes(c.reentrant),
                l.description
            ),
            None => outln!(
                "{:<18} {:<10} {:<12} {:<5} {:<6} {:<8} {:<10} {}",
                format!("{}://", l.scheme),
                yes(l.available),
                "-",
                "-",
                "-",
                "-",
                "-",
                l.description
            ),
        }
    }
    Ok(0)
}
