//! Exit codes and one-line error reporting.

use dlock::Error;

use crate::output::errln;

/// `dlock check`: a hard guarantee broke; `dlock status`: a named lock is free.
pub const SOME_FREE: i32 = 1;
/// Usage error (bad flag, bad value, bad URL or name).
pub const USAGE: i32 = 2;
/// The lock service could not be reached (sysexits EX_UNAVAILABLE).
pub const UNAVAILABLE: i32 = 69;
/// Internal error (sysexits EX_SOFTWARE).
pub const INTERNAL: i32 = 70;
/// A file the user named could not be created (sysexits EX_CANTCREAT).
pub const CANT_CREATE: i32 = 73;
/// The server refused the credentials or the operation (sysexits EX_NOPERM).
pub const DENIED: i32 = 77;
/// The lock was not acquired in time (sysexits EX_TEMPFAIL).
pub const NOT_ACQUIRED: i32 = 75;
/// The lock was lost while the command ran.
pub const LOCK_LOST: i32 = 76;
/// The command exists but could not be executed (or could not be started with the
/// reaper that covers its process group).
pub const CANNOT_EXECUTE: i32 = 126;
/// The command was not found.
pub const NOT_FOUND: i32 = 127;
/// Standard output could not be written (e.g. a full disk): one line on stderr
/// (sysexits EX_IOERR).
pub const OUTPUT_FAILED: i32 = 74;
/// Standard output was closed by its reader (e.g. `dlock backends | head`): the program
/// ends quietly, with the status a shell shows for a process ended by SIGPIPE.
pub const OUTPUT_CLOSED: i32 = 141;

/// Every exit status `dlock` itself can end with (besides `dlock run`'s command's own,
/// and 0), with what it means: the one list the help text and the docs come from.
pub const CODES: [(i32, &str); 15] = [
    (
        SOME_FREE,
        "dlock check: a hard guarantee broke (see its report); dlock status: a named lock is free (0: all held); dlock break: nothing was broken (free, changed hands, or not confirmed); dlock leader: no leader",
    ),
    (
        USAGE,
        "usage error (bad flag, duration, URL or name; a primitive or mode the backend does not offer; --write by an owner that holds --read): one line on stderr",
    ),
    (UNAVAILABLE, "the lock service could not be reached"),
    (INTERNAL, "internal error (a bug): one line on stderr"),
    (
        CANT_CREATE,
        "a file named on the command line could not be created (dlock check --history)",
    ),
    (
        OUTPUT_FAILED,
        "standard output could not be written (e.g. a full disk)",
    ),
    (
        NOT_ACQUIRED,
        "the lock was not acquired in time (--wait ran out, or --no-wait and busy): the holder is named",
    ),
    (
        LOCK_LOST,
        "the lock was lost while the command ran, or renewals failed and the command was stopped before the lease could end",
    ),
    (
        DENIED,
        "the server refused the credentials or the operation (authentication, permission)",
    ),
    (
        CANNOT_EXECUTE,
        "the command could not be executed; or, off a terminal, dlock's reaper (which ends the command's process group if dlock dies) could not be started or was gone, and the command was not run",
    ),
    (NOT_FOUND, "the command was not found"),
    (
        129,
        "dlock run: SIGHUP while waiting for the lock (nothing was run)",
    ),
    (
        130,
        "dlock run: SIGINT while waiting for the lock (nothing was run)",
    ),
    (
        143,
        "dlock run: SIGTERM while waiting for the lock (nothing was run)",
    ),
    (
        OUTPUT_CLOSED,
        "standard output was closed by its reader (e.g. piped into head): ends quietly",
    ),
];

/// The exit statuses, for `--help`.
pub fn codes_help() -> String {
    let mut text = String::from(
        "Exit status: 0 on success; for `run`, the command's own (128 + N if it died of signal N). Otherwise:",
    );
    for (code, meaning) in CODES {
        text.push_str(&format!("\n  {code:>3}  {meaning}"));
    }
    text
}

/// A failure with the exit code it maps to and a one-line message.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

impl Failure {
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(INTERNAL, message)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::InvalidUrl { .. }
            | Error::InvalidName { .. }
            | Error::InvalidOption { .. }
            | Error::BackendNotEnabled { .. }
            | Error::Unsupported(_)
            | Error::UpgradeRefused { .. } => USAGE,
            Error::Timeout { .. } => NOT_ACQUIRED,
            Error::LockLost { .. } => LOCK_LOST,
            Error::Connection { .. } | Error::NoQuorum { .. } => UNAVAILABLE,
            Error::Denied { .. } => DENIED,
            _ => INTERNAL,
        };
        // Error messages are redacted by the library; redact once more for anything
        // that came from elsewhere.
        Failure::new(code, dlock::url::redact_secrets(&e.to_string()))
    }
}

/// Print `dlock: <message>` on one line and exit with the failure's code.
pub fn fail(failure: &Failure) -> ! {
    let line = failure.message.lines().next().unwrap_or("failed");
    errln!("dlock: {line}");
    std::process::exit(failure.code)
}

/// Report a clap error: help and version print as usual; anything else becomes one
/// line and exit status 2.
pub fn usage_error(e: &clap::Error) -> ! {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            std::process::exit(if e.use_stderr() { USAGE } else { 0 });
        }
        _ => {
            let rendered = e.render().to_string();
            let mut lines = rendered.lines().filter(|l| !l.trim().is_empty());
            let mut first = lines
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ")
                .to_owned();
            // "the following required arguments were not provided:" names them below.
            if first.ends_with(':')
                && let Some(next) = lines.next()
            {
                first = format!("{first} {}", next.trim());
            }
            // A value outside a fixed set: say which values there are, on the line.
            let values = rendered
                .lines()
                .find_map(|l| l.trim().strip_prefix("[possible values: "))
                .map(|v| format!("; possible values: {}", v.trim_end_matches(']')))
                .unwrap_or_default();
            errln!("dlock: {first}{values} (see dlock --help)");
            std::process::exit(USAGE)
        }
    }
}

/// The URL to use: the flag, else `$DLOCK_URL`, else an SQLite file in the user's state
/// directory (created on first use).
pub fn resolve_url(flag: Option<&str>) -> Result<String, Failure> {
    if let Some(u) = flag {
        return Ok(u.to_owned());
    }
    if let Ok(u) = std::env::var("DLOCK_URL")
        && !u.is_empty()
    {
        return Ok(u);
    }
    let base = dirs::state_dir()
        .or_else(dirs::data_local_dir)
        .or_else(|| dirs::home_dir().map(|h| h.join(".local/state")))
        .ok_or_else(|| {
            Failure::new(
                USAGE,
                "no --url, no $DLOCK_URL and no state directory to put the default SQLite file in",
            )
        })?;
    let dir = base.join("dlock");
    std::fs::create_dir_all(&dir)
        .map_err(|e| Failure::new(UNAVAILABLE, format!("cannot create {}: {e}", dir.display())))?;
    Ok(format!("sqlite://{}", dir.join("locks.db").display()))
}

/// Connect to `url` for one command. On SQLite the WAL is kept short
/// ([`dlock::sqlite::SHORT_LIVED_WAL_PAGES`], unless the URL sets
/// `wal_autocheckpoint`): a process that opens the file while no other has it open
/// rebuilds SQLite's WAL index from the whole WAL, and a command-line run is such a
/// process every time.
///
/// # Errors
/// As [`dlock::Locker::connect`].
pub async fn connect(url: &str) -> Result<dlock::Locker, Failure> {
    let mut parsed = dlock::url::ConnectUrl::parse(url)?;
    if parsed.scheme() == "sqlite" {
        let pages = dlock::sqlite::SHORT_LIVED_WAL_PAGES.to_string();
        parsed.default_param("wal_autocheckpoint", &pages);
    }
    Ok(dlock::Locker::with_options(parsed).await?)
}

/// The URL for a self-contained run (demo, bench): the flag, else `$DLOCK_URL`, else a
/// fresh SQLite file `file` in `dir` (so the run never touches the user's locks).
pub fn scratch_url(flag: Option<&str>, dir: &std::path::Path, file: &str) -> String {
    flag.map(str::to_owned)
        .or_else(|| std::env::var("DLOCK_URL").ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| format!("sqlite://{}", dir.join(file).display()))
}
