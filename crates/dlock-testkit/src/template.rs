//! Data directories made once and copied: `initdb` costs about 2 s of CPU and
//! `mariadb-install-db` about 1 s, a copy of what they make a tenth of that, and the
//! suites start hundreds of servers (a test each) on two cores.
//!
//! A template lives in the temp dir under a name made of the kind, the tool's path,
//! size and modification time, so an upgraded server gets a new one. It is made in a
//! staging directory and renamed into place: a template is complete or absent, and
//! parallel tests that race to make one all end up copying the same.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Bumped whenever what a template holds changes (the tools' arguments).
const RECIPE: u32 = 1;

fn template_dir(kind: &str, tool: &Path) -> PathBuf {
    let mut h = std::hash::DefaultHasher::new();
    (RECIPE, kind, tool).hash(&mut h);
    if let Ok(m) = std::fs::metadata(tool) {
        m.len().hash(&mut h);
        m.modified().ok().hash(&mut h);
    }
    std::env::temp_dir()
        .join(format!("dlock-testkit-{}", nix::unistd::Uid::effective()))
        .join(format!("{kind}-{:016x}", h.finish()))
}

/// Fill `dest` (absent) with a copy of the data directory `make` creates for `kind` with
/// `tool`. `make` gets an empty staging directory, to create `data` in; ownership and
/// modes are kept in the copy (PostgreSQL wants its own user and 0700).
///
/// # Errors
/// What `make` returned, or why the copy failed.
pub(crate) fn copy_of(
    kind: &str,
    tool: &Path,
    dest: &Path,
    make: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), String> {
    let template = template_dir(kind, tool);
    if !template.join("data").is_dir() {
        let parent = template.parent().expect("a parent");
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        // Whatever the umask: a server's own user (PostgreSQL's) must get through.
        std::fs::set_permissions(parent, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", parent.display()))?;
        let staging = tempfile::Builder::new()
            .prefix(&format!("{kind}-staging-"))
            .tempdir_in(parent)
            .map_err(|e| format!("staging dir: {e}"))?;
        make(staging.path())?;
        // Losing the race to another test is fine: its template is as good.
        if let Err(e) = std::fs::rename(staging.path(), &template)
            && !template.join("data").is_dir()
        {
            return Err(format!("{}: {e}", template.display()));
        }
    }
    let out = Command::new("cp")
        .arg("-a")
        .arg(template.join("data"))
        .arg(dest)
        .output()
        .map_err(|e| format!("cp: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "copying {} failed: {}",
            template.display(),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
