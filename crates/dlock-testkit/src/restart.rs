//! Servers a test can kill and start again on the same port and data dir, and the one
//! retry loop they share.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::server::ServerProcess;

/// A server that can be started again after it died (or was killed), on the same port
/// and with the same data dir: what a supervisor (systemd `Restart=always`) does.
pub trait Restartable: Send {
    /// The running process (pid, pause, kill).
    fn process(&mut self) -> &mut ServerProcess;

    /// Kill the server if it still runs and start it again on the same port and data.
    ///
    /// # Panics
    /// When it does not come back within 10 s.
    fn restart(&mut self);
}

/// A server shared between a test and the runs that fault it.
pub type SharedServer = Arc<Mutex<dyn Restartable>>;

/// Lock a shared server (a poisoned lock still holds a usable server).
pub fn lock_server<T: ?Sized>(server: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    server
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Kill `process` and start it again with `launch`, retrying for up to 10 s (the port
/// may take a moment to be free).
///
/// # Panics
/// When it does not come back.
pub(crate) fn relaunch(
    process: &mut ServerProcess,
    mut launch: impl FnMut() -> Result<ServerProcess, String>,
) {
    process.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match launch() {
            Ok(p) => {
                *process = p;
                return;
            }
            Err(e) if Instant::now() > deadline => {
                panic!("{} did not restart: {e}", process.name())
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
