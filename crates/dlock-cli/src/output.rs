//! Writing to stdout and stderr without ever panicking (`println!` panics when the
//! output is gone). A closed stdout — the reader of a pipe went away, as with
//! `dlock backends | head` — ends the program quietly with [`exit::OUTPUT_CLOSED`];
//! any other write error (a full disk) ends it with one line on stderr and
//! [`exit::OUTPUT_FAILED`]. Messages to stderr that cannot be written are dropped.

use std::io::Write;

use crate::exit;

/// Print a line on stdout (see the module docs for what happens when that fails).
macro_rules! outln {
    () => { $crate::output::stdout_line(format_args!("")) };
    ($($arg:tt)*) => { $crate::output::stdout_line(format_args!($($arg)*)) };
}

/// Print a line on stderr; a failure to do so is ignored.
macro_rules! errln {
    ($($arg:tt)*) => { $crate::output::stderr_line(format_args!($($arg)*)) };
}

pub(crate) use {errln, outln};

pub fn stdout_line(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let written = writeln!(out, "{args}").and_then(|()| out.flush());
    drop(out);
    end_if_failed(written);
}

/// A write to stdout that failed ends the program (see the module docs).
fn end_if_failed(written: std::io::Result<()>) {
    if let Err(e) = written {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(exit::OUTPUT_CLOSED);
        }
        stderr_line(format_args!("dlock: cannot write the output: {e}"));
        std::process::exit(exit::OUTPUT_FAILED);
    }
}

pub fn stderr_line(args: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "{args}");
}

/// Write `bytes` to stdout, as [`stdout_line`] writes a line.
fn stdout_bytes(bytes: &[u8]) {
    let mut out = std::io::stdout().lock();
    let written = out.write_all(bytes).and_then(|()| out.flush());
    drop(out);
    end_if_failed(written);
}

/// `dlock completions SHELL`: the completion script, from the same definitions as
/// the parser.
pub fn completions(shell: clap_complete::Shell) -> Result<i32, exit::Failure> {
    let mut cmd = <crate::args::Cli as clap::CommandFactory>::command();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "dlock", &mut script);
    stdout_bytes(&script);
    Ok(0)
}

/// `dlock manpage`: dlock(1) in roff, from the same definitions as the parser.
pub fn manpage() -> Result<i32, exit::Failure> {
    let cmd = <crate::args::Cli as clap::CommandFactory>::command();
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd)
        .render(&mut page)
        .map_err(|e| exit::Failure::internal(format!("manual page: {e}")))?;
    stdout_bytes(&page);
    Ok(0)
}
