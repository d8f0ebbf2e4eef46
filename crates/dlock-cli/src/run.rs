//! `dlock run`: hold a lock while a child command runs.
//!
//! The command must never run without the lock:
//! - it dies with dlock: the kernel sends it SIGKILL if dlock dies first
//!   (`PR_SET_PDEATHSIG`, set in the child before exec and checked against a parent
//!   that died before that);
//! - when renewals fail, it is stopped before the lease can end on the server: SIGTERM
//!   at the guard's local deadline minus `--grace` (or as soon as a renewal is overdue,
//!   when the lease is too short for the whole grace), SIGKILL at the deadline;
//! - when standard input is not a terminal (cron, systemd, CI), the command runs in a
//!   process group of its own: signals go to that group, and a small reaper process
//!   kills the whole group — the command's own children too — if dlock dies (a reaper
//!   that cannot be started, or is found gone when the command would start: the run
//!   ends with 126, the command never started; one killed while the command runs is
//!   replaced at once). On a terminal the command stays in dlock's process group (job control
//!   keeps working) and only the command itself is covered.
//!
//! SIGINT, SIGTERM and SIGHUP end a wait for the lock (130, 143, 129: nothing was run)
//! and, once the command runs, are passed on to it. One that was ignored when dlock
//! started (`nohup`, a non-interactive shell's `&`) stays ignored, for dlock and for
//! the command.

use std::time::Duration;

use dlock::{LockOptions, Locker, Metadata, MultiGuard, Owner, Wait};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;

use crate::args::RunArgs;
use crate::child::{self, Reaper};
use crate::exit::{self, Failure};
use crate::output::errln;

/// How long a fair-mode or waiting acquisition may take to clean up after a signal.
const CLEANUP_GRACE: Duration = Duration::from_millis(300);

/// Most time spent giving the lock back after the command was stopped for failing
/// renewals (the lease frees it anyway).
const STOPPED_RELEASE_LIMIT: Duration = Duration::from_secs(1);

/// `early`: the reaper `main` forked before anything else, if it did ([`Reaper::early`]).
pub async fn run(args: RunArgs, early: Option<Reaper>) -> Result<i32, Failure> {
    let url = exit::resolve_url(args.url.url.as_deref())?;
    let owner = match &args.owner {
        Some(o) => o.parse::<Owner>()?,
        None => Owner::random(),
    };
    let argv = command_line(&args);
    let program = argv.first().cloned().unwrap_or_default();
    let mut note = format!("dlock run {program}");
    if let Some(n) = &args.note {
        note = n.clone();
    }
    let wait = if args.no_wait {
        Wait::NoWait
    } else {
        args.wait.map_or(Wait::Forever, Wait::Timeout)
    };
    let opts = LockOptions::new()
        .ttl(args.ttl)
        .wait(wait)
        .fair(args.fair)
        .queue_entry_ttl(args.queue_entry_ttl)
        .owner(owner.clone())
        .metadata(Metadata::this_process().with_note(note));

    // Off a terminal the command gets a process group of its own, which a reaper
    // kills if dlock dies; `main` forked it first thing, or it is forked now, while
    // dlock is still one thread and small.
    let own_group = !nix::unistd::isatty(std::io::stdin()).unwrap_or(false);
    let mut reaper = if own_group {
        // Nothing would end what the command starts if dlock died: nothing runs.
        Some(early.map_or_else(Reaper::start, Ok).map_err(|e| {
            Failure::new(
                exit::CANNOT_EXECUTE,
                format!(
                    "cannot start the reaper that ends {program:?}'s process group if dlock dies: {e}"
                ),
            )
        })?)
    } else {
        // (Standard input became a terminal since `main` looked: nothing to watch.)
        if let Some(r) = early {
            r.done();
        }
        None
    };

    // A signal ignored when dlock started stays ignored (`nohup dlock run …`).
    let mut sigint = child::unless_ignored(SignalKind::interrupt()).map_err(sig_err)?;
    let mut sigterm = child::unless_ignored(SignalKind::terminate()).map_err(sig_err)?;
    let mut sighup = child::unless_ignored(SignalKind::hangup()).map_err(sig_err)?;

    // One lock, or with --also a set: all of them or none. A name the URL refuses is
    // refused before any I/O.
    let names: Vec<&String> = std::iter::once(&args.name).chain(&args.also).collect();
    for name in &names {
        Locker::check_name(&url, name)?;
    }
    let locker = exit::connect(&url).await?;
    let label = names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let acquire = async {
        if let Some(value) = &args.campaign {
            // A campaign has a fresh owner of its own (see `Election::campaign_with`).
            let election = locker.election(&args.name);
            let mut fresh = opts.clone();
            fresh.owner = None;
            let leadership = election.campaign_with(value, &fresh).await?;
            Ok(dlock::MultiGuard::from(leadership.into_guard()))
        } else if let Some(permits) = args.permits {
            let sem = locker.semaphore(&args.name, permits);
            sem.acquire_with(&opts).await.map(dlock::MultiGuard::from)
        } else if args.read {
            let rw = locker.rwlock(&args.name);
            rw.read_with(&opts).await.map(dlock::MultiGuard::from)
        } else if args.write {
            let rw = locker.rwlock(&args.name);
            rw.write_with(&opts).await.map(dlock::MultiGuard::from)
        } else {
            locker.lock_all(&names, &opts).await
        }
    };
    let guard = tokio::select! {
        r = acquire => match r {
            Ok(g) => g,
            Err(e @ dlock::Error::Timeout { .. }) => {
                let busy_name = match &e {
                    dlock::Error::Timeout { name, .. } => name.clone(),
                    _ => args.name.clone(),
                };
                if let Some(what) = primitive_label(&args) {
                    return Err(exit::Failure::new(exit::NOT_ACQUIRED, format!("{what}: {e}")));
                }
                return Err(busy(&locker, &busy_name, &e).await);
            }
            Err(e) => return Err(e.into()),
        },
        () = child::delivered(&mut sigint) => return interrupted(130).await,
        () = child::delivered(&mut sigterm) => return interrupted(143).await,
        () = child::delivered(&mut sighup) => return interrupted(129).await,
    };

    // The command is told the owner that holds: a campaign's own.
    let owner = match guard.guards() {
        [leading] if args.campaign.is_some() => leading.owner().clone(),
        _ => owner,
    };

    // A set is granted lock by lock: never start the command if one of them was lost
    // in the meantime.
    if let Some(reason) = guard.loss_reason() {
        let _ = tokio::time::timeout(STOPPED_RELEASE_LIMIT, guard.release()).await;
        errln!("dlock: lock {label} was lost before the command could start: {reason}");
        return Ok(exit::LOCK_LOST);
    }
    let program_os = std::ffi::OsString::from(&program);
    let rest: Vec<std::ffi::OsString> = argv
        .get(1..)
        .unwrap_or_default()
        .iter()
        .map(std::ffi::OsString::from)
        .collect();
    let env = [
        ("DLOCK_NAME", args.name.clone()),
        ("DLOCK_OWNER", owner.as_str().to_owned()),
        (
            "DLOCK_FENCING_TOKEN",
            guard.fencing_token(&args.name).unwrap_or(0).to_string(),
        ),
        ("DLOCK_FENCING_TOKENS", tokens_env(&guard)),
    ];
    // Every child's exit, the reaper's among them: one killed is replaced at once.
    let mut children = signal(SignalKind::child()).map_err(sig_err)?;
    let mut child = match child::spawn(&program_os, &rest, &env, own_group, reaper.as_ref()) {
        Ok(c) => c,
        Err(failed) => {
            // The child that failed may have announced its group: nothing to kill.
            let e = failed.release(reaper);
            let _ = guard.release().await;
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
            return Err(Failure::new(code, format!("cannot run {program:?}: {e}")));
        }
    };
    let pid = child.id();
    let target = if own_group {
        Target::Group(Pid::from_raw(pid))
    } else {
        Target::Process(Pid::from_raw(pid))
    };
    let lost = guard.lost();
    tokio::pin!(lost);
    let mut stopping: Option<Instant> = None;
    let outcome = loop {
        let check_at = stop_check_at(&guard, args.ttl, args.grace, stopping.is_some());
        tokio::select! {
            status = child.wait() => break Outcome::Exited(status),
            () = child::delivered(&mut sigint) => target.send(Signal::SIGINT),
            () = child::delivered(&mut sigterm) => target.send(Signal::SIGTERM),
            () = child::delivered(&mut sighup) => target.send(Signal::SIGHUP),
            _ = children.recv(), if reaper.is_some() => {
                if reaper.as_ref().is_some_and(Reaper::gone) {
                    reaper = match Reaper::replace(pid) {
                        Ok(r) => {
                            errln!("dlock: the reaper process was gone; a new one covers {program:?}'s process group");
                            Some(r)
                        }
                        Err(e) => {
                            errln!("dlock: the reaper process was gone and cannot be replaced ({e}): if dlock dies, what {program:?} started keeps running");
                            None
                        }
                    };
                }
            }
            () = tokio::time::sleep_until(check_at) => {
                if stopping.is_none() && renewals_failing(&guard, args.ttl, args.grace) {
                    let left = guard.deadline().saturating_duration_since(std::time::Instant::now());
                    errln!(
                        "dlock: renewals of {label} are failing; stopping {program:?} before the lease can end ({left:?} left: SIGTERM now, SIGKILL then)"
                    );
                    target.send(Signal::SIGTERM);
                    stopping = Some(Instant::now());
                }
            }
            err = &mut lost => {
                if stopping.is_some() {
                    // The deadline came: the lease may end on the server any moment.
                    target.send(Signal::SIGKILL);
                    let _ = child.wait().await;
                } else {
                    errln!("dlock: {err}; stopping {program:?} (SIGTERM, SIGKILL after {:?})", args.grace);
                    target.send(Signal::SIGTERM);
                    if tokio::time::timeout(args.grace, child.wait()).await.is_err() {
                        target.send(Signal::SIGKILL);
                        let _ = child.wait().await;
                    }
                }
                break Outcome::Lost;
            }
        }
    };
    let code = match outcome {
        Outcome::Lost => {
            // What the command left behind ran without the lock too.
            child.kill_group(reaper).await;
            // The set's other locks go back now, not at the end of their leases.
            let _ = tokio::time::timeout(STOPPED_RELEASE_LIMIT, guard.release()).await;
            return Ok(exit::LOCK_LOST);
        }
        Outcome::Exited(status) => {
            status.map_err(|e| Failure::internal(format!("waiting for {program:?}: {e}")))?
        }
    };
    if stopping.is_some() {
        // Stopped for failing renewals: the lock is as good as lost, and whatever the
        // command left running must stop too (its group, by the reaper).
        child.kill_group(reaper).await;
        let _ = tokio::time::timeout(STOPPED_RELEASE_LIMIT, guard.release()).await;
        errln!("dlock: {program:?} was stopped: the lock {label} could not be kept");
        return Ok(exit::LOCK_LOST);
    }
    if let Some(reason) = guard.loss_reason() {
        // What the command left behind ran without the lock too.
        child.kill_group(reaper).await;
        errln!("dlock: lock {label} was lost while {program:?} ran: {reason}");
        let _ = tokio::time::timeout(STOPPED_RELEASE_LIMIT, guard.release()).await;
        return Ok(exit::LOCK_LOST);
    }
    child.release(reaper);
    if let Err(e) = guard.release().await {
        if matches!(e, dlock::Error::LockLost { .. }) {
            errln!("dlock: {e}");
            return Ok(exit::LOCK_LOST);
        }
        tracing::warn!(error = %e, "release failed; the lease will free the lock");
    }
    Ok(child_code(code))
}

/// The command to run: `sh -c TEXT` for `-c TEXT`, else CMD — without the `--` that
/// may stand between NAME and CMD (`dlock run -- -tmp -- CMD` keeps it there after a
/// name that begins with `-`).
fn command_line(args: &RunArgs) -> Vec<String> {
    if let Some(text) = &args.shell {
        return vec!["sh".to_owned(), "-c".to_owned(), text.clone()];
    }
    match args.command.split_first() {
        Some((first, rest)) if first == "--" => rest.to_vec(),
        _ => args.command.clone(),
    }
}

/// `DLOCK_FENCING_TOKENS`: `NAME=TOKEN` for every lock held, one per line, in the
/// order they were taken (names hold no control character; a name may hold `=`, so
/// the token follows the last one).
fn tokens_env(guard: &MultiGuard) -> String {
    let mut out = String::new();
    for g in guard.guards() {
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&format!("{}={}", g.name(), g.fencing_token()));
    }
    out
}

enum Outcome {
    Exited(std::io::Result<std::process::ExitStatus>),
    Lost,
}

/// Where signals for the command go.
#[derive(Clone, Copy)]
enum Target {
    /// The command's own process group (it and everything it started).
    Group(Pid),
    /// The command alone (it shares dlock's process group on a terminal).
    Process(Pid),
}

impl Target {
    fn send(self, sig: Signal) {
        let _ = match self {
            Target::Group(g) => killpg(g, sig),
            Target::Process(p) => kill(p, sig),
        };
    }
}

/// When to look next whether renewals are failing: the instant the guard's remaining
/// lease falls to the stop threshold (re-checked, since renewals move the deadline).
fn stop_check_at(guard: &MultiGuard, ttl: Duration, grace: Duration, stopping: bool) -> Instant {
    if stopping {
        return Instant::now() + Duration::from_secs(3600);
    }
    let deadline = Instant::from_std(guard.deadline());
    deadline
        .checked_sub(stop_threshold(ttl, grace))
        .unwrap_or_else(Instant::now)
        .max(Instant::now() + Duration::from_millis(5))
}

/// How much lease may be left, at most, when the command gets SIGTERM: `grace`, but
/// never more than renewals that work would leave (two thirds of the TTL, renewed
/// every third, less a tenth of slack): a lease too short for the whole grace still
/// sends SIGTERM only once a renewal is overdue.
fn stop_threshold(ttl: Duration, grace: Duration) -> Duration {
    grace.min((ttl * 2 / 3).saturating_sub(ttl / 10))
}

fn renewals_failing(guard: &MultiGuard, ttl: Duration, grace: Duration) -> bool {
    guard.is_held()
        && guard
            .deadline()
            .saturating_duration_since(std::time::Instant::now())
            <= stop_threshold(ttl, grace)
}

/// The lock was busy (or the wait ran out): say who holds it and for how long.
async fn busy(locker: &Locker, name: &str, e: &dlock::Error) -> Failure {
    let waited = match e {
        dlock::Error::Timeout { waited, .. } => *waited,
        _ => Duration::ZERO,
    };
    let holder = match locker.inspect(name).await {
        Ok(Some(info)) => crate::status::describe_holder(&info),
        Ok(None) => "nobody now (it was released meanwhile)".to_owned(),
        Err(_) => "unknown (it cannot be inspected)".to_owned(),
    };
    let asked = if waited < Duration::from_millis(1) {
        "busy".to_owned()
    } else {
        format!("still busy after {waited:.1?}")
    };
    Failure::new(
        exit::NOT_ACQUIRED,
        format!("lock {name:?} is {asked}: held by {holder}"),
    )
}

/// What `dlock run` takes when it is not a lock: "a permit of semaphore …", … .
fn primitive_label(args: &RunArgs) -> Option<String> {
    let name = &args.name;
    if let Some(n) = args.permits {
        Some(format!(
            "no permit of semaphore {name:?} ({n} permits) came free"
        ))
    } else if args.read {
        Some(format!("no read of read-write lock {name:?}"))
    } else if args.write {
        Some(format!("no write of read-write lock {name:?}"))
    } else {
        None
    }
}

/// The shell convention: the exit code, or 128 + the signal that killed it.
fn child_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(exit::INTERNAL)
}

fn sig_err(e: std::io::Error) -> Failure {
    Failure::internal(format!("cannot install signal handlers: {e}"))
}

async fn interrupted(code: i32) -> Result<i32, Failure> {
    // The acquisition future was dropped; give its background cleanup (queue entry,
    // a grant that raced the signal) a moment to run before the process exits.
    tokio::time::sleep(CLEANUP_GRACE).await;
    Ok(code)
}
