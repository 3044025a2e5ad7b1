//! Named network namespaces (`/run/netns/NAME`, as `ip netns` makes them) and running code
//! inside one.
//!
//! We never use `ip netns exec` for anything that needs cgroups: it remounts /sys, which
//! hides cgroup2. Code that must run in a namespace either uses `ip -n NAME ...` or
//! [`in_netns`], which moves one fresh thread with setns(2).

use std::{fs, os::fd::AsRawFd as _, path::PathBuf};

use anyhow::{Context as _, Result, bail};

use crate::cmd;

pub const NETNS_DIR: &str = "/run/netns";

/// The bind-mount file that names the namespace.
pub fn path(name: &str) -> PathBuf {
    PathBuf::from(NETNS_DIR).join(name)
}

pub fn exists(name: &str) -> bool {
    path(name).exists()
}

/// Creates a named network namespace and brings its loopback up. Devices made in it later
/// skip IPv6 duplicate address detection, link-local addresses included: a veth's
/// link-local address stays tentative for about a second otherwise, and the first IPv6
/// packets to a pod behind it (neighbour discovery) were lost now and then, failing tests
/// on a SYN that is resent only after a second.
pub fn add(name: &str) -> Result<()> {
    cmd::ip(["netns", "add", name])?;
    cmd::ip(["-n", name, "link", "set", "lo", "up"])?;
    for key in [
        "net/ipv6/conf/all/accept_dad",
        "net/ipv6/conf/default/accept_dad",
    ] {
        sysctl(name, key, "0")?;
    }
    Ok(())
}

/// Deletes a named network namespace; a missing one is fine. The namespace itself lives on
/// until its last process exits.
pub fn delete(name: &str) -> Result<()> {
    if !exists(name) {
        return Ok(());
    }
    cmd::ip(["netns", "del", name]).map(drop)
}

/// The names in /run/netns.
pub fn list() -> Vec<String> {
    let Ok(entries) = fs::read_dir(NETNS_DIR) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

/// Moves the calling thread into the named network namespace.
///
/// Only this thread moves (and threads it creates later). Call it before making sockets.
pub fn enter(name: &str) -> Result<()> {
    let p = path(name);
    let file = fs::File::open(&p).with_context(|| format!("opening {}", p.display()))?;
    // SAFETY: the fd is valid for the call; setns has no memory-safety preconditions.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        let err = std::io::Error::last_os_error();
        bail!("setns into network namespace {name}: {err}");
    }
    Ok(())
}

/// Runs `f` on a new thread inside the named network namespace and returns its result
/// (a panic in `f` is passed on). Sockets made by `f` belong to that namespace.
pub fn in_netns<T, F>(name: &str, f: F) -> Result<T>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    std::thread::scope(|scope| {
        let handle = scope.spawn(move || -> Result<T> {
            enter(name)?;
            Ok(f())
        });
        match handle.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Sets a network sysctl (`key` like `net/ipv4/ip_forward`) inside the named namespace.
pub fn sysctl(name: &str, key: &str, value: &str) -> Result<()> {
    let file = PathBuf::from("/proc/sys").join(key);
    in_netns(name, || fs::write(&file, value))?
        .with_context(|| format!("setting {} = {value} in netns {name}", file.display()))
}
