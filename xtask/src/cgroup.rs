//! cgroup v2 helpers: find (or mount) the hierarchy, make, join, empty and remove groups.

use std::{
    fs,
    io::ErrorKind,
    path::{Path, PathBuf},
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// Where we mount cgroup2 ourselves when the machine has no cgroup2 mount.
pub const OWN_MOUNT: &str = "/run/fastpath/cgroup2";

/// The cgroup2 mount point, from /proc/self/mounts; if there is none, one is mounted at
/// [`OWN_MOUNT`] (and left mounted: it is shared by every test bed).
pub fn cgroup2_mount() -> Result<PathBuf> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(found) = find_cgroup2_mount()? {
        return Ok(found);
    }
    let dir = Path::new(OWN_MOUNT);
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let target = std::ffi::CString::new(OWN_MOUNT)?;
    // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
    let rc = unsafe {
        libc::mount(
            c"cgroup2".as_ptr(),
            target.as_ptr(),
            c"cgroup2".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        bail!("no cgroup2 is mounted and mounting one at {OWN_MOUNT} failed: {err}");
    }
    Ok(dir.to_path_buf())
}

/// The first cgroup2 mount in /proc/self/mounts, if any.
pub fn find_cgroup2_mount() -> Result<Option<PathBuf>> {
    let mounts = fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    Ok(parse_cgroup2_mount(&mounts))
}

/// Finds the cgroup2 mount point in the text of /proc/self/mounts.
pub fn parse_cgroup2_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_dev, dir, fstype) = (fields.next()?, fields.next()?, fields.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(unescape_mount_path(dir)))
    })
}

/// /proc/self/mounts writes space, tab, newline and backslash as `\ooo` octal escapes.
fn unescape_mount_path(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Creates a cgroup (and missing parents).
pub fn create(path: &Path) -> Result<()> {
    fs::create_dir_all(path).with_context(|| format!("creating cgroup {}", path.display()))
}

/// Moves process `pid` (0: the caller) into the cgroup at `path`.
pub fn join(path: &Path, pid: u32) -> Result<()> {
    let procs = path.join("cgroup.procs");
    fs::write(&procs, format!("{pid}\n"))
        .with_context(|| format!("moving pid {pid} into {}", procs.display()))
}

/// The pids in the cgroup at `path` and every group below it.
pub fn procs_recursive(path: &Path) -> Vec<u32> {
    let mut pids: Vec<u32> = fs::read_to_string(path.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    for child in subgroups(path) {
        pids.extend(procs_recursive(&child));
    }
    pids
}

fn subgroups(path: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(path) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

/// True while some process lives in the cgroup or below it.
pub fn populated(path: &Path) -> bool {
    match fs::read_to_string(path.join("cgroup.events")) {
        Ok(events) => events.lines().any(|l| l.trim() == "populated 1"),
        Err(_) => !procs_recursive(path).is_empty(),
    }
}

/// SIGKILLs every process in the cgroup and below (cgroup.kill, else one by one).
///
/// Only ever used on groups the test bed made, so everything in them is ours.
pub fn kill_all(path: &Path) {
    if fs::write(path.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    for pid in procs_recursive(path) {
        if let Ok(pid) = i32::try_from(pid) {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Kills what is left inside, waits (at most `timeout`) for it to go, and removes the
/// group and its subgroups. A group that is already gone is fine.
pub fn remove_tree(path: &Path, timeout: Duration) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let deadline = Instant::now() + timeout;
    if populated(path) {
        kill_all(path);
        while populated(path) {
            if Instant::now() >= deadline {
                bail!(
                    "processes {:?} are still in {} after SIGKILL",
                    procs_recursive(path),
                    path.display()
                );
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
    rmdir_tree(path, deadline)
}

fn rmdir_tree(path: &Path, deadline: Instant) -> Result<()> {
    for child in subgroups(path) {
        rmdir_tree(&child, deadline)?;
    }
    loop {
        match fs::remove_dir(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            // A just-killed process can keep the group busy for a moment.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e).with_context(|| format!("removing cgroup {}", path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_in_mounts() {
        let mounts = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        assert_eq!(
            parse_cgroup2_mount(mounts),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(parse_cgroup2_mount("cgroup /a cgroup rw 0 0\n"), None);
        assert_eq!(
            parse_cgroup2_mount("none /mnt/my\\040cg cgroup2 rw 0 0\n"),
            Some(PathBuf::from("/mnt/my cg"))
        );
    }
}
