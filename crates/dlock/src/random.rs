//! Random bits for what must never repeat: owners, acquisition ids, nonces.
//!
//! The operating system's randomness, fetched 4 KiB at a time per thread (one system
//! call per 256 owners), each bit handed out once — also across a `fork` without
//! `exec`: a child goes on from a copy of its parent's memory, pool included, and
//! would hand out the very bits its parent hands out next. Two processes with one
//! owner are one holder, so both would hold; two with one ZooKeeper node prefix or
//! one Redis grant nonce could each take the other's grant for its own. A child's pool
//! is refilled before its first draw (the fork is counted by a `pthread_atfork`
//! handler, registered before any pool is filled).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Forks this process has been through (counted in the child).
static FORKS: AtomicU64 = AtomicU64::new(0);

const POOL_BYTES: usize = 4096;

struct Pool {
    bytes: Vec<u8>,
    used: usize,
    /// [`FORKS`] when the pool was filled: a pool from before a fork is not ours.
    forks: u64,
}

thread_local! {
    static POOL: RefCell<Pool> = const {
        RefCell::new(Pool {
            bytes: Vec::new(),
            used: 0,
            forks: 0,
        })
    };
}

/// `N` random bytes (`N` at most 4096), never handed out before by this process or
/// by the process it was forked from.
///
/// # Panics
/// If the operating system has no usable random source (never on supported systems).
pub(crate) fn bytes<const N: usize>() -> [u8; N] {
    const { assert!(N <= POOL_BYTES) };
    let mut out = [0u8; N];
    let pooled = POOL.try_with(|pool| {
        let mut pool = pool.borrow_mut();
        let forks = FORKS.load(Ordering::SeqCst);
        if pool.used + N > pool.bytes.len() || pool.forks != forks {
            count_forks();
            // Read before the fill: a fork during it leaves the child refilling again.
            pool.forks = FORKS.load(Ordering::SeqCst);
            pool.bytes.resize(POOL_BYTES, 0);
            #[allow(clippy::expect_used)]
            getrandom::fill(&mut pool.bytes).expect("the OS random number generator failed");
            pool.used = 0;
        }
        let used = pool.used;
        let drawn = &mut pool.bytes[used..used + N];
        out.copy_from_slice(drawn);
        // Never hand out the same bits twice.
        drawn.fill(0);
        pool.used += N;
    });
    if pooled.is_err() {
        // The thread is exiting (its pool is gone): straight from the OS.
        #[allow(clippy::expect_used)]
        getrandom::fill(&mut out).expect("the OS random number generator failed");
    }
    out
}

/// Registers the fork counter (before any pool is filled). Not behind a `Once`: a
/// child forked while another thread ran it would wait on it forever. Threads that
/// race here may each register it; a fork then counts more than once, which only
/// refills the child's pools as it must anyway.
fn count_forks() {
    #[cfg(unix)]
    {
        use std::sync::atomic::AtomicBool;
        static REGISTERED: AtomicBool = AtomicBool::new(false);
        extern "C" fn forked() {
            // In the child, before it returns from fork: async-signal-safe.
            FORKS.fetch_add(1, Ordering::SeqCst);
        }
        if !REGISTERED.load(Ordering::SeqCst) {
            // SAFETY: registers a handler that only increments an atomic; the handler
            // stays valid for the life of the process (a plain function).
            let r = unsafe { libc::pthread_atfork(None, None, Some(forked)) };
            // A failed registration (no memory) is tried again at the next fill.
            REGISTERED.store(r == 0, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_differ() {
        let a = bytes::<16>();
        let b = bytes::<16>();
        assert_ne!(a, b);
        assert_ne!(a, [0; 16]);
    }

    /// A child forked without exec draws bits its parent never hands out: not the
    /// rest of the pool it was copied with.
    #[cfg(unix)]
    #[test]
    fn a_forked_child_draws_other_bits_than_its_parent() {
        use std::io::{Read, Write};
        use std::os::fd::{FromRawFd, OwnedFd};
        // The pool is filled before the fork.
        let _ = bytes::<16>();
        let mut fds = [0; 2];
        // SAFETY: a pipe into a valid array of two descriptors.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors are ours from here on.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: the child draws (the pool, maybe the OS's randomness and malloc,
        // which glibc keeps usable after a fork), writes to the pipe and _exits.
        match unsafe { libc::fork() } {
            0 => {
                // Nothing may unwind into the copy of the test harness.
                let wrote = std::panic::catch_unwind(move || {
                    let drawn = bytes::<16>();
                    std::fs::File::from(write).write_all(&drawn).is_ok()
                });
                // SAFETY: ends the child without running the parent's exit handlers.
                unsafe { libc::_exit(i32::from(!matches!(wrote, Ok(true)))) }
            }
            pid => {
                assert!(pid > 0, "fork failed");
                drop(write);
                let mine = bytes::<16>();
                let mut theirs = [0u8; 16];
                std::fs::File::from(read)
                    .read_exact(&mut theirs)
                    .expect("the child's draw");
                let mut status = 0;
                // SAFETY: waits for our own child.
                unsafe { libc::waitpid(pid, &raw mut status, 0) };
                assert_ne!(mine, theirs, "the child drew its parent's next bits");
            }
        }
    }
}
