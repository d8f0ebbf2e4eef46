//! The command `dlock run` starts, and the watcher that ends it if dlock dies.
//!
//! The command is started the way `posix_spawn` starts one — a child that shares
//! dlock's memory and runs only until `execve`, while the starting thread waits —
//! instead of a `fork`, which copies dlock's page tables and then makes every write of
//! dlock's fault until the child has exec'd (measured here: a fork-based start was
//! about a tenth of a whole `dlock run true`). Unlike `posix_spawn` it arms the parent
//! death signal in the child before the exec, which the command must never run
//! without.
//!
//! The [`Reaper`] is forked once, early, while dlock is one thread and small, and is
//! told the command's process group only once there is one.

use std::ffi::{CString, OsStr, OsString, c_int, c_void};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::signal::unix::{Signal, SignalKind, signal};

/// The child's stack while it runs before `execve` (it only makes system calls),
/// besides the guard page below it.
const STACK: usize = 64 * 1024;

/// A command started by [`spawn`].
#[derive(Debug)]
pub struct Child {
    pid: libc::pid_t,
    /// It leads a process group of its own (id: its pid).
    own_group: bool,
    sigchld: Signal,
    status: Option<ExitStatus>,
}

/// Everything the child needs, prepared before it starts: between `clone` and
/// `execve` it shares dlock's memory and may not allocate or take a lock.
struct Plan {
    /// The paths to try, in `PATH` order (one when the program names a path).
    candidates: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    /// `/bin/sh PATH ARG…` for a file without `#!` (`ENOEXEC`), as `execvp` runs it;
    /// the child writes the path it found into the second slot.
    sh_argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    own_group: bool,
    parent: libc::pid_t,
    /// The reaper's pipe: the child announces its process group there before it
    /// execs, so nothing the command starts can escape it (-1: no reaper).
    reaper: c_int,
    /// The `errno` of the step that failed in the child; [`NOT_REACHED`] until it
    /// tries to exec, 0 once it does.
    error: c_int,
}

/// `Plan::error` of a child that died before it tried to exec.
const NOT_REACHED: c_int = c_int::MIN;

/// `Plan::error` of a child that could not tell the reaper its group (the reaper is
/// gone: it was killed).
const NO_REAPER: c_int = c_int::MIN + 1;

/// The shell that runs a file without `#!`, as `execvp` does.
const SH: &std::ffi::CStr = c"/bin/sh";

/// Start `program` with `args`, dlock's environment plus `env`, standard streams
/// inherited: in a process group of its own when `own_group` (announced to `reaper`
/// before the exec), and killed by the kernel if dlock dies (`PR_SET_PDEATHSIG`,
/// checked against a parent that died before it was armed). The signal mask is
/// emptied and handled signals (and `SIGPIPE`) go back to their defaults, as
/// `std::process::Command` does; a file without `#!` runs through `/bin/sh`, as
/// `execvp` runs it.
///
/// # Errors
/// The command was not found or could not be executed (`errno` of the last try, as
/// `execvp` reports it), or the child could not be created, could not reach the
/// reaper (gone), or died before its exec. The reaper may have been told the child's
/// group, whose pid the child keeps taken until [`NotStarted::release`] tells the
/// reaper to leave it and only then collects it.
pub fn spawn(
    program: &OsStr,
    args: &[OsString],
    env: &[(&str, String)],
    own_group: bool,
    reaper: Option<&Reaper>,
) -> Result<Child, NotStarted> {
    if program.is_empty() {
        // execvp("") fails with ENOENT (each PATH directory would be tried as is).
        return Err(io::Error::from_raw_os_error(libc::ENOENT).into());
    }
    // Listening before the child exists: its exit cannot be missed.
    let sigchld = signal(SignalKind::child())?;
    let cstr = |bytes: Vec<u8>| {
        CString::new(bytes)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the command"))
    };
    let candidates = candidates(program)
        .into_iter()
        .map(|p| cstr(p.into_vec()))
        .collect::<io::Result<Vec<_>>>()?;
    let argv_owned = std::iter::once(program.to_owned())
        .chain(args.iter().cloned())
        .map(|a| cstr(a.into_vec()))
        .collect::<io::Result<Vec<_>>>()?;
    let mut env_owned = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (key, value) in std::env::vars_os() {
        if env.iter().any(|(k, _)| OsStr::new(k) == key) || !seen.insert(key.clone()) {
            continue;
        }
        let mut entry = key.into_vec();
        entry.push(b'=');
        entry.extend_from_slice(value.as_bytes());
        env_owned.push(cstr(entry)?);
    }
    for (key, value) in env {
        env_owned.push(cstr(format!("{key}={value}").into_bytes())?);
    }
    let null_terminated = |v: &[CString]| {
        v.iter()
            .map(|c| c.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect::<Vec<_>>()
    };
    let mut sh_argv = null_terminated(&argv_owned);
    sh_argv.insert(0, SH.as_ptr());
    let mut plan = Plan {
        candidates,
        argv: null_terminated(&argv_owned),
        sh_argv,
        envp: null_terminated(&env_owned),
        own_group,
        parent: nix::unistd::getpid().as_raw(),
        reaper: reaper.map_or(-1, |r| r.pipe.as_raw_fd()),
        error: NOT_REACHED,
    };
    let stack = Stack::new()?;
    // SAFETY: the child runs `child_main` on its own stack with `plan`, which outlives
    // it (CLONE_VFORK: this thread resumes only once the child exec'd or exited); all
    // signals are blocked around the clone so no handler of dlock's runs in the child
    // before it has reset the dispositions.
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&raw mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &raw const all, &raw mut old);
        let pid = libc::clone(
            child_main,
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&raw mut plan).cast::<c_void>(),
        );
        let clone_error = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &raw const old, std::ptr::null_mut());
        if pid < 0 {
            return Err(clone_error.into());
        }
        pid
    };
    drop(stack);
    // SAFETY: the child wrote `error` (if at all) before it exited; it is gone now.
    let error = unsafe { std::ptr::read_volatile(&raw const plan.error) };
    let mut child = Child {
        pid,
        own_group,
        sigchld,
        status: None,
    };
    if error != 0 {
        // The child ended without exec'ing: why. It stays uncollected (its pid, which
        // the reaper may know as a group, stays taken) until the reaper is told.
        let _ = child.exited(0);
        let error = if error == NOT_REACHED {
            io::Error::other("the child ended before it could exec")
        } else if error == NO_REAPER {
            io::Error::other(
                "dlock's reaper process (which ends the command's process group if \
                 dlock dies) is gone: not started without it",
            )
        } else {
            io::Error::from_raw_os_error(error)
        };
        return Err(NotStarted {
            error,
            child: Some(child),
        });
    }
    Ok(child)
}

/// Why [`spawn`] started no command; the child that failed, if there was one, is
/// collected by [`NotStarted::release`].
#[derive(Debug)]
pub struct NotStarted {
    error: io::Error,
    child: Option<Child>,
}

impl From<io::Error> for NotStarted {
    fn from(error: io::Error) -> Self {
        NotStarted { error, child: None }
    }
}

impl NotStarted {
    /// Tell the reaper (if any) to leave the child's group be, then collect the child:
    /// the cause.
    pub fn release(self, reaper: Option<Reaper>) -> io::Error {
        if let Some(r) = reaper {
            r.done();
        }
        if let Some(c) = self.child {
            c.collect();
        }
        self.error
    }
}

impl Child {
    /// The command's process id.
    pub fn id(&self) -> libc::pid_t {
        self.pid
    }

    /// Wait for the command to exit (its status is kept: a second wait returns it).
    /// The command is not collected: it stays a zombie, its pid (and so its process
    /// group's id) taken, until [`Child::release`] or [`Child::kill_group`] has dealt
    /// with the reaper. A pid collected earlier could go to a new process that makes
    /// it a group before the reaper's kill, or a signal forwarded here, lands.
    ///
    /// # Errors
    /// `waitid` failed.
    ///
    /// # Cancel safety
    /// Cancel-safe: the status is read only once the command has exited, and kept.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        loop {
            if let Some(status) = self.exited(libc::WNOHANG)? {
                return Ok(status);
            }
            if self.sigchld.recv().await.is_none() {
                return Err(io::Error::other("the SIGCHLD stream ended"));
            }
        }
    }

    /// The command is done with: tell the reaper (if any) to leave its group be, then
    /// collect it. Call once [`Child::wait`] has returned.
    pub fn release(self, reaper: Option<Reaper>) {
        if let Some(r) = reaper {
            r.done();
        }
        self.collect();
    }

    /// The lock is gone: kill what is left of the command's own process group (dlock
    /// itself, while the uncollected command keeps the group's id taken; the reaper,
    /// told at once, too), wait for the reaper to be gone (see [`Reaper::kill_now`]),
    /// then collect the command — or, if the reaper could not be made to go, leave it
    /// uncollected for as long as dlock lives, so a late kill of the reaper's still
    /// reaches no other group. Call once [`Child::wait`] has returned.
    pub async fn kill_group(self, reaper: Option<Reaper>) {
        if self.own_group {
            // SAFETY: kill has no memory effects; the group is the command's own (its
            // leader, exited or not, is not collected: the id is not reused).
            unsafe {
                libc::kill(-self.pid, libc::SIGKILL);
            }
        }
        let reaper_gone = match reaper {
            Some(r) => r.kill_now().await,
            None => true,
        };
        if reaper_gone {
            self.collect();
        }
    }

    /// Collect the exited command (its pid may then go to another process).
    fn collect(self) {
        if self.status.is_none() {
            // Not seen to exit: a blocking wait could hang; leave it to the end of dlock.
            return;
        }
        loop {
            let mut raw = 0;
            // SAFETY: waitpid on our own child, which has exited, with a valid pointer.
            let r = unsafe { libc::waitpid(self.pid, &raw mut raw, 0) };
            if r >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return;
            }
        }
    }

    /// The command's status once it has exited (`flags`: `WNOHANG` not to block),
    /// without collecting it (`WNOWAIT`).
    fn exited(&mut self, flags: c_int) -> io::Result<Option<ExitStatus>> {
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        loop {
            // SAFETY: an all-zero siginfo_t is valid; waitid on our own child with a
            // valid pointer.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            let r = unsafe {
                libc::waitid(
                    libc::P_PID,
                    libc::id_t::try_from(self.pid).unwrap_or(0),
                    &raw mut info,
                    libc::WEXITED | libc::WNOWAIT | flags,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            // SAFETY: waitid filled `info` (or left it zero: no child has exited).
            let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
            if pid == 0 {
                return Ok(None);
            }
            let status = ExitStatus::from_raw(wait_status(info.si_code, status));
            self.status = Some(status);
            return Ok(Some(status));
        }
    }
}

/// The `wait` status word of a child `waitid` reports ended with `code` (`CLD_*`) and
/// `status` (the exit code or the signal).
fn wait_status(code: c_int, status: c_int) -> c_int {
    match code {
        libc::CLD_KILLED => status & 0x7f,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        _ => (status & 0xff) << 8,
    }
}

/// Where `execvp` would look for `program`: the path itself when it holds a `/`, else
/// each directory of `PATH` (an empty one is the current directory; no `PATH`:
/// `/bin:/usr/bin`).
fn candidates(program: &OsStr) -> Vec<OsString> {
    if program.as_bytes().contains(&b'/') {
        return vec![program.to_owned()];
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| OsString::from("/bin:/usr/bin"));
    path.as_bytes()
        .split(|b| *b == b':')
        .map(|dir| {
            let mut full = if dir.is_empty() {
                b".".to_vec()
            } else {
                dir.to_vec()
            };
            full.push(b'/');
            full.extend_from_slice(program.as_bytes());
            OsString::from_vec(full)
        })
        .collect()
}

/// The child's life between `clone` and `execve`.
///
/// It shares dlock's memory (the starting thread is suspended until it execs or exits)
/// but has its own signal dispositions: only async-signal-safe calls, no allocation.
extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Plan` of `spawn`, alive and untouched by the suspended
    // parent thread; only async-signal-safe libc calls follow.
    unsafe {
        let plan = &mut *arg.cast::<Plan>();
        if plan.own_group && libc::setpgid(0, 0) != 0 {
            fail(plan);
        }
        if plan.reaper >= 0 {
            // Before anything of the command runs (SIGPIPE is still dlock's ignored
            // one here: a reaper gone gives EPIPE, not a signal). Without the reaper
            // nothing would end what the command starts if dlock died: no start.
            let group = libc::getpid().to_le_bytes();
            let written = libc::write(plan.reaper, group.as_ptr().cast(), group.len());
            if usize::try_from(written) != Ok(group.len()) {
                std::ptr::write_volatile(&raw mut plan.error, NO_REAPER);
                libc::_exit(127);
            }
        }
        // dlock's handlers must not run here: defaults for every handled signal (and
        // SIGPIPE, which Rust ignores), ignored ones stay ignored, as exec would keep.
        default_handlers(libc::SIGPIPE);
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
            fail(plan);
        }
        if libc::getppid() != plan.parent {
            // dlock died before the death signal was armed: it will never come.
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&raw mut empty);
        libc::pthread_sigmask(libc::SIG_SETMASK, &raw const empty, std::ptr::null_mut());
        std::ptr::write_volatile(&raw mut plan.error, 0);
        // execvp's search: a directory that cannot be searched or does not hold the
        // program moves on; "permission denied" is reported if nothing else worked; a
        // file without `#!` runs through /bin/sh; any other failure ends the search.
        let mut denied = false;
        for i in 0..plan.candidates.len() {
            let path = plan.candidates[i].as_ptr();
            libc::execve(path, plan.argv.as_ptr(), plan.envp.as_ptr());
            match *libc::__errno_location() {
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                libc::ENOEXEC => {
                    plan.sh_argv[1] = path;
                    libc::execve(SH.as_ptr(), plan.sh_argv.as_ptr(), plan.envp.as_ptr());
                    fail(plan);
                }
                _ => fail(plan),
            }
        }
        if denied {
            *libc::__errno_location() = libc::EACCES;
        } else if plan.candidates.is_empty() {
            *libc::__errno_location() = libc::ENOENT;
        }
        fail(plan)
    }
}

/// A signal `dlock run` acts on (forwarding it to the command, or giving up the wait),
/// or `None` when it was ignored when asked (`nohup`, a non-interactive shell's
/// background job): then it stays ignored, for dlock and for the command, as a shell
/// keeps a signal that was ignored on entry ignored even when a trap names it. Ask
/// before anything else in the process listens for the same signal.
///
/// # Errors
/// When the signal cannot be listened for.
pub fn unless_ignored(kind: SignalKind) -> io::Result<Option<Signal>> {
    if disposition(kind.as_raw_value()) == Some(libc::SIG_IGN) {
        return Ok(None);
    }
    signal(kind).map(Some)
}

/// `sig`'s current action (`SIG_IGN`, `SIG_DFL` or a handler), or `None` when it cannot
/// be read. Async-signal-safe (sigaction only), so a child before `execve` may call it.
fn disposition(sig: c_int) -> Option<libc::sighandler_t> {
    // SAFETY: sigaction with no new action only reads the disposition into `current`,
    // and an all-zero sigaction is a valid value of it.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(sig, std::ptr::null(), &raw mut current) == 0)
            .then_some(current.sa_sigaction)
    }
}

/// The next delivery of `signal`; never, for a signal [`unless_ignored`] left ignored.
pub async fn delivered(signal: &mut Option<Signal>) {
    match signal {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// Every signal with a handler (and `also`, unless 0) back to its default action;
/// ignored signals stay ignored.
///
/// # Safety
/// Async-signal-safe (sigaction only): for a child between fork or clone and exec.
unsafe fn default_handlers(also: c_int) {
    for sig in 1..65 {
        let Some(current) = disposition(sig) else {
            continue;
        };
        if sig == also || (current != libc::SIG_IGN && current != libc::SIG_DFL) {
            // SAFETY: sigaction sets one signal's disposition, nothing else.
            unsafe {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &raw const default, std::ptr::null_mut());
            }
        }
    }
}

/// Report `errno` to the suspended parent and end the child.
///
/// # Safety
/// Only in the child of [`spawn`], before `execve` succeeded.
unsafe fn fail(plan: &mut Plan) -> ! {
    // SAFETY: the parent reads `error` only after the child is gone.
    unsafe {
        std::ptr::write_volatile(&raw mut plan.error, *libc::__errno_location());
        libc::_exit(127)
    }
}

/// The child's stack: mapped for the start, with a guard page below it.
struct Stack {
    base: *mut c_void,
    len: usize,
}

impl Stack {
    fn new() -> io::Result<Self> {
        // SAFETY: sysconf has no preconditions; then a fresh private anonymous
        // mapping, owned by the returned value.
        unsafe {
            let page = usize::try_from(libc::sysconf(libc::_SC_PAGESIZE)).unwrap_or(4096);
            let len = STACK + page;
            let base = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let stack = Stack { base, len };
            // The lowest page faults instead of running into other memory.
            if libc::mprotect(base, page, libc::PROT_NONE) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(stack)
        }
    }

    /// The top (the stack grows down).
    fn top(&self) -> *mut c_void {
        // SAFETY: one past the end of the mapping, 16-byte aligned (page-aligned base
        // and length).
        unsafe { self.base.cast::<u8>().add(self.len).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used (the child exec'd or exited).
        unsafe {
            libc::munmap(self.base, self.len);
        }
    }
}

/// How long [`Reaper::kill_now`] waits for the reaper's kill: it takes microseconds;
/// a reaper that has not made it by then was stopped or starved (it is then killed).
const KILL_WAIT: Duration = Duration::from_secs(1);

/// A process that kills the command's process group if dlock dies: forked (no exec),
/// it waits on a pipe whose other end only dlock holds. It is told the group first
/// (4 bytes, by the command's child itself before its exec: [`spawn`]); then a byte
/// means "done, leave them", and the end of the pipe without one means dlock is gone.
/// The end of the pipe before a group: there is nothing to kill.
#[derive(Debug)]
pub struct Reaper {
    pipe: OwnedFd,
    pid: libc::pid_t,
}

impl Reaper {
    /// Fork the reaper now: call it early, while dlock is still one thread and its
    /// memory small (a fork copies the page tables, and each page dlock writes
    /// afterwards while the child lives is copied once more): see [`Reaper::early`].
    ///
    /// # Errors
    /// The pipe or the fork failed (`errno`): the command must not start without it.
    pub fn start() -> io::Result<Self> {
        Self::fork(None)
    }

    /// The reaper of a `dlock run` or `dlock elect` off a terminal, forked first thing
    /// in `main`, before the arguments are parsed, the runtime built or anything
    /// allocated: the fewer pages dlock has when it forks, the fewer the fork copies
    /// the tables of and the fewer dlock faults on afterwards, copying them while the
    /// reaper lives. `None` when the raw arguments (`args`, without the program's name)
    /// do not start one of those commands, standard input is a terminal, or the fork
    /// failed: `run` then forks its own, and reports a failure. A guess wrong the other
    /// way only forks a reaper that is never told a group: dropped, it exits.
    pub fn early(args: impl IntoIterator<Item = OsString>) -> Option<Self> {
        if !runs_a_command(args) || nix::unistd::isatty(std::io::stdin()).unwrap_or(false) {
            return None;
        }
        Self::start().ok()
    }

    /// A new reaper for `group`, which already runs (the previous reaper is gone).
    ///
    /// # Errors
    /// The pipe, the write of the group or the fork failed.
    pub fn replace(group: libc::pid_t) -> io::Result<Self> {
        Self::fork(Some(group))
    }

    /// A reaper told `group` (if any) before it exists: the group waits in the pipe, so
    /// a dlock that dies right after the fork still leaves it to kill.
    fn fork(group: Option<libc::pid_t>) -> io::Result<Self> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        if let Some(group) = group {
            // Four bytes on an empty pipe: written whole or not at all.
            nix::unistd::write(&write, &group.to_le_bytes())?;
        }
        let (read_fd, write_fd) = (read.as_raw_fd(), write.as_raw_fd());
        // SAFETY: the child only makes async-signal-safe calls (no allocation, no
        // locks) and ends with _exit.
        match unsafe { libc::fork() } {
            0 => unsafe { reap(read_fd, write_fd) },
            -1 => Err(io::Error::last_os_error()),
            pid => {
                drop(read);
                Ok(Reaper { pipe: write, pid })
            }
        }
    }

    /// Whether the reaper has died (someone killed it): collected now if so.
    pub fn gone(&self) -> bool {
        collected(self.pid)
    }

    /// dlock is finishing normally: the reaper leaves without killing.
    pub fn done(self) {
        let _ = nix::unistd::write(&self.pipe, b"d");
    }

    /// Kill the watched group now (the reaper's end does it), and wait up to
    /// [`KILL_WAIT`] for the reaper to have exited; one that has not by then (stopped,
    /// starved) is killed and waited for as long again. Whether it is gone: until it
    /// is, its kill may still come, so the command must stay uncollected (its pid, the
    /// group's id, taken). Only through [`Child::kill_group`].
    async fn kill_now(self) -> bool {
        let Reaper { pipe, pid } = self;
        drop(pipe);
        if exits_within(pid, KILL_WAIT).await {
            return true;
        }
        // SAFETY: kill has no memory effects; `pid` is our uncollected child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
        exits_within(pid, KILL_WAIT).await
    }
}

/// Whether our child `pid` has exited (collected now if so) or is not ours to wait
/// for (`ECHILD`); without blocking. Any other error answers "not gone", the safe
/// side for both callers: a reaper taken for gone is replaced (its pipe closed: it
/// kills), and a command is collected only once its reaper is gone.
fn collected(pid: libc::pid_t) -> bool {
    let mut status = 0;
    // SAFETY: waitpid on our own child, with a valid status pointer.
    let r = unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) };
    r == pid || (r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD))
}

/// Whether our child `pid` has exited (collected here) or is not ours to wait for,
/// within `limit`.
async fn exits_within(pid: libc::pid_t, limit: Duration) -> bool {
    let until = tokio::time::Instant::now() + limit;
    loop {
        if collected(pid) {
            return true;
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Whether raw arguments (without the program's name) start `run` or `elect`: the
/// subcommand is the first argument but the global `--log` and its value (either
/// spelling). A guess: clap has the last word ([`Reaper::early`]).
fn runs_a_command(args: impl IntoIterator<Item = OsString>) -> bool {
    let mut args = args.into_iter();
    loop {
        let Some(arg) = args.next() else {
            return false;
        };
        if arg == "--log" {
            if args.next().is_none() {
                return false;
            }
        } else if !arg.as_bytes().starts_with(b"--log=") {
            return arg == "run" || arg == "elect";
        }
    }
}

/// The reaper's life (in the forked child).
///
/// # Safety
/// Only in a child just forked: it makes async-signal-safe calls only.
unsafe fn reap(read_fd: i32, write_fd: i32) -> ! {
    // SAFETY: async-signal-safe calls on our own descriptors, dispositions and process
    // group.
    unsafe {
        // Out of dlock's process group (a Ctrl-C or a signal to dlock's group must
        // not take the reaper with it), and holding nothing of dlock's but the pipe:
        // above all not the pipe's write end, whose last copy closing is dlock's death
        // (closed by itself too, should close_range be missing).
        libc::setpgid(0, 0);
        libc::close(write_fd);
        let first = u32::try_from(read_fd).unwrap_or(0);
        if first > 0 {
            libc::syscall(libc::SYS_close_range, 0u32, first - 1, 0u32);
        }
        libc::syscall(libc::SYS_close_range, first + 1, u32::MAX, 0u32);
        // dlock's handlers (a reaper forked while dlock runs has them) do not apply.
        default_handlers(0);
        let mut group = [0u8; 4];
        if !read_exact(read_fd, &mut group) {
            libc::_exit(0);
        }
        let mut byte = [0u8; 1];
        if read_exact(read_fd, &mut byte) {
            libc::_exit(0);
        }
        libc::kill(-i32::from_le_bytes(group), libc::SIGKILL);
        libc::_exit(0)
    }
}

/// Fill `buf` from `fd`: false at the end of the pipe (or an error) first.
///
/// # Safety
/// Async-signal-safe; `fd` is a pipe's read end.
unsafe fn read_exact(fd: i32, buf: &mut [u8]) -> bool {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: reading into the unfilled rest of `buf`.
        let n = unsafe { libc::read(fd, buf[filled..].as_mut_ptr().cast(), buf.len() - filled) };
        if n > 0 {
            filled += n.cast_unsigned();
        } else if n == 0 || unsafe { *libc::__errno_location() } != libc::EINTR {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guess(args: &[&str]) -> bool {
        runs_a_command(args.iter().map(OsString::from))
    }

    /// The state letter of `pid` in `/proc` (`None`: no such process).
    fn state(pid: libc::pid_t) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(") ")?.1.chars().next()
    }

    /// Whether `pid` is still this process's child (exited or not, not collected).
    fn uncollected(pid: libc::pid_t) -> bool {
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a valid siginfo pointer; WNOWAIT | WNOHANG only looks.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                libc::id_t::try_from(pid).unwrap_or(0),
                &raw mut info,
                libc::WEXITED | libc::WNOWAIT | libc::WNOHANG,
            )
        };
        r == 0
    }

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[tokio::test]
    async fn an_exited_command_keeps_its_pid_until_it_is_released() {
        let mut child =
            spawn(OsStr::new("sh"), &os(&["-c", "exit 3"]), &[], false, None).expect("spawn");
        let pid = child.id();
        let status = child.wait().await.expect("wait");
        assert_eq!(status.code(), Some(3));
        // Waited for, yet still a zombie: its pid cannot go to another process.
        assert_eq!(
            state(pid),
            Some('Z'),
            "the command was collected by its wait"
        );
        assert_eq!(child.wait().await.expect("again").code(), Some(3));
        assert!(uncollected(pid));
        child.release(None);
        assert!(!uncollected(pid), "released, yet not collected");
    }

    /// Processes of process group `group` that have not exited.
    fn running_in(group: libc::pid_t) -> usize {
        std::fs::read_dir("/proc")
            .expect("/proc")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<libc::pid_t>().ok())
            .filter(|&p| {
                std::fs::read_to_string(format!("/proc/{p}/stat"))
                    .ok()
                    .and_then(|st| {
                        let rest = st.rsplit_once(") ")?.1.to_owned();
                        let mut f = rest.split(' ');
                        let state = f.next()?.to_owned();
                        let pgrp = f.nth(1)?.parse::<libc::pid_t>().ok()?;
                        Some(pgrp == group && state != "Z")
                    })
                    .unwrap_or(false)
            })
            .count()
    }

    /// The status rebuilt from `waitid`'s report: exit codes as codes, signals as
    /// signals (every `dlock run` exit code is derived from it).
    #[tokio::test]
    async fn a_command_killed_by_a_signal_reports_it() {
        for (script, code, signal) in [
            ("exit 0", Some(0), None),
            ("exit 255", Some(255), None),
            ("kill -TERM $$", None, Some(libc::SIGTERM)),
            ("kill -KILL $$", None, Some(libc::SIGKILL)),
        ] {
            let mut child =
                spawn(OsStr::new("sh"), &os(&["-c", script]), &[], false, None).expect("spawn");
            let status = child.wait().await.expect("wait");
            assert_eq!(status.code(), code, "{script}");
            assert_eq!(status.signal(), signal, "{script}");
            assert!(!status.core_dumped(), "{script}");
            child.release(None);
        }
    }

    /// `kill_group` with a reaper that works, one stopped (SIGSTOP) so it cannot kill,
    /// and none (it could not be replaced): each time the group's member is killed, the
    /// reaper (if any) is gone, and only then is the leader collected.
    #[tokio::test]
    async fn the_group_is_killed_before_its_leader_is_collected() {
        for case in ["reaper", "stopped reaper", "no reaper"] {
            let reaper = (case != "no reaper").then(|| Reaper::start().expect("reaper"));
            let reaper_pid = reaper.as_ref().map(|r| r.pid);
            // The leader exits at once and leaves a member behind, as a daemonizing
            // command does.
            let mut child = spawn(
                OsStr::new("sh"),
                &os(&["-c", "sleep 30 & exit 0"]),
                &[],
                true,
                reaper.as_ref(),
            )
            .expect("spawn");
            let group = child.id();
            assert_eq!(child.wait().await.expect("wait").code(), Some(0), "{case}");
            assert_eq!(state(group), Some('Z'), "{case}");
            if case == "stopped reaper" {
                let pid = reaper_pid.expect("a reaper");
                // SAFETY: a signal to our own child.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
                let until = std::time::Instant::now() + Duration::from_secs(10);
                while state(pid) != Some('T') {
                    assert!(
                        std::time::Instant::now() < until,
                        "the reaper never stopped"
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            child.kill_group(reaper).await;
            if let Some(pid) = reaper_pid {
                assert!(!uncollected(pid), "{case}: the reaper is not gone");
            }
            assert!(!uncollected(group), "{case}: the leader was not collected");
            let until = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let alive = running_in(group);
                if alive == 0 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < until,
                    "{case}: {alive} process(es) of the group still run"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    #[tokio::test]
    async fn a_command_that_cannot_start_is_collected_after_the_reaper_is_told() {
        let reaper = Reaper::start().expect("reaper");
        let failed = spawn(
            OsStr::new("/nonexistent/dlock-no-such-program"),
            &[],
            &[],
            true,
            Some(&reaper),
        )
        .expect_err("no such program");
        let pid = failed.child.as_ref().expect("a child was made").id();
        // The child told the reaper its group before its exec failed: its pid stays
        // taken until the reaper has been told to leave it.
        assert_eq!(state(pid), Some('Z'));
        let e = failed.release(Some(reaper));
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(!uncollected(pid));
    }

    #[test]
    fn the_early_guess_finds_run_and_elect_behind_the_global_option() {
        for yes in [
            &["run", "n", "--", "true"][..],
            &["elect", "n", "true"],
            &["--log", "debug", "run", "n"],
            &["--log=warn", "elect", "n"],
            &["--log", "run", "run"],
            &["--log=", "run"],
        ] {
            assert!(guess(yes), "{yes:?}");
        }
        for no in [
            &[][..],
            &["--log"],
            &["--log", "run"],
            &["leader", "run"],
            &["status", "--log", "run"],
            &["-h", "run"],
            &["-V"],
            &["--", "run"],
            &["help", "run"],
            &["ru"],
            &["Run"],
            &["runx"],
            &["bench-worker"],
        ] {
            assert!(!guess(no), "{no:?}");
        }
    }
}
