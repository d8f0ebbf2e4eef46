//! `dlock run`: hold a lock while a child command runs.

use std::process::Stdio;
use std::time::Duration;

use dlock::{LockOptions, Locker, Metadata, Owner, Wait};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};

use crate::args::RunArgs;
use crate::exit::{self, Failure};
use crate::output::errln;

/// How long a fair-mode or waiting acquisition may take to clean up after a signal.
const CLEANUP_GRACE: Duration = Duration::from_millis(300);

pub async fn run(args: RunArgs) -> Result<i32, Failure> {
    let url = exit::resolve_url(args.url.url.as_deref())?;
    let owner = match &args.owner {
        Some(o) => o.parse::<Owner>()?,
        None => Owner::random(),
    };
    let program = args.command.first().cloned().unwrap_or_default();
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
        .owner(owner.clone())
        .metadata(Metadata::this_process().with_note(note));

    let mut sigint = signal(SignalKind::interrupt()).map_err(sig_err)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(sig_err)?;
    let mut sighup = signal(SignalKind::hangup()).map_err(sig_err)?;

    let locker = Locker::connect(&url).await?;
    let acquire = locker.lock_with(&args.name, &opts);
    let guard = tokio::select! {
        r = acquire => r?,
        _ = sigint.recv() => return interrupted(130).await,
        _ = sigterm.recv() => return interrupted(143).await,
        _ = sighup.recv() => return interrupted(129).await,
    };

    let mut child = match tokio::process::Command::new(&program)
        .args(&args.command[1..])
        .env("DLOCK_NAME", &args.name)
        .env("DLOCK_OWNER", owner.as_str())
        .env("DLOCK_FENCING_TOKEN", guard.fencing_token().to_string())
        .stdin(Stdio::inherit())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            let _ = guard.release().await;
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
            return Err(Failure::new(code, format!("cannot run {program:?}: {e}")));
        }
    };
    let pid = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .map(Pid::from_raw);
    let send = |sig: Signal| {
        if let Some(pid) = pid {
            let _ = kill(pid, sig);
        }
    };

    let lost = guard.lost();
    tokio::pin!(lost);
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            _ = sigint.recv() => send(Signal::SIGINT),
            _ = sigterm.recv() => send(Signal::SIGTERM),
            _ = sighup.recv() => send(Signal::SIGHUP),
            err = &mut lost => {
                errln!("dlock: {err}; stopping {program:?} (SIGTERM, SIGKILL after {:?})", args.grace);
                send(Signal::SIGTERM);
                if tokio::time::timeout(args.grace, child.wait()).await.is_err() {
                    send(Signal::SIGKILL);
                    let _ = child.wait().await;
                }
                return Ok(exit::LOCK_LOST);
            }
        }
    };
    let status = status.map_err(|e| Failure::internal(format!("waiting for {program:?}: {e}")))?;
    if let Some(reason) = guard.loss_reason() {
        errln!(
            "dlock: lock {:?} was lost while {program:?} ran: {reason}",
            args.name
        );
        return Ok(exit::LOCK_LOST);
    }
    if let Err(e) = guard.release().await {
        if matches!(e, dlock::Error::LockLost { .. }) {
            errln!("dlock: {e}");
            return Ok(exit::LOCK_LOST);
        }
        tracing::warn!(error = %e, "release failed; the lease will free the lock");
    }
    Ok(child_code(status))
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
