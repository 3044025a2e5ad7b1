//! `cargo xtask run` and `cargo xtask test`.

use std::{path::PathBuf, process::Command, thread, time::Duration};

use anyhow::{Context as _, Result, bail};

use crate::{cmd, demo, setup, signals};

/// What `cargo xtask run` was given.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Run the daemon on these manifests instead of the demo.
    pub manifests: Option<PathBuf>,
    /// Run the daemon against this cluster instead of the demo.
    pub kubeconfig: Option<PathBuf>,
    /// Passed to the daemon (not allowed with the demo, which makes its own cgroup).
    pub cgroup_path: Option<PathBuf>,
    pub log_level: Option<String>,
    /// More daemon flags (given after `--`).
    pub daemon_args: Vec<String>,
}

/// `cargo xtask test [ARGS]`: set-up, then `cargo test ARGS` at the workspace root (so the
/// default members: proxy-ebpf only builds for the BPF target).
pub fn test(args: &[String]) -> Result<()> {
    setup::setup()?;
    let mut test = crate::cargo();
    // Every test binary runs even after one fails, so a CI log shows all failures at once.
    test.args(["test", "--no-fail-fast"]).args(args);
    println!("test: running `{}`", cmd::describe(&test));
    cmd::run(&mut test)
}

/// `cargo xtask bench`: set-up, then the `dataplane` and `nodeport` benches of
/// proxy-userland (plain programs printing tables; see proxy-userland/benches/).
pub fn bench(sizes: &[u32], connections: u32, rounds: u32) -> Result<()> {
    setup::setup()?;
    let sizes: Vec<String> = sizes.iter().map(u32::to_string).collect();
    for name in ["dataplane", "nodeport"] {
        let mut bench = crate::cargo();
        bench
            .args(["bench", "-p", "proxy-userland", "--bench", name])
            .env("FASTPATH_BENCH_SIZES", sizes.join(","))
            .env("FASTPATH_BENCH_CONNS", connections.to_string())
            .env("FASTPATH_BENCH_ROUNDS", rounds.to_string());
        println!("bench: running `{}`", cmd::describe(&bench));
        cmd::run(&mut bench)?;
    }
    Ok(())
}

/// Builds the daemon and the probe (release).
pub fn build_release() -> Result<()> {
    let mut build = crate::cargo();
    build.args(["build", "--release", "-p", "proxy-userland"]);
    println!("run: building fastpath (`{}`)", cmd::describe(&build));
    cmd::run(&mut build).context("building proxy-userland failed")
}

/// `target/release/<name>`, which must exist.
pub fn release_binary(name: &str) -> Result<PathBuf> {
    let path = crate::target_dir().join("release").join(name);
    if !path.is_file() {
        bail!(
            "{} does not exist after the build; does proxy-userland have a `{name}` binary?",
            path.display()
        );
    }
    Ok(path)
}

/// `cargo xtask run`: set-up, build, then the demo or (with --manifests/--kubeconfig) the
/// daemon with the given flags.
pub fn run(options: RunOptions) -> Result<()> {
    setup::setup()?;
    build_release()?;
    let daemon = release_binary("fastpath")?;
    if options.manifests.is_none() && options.kubeconfig.is_none() {
        if options.cgroup_path.is_some() {
            bail!(
                "--cgroup-path only goes with --manifests or --kubeconfig; the demo makes its own cgroup"
            );
        }
        let probe = release_binary("fastpath-probe")?;
        return demo::demo(
            &daemon,
            &probe,
            options.log_level.as_deref(),
            &options.daemon_args,
        );
    }
    let mut cmd = Command::new(&daemon);
    for (flag, value) in [
        (
            "--manifests",
            options.manifests.as_ref().map(|p| p.as_os_str()),
        ),
        (
            "--kubeconfig",
            options.kubeconfig.as_ref().map(|p| p.as_os_str()),
        ),
        (
            "--cgroup-path",
            options.cgroup_path.as_ref().map(|p| p.as_os_str()),
        ),
        (
            "--log-level",
            options.log_level.as_ref().map(|s| s.as_ref()),
        ),
    ] {
        if let Some(value) = value {
            cmd.arg(flag).arg(value);
        }
    }
    cmd.args(&options.daemon_args);
    println!("run: starting `{}` (Ctrl-C stops it)", cmd::describe(&cmd));
    // Ctrl-C reaches the daemon directly (same process group); we only wait for it.
    signals::install()?;
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", daemon.display()))?;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        thread::sleep(Duration::from_millis(100));
    };
    let interrupted = signals::stop_requested() && status.code().is_none();
    if !status.success() && !interrupted {
        bail!("fastpath exited: {status}");
    }
    Ok(())
}
