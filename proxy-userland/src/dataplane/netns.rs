//! Running the proxier for another network namespace (`/run/netns/NAME`, as `ip netns`
//! names them): its iptables commands through `ip netns exec NAME`, its sockets from a
//! thread that entered the namespace with setns(2).
//!
//! Tests use this to program a test bed's node namespace without touching the host's
//! tables; it also lets one proxy serve a namespace other than its own.

use std::{ffi::OsStr, fs::File, os::fd::AsRawFd as _, path::PathBuf, process::Command};

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("network namespace {name}: cannot open {path}: {source}")]
    Open {
        name: String,
        path: String,
        source: std::io::Error,
    },
    #[error("network namespace {name}: setns failed: {source}")]
    Setns {
        name: String,
        source: std::io::Error,
    },
    #[error("bad network namespace name {0:?} (a name under /run/netns, no '/')")]
    BadName(String),
}

/// The bind mount that names a namespace.
pub fn path(name: &str) -> PathBuf {
    PathBuf::from("/run/netns").join(name)
}

/// Checks a namespace name before it goes into a path or a command line.
pub fn check_name(name: &str) -> Result<(), NetnsError> {
    let ok = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(NetnsError::BadName(name.to_string()))
    }
}

/// `program` as a command that runs in `netns` when one is given (through
/// `ip netns exec`), else as is.
pub fn command(netns: Option<&str>, program: impl AsRef<OsStr>) -> Command {
    match netns {
        Some(ns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns]).arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// Moves the calling thread (only it, and threads it starts later) into `name`.
pub fn enter(name: &str) -> Result<(), NetnsError> {
    check_name(name)?;
    let p = path(name);
    let file = File::open(&p).map_err(|source| NetnsError::Open {
        name: name.to_string(),
        path: p.display().to_string(),
        source,
    })?;
    // SAFETY: the fd is valid for the duration of the call; setns has no memory-safety
    // preconditions.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(NetnsError::Setns {
            name: name.to_string(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Runs `f` inside `ns` (None: where we are): on a thread of its own that enters the
/// namespace, so ours never changes namespace.
pub fn in_netns<T: Send>(ns: Option<&str>, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
    let Some(ns) = ns else { return Ok(f()) };
    std::thread::scope(|scope| {
        let handle = scope.spawn(move || {
            enter(ns)?;
            Ok(f())
        });
        handle
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_could_escape_are_refused() {
        assert!(check_name("fp-a-1-0-node").is_ok());
        for bad in ["", ".", "..", "a/b", "-x"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn commands_run_through_ip_netns_exec_only_with_a_namespace() {
        let c = command(Some("ns1"), "iptables-restore");
        assert_eq!(c.get_program(), "ip");
        let args: Vec<_> = c.get_args().collect();
        assert_eq!(args, ["netns", "exec", "ns1", "iptables-restore"]);
        assert_eq!(command(None, "iptables").get_program(), "iptables");
    }
}
