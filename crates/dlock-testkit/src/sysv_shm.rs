//! PostgreSQL's System V shared memory segment, which a killed server leaves behind.
//!
//! Even with `shared_memory_type=mmap`, every postmaster creates one small System V
//! segment as an interlock, and removes it only on a clean exit. Tests SIGKILL their
//! servers, so each one left a segment; the kernel allows 4,096 (`kernel.shmmni`), and
//! once a machine had that many, every later PostgreSQL failed to start ("could not
//! create shared memory segment: No space left on device"). So a test server removes
//! its segment when dropped ([`remove_segment_of`]), every segment a test server made
//! is recorded ([`record_segment_of`]), and the first server a process starts removes
//! the recorded ones that earlier, interrupted runs left ([`remove_orphans`]).

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The id of the segment named in `data_dir/postmaster.pid` (its seventh line: key
/// and id).
fn segment_of(data_dir: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
    text.lines()
        .nth(6)
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|id| id.parse::<i32>().ok())
}

/// Remove the segment of the server that ran on `data_dir`. Called after the server
/// was killed; a segment still attached by a dying backend goes when its last process
/// detaches. Returns whether one was marked for removal.
pub(crate) fn remove_segment_of(data_dir: &Path) -> bool {
    segment_of(data_dir).is_some_and(remove)
}

/// Where the ids of test servers' segments are recorded (one per line, appended).
pub(crate) fn registry() -> PathBuf {
    let uid = nix::unistd::Uid::effective().as_raw();
    std::env::temp_dir().join(format!("dlock-testkit-{uid}-pg-segments"))
}

/// Record the segment of the server now running on `data_dir` in `registry`, so a
/// later process can remove it if this one dies before the server's Drop.
pub(crate) fn record_segment_of(data_dir: &Path, registry: &Path) {
    if let Some(id) = segment_of(data_dir)
        && let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(registry)
    {
        // One short append: lines of processes writing at once do not interleave.
        let _ = file.write_all(format!("{id}\n").as_bytes());
    }
}

/// The number PostgreSQL writes first in its segment (`PGShmemMagic`).
const POSTGRES_MAGIC: i32 = 679_834_894;

/// One row of `/proc/sysvipc/shm`.
struct Segment {
    id: i32,
    creator: i64,
    attached: i64,
    uid: i64,
}

fn segments() -> Vec<Segment> {
    let Ok(table) = std::fs::read_to_string("/proc/sysvipc/shm") else {
        return Vec::new();
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            // key shmid perms size cpid lpid nattch uid …
            let fields: Vec<&str> = line.split_whitespace().collect();
            let number = |i: usize| fields.get(i).and_then(|f| f.parse::<i64>().ok());
            Some(Segment {
                id: i32::try_from(number(1)?).ok()?,
                creator: number(4)?,
                attached: number(6)?,
                uid: number(7)?,
            })
        })
        .collect()
}

/// The ids of the System V segments that process `pid` created (a PostgreSQL
/// postmaster's interlock, for tests that check none is left).
#[must_use]
pub fn segments_created_by(pid: u32) -> Vec<i32> {
    segments()
        .into_iter()
        .filter(|s| s.creator == i64::from(pid))
        .map(|s| s.id)
        .collect()
}

/// Whether the machine is close to its limit of segments (three quarters of
/// `kernel.shmmni`).
fn crowded(count: usize) -> bool {
    let limit = std::fs::read_to_string("/proc/sys/kernel/shmmni")
        .ok()
        .and_then(|t| t.trim().parse::<usize>().ok())
        .unwrap_or(4096);
    count * 4 >= limit * 3
}

/// Remove the PostgreSQL segments owned by `uid` that no process has attached and
/// whose creator is gone — what a killed PostgreSQL leaves — among those `registry`
/// records; all of them when the machine is close to its limit (then no PostgreSQL
/// would start anyway; a crashed PostgreSQL that is not a test's would have removed
/// its own on restart). A segment of a server that runs (attached) or is starting (its
/// creator alive) is left alone. The registry keeps the ids still present. Returns how
/// many were removed.
pub(crate) fn remove_orphans(uid: u32, registry: &Path) -> usize {
    let table = segments();
    let everything = crowded(table.len());
    let recorded: HashSet<i32> = std::fs::read_to_string(registry)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let mut removed = 0;
    let mut kept = String::new();
    for s in &table {
        if !everything && !recorded.contains(&s.id) {
            continue;
        }
        let orphan = s.uid == i64::from(uid) && s.attached == 0 && !alive(s.creator);
        if orphan && of_postgres(s.id) && remove(s.id) {
            removed += 1;
        } else if recorded.contains(&s.id) {
            kept.push_str(&format!("{}\n", s.id));
        }
    }
    // Ids recorded by another process between the read and this write may be lost:
    // their segments then wait for a crowded machine's sweep.
    if !recorded.is_empty() {
        let _ = std::fs::write(registry, kept);
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
    // segment is at least one page; volatile, as other processes share it), then
    // detached.
    unsafe {
        let at = libc::shmat(id, std::ptr::null(), libc::SHM_RDONLY);
        if at as isize == -1 {
            return false;
        }
        let magic = at.cast::<i32>().read_volatile();
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
        // start, then detached (removed if it cannot be attached).
        unsafe {
            let id = libc::shmget(libc::IPC_PRIVATE, 56, libc::IPC_CREAT | 0o600);
            if id < 0 {
                return -1;
            }
            let at = libc::shmat(id, std::ptr::null(), 0);
            if at as isize == -1 {
                remove(id);
                return -1;
            }
            at.cast::<i32>().write(magic);
            libc::shmdt(at);
            id
        }
    }

    #[test]
    fn recorded_orphans_go_and_other_segments_stay() {
        let (reader, writer) = nix::unistd::pipe().expect("pipe");
        // SAFETY: the child only calls shmget, shmat, shmdt, write and _exit, with
        // buffers on its stack.
        match unsafe { nix::unistd::fork() }.expect("fork") {
            nix::unistd::ForkResult::Child => {
                let mut ids = [0u8; 12];
                for (i, magic) in [POSTGRES_MAGIC, POSTGRES_MAGIC, 0].into_iter().enumerate() {
                    ids[i * 4..i * 4 + 4].copy_from_slice(&create(magic).to_ne_bytes());
                }
                let _ = nix::unistd::write(&writer, &ids);
                // SAFETY: ends the forked child without running the parent's destructors.
                unsafe { libc::_exit(0) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                drop(writer);
                let mut bytes = [0u8; 12];
                let n = nix::unistd::read(&reader, &mut bytes).expect("read the ids");
                assert_eq!(n, 12);
                nix::sys::wait::waitpid(child, None).expect("wait for the child");
                let id = |i: usize| {
                    i32::from_ne_bytes(bytes[i * 4..i * 4 + 4].try_into().expect("4 bytes"))
                };
                let (orphan, unrecorded, foreign) = (id(0), id(1), id(2));
                let mine = create(POSTGRES_MAGIC);
                let all = [orphan, unrecorded, foreign, mine];
                assert!(all.iter().all(|id| *id >= 0), "shmget failed: {all:?}");
                let dir = tempfile::tempdir().expect("dir");
                let registry = dir.path().join("segments");
                let lines: String = [orphan, foreign, mine]
                    .iter()
                    .map(|id| format!("{id}\n"))
                    .collect();
                std::fs::write(&registry, lines).expect("registry");
                let uid = nix::unistd::Uid::effective().as_raw();
                remove_orphans(uid, &registry);
                let left = all.map(exists);
                let crowded = crowded(segments().len());
                for id in all {
                    remove(id);
                }
                assert!(
                    !left[0],
                    "a recorded PostgreSQL segment whose creator is gone stayed"
                );
                assert!(
                    left[1] || crowded,
                    "an unrecorded segment was removed on a machine far from its limit"
                );
                assert!(left[2], "a segment that is not PostgreSQL's was removed");
                assert!(left[3], "a segment of a live creator was removed");
                let kept = std::fs::read_to_string(&registry).expect("registry");
                assert!(!kept.contains(&format!("{orphan}\n")), "{kept}");
                assert!(kept.contains(&format!("{mine}\n")), "{kept}");
            }
        }
    }
}
