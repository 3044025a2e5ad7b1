//! `cargo xtask <setup|test|run|bench>`; see the README.

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
    /// Set up, then run the side-by-side benchmarks (eBPF against iptables, control plane and
    /// data path; node ports through tc against XDP) and write their tables to
    /// target/bench/results.md and target/bench/nodeport.md.
    Bench {
        /// Service counts for the control-plane rows (the data path uses 1 and the largest).
        #[arg(long, value_delimiter = ',', default_value = "100,1000,10000")]
        sizes: Vec<u32>,
        /// New connections (and UDP requests) per data-path run.
        #[arg(long, default_value_t = 2000)]
        connections: u32,
        /// Interleaved rounds per data-path comparison.
        #[arg(long, default_value_t = 5)]
        rounds: u32,
    },
    /// Build the container image localhost/fastpath:0.1.0 with podman, from a Debian root
    /// file system made by debootstrap (cached under target/image/) and the release binaries.
    Image,
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
            Cmd::Test { args } => xtask::run::test(&args),
            Cmd::Bench {
                sizes,
                connections,
                rounds,
            } => xtask::run::bench(&sizes, connections, rounds),
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
