//! What an operator asks of a backend besides locking: [`Locker::list`](crate::Locker::list).

use super::{Harness, unique};
use crate::Error;

/// `list(prefix)` shows exactly the locks held under the prefix, in byte order, each
/// with its holder's token — not a released one, not one beside the prefix. Redis and
/// Redlock cannot enumerate their locks (the default layout keeps a lock at its bare
/// name) and must say so; every other backend must list.
///
/// # Panics
/// When the listing is wrong, or a backend that should list does not.
pub async fn list_shows_the_held_locks(h: &Harness) {
    let a = h.locker().await;
    let base = unique("list");
    let prefix = format!("{base}/");
    let held = [format!("{prefix}b"), format!("{prefix}a")];
    let mut guards = Vec::new();
    for name in &held {
        guards.push(a.lock(name).await.expect("lock"));
    }
    let released = a.lock(&format!("{prefix}c")).await.expect("lock");
    released.release().await.expect("release");
    let beside = a.lock(&format!("{base}-beside")).await.expect("lock");
    let scheme = h.url().split(':').next().unwrap_or_default();
    match a.list(&prefix).await {
        Ok(listed) => {
            let names: Vec<&str> = listed.iter().map(|i| i.name.as_str()).collect();
            assert_eq!(names, [held[1].as_str(), held[0].as_str()], "{scheme}");
            for info in &listed {
                let guard = guards
                    .iter()
                    .find(|g| g.name() == info.name)
                    .expect("a listed lock is held");
                assert_eq!(info.fencing_token, guard.fencing_token(), "{scheme}");
            }
        }
        Err(Error::Unsupported(_)) if scheme.starts_with("redis") || scheme == "redlock" => {}
        Err(e) => panic!("{scheme}: list: {e}"),
    }
    beside.release().await.expect("release");
    for g in guards {
        g.release().await.expect("release");
    }
}
