//! Command-line grammar (clap).

use std::time::Duration;

use clap::{ArgMatches, Args, FromArgMatches, Parser, Subcommand, ValueEnum};

/// Parse a duration flag (`500ms`, `30s`, `2m`).
fn duration(text: &str) -> Result<Duration, String> {
    dlock::url::parse_duration("duration", text).map_err(|e| match e {
        dlock::Error::InvalidOption { reason, .. } => reason,
        other => other.to_string(),
    })
}

/// Parse `--wait`: a duration, or bare seconds as flock's `-w 5` takes them (`5`,
/// `0.5`). Only this flag reads a bare number; every other duration needs its unit.
fn wait_duration(text: &str) -> Result<Duration, String> {
    let bare = !text.is_empty() && text.chars().all(|c| c.is_ascii_digit() || c == '.');
    if bare {
        return text
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s <= 1e9)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| format!("{text:?} is not a number of seconds"));
    }
    duration(text)
}

/// Parse `--log`: a level (`off`, `error`, `warn`, `info`, `debug`, `trace`) or a
/// tracing filter with targets (`dlock=debug,sqlx=warn`). A lone word that is not a
/// level is refused (it would silently mean "trace for a target of that name").
fn log_filter(text: &str) -> Result<String, String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let lower = text.to_ascii_lowercase();
    if LEVELS.contains(&lower.as_str()) {
        return Ok(lower);
    }
    if text.contains('=') && tracing_subscriber::EnvFilter::try_new(text).is_ok() {
        return Ok(text.to_owned());
    }
    Err(format!(
        "{text:?} is not a log level ({}) or a filter like dlock=debug",
        LEVELS.join(", ")
    ))
}

/// Parse a lease flag: a duration within dlock's accepted TTL range.
fn ttl(text: &str) -> Result<Duration, String> {
    let d = duration(text)?;
    dlock::LockOptions::new()
        .ttl(d)
        .validate()
        .map_err(|e| match e {
            dlock::Error::InvalidOption { reason, .. } => reason,
            other => other.to_string(),
        })?;
    Ok(d)
}

/// Distributed locks over the servers you already run.
#[derive(Debug, Parser)]
#[command(
    name = "dlock",
    version,
    about,
    long_about = None,
    propagate_version = true,
    after_help = crate::exit::codes_help()
)]
pub struct Cli {
    /// Log level for dlock's own diagnostics (off, error, warn, info, debug, trace, or
    /// a filter such as dlock=debug); coloured only on a terminal, never with NO_COLOR.
    #[arg(long, global = true, default_value = "warn", env = "DLOCK_LOG", value_parser = log_filter)]
    pub log: String,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// A subcommand's arguments, built only when that subcommand is the one given: clap
/// otherwise builds every subcommand's arguments (`bench` and `check` have dozens) on
/// every start, which is part of each short `dlock run` (BENCHMARKS.md, the command
/// line). Help, completions and the manual page build them all, as before.
#[derive(Debug)]
pub struct Deferred<T>(pub T);

impl<T: Args> Args for Deferred<T> {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        cmd.defer(augment_later::<T>)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        cmd.defer(augment_later_for_update::<T>)
    }

    fn group_id() -> Option<clap::Id> {
        T::group_id()
    }
}

/// `T`'s arguments, added when the subcommand is built.
fn augment_later<T: Args>(cmd: clap::Command) -> clap::Command {
    keeping_about(cmd, T::augment_args)
}

/// [`augment_later`] for an update.
fn augment_later_for_update<T: Args>(cmd: clap::Command) -> clap::Command {
    keeping_about(cmd, T::augment_args_for_update)
}

/// `augment(cmd)`, the subcommand keeping the description it had (the variant's doc
/// comment, set before): added at once, the struct's own would have come first and
/// been replaced by it.
fn keeping_about(cmd: clap::Command, augment: fn(clap::Command) -> clap::Command) -> clap::Command {
    use clap::builder::Resettable;
    let text = |t: Option<&clap::builder::StyledStr>| {
        t.map_or(Resettable::Reset, |t| Resettable::Value(t.clone()))
    };
    let (about, long_about) = (text(cmd.get_about()), text(cmd.get_long_about()));
    augment(cmd).about(about).long_about(long_about)
}

impl<T: FromArgMatches> FromArgMatches for Deferred<T> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        T::from_arg_matches(matches).map(Deferred)
    }

    fn from_arg_matches_mut(matches: &mut ArgMatches) -> Result<Self, clap::Error> {
        T::from_arg_matches_mut(matches).map(Deferred)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        self.0.update_from_arg_matches(matches)
    }

    fn update_from_arg_matches_mut(&mut self, matches: &mut ArgMatches) -> Result<(), clap::Error> {
        self.0.update_from_arg_matches_mut(matches)
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command while holding a lock.
    Run(Deferred<RunArgs>),
    /// Campaign for leadership of an election and run a command while leader (stopped
    /// when leadership is lost).
    Elect(Deferred<ElectArgs>),
    /// Show an election's leader (value, term, holder), once or at every change.
    Leader(Deferred<LeaderArgs>),
    /// Show who holds locks.
    Status(Deferred<StatusArgs>),
    /// Force a stuck lock free (an operator's tool): its holder loses it at its next
    /// renewal and the next holder gets a higher fencing token.
    Break(Deferred<BreakArgs>),
    /// List every held lock (whose name begins with PREFIX): every backend but Redis
    /// and Redlock, which say they cannot.
    List(Deferred<ListArgs>),
    /// List the backends this build knows and what each guarantees.
    Backends(Deferred<BackendsArgs>),
    /// Demonstrations of what a lock prevents.
    #[command(subcommand)]
    Demo(DemoCommand),
    /// Measure lock throughput and latency on a backend.
    Bench(Deferred<BenchArgs>),
    /// Internal: one worker process of `demo flash-sale`.
    #[command(hide = true)]
    DemoWorker(Deferred<DemoWorkerArgs>),
    /// Internal: one worker process of `bench`.
    #[command(hide = true)]
    BenchWorker(Deferred<BenchWorkerArgs>),
    /// Prove what a backend guarantees: workers update a fenced store under the lock
    /// while faults are injected; prints overlaps, stale operations, token order,
    /// recovery times; exits 1 if a hard guarantee was broken.
    Check(Deferred<CheckArgs>),
    /// Internal: one worker process of `check`.
    #[command(hide = true)]
    CheckWorker(Deferred<CheckWorkerArgs>),
    /// Print a shell completion script (e.g. `dlock completions bash >
    /// /etc/bash_completion.d/dlock`).
    Completions(Deferred<CompletionsArgs>),
    /// Print the manual page, in roff (e.g. `dlock manpage > dlock.1; man ./dlock.1`).
    Manpage,
}

/// `dlock completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell.
    pub shell: clap_complete::Shell,
}

/// The fault `dlock check` injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CheckFault {
    /// No fault: the lock alone.
    None,
    /// SIGKILL a holder inside its critical section.
    KillHolder,
    /// SIGSTOP a holder inside its critical section for TTL + 0.5 s, then SIGCONT (the
    /// garbage-collection pause): it resumes with a stale token.
    PauseHolder,
    /// SIGSTOP the lock server (`--server-pid`, a process on this machine) for TTL + 1 s
    /// a third of the way into the run, then SIGCONT.
    PauseServer,
    /// SIGKILL the lock server (`--server-pid`) and its child processes a third of the
    /// way into the run; something else must start it again (systemd, a supervisor,
    /// the testkit): with persistence the lock state survives, without it does not.
    RestartServer,
    /// Workers reach the server through a loopback proxy that goes silent for TTL + 1 s
    /// a third of the way into the run, then resets its connections (single-host URLs).
    Partition,
    /// The same proxy adds 100 ms each way for TTL + 1 s.
    Latency,
    /// The same proxy, for TTL + 1 s, repeatedly drops the server's replies for a few
    /// milliseconds and then resets every connection: requests that ran on the server
    /// lose their answers mid-acquire and mid-release.
    Reset,
}

/// What each `dlock check` worker process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CheckWorkload {
    /// One task per process, a fresh owner per acquisition, waiting up to 30 s.
    Single,
    /// `--tasks` tasks per process on one locker, two owners shared among them (and
    /// fresh ones), leases of ½, 1 and 2 × TTL with and without renewal, short waits,
    /// `try_lock`, cancelled waits, and re-entries that outlive their outer hold.
    Crowd,
}

/// What `dlock check` workers take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CheckPrimitive {
    /// The lock.
    Lock,
    /// Leadership (`Election::campaign`, resigned after each critical section).
    Election,
    /// A permit of a semaphore of `--permits`: at most that many inside at once.
    Semaphore,
    /// A read (two in three) or a write of a read-write lock: writers alone.
    Rwlock,
}

impl CheckPrimitive {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            CheckPrimitive::Lock => "lock",
            CheckPrimitive::Election => "election",
            CheckPrimitive::Semaphore => "semaphore",
            CheckPrimitive::Rwlock => "rwlock",
        }
    }
}

impl CheckWorkload {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            CheckWorkload::Single => "single",
            CheckWorkload::Crowd => "crowd",
        }
    }
}

impl CheckFault {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            CheckFault::None => "none",
            CheckFault::KillHolder => "kill-holder",
            CheckFault::PauseHolder => "pause-holder",
            CheckFault::PauseServer => "pause-server",
            CheckFault::RestartServer => "restart-server",
            CheckFault::Partition => "partition",
            CheckFault::Latency => "latency",
            CheckFault::Reset => "reset",
        }
    }
}

/// `dlock check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Lock service URL [default: $DLOCK_URL, else a fresh SQLite file in a temp dir].
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// Worker processes.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
    /// Critical sections in all (shared among the workers).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub ops: u32,
    /// The fault to inject.
    #[arg(long, value_enum, default_value = "none")]
    pub fault: CheckFault,
    /// What each worker process does.
    #[arg(long, value_enum, default_value = "single")]
    pub workload: CheckWorkload,
    /// What the workers take (`--workload single` only for anything but the lock).
    #[arg(long, value_enum, default_value = "lock")]
    pub primitive: CheckPrimitive,
    /// The semaphore's permits (`--primitive semaphore`).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub permits: u32,
    /// Tasks per worker process (`--workload crowd`).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=63))]
    pub tasks: u32,
    /// How many faults (each on its own worker; at most workers − 1).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=63))]
    pub faults: u32,
    /// The store rejects operations with a token below the highest seen (the default).
    #[arg(long, conflicts_with = "unfenced")]
    pub fenced: bool,
    /// The store accepts everything: measures what the lock alone provides.
    #[arg(long)]
    pub unfenced: bool,
    /// Seed for where the faults fall.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Lease of each grant (renewed every third of it).
    #[arg(long, value_parser = ttl, default_value = "1s", value_name = "DURATION")]
    pub ttl: Duration,
    /// How long `--fault pause-holder` stops a holder [default: TTL + 0.5 s].
    #[arg(long, value_parser = duration, value_name = "DURATION")]
    pub pause: Option<Duration>,
    /// Time between the read and the write of a critical section.
    #[arg(long, value_parser = duration, default_value = "1ms", value_name = "DURATION")]
    pub think: Duration,
    /// Stop after this long whatever is left.
    #[arg(long, value_parser = duration, default_value = "120s", value_name = "DURATION")]
    pub max_time: Duration,
    /// The lock server's process id (for `--fault pause-server|restart-server`).
    #[arg(
        long,
        value_name = "PID",
        required_if_eq_any([("fault", "pause-server"), ("fault", "restart-server")])
    )]
    pub server_pid: Option<u32>,
    /// Where to write the history (JSONL) [default: a file in the temp dir].
    #[arg(long, value_name = "FILE")]
    pub history: Option<std::path::PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `dlock check-worker` (internal).
#[derive(Debug, Args)]
pub struct CheckWorkerArgs {
    #[arg(long)]
    pub url: String,
    #[arg(long)]
    pub store: String,
    #[arg(long)]
    pub lock_name: String,
    #[arg(long)]
    pub worker: u32,
    #[arg(long)]
    pub ops: u32,
    #[arg(long, value_parser = ttl)]
    pub ttl: Duration,
    #[arg(long, value_parser = duration)]
    pub think: Duration,
    #[arg(long)]
    pub fault_at: Option<u64>,
    /// At the fault: wait to be killed (else stop itself).
    #[arg(long)]
    pub kill_me: bool,
    /// Run the crowd workload with this many tasks (0: the single workload).
    #[arg(long, default_value_t = 0)]
    pub tasks: u32,
    /// Seed of the crowd's random choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// What to take.
    #[arg(long, value_enum, default_value = "lock")]
    pub primitive: CheckPrimitive,
    /// The semaphore's permits.
    #[arg(long, default_value_t = 3)]
    pub permits: u32,
}

/// Where the locks live.
#[derive(Debug, Args, Clone)]
pub struct UrlArg {
    /// Lock service URL [default: $DLOCK_URL, else an SQLite file in the user's state
    /// directory].
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
}

/// `dlock run`.
#[derive(Debug, Args)]
#[command(after_help = crate::exit::codes_help())]
pub struct RunArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Lease length; renewed every third of it while the command runs.
    #[arg(long, value_parser = ttl, default_value = "30s", value_name = "DURATION")]
    pub ttl: Duration,
    /// Wait at most this long for the lock (`10s`, or bare seconds as flock's `-w`:
    /// `10`) [default: wait as long as it takes].
    #[arg(short = 'w', long, value_parser = wait_duration, value_name = "DURATION", conflicts_with = "no_wait")]
    pub wait: Option<Duration>,
    /// Do not wait: exit 75 at once if the lock is busy.
    #[arg(long)]
    pub no_wait: bool,
    /// First come, first served among waiters.
    #[arg(long)]
    pub fair: bool,
    /// With --fair, where queue entries are leases (SQLite, Redis): how long a waiter
    /// that died while queued can hold up the ones behind it.
    #[arg(long, value_parser = duration, default_value = "5s", value_name = "DURATION", requires = "fair")]
    pub queue_entry_ttl: Duration,
    /// Owner token (reentrancy across processes): every process given the same token
    /// is the one holder, so each re-enters the other's hold and they run at once
    /// (with one fencing token), a run that died holding it included; default: a
    /// fresh random one.
    #[arg(long, value_name = "TOKEN")]
    pub owner: Option<String>,
    /// How long the command gets between SIGTERM and SIGKILL when the lock is in
    /// danger: while renewals fail, SIGTERM comes this long before the local deadline
    /// (at most when a renewal is overdue) and SIGKILL at the deadline; after a sudden
    /// loss, SIGKILL follows SIGTERM after this long.
    #[arg(long, value_parser = duration, default_value = "5s", value_name = "DURATION")]
    pub grace: Duration,
    /// Free text shown by `dlock status`.
    #[arg(long, value_name = "TEXT")]
    pub note: Option<String>,
    /// Hold this lock too (repeatable): all of them or none, taken in the names' byte
    /// order so overlapping sets never deadlock; each has its own token
    /// (`DLOCK_FENCING_TOKENS`).
    #[arg(long, value_name = "NAME")]
    pub also: Vec<String>,
    /// Take a permit of the semaphore NAME, which has N permits (at most N commands
    /// run at once under it; `DLOCK_FENCING_TOKEN` is the permit's token).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..), conflicts_with_all = ["also", "read", "write"])]
    pub permits: Option<u32>,
    /// Take a read hold of the read-write lock NAME (readers run together; a waiting
    /// writer goes first).
    #[arg(long, conflicts_with_all = ["also", "write"])]
    pub read: bool,
    /// Take the write hold of the read-write lock NAME (no reader and no other writer
    /// runs meanwhile).
    #[arg(long, conflicts_with_all = ["also"])]
    pub write: bool,
    /// Set by `dlock elect`: campaign with this value for the election NAME.
    #[arg(skip)]
    pub campaign: Option<String>,
    /// Run this shell command (`sh -c TEXT`) instead of CMD, as flock's `-c` does.
    #[arg(
        short = 'c',
        long = "command",
        value_name = "TEXT",
        conflicts_with = "command"
    )]
    pub shell: Option<String>,
    /// The lock's name (a name that begins with `-` goes after `--`:
    /// `dlock run -- -tmp CMD`).
    pub name: String,
    /// The command and its arguments, run directly (no shell); a `--` before it is
    /// optional: `dlock run NAME CMD ARGS...` and `dlock run NAME -- CMD ARGS...` are
    /// the same.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required_unless_present = "shell",
        value_name = "CMD"
    )]
    pub command: Vec<String>,
}

/// `dlock elect`.
#[derive(Debug, Args)]
#[command(after_help = crate::exit::codes_help())]
pub struct ElectArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// What observers see as the leader's value (`dlock leader`) [default: HOST:PID].
    #[arg(long, value_name = "TEXT")]
    pub value: Option<String>,
    /// Lease length of the leadership; renewed every third of it while the command
    /// runs (session-bound backends: the session's timeout bounds a dead leader).
    #[arg(long, value_parser = ttl, default_value = "30s", value_name = "DURATION")]
    pub ttl: Duration,
    /// Campaign at most this long (`10s`, or bare seconds) [default: as long as it
    /// takes].
    #[arg(short = 'w', long, value_parser = wait_duration, value_name = "DURATION")]
    pub wait: Option<Duration>,
    /// How long the command gets between SIGTERM and SIGKILL when leadership is lost
    /// (as `dlock run --grace`).
    #[arg(long, value_parser = duration, default_value = "5s", value_name = "DURATION")]
    pub grace: Duration,
    /// Run this shell command (`sh -c TEXT`) instead of CMD.
    #[arg(
        short = 'c',
        long = "command",
        value_name = "TEXT",
        conflicts_with = "command"
    )]
    pub shell: Option<String>,
    /// The election's name (the same as a lock's: the leader holds the lock NAME).
    pub name: String,
    /// The command and its arguments (a `--` before it is optional).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required_unless_present = "shell",
        value_name = "CMD"
    )]
    pub command: Vec<String>,
}

/// `dlock leader`.
#[derive(Debug, Args)]
pub struct LeaderArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Print JSON (one object per line) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Keep printing: a line at every change of leader (or to none), until killed.
    #[arg(long)]
    pub watch: bool,
    /// The election's name.
    pub name: String,
}

/// `dlock status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Print JSON (one array) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The names are semaphores: show every permit holder.
    #[arg(long, conflicts_with = "rwlock")]
    pub semaphore: bool,
    /// The names are read-write locks: show the readers or the writer.
    #[arg(long)]
    pub rwlock: bool,
    /// Lock names.
    #[arg(required = true)]
    pub names: Vec<String>,
}

/// `dlock break`.
#[derive(Debug, Args)]
pub struct BreakArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Do not ask (needed off a terminal).
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// The lock's name.
    pub name: String,
}

/// `dlock list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub url: UrlArg,
    /// Print JSON (one array) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Only names that begin with this.
    #[arg(default_value = "")]
    pub prefix: String,
}

/// `dlock backends`.
#[derive(Debug, Args)]
pub struct BackendsArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `dlock demo …`.
#[derive(Debug, Subcommand)]
pub enum DemoCommand {
    /// Worker processes sell from one stock with a racy read-check-write, first
    /// unprotected, then under dlock: the first oversells, the second sells exactly.
    FlashSale(FlashSaleArgs),
}

/// `dlock demo flash-sale`.
#[derive(Debug, Args)]
pub struct FlashSaleArgs {
    /// Lock service URL [default: $DLOCK_URL, else a fresh SQLite file in a temp dir].
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// Buyers in all (shared among the workers).
    #[arg(long, default_value_t = 800, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub buyers: u32,
    /// Items in stock.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub stock: u32,
    /// Worker processes.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub workers: u32,
    /// Time a buyer spends between reading the stock and writing it back.
    #[arg(long, value_parser = duration, default_value = "2ms", value_name = "DURATION")]
    pub think: Duration,
}

/// Which protection a demo worker uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Strategy {
    /// No protection at all.
    None,
    /// No lock: a version-checked write, retried on conflict.
    Optimistic,
    /// `SELECT … FOR UPDATE` on the stock row itself (database servers only).
    RowLock,
    /// A dlock lock around the read-check-write.
    Dlock,
}

impl Strategy {
    /// The name shown and passed to workers.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::Optimistic => "optimistic",
            Strategy::RowLock => "row-lock",
            Strategy::Dlock => "dlock",
        }
    }
}

/// `dlock demo-worker` (internal).
#[derive(Debug, Args)]
pub struct DemoWorkerArgs {
    #[arg(long)]
    pub url: String,
    /// An SQLite file path, or the SQL URL whose database holds the stock.
    #[arg(long)]
    pub inventory: String,
    #[arg(long, default_value_t = 1)]
    pub stock_id: i64,
    #[arg(long)]
    pub strategy: Strategy,
    #[arg(long)]
    pub buyers: u32,
    #[arg(long)]
    pub lock_name: String,
    #[arg(long, value_parser = duration)]
    pub think: Duration,
}

/// `dlock bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Lock service URL [default: $DLOCK_URL, else a fresh SQLite file in a temp dir].
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// Uncontended acquire+release cycles (one task, one lock).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub cycles: u32,
    /// Worker processes for the contended run (0 skips it).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(0..=256))]
    pub processes: u32,
    /// Length of each contended run.
    #[arg(long, value_parser = duration, default_value = "5s", value_name = "DURATION")]
    pub duration: Duration,
    /// Tasks cycling their own locks in parallel in the uncontended-parallel run (0 skips it).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub tasks: u32,
    /// Distinct locks to acquire and hold with automatic renewal (0 skips that run).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    pub hold: u64,
    /// How long to hold them.
    #[arg(long, value_parser = duration, default_value = "30s", value_name = "DURATION")]
    pub hold_for: Duration,
    /// Lease of the held locks (renewed every third of it) [default: --ttl].
    #[arg(long, value_parser = ttl, value_name = "DURATION")]
    pub hold_ttl: Option<Duration>,
    /// Tasks of this process contending for one lock in the hand-off run (0 skips it).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub waiters: u32,
    /// Run only these scenarios (repeat the flag or separate with commas) [default:
    /// uncontended, and each other scenario whose count is not 0].
    #[arg(long, value_enum, value_delimiter = ',', value_name = "NAME")]
    pub scenario: Vec<Scenario>,
    /// Distinct locks: in `parallel`, the tasks share this many (default one per task,
    /// so no contention); in `hold`, how many are held (default: --hold, else 100000).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub keys: Option<u64>,
    /// In `scaling`: how many other distinct locks are held while cycles are timed.
    #[arg(long, value_delimiter = ',', default_value = "1,1000,100000", value_name = "N,...",
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub scale_held: Vec<u64>,
    /// In `scaling`: how many tasks wait on one name behind its holder.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100,1000", value_name = "N,...",
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub scale_waiters: Vec<u32>,
    /// Lease of every lock the bench takes (the held locks: --hold-ttl if given).
    #[arg(long, value_parser = ttl, default_value = "30s", value_name = "DURATION")]
    pub ttl: Duration,
    /// Take every lock in fair (first come, first served) mode.
    #[arg(long)]
    pub fair: bool,
    /// What each cycle takes and gives back: the lock, or (uncontended and contended
    /// scenarios only) a permit, a read, a write or leadership.
    #[arg(long, value_enum, default_value = "lock", value_name = "PRIMITIVE")]
    pub primitive: BenchPrimitive,
    /// The semaphore's permits with `--primitive semaphore`.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub permits: u32,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// What a `dlock bench` cycle takes and gives back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchPrimitive {
    /// The lock (`lock` + `release`).
    Lock,
    /// A permit of a semaphore of `--permits` (`acquire` + `release`).
    Semaphore,
    /// A read of a read-write lock.
    Read,
    /// A write of a read-write lock.
    Write,
    /// Leadership (`campaign` + `resign`).
    Election,
}

impl BenchPrimitive {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            BenchPrimitive::Lock => "lock",
            BenchPrimitive::Semaphore => "semaphore",
            BenchPrimitive::Read => "read",
            BenchPrimitive::Write => "write",
            BenchPrimitive::Election => "election",
        }
    }
}

/// A `dlock bench` scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// One task cycling one lock, against the floor (always the first figure).
    Uncontended,
    /// --tasks tasks cycling their own locks (or --keys shared ones).
    Parallel,
    /// --processes worker processes on one lock.
    Contended,
    /// --waiters tasks of this process on one lock: real hand-offs.
    Handoff,
    /// --keys locks held with automatic renewal for --hold-for.
    Hold,
    /// The hand-off run with waiters that poll (`try_lock`, 10 ms sleep when busy)
    /// instead of waiting for a notification.
    Polling,
    /// How one lock's latency grows with --scale-held other locks held, and hand-offs
    /// with --scale-waiters waiters on one name (run only when named).
    Scaling,
}

/// `dlock bench-worker` (internal).
#[derive(Debug, Args)]
pub struct BenchWorkerArgs {
    #[arg(long)]
    pub url: String,
    #[arg(long)]
    pub lock_name: String,
    #[arg(long, value_parser = duration)]
    pub duration: Duration,
    #[arg(long)]
    pub max_cycles: u64,
    #[arg(long, value_parser = ttl, default_value = "30s")]
    pub ttl: Duration,
    #[arg(long, value_enum, default_value = "lock")]
    pub primitive: BenchPrimitive,
    #[arg(long, default_value_t = 3)]
    pub permits: u32,
}
