//! fastpath's chores (`cargo xtask setup | test | run | fuzz`) and the network-namespace test bed.
//!
//! The test bed ([`testbed::Testbed`]) is what proxy-userland's integration tests and the demo
//! build on: private network namespaces joined by veth pairs, a cgroup v2 for the client side,
//! and helper processes that are all torn down on drop. This crate must not depend on
//! proxy-userland: that crate's build script needs the toolchain that `setup` installs.

pub mod apiserver;
pub mod cgroup;
pub mod cluster;
pub mod cmd;
pub mod demo;
pub mod fuzz;
pub mod image;
pub mod memcg;
pub mod netns;
pub mod probe;
pub mod run;
pub mod seccomp;
pub mod setup;
pub mod signals;
pub mod testbed;

use std::path::{Path, PathBuf};

pub use testbed::{Pod, Testbed, reap_stale};

/// The workspace root (the folder holding the top-level Cargo.toml).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Cargo's target folder: `$CARGO_TARGET_DIR` if set, else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                workspace_root().join(dir)
            }
        }
        _ => workspace_root().join("target"),
    }
}

/// The cargo to run: the one that started us (`$CARGO`), else `cargo` from PATH.
pub fn cargo() -> std::process::Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(workspace_root());
    cmd
}

/// Fails unless we run as root; the test bed and the daemon need it.
pub fn require_root(what: &str) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!("{what} needs root (network namespaces, cgroups, BPF); run it as root");
    }
    Ok(())
}
