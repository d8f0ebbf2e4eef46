//! `dlock`: run a command under a distributed lock, inspect locks, demo and bench.

mod args;
mod bench;
mod check;
mod child;
mod demo;
mod elect;
mod exit;
mod fleet;
mod output;
mod run;
mod status;

use clap::Parser;

use crate::args::{Cli, Command, Deferred, DemoCommand};
use crate::exit::Failure;

fn main() {
    // Before anything else, while dlock is smallest (see `Reaper::early`).
    let reaper = child::Reaper::early(std::env::args_os().skip(1));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => exit::usage_error(&e),
    };
    init_logging(&cli.log);
    // One thread: a CLI has little to run in parallel, and every hand-off between
    // threads costs a wake-up (tens of µs on a VM) on the lock's critical path.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => exit::fail(&Failure::internal(format!("cannot start the runtime: {e}"))),
    };
    // Each command's future boxed: this one would otherwise be as large as the largest
    // (`check`, `bench`), on the stack of every short `dlock run`.
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Run(Deferred(a)) => Box::pin(run::run(a, reaper)).await,
            Command::Elect(Deferred(a)) => Box::pin(elect::elect(a, reaper)).await,
            Command::Leader(Deferred(a)) => Box::pin(elect::leader(a)).await,
            Command::Status(Deferred(a)) => Box::pin(status::status(a)).await,
            Command::List(Deferred(a)) => Box::pin(status::list(a)).await,
            Command::Break(Deferred(a)) => Box::pin(status::break_lock(a)).await,
            Command::Backends(Deferred(a)) => status::backends(&a),
            Command::Demo(DemoCommand::FlashSale(a)) => Box::pin(demo::flash_sale(a)).await,
            Command::Bench(Deferred(a)) => Box::pin(bench::bench(a)).await,
            Command::DemoWorker(Deferred(a)) => Box::pin(demo::worker(a)).await,
            Command::BenchWorker(Deferred(a)) => Box::pin(bench::worker(a)).await,
            Command::Check(Deferred(a)) => Box::pin(check::check(a)).await,
            Command::CheckWorker(Deferred(a)) => Box::pin(check::worker(a)).await,
            Command::Completions(Deferred(a)) => output::completions(a.shell),
            Command::Manpage => output::manpage(),
        }
    });
    // Do not wait for background tasks (a dropped guard's release is best effort and
    // the lease covers it); every path that matters released explicitly. Spawned tasks
    // are dropped at any shutdown; this one does not wait for idle blocking threads
    // either (joining them is a measurable part of a short `dlock run`).
    runtime.shutdown_background();
    match code {
        Ok(code) => std::process::exit(code),
        Err(failure) => exit::fail(&failure),
    }
}

/// Diagnostics on stderr; colour only on a terminal, and never with `NO_COLOR` set
/// (<https://no-color.org>).
fn init_logging(level: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .with_target(false)
        .init();
}
