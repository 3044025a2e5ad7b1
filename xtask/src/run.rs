//! `cargo xtask run` and `cargo xtask test`.

use std::{path::PathBuf, process::Command, thread, time::Duration};

use anyhow::{Context as _, Result, bail};

use crate::{cmd, demo, fuzz, setup, signals};

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

/// How long `cargo xtask test` runs each fuzz target: enough to replay the seeds and catch
/// a parser broken outright, little enough for CI (the build is most of the step).
pub const TEST_FUZZ_SECONDS: u64 = 10;

/// `cargo xtask test [ARGS]`: set-up, then `cargo test ARGS` at the workspace root (so the
/// default members: proxy-ebpf only builds for the BPF target); without ARGS, then every
/// fuzz target for [`TEST_FUZZ_SECONDS`].
pub fn test(args: &[String]) -> Result<()> {
    setup::setup()?;
    check()?;
    let mut test = crate::cargo();
    // Every test binary runs even after one fails, so a CI log shows all failures at once.
    test.args(["test", "--no-fail-fast"]).args(args);
    println!("test: running `{}`", cmd::describe(&test));
    let tested = cmd::run(&mut test);
    if !args.is_empty() {
        return tested;
    }
    // After the tests, even failed ones, for the same reason as --no-fail-fast.
    let fuzzed = fuzz::fuzz(&fuzz::FuzzOptions {
        seconds: TEST_FUZZ_SECONDS,
        targets: Vec::new(),
    });
    tested.and(fuzzed)
}

/// The code-health gate `cargo xtask test` runs before the tests: formatting, and clippy
/// with warnings denied over the default members (stable) and the eBPF crate (nightly, for
/// the BPF target, as its build script builds it).
pub fn check() -> Result<()> {
    let mut fmt = crate::cargo();
    fmt.args(["fmt", "--all", "--check"]);
    let mut clippy = crate::cargo();
    clippy.args(["clippy", "--all-targets", "--", "-D", "warnings"]);
    let mut clippy_ebpf = Command::new("cargo");
    clippy_ebpf
        .current_dir(crate::workspace_root())
        // Our own cargo's settings must not leak into the nightly one.
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        // The build-std target gets its own folder: sharing one with host builds would make
        // every switch between the two rebuild core.
        .env("CARGO_TARGET_DIR", crate::target_dir().join("ebpf-clippy"))
        .args([
            "+nightly",
            "clippy",
            "-p",
            "proxy-ebpf",
            "--target",
            "bpfel-unknown-none",
        ])
        .args(["-Z", "build-std=core", "--", "-D", "warnings"]);
    for (what, cmd) in [
        ("format", &mut fmt),
        ("lint", &mut clippy),
        ("lint eBPF", &mut clippy_ebpf),
    ] {
        println!("check: {what}: `{}`", cmd::describe(cmd));
        cmd::run(cmd).with_context(|| format!("the {what} check failed"))?;
    }
    Ok(())
}

/// What `cargo xtask bench` runs, and how much of it.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Service counts for the proxier's control-plane and data-path rows.
    pub sizes: Vec<u32>,
    /// Service counts for the whole-daemon rows (latency, memory).
    pub daemon_sizes: Vec<u32>,
    /// Service counts for the node-port rows.
    pub nodeport_sizes: Vec<u32>,
    pub connections: u32,
    pub rounds: u32,
    /// Measured changes per daemon row, and the time they may take.
    pub samples: u32,
    pub phase_secs: u64,
    /// Longest a daemon's first sync may take before its row says it did not finish.
    pub sync_secs: u64,
    /// Endpoint changes per second around the measured ones.
    pub churn: u32,
    /// Highest load average a connection run may see (None: the number of CPUs).
    pub max_load: Option<f64>,
    /// The cluster row: nodes, and services on each.
    pub cluster_nodes: u32,
    pub cluster_services: u32,
    /// Benches to run: any of dataplane, nodeport, daemon, cluster, dsr.
    pub only: Vec<String>,
}

/// The benches, in the order they run, and the file each writes under target/bench.
const BENCHES: [(&str, &str); 5] = [
    ("dataplane", "results.md"),
    ("nodeport", "nodeport.md"),
    ("daemon", "daemon.md"),
    ("cluster", "cluster.md"),
    ("dsr", "dsr.md"),
];

/// `cargo xtask bench`: set-up, then the `dataplane`, `nodeport`, `daemon`, `cluster` and `dsr` benches of
/// proxy-userland (plain programs printing tables; see proxy-userland/benches/), each
/// bounded in count and time; then every bench's Targets, together, printed and written to
/// target/bench/targets.md. A bench that fails does not stop the others.
pub fn bench(o: &BenchOptions) -> Result<()> {
    setup::setup()?;
    let join = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let started = std::time::Instant::now();
    let mut failed = Vec::new();
    for (name, _) in BENCHES
        .iter()
        .filter(|(n, _)| o.only.is_empty() || o.only.iter().any(|x| x == n))
    {
        let mut bench = crate::cargo();
        bench
            .args(["bench", "-p", "proxy-userland", "--bench", name])
            .env("FASTPATH_BENCH_SIZES", join(&o.sizes))
            .env("FASTPATH_BENCH_DAEMON_SIZES", join(&o.daemon_sizes))
            .env("FASTPATH_BENCH_NODEPORT_SIZES", join(&o.nodeport_sizes))
            .env("FASTPATH_BENCH_CONNS", o.connections.to_string())
            .env("FASTPATH_BENCH_ROUNDS", o.rounds.to_string())
            .env("FASTPATH_BENCH_SAMPLES", o.samples.to_string())
            .env("FASTPATH_BENCH_PHASE_SECS", o.phase_secs.to_string())
            .env("FASTPATH_BENCH_SYNC_SECS", o.sync_secs.to_string())
            .env("FASTPATH_BENCH_CHURN", o.churn.to_string())
            .env("FASTPATH_BENCH_CLUSTER_NODES", o.cluster_nodes.to_string())
            .env(
                "FASTPATH_BENCH_CLUSTER_SERVICES",
                o.cluster_services.to_string(),
            );
        if let Some(load) = o.max_load {
            bench.env("FASTPATH_BENCH_MAX_LOAD", load.to_string());
        }
        println!("bench: running `{}`", cmd::describe(&bench));
        if let Err(e) = cmd::run(&mut bench) {
            eprintln!("bench: {name} failed: {e:#}");
            failed.push(*name);
        }
    }
    let dir = crate::target_dir().join("bench");
    let mut targets = String::from("# Targets\n");
    for (name, file) in BENCHES {
        let text = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
        let section = targets_of(&text);
        if !section.is_empty() {
            targets.push_str(&format!(
                "\nFrom {name} (target/bench/{file}):\n\n{section}"
            ));
        }
    }
    targets.push_str(&format!(
        "\nThe whole bench took {:.0} s.\n",
        started.elapsed().as_secs_f64()
    ));
    println!("\n{targets}");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("targets.md"), &targets)?;
    if !failed.is_empty() {
        bail!("bench: {} failed (see above)", failed.join(", "));
    }
    Ok(())
}

/// The bullet lines of every `## Targets...` section of a results file.
fn targets_of(text: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with("## ") {
            inside = line.starts_with("## Targets");
            continue;
        }
        if inside && !line.trim().is_empty() {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
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
