//! `cargo xtask <setup|test|run|bench|fuzz>`; see the README.

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use xtask::run::RunOptions;

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "fastpath's chores"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Install what building and testing need (nightly + rust-src, bpf-linker, system tools).
    /// Idempotent and quick when done.
    Setup,
    /// Set up, then `cargo test ARGS...` over the default members (as root).
    Test {
        /// Passed to `cargo test` unchanged (including any `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Set up, then run the benchmarks: the proxier alone (eBPF against iptables, control
    /// plane and data path), node ports from another host (tc, XDP, iptables, direct), and
    /// the whole daemon (network programming latency, memory), and a cluster (the latency on
    /// every node); write their tables to target/bench/{results,nodeport,daemon,cluster}.md
    /// and their Targets to targets.md. Every
    /// part is bounded in count and time; these flags trim it.
    Bench {
        /// Service counts for the proxier rows (the data path also runs at 1).
        #[arg(long, value_delimiter = ',', default_value = "100,1000,10000")]
        sizes: Vec<u32>,
        /// Service counts for the whole-daemon rows.
        #[arg(long, value_delimiter = ',', default_value = "100,1000,10000,50000")]
        daemon_sizes: Vec<u32>,
        /// Service counts for the node-port rows.
        #[arg(long, value_delimiter = ',', default_value = "1,10000")]
        nodeport_sizes: Vec<u32>,
        /// New connections (and UDP requests) per data-path run.
        #[arg(long, default_value_t = 2000)]
        connections: u32,
        /// Interleaved rounds per data-path comparison.
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// Measured endpoint changes per daemon row (at most).
        #[arg(long, default_value_t = 100)]
        samples: u32,
        /// Longest the measured changes of one daemon row may take, in seconds.
        #[arg(long, default_value_t = 30)]
        phase_secs: u64,
        /// Longest a daemon's first sync may take, in seconds (the row then says so).
        #[arg(long, default_value_t = 300)]
        sync_secs: u64,
        /// Other endpoint changes per second while a daemon row measures.
        #[arg(long, default_value_t = 100)]
        churn: u32,
        /// Highest 1-minute load average a connection run may see (default: the CPUs).
        #[arg(long)]
        max_load: Option<f64>,
        /// Nodes of the cluster row (each runs fastpath as deploy/ ships it).
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=9))]
        cluster_nodes: u32,
        /// Services (x 10 endpoints) of the cluster row, at most 12,000 (the shipped map size).
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(2..=12_000))]
        cluster_services: u32,
        /// Run only these benches: dataplane, nodeport, daemon, cluster, dsr.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// Set up, build (release), and show a cluster: N nodes (network namespaces), a real
    /// fastpath on each as deploy/ ships it, a Deployment under load rolled and fastpath
    /// upgraded node by node, with a live table; everything is removed at the end or on
    /// Ctrl-C.
    Cluster {
        /// Nodes in the cluster (1 to 9).
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=9))]
        nodes: u8,
        /// Proxy mode per node, comma-separated (ebpf, iptables); the last one repeats for
        /// the remaining nodes, e.g. `--modes ebpf,ebpf,iptables` for a mixed cluster.
        #[arg(long, value_delimiter = ',', default_value = "ebpf")]
        modes: Vec<String>,
        /// Keep the cluster running after the show, until Ctrl-C.
        #[arg(long)]
        wait: bool,
    },
    /// Set up, build the fuzz targets (nightly), and run each for a bounded time; fails on a
    /// crash, hang or out-of-memory input, naming the reproducer (see docs/fuzzing.md).
    Fuzz {
        /// How long each target runs.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Run only this target (repeatable); default: every one in fuzz/fuzz_targets.
        #[arg(long = "target", value_name = "NAME")]
        targets: Vec<String>,
    },
    /// Build the container image localhost/fastpath:0.1.0 with podman, from a Debian root
    /// file system made by debootstrap (cached under target/image/) and the release binaries.
    Image,
    /// Run the tests that start the real daemon (every mode, --cleanup, inspect, explain,
    /// probes, SIGTERM) under `strace -f`, and rewrite deploy/seccomp/fastpath.json as the
    /// allow-list of the system calls they made.
    SeccompTrace {
        /// Only these integration tests of proxy-userland (default: every daemon workload).
        tests: Vec<String>,
        /// Rewrite the profile from the last trace (target/seccomp-trace) without running
        /// the tests again.
        #[arg(long)]
        no_run: bool,
    },
    /// Set up, build (release), and run the demo; with --manifests or --kubeconfig, run the
    /// daemon instead.
    Run {
        /// Run fastpath on these manifests (file or folder) instead of the demo.
        #[arg(long, value_name = "PATH")]
        manifests: Option<PathBuf>,
        /// Run fastpath against this cluster instead of the demo.
        #[arg(long, value_name = "FILE")]
        kubeconfig: Option<PathBuf>,
        /// fastpath's --cgroup-path (only with --manifests or --kubeconfig).
        #[arg(long, value_name = "DIR")]
        cgroup_path: Option<PathBuf>,
        /// fastpath's --log-level.
        #[arg(long, value_name = "LEVEL")]
        log_level: Option<String>,
        /// More fastpath flags, after `--`.
        #[arg(last = true)]
        daemon_args: Vec<String>,
    },
}

fn main() -> ExitCode {
    // `test` hands its arguments to cargo untouched; clap would eat a leading `--`.
    let argv: Vec<String> = std::env::args().collect();
    let result = if argv.get(1).map(String::as_str) == Some("test") {
        xtask::run::test(&argv[2..])
    } else {
        match Cli::parse().command {
            Cmd::Setup => xtask::setup::setup(),
            Cmd::Image => xtask::image::image(),
            Cmd::SeccompTrace { tests, no_run } => xtask::seccomp::trace(&tests, !no_run),
            Cmd::Fuzz { seconds, targets } => xtask::setup::setup()
                .and_then(|()| xtask::fuzz::fuzz(&xtask::fuzz::FuzzOptions { seconds, targets })),
            Cmd::Cluster { nodes, modes, wait } => {
                let last = modes.last().cloned().unwrap_or_else(|| "ebpf".into());
                let modes = (0..usize::from(nodes))
                    .map(|i| modes.get(i).cloned().unwrap_or_else(|| last.clone()))
                    .collect();
                xtask::cluster::demo::cluster_demo(&xtask::cluster::demo::DemoOptions {
                    modes,
                    wait,
                })
            }
            Cmd::Test { args } => xtask::run::test(&args),
            Cmd::Bench {
                sizes,
                daemon_sizes,
                nodeport_sizes,
                connections,
                rounds,
                samples,
                phase_secs,
                sync_secs,
                churn,
                max_load,
                cluster_nodes,
                cluster_services,
                only,
            } => xtask::run::bench(&xtask::run::BenchOptions {
                sizes,
                daemon_sizes,
                nodeport_sizes,
                connections,
                rounds,
                samples,
                phase_secs,
                sync_secs,
                churn,
                max_load,
                cluster_nodes,
                cluster_services,
                only,
            }),
            Cmd::Run {
                manifests,
                kubeconfig,
                cgroup_path,
                log_level,
                daemon_args,
            } => xtask::run::run(RunOptions {
                manifests,
                kubeconfig,
                cgroup_path,
                log_level,
                daemon_args,
            }),
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
