//! `dlock status` and `dlock backends`.

use dlock::Locker;
use serde::Serialize;

use crate::args::{BackendsArgs, BreakArgs, ListArgs, StatusArgs};
use crate::exit::{self, Failure};
use crate::output::outln;

/// Who holds a lock, for a person: host and pid (or what is known), the note, the
/// owner, and how long the lease has left.
pub fn describe_holder(i: &dlock::LockInfo) -> String {
    let mut who = match (&i.metadata.host, i.metadata.pid) {
        (Some(h), Some(p)) => format!("{h} pid {p}"),
        (Some(h), None) => h.clone(),
        (None, Some(p)) => format!("pid {p}"),
        (None, None) => format!("owner {}", i.owner),
    };
    if let Some(note) = &i.metadata.note {
        who.push_str(&format!(" ({note})"));
    }
    match i.remaining {
        Some(d) => who.push_str(&format!(", lease {:.1}s left", d.as_secs_f64())),
        None => who.push_str(", for as long as its session lives"),
    }
    who
}

/// One lock's status as JSON: its name once, whether it is held, and what is known of
/// the holder.
fn status_json(name: &str, info: Option<&dlock::LockInfo>) -> serde_json::Value {
    let mut line = serde_json::Map::new();
    line.insert("name".into(), name.into());
    line.insert("held".into(), info.is_some().into());
    if let Some(serde_json::Value::Object(fields)) = info.and_then(|i| serde_json::to_value(i).ok())
    {
        for (k, v) in fields {
            if k != "name" {
                line.insert(k, v);
            }
        }
    }
    serde_json::Value::Object(line)
}

pub async fn status(args: StatusArgs) -> Result<i32, Failure> {
    let url = exit::resolve_url(args.url.url.as_deref())?;
    for name in &args.names {
        Locker::check_name(&url, name)?;
    }
    let locker = exit::connect(&url).await?;
    if args.semaphore || args.rwlock {
        return shared_status(&locker, &args).await;
    }
    let mut lines = Vec::new();
    for name in &args.names {
        let info = locker.inspect(name).await?;
        lines.push((name.clone(), info));
    }
    print_lines(&lines, args.json)?;
    Ok(held_code(&lines))
}

/// `dlock list [PREFIX]`: every held lock whose name begins with PREFIX, as `status`
/// shows it.
pub async fn list(args: ListArgs) -> Result<i32, Failure> {
    let url = exit::resolve_url(args.url.url.as_deref())?;
    let locker = exit::connect(&url).await?;
    let lines: Vec<(String, Option<dlock::LockInfo>)> = locker
        .list(&args.prefix)
        .await?
        .into_iter()
        .map(|i| (i.name.clone(), Some(i)))
        .collect();
    print_lines(&lines, args.json)?;
    Ok(0)
}

/// `dlock break NAME`: show the holder, ask (on a terminal, unless `--yes`), break.
pub async fn break_lock(args: BreakArgs) -> Result<i32, Failure> {
    use std::io::IsTerminal;
    let url = exit::resolve_url(args.url.url.as_deref())?;
    Locker::check_name(&url, &args.name)?;
    let locker = exit::connect(&url).await?;
    let name = &args.name;
    let Some(info) = locker.inspect(name).await? else {
        outln!("{name}: free, nothing to break");
        return Ok(exit::SOME_FREE);
    };
    outln!(
        "{name}: held by {} (owner {}), fencing token {}",
        describe_holder(&info),
        info.owner,
        info.fencing_token
    );
    if !args.yes {
        if !std::io::stdin().is_terminal() {
            return Err(Failure::new(
                exit::USAGE,
                "not breaking a lock without --yes off a terminal",
            ));
        }
        crate::output::errln!("Break it? Its holder may still be working. [y/N]");
        let mut answer = String::new();
        let _ = std::io::stdin().read_line(&mut answer);
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            outln!("{name}: not broken");
            return Ok(exit::SOME_FREE);
        }
    }
    if locker.break_lock(name, info.fencing_token).await? {
        outln!(
            "{name}: broken (was held by owner {}, token {}); the next holder gets a higher token",
            info.owner,
            info.fencing_token
        );
        Ok(0)
    } else {
        outln!("{name}: released or taken by someone else meanwhile; nothing broken");
        Ok(exit::SOME_FREE)
    }
}

/// `dlock status --semaphore|--rwlock NAME…`: every holder of each; exit 0 when each
/// has one, [`exit::SOME_FREE`] when one has none.
async fn shared_status(locker: &Locker, args: &StatusArgs) -> Result<i32, Failure> {
    let mut all = Vec::new();
    let mut every_held = true;
    for name in &args.names {
        let holders = if args.semaphore {
            // The permit count is each caller's: any number shows the holders.
            locker.semaphore(name, 1).holders().await?
        } else {
            locker.rwlock(name).holders().await?
        };
        every_held &= !holders.is_empty();
        all.push((name, holders));
    }
    if args.json {
        let lines: Vec<serde_json::Value> = all
            .iter()
            .map(|(name, holders)| {
                serde_json::json!({ "name": name, "held": !holders.is_empty(), "holders": holders })
            })
            .collect();
        let text =
            serde_json::to_string_pretty(&lines).map_err(|e| Failure::internal(e.to_string()))?;
        outln!("{text}");
    } else {
        for (name, holders) in &all {
            let writes = holders
                .iter()
                .filter(|h| h.hold == Some(dlock::HoldKind::Write))
                .count();
            let summary = match (holders.len(), args.semaphore, writes) {
                (0, _, _) => "free".to_owned(),
                (n, true, _) => format!("{n} permit{} held", if n == 1 { "" } else { "s" }),
                (n, false, 0) => format!("read by {n}"),
                (_, false, _) => "written".to_owned(),
            };
            outln!("{name}: {summary}");
            for h in holders {
                let what = match h.hold {
                    Some(dlock::HoldKind::Read) => "read",
                    Some(dlock::HoldKind::Write) => "write",
                    _ => "permit",
                };
                outln!(
                    "  {what}, token {}: {} (owner {})",
                    h.fencing_token,
                    describe_holder(h),
                    h.owner
                );
            }
        }
    }
    Ok(if every_held { 0 } else { exit::SOME_FREE })
}

/// One line per lock (or one JSON array).
fn print_lines(lines: &[(String, Option<dlock::LockInfo>)], json: bool) -> Result<(), Failure> {
    if json {
        let all: Vec<serde_json::Value> = lines
            .iter()
            .map(|(name, info)| status_json(name, info.as_ref()))
            .collect();
        let text =
            serde_json::to_string_pretty(&all).map_err(|e| Failure::internal(e.to_string()))?;
        outln!("{text}");
        return Ok(());
    }
    for (name, info) in lines {
        match info {
            None => outln!("{name}: free"),
            Some(i) => {
                let token = if i.fencing_token == 0 {
                    "none".to_owned()
                } else {
                    i.fencing_token.to_string()
                };
                outln!(
                    "{name}: held by {} (owner {}, holds {}), fencing token {token}{}",
                    describe_holder(i),
                    i.owner,
                    i.holds,
                    i.waiters
                        .map(|w| format!(", {w} queued"))
                        .unwrap_or_default(),
                );
            }
        }
    }
    Ok(())
}

/// `dlock status`'s exit status, for scripts: 0 when every named lock is held,
/// [`exit::SOME_FREE`] when one is free.
fn held_code(lines: &[(String, Option<dlock::LockInfo>)]) -> i32 {
    if lines.iter().all(|(_, info)| info.is_some()) {
        0
    } else {
        exit::SOME_FREE
    }
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
        "{:<18} {:<10} {:<12} {:<5} {:<6} {:<8} {:<10} {:<17} description",
        "scheme",
        "available",
        "fencing",
        "fifo",
        "notify",
        "session",
        "reentrant",
        "also"
    );
    let also = |p: dlock::Primitives| {
        let mut offered = Vec::new();
        if p.semaphore {
            offered.push("semaphore");
        }
        if p.rwlock {
            offered.push("rwlock");
        }
        if offered.is_empty() {
            "-".to_owned()
        } else {
            offered.join(",")
        }
    };
    let yes = |b: bool| if b { "yes" } else { "no" };
    for l in &lines {
        match &l.capabilities {
            Some(c) => outln!(
                "{:<18} {:<10} {:<12} {:<5} {:<6} {:<8} {:<10} {:<17} {}",
                format!("{}://", l.scheme),
                yes(l.available),
                c.fencing.to_string(),
                yes(c.fifo),
                yes(c.native_wait),
                yes(c.session_bound),
                yes(c.reentrant),
                also(c.primitives),
                l.description
            ),
            None => outln!(
                "{:<18} {:<10} {:<12} {:<5} {:<6} {:<8} {:<10} {:<17} {}",
                format!("{}://", l.scheme),
                yes(l.available),
                "-",
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
