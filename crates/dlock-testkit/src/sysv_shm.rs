//! PostgreSQL's System V shared memory segment, which a killed server leaves behind.
//!
//! Even with `shared_memory_type=mmap`, every postmaster creates one small System V
//! segment as an interlock, and removes it only on a clean exit. Tests SIGKILL their
//! servers, so each one left a segment; the kernel allows 4,096 (`kernel.shmmni`), and
//! once a machine had that many, every later PostgreSQL failed to start ("could not
//! create shared memory segment: No space left on device"). So a test server removes
//! its segment when dropped ([`remove_segment_of`]), and the first server a process
//! starts removes segments that earlier, interrupted runs left ([`remove_orphans`]).

use std::path::Path;

/// Remove the segment named in `data_dir/postmaster.pid` (its seventh line: key and
/// id). Called after the server was killed; a segment still attached by a dying
/// backend goes when its last process detaches. Returns whether one was removed.
pub(crate) fn remove_segment_of(data_dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(data_dir.join("postmaster.pid")) else {
        return false;
    };
    let Some(id) = text
        .lines()
        .nth(6)
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|id| id.parse::<i32>().ok())
    else {
        return false;
    };
    remove(id)
}

/// The number PostgreSQL writes first in its segment (`PGShmemMagic`).
const POSTGRES_MAGIC: i32 = 679_834_894;

/// Remove PostgreSQL's segments owned by `uid` that no process has attached and whose
/// creator is gone: what a killed PostgreSQL leaves. PostgreSQL itself removes such a segment
/// when it restarts on the same data; test data dirs never see a restart once their
/// test ended. A segment of a server that runs (attached) or is starting (its creator
/// alive) is left alone. Returns how many were removed.
pub(crate) fn remove_orphans(uid: u32) -> usize {
    let Ok(table) = std::fs::read_to_string("/proc/sysvipc/shm") else {
        return 0;
    };
    let mut removed = 0;
    for line in table.lines().skip(1) {
        // key shmid perms size cpid lpid nattch uid …
        let fields: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| fields.get(i).and_then(|f| f.parse::<i64>().ok());
        let (Some(id), Some(cpid), Some(nattch), Some(owner)) =
            (number(1), number(4), number(6), number(7))
        else {
            continue;
        };
        if owner != i64::from(uid) || nattch != 0 || alive(cpid) {
            continue;
        }
        if let Ok(id) = i32::try_from(id)
            && of_postgres(id)
            && remove(id)
        {
            removed += 1;
        }
    }
    removed
}

fn alive(pid: i64) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return true;
    };
    if pid <= 0 {
        return true;
    }
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// Whether segment `id` starts with PostgreSQL's magic number.
fn of_postgres(id: i32) -> bool {
    // SAFETY: attached read-only, one aligned i32 read from its start (every System V
    // segment is at least one page), then detached.
    unsafe {
        let at = libc::shmat(id, std::ptr::null(), libc::SHM_RDONLY);
        if at as isize == -1 {
            return false;
        }
        let magic = at.cast::<i32>().read();
        libc::shmdt(at);
        magic == POSTGRES_MAGIC
    }
}

fn remove(id: i32) -> bool {
    // SAFETY: IPC_RMID takes no buffer; an id that is gone or not ours fails with an
    // error code and changes nothing.
    unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exists(id: i32) -> bool {
        let mut info = std::mem::MaybeUninit::<libc::shmid_ds>::zeroed();
        // SAFETY: IPC_STAT writes one shmid_ds into the buffer it is given.
        unsafe { libc::shmctl(id, libc::IPC_STAT, info.as_mut_ptr()) == 0 }
    }

    /// A new segment that starts with `magic`, or -1.
    fn create(magic: i32) -> i32 {
        // SAFETY: a new private segment of 56 bytes, attached to write one i32 at its
        // start, then detached.
        unsafe {
            let id = libc::shmget(libc::IPC_PRIVATE, 56, libc::IPC_CREAT | 0o600);
            if id < 0 {
                return -1;
            }
            let at = libc::shmat(id, std::ptr::null(), 0);
            if at as isize == -1 {
                return -1;
            }
            at.cast::<i32>().write(magic);
            libc::shmdt(at);
            id
        }
    }

    #[test]
    fn orphans_go_and_segments_of_live_creators_stay() {
        let (reader, writer) = nix::unistd::pipe().expect("pipe");
        // SAFETY: the child only calls shmget, shmat, shmdt, write and _exit.
        match unsafe { nix::unistd::fork() }.expect("fork") {
            nix::unistd::ForkResult::Child => {
                let ids = [create(POSTGRES_MAGIC), create(0)];
                let _ = nix::unistd::write(
                    &writer,
                    &[ids[0].to_ne_bytes(), ids[1].to_ne_bytes()].concat(),
                );
                // SAFETY: ends the forked child without running the parent's destructors.
                unsafe { libc::_exit(0) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                drop(writer);
                let mut bytes = [0u8; 8];
                let n = nix::unistd::read(&reader, &mut bytes).expect("read the ids");
                assert_eq!(n, 8);
                nix::sys::wait::waitpid(child, None).expect("wait for the child");
                let id = |i: usize| i32::from_ne_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap());
                let (orphan, foreign) = (id(0), id(1));
                assert!(
                    orphan >= 0 && foreign >= 0,
                    "the child could not create segments"
                );
                let mine = create(POSTGRES_MAGIC);
                assert!(mine >= 0, "shmget: {}", std::io::Error::last_os_error());
                let uid = nix::unistd::Uid::effective().as_raw();
                assert!(remove_orphans(uid) >= 1);
                let left = [orphan, foreign, mine].map(exists);
                for id in [orphan, foreign, mine] {
                    remove(id);
                }
                assert!(
                    !left[0],
                    "a PostgreSQL segment whose creator is gone stayed"
                );
                assert!(left[1], "a segment that is not PostgreSQL's was removed");
                assert!(left[2], "a segment of a live creator was removed");
            }
        }
    }
}
