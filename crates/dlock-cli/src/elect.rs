//! `dlock elect` (a command run while leader: `dlock run` on the election's lock, the
//! value as the holder's note) and `dlock leader` (the leader, once or at every change).

use std::time::Duration;

use dlock::{Leader, Locker, Metadata};

use crate::args::{ElectArgs, LeaderArgs, RunArgs, UrlArg};
use crate::child::Reaper;
use crate::exit::{self, Failure};
use crate::output::outln;

/// How often `dlock leader --watch` looks.
const WATCH_EVERY: Duration = Duration::from_millis(100);

pub async fn elect(args: ElectArgs, reaper: Option<Reaper>) -> Result<i32, Failure> {
    let value = args.value.unwrap_or_else(|| {
        let me = Metadata::this_process();
        format!(
            "{}:{}",
            me.host.unwrap_or_else(|| "localhost".into()),
            me.pid.unwrap_or(0)
        )
    });
    crate::run::run(
        RunArgs {
            url: args.url,
            ttl: args.ttl,
            wait: args.wait,
            no_wait: false,
            fair: false,
            queue_entry_ttl: Duration::from_secs(5),
            owner: None,
            grace: args.grace,
            note: Some(value.clone()),
            also: Vec::new(),
            permits: None,
            read: false,
            write: false,
            campaign: Some(value),
            shell: args.shell,
            name: args.name,
            command: args.command,
        },
        reaper,
    )
    .await
}

/// One line about the leader (or its absence).
fn describe(name: &str, leader: Option<&Leader>) -> String {
    let Some(l) = leader else {
        return format!("{name}: no leader");
    };
    let term = if l.term == 0 {
        "none (a holder outside dlock)".to_owned()
    } else {
        l.term.to_string()
    };
    let mut line = format!("{name}: leader {:?}, term {term}", l.value);
    match (&l.metadata.host, l.metadata.pid) {
        (Some(h), Some(p)) => line.push_str(&format!(", {h} pid {p}")),
        (Some(h), None) => line.push_str(&format!(", {h}")),
        _ => line.push_str(&format!(", owner {}", l.owner)),
    }
    match l.remaining {
        Some(d) => line.push_str(&format!(", lease {:.1}s left", d.as_secs_f64())),
        None => line.push_str(", for as long as its session lives"),
    }
    line
}

/// `{"name": NAME, "leader": {value, term, owner, remaining_ms, metadata} | null}`.
fn json(name: &str, leader: Option<&Leader>) -> Result<String, Failure> {
    let leader = match leader {
        Some(l) => {
            let mut v = serde_json::to_value(l).map_err(|e| Failure::internal(e.to_string()))?;
            if let Some(fields) = v.as_object_mut() {
                fields.remove("name");
            }
            v
        }
        None => serde_json::Value::Null,
    };
    Ok(serde_json::json!({ "name": name, "leader": leader }).to_string())
}

/// `dlock leader NAME`: exit 0 when there is a leader, 1 when there is none; with
/// `--watch`, a line at every change until killed.
pub async fn leader(args: LeaderArgs) -> Result<i32, Failure> {
    let UrlArg { url } = &args.url;
    let url = exit::resolve_url(url.as_deref())?;
    Locker::check_name(&url, &args.name)?;
    let locker = exit::connect(&url).await?;
    let mut watch = locker.election(&args.name).watch(WATCH_EVERY);
    loop {
        let now = match watch.changed().await {
            Ok(now) => now,
            // Watching goes on through a passing error (said on stderr).
            Err(e) if args.watch => {
                crate::output::errln!("dlock: {}", dlock::url::redact_secrets(&e.to_string()));
                tokio::time::sleep(WATCH_EVERY * 10).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if args.json {
            outln!("{}", json(&args.name, now.as_ref())?);
        } else {
            outln!("{}", describe(&args.name, now.as_ref()));
        }
        if !args.watch {
            return Ok(if now.is_some() { 0 } else { exit::SOME_FREE });
        }
    }
}
