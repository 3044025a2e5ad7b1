//! `fastpath`: parse flags and the config file, set up logging, run the daemon until a
//! signal.

use clap::CommandFactory;
use proxy_userland::{
    config::{Args, LogFormat},
    daemon, shutdown,
};
use tracing_subscriber::EnvFilter;

fn main() -> std::process::ExitCode {
    // `fastpath inspect|explain ...` are tools, not the daemon: dispatched before the
    // daemon's flags are parsed, and without its runtime.
    let first = std::env::args_os().nth(1);
    if first
        .as_ref()
        .is_some_and(|a| proxy_userland::inspect::SUBCOMMANDS.iter().any(|s| a == *s))
    {
        return proxy_userland::inspect::main(std::env::args_os().collect());
    }
    // `fastpath node-setup FLAGS...`: only the node set-up (conntrack sysctls, as the
    // DaemonSet's privileged init container runs it), with the daemon's flags and config.
    let setup_only = first.is_some_and(|a| a == "node-setup");
    one_heap_arena();
    daemon_main(setup_only)
}

/// One malloc arena for the whole daemon, set before any thread starts. glibc gives each
/// allocating thread an arena of its own; the source's threads decode objects, the engine
/// converts and keeps them, and every arena keeps its own free pages: at 10,000 services
/// that slack was 13 MB of a 79 MB RSS (VmHWM 79 -> 66 MiB with one arena). The daemon
/// allocates at most a few hundred times per change, so one arena's lock costs nothing
/// measurable (the daemon bench's latency is unchanged). A `MALLOC_ARENA_MAX` in the
/// environment is left to rule.
fn one_heap_arena() {
    #[cfg(target_env = "gnu")]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets a glibc tunable; called before any other thread exists.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

#[tokio::main]
async fn daemon_main(setup_only: bool) -> std::process::ExitCode {
    let argv = std::env::args_os()
        .enumerate()
        .filter(|(i, _)| !(setup_only && *i == 1))
        .map(|(_, a)| a);
    // Exits itself for --help, --version and malformed flags.
    let matches = Args::command().get_matches_from(argv);
    let args = match Args::from_matches(&matches) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("fastpath: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    // Checked when parsed (config::LogLevel).
    let filter = EnvFilter::new(args.log_level.as_str());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    match args.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    for warning in &args.config_warnings {
        tracing::warn!("{warning}");
    }
    if setup_only {
        match args.node_setup() {
            Some(setup) => proxy_userland::node_setup::apply_to_node(&setup),
            None => {
                tracing::warn!("node set-up is off: --node-setup or fastpath.nodeSetup turn it on")
            }
        }
        return std::process::ExitCode::SUCCESS;
    }
    match daemon::run(args, shutdown::signal_received()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // A setting start-up cannot make sense of: the status of a bad flag.
        Err(e) if e.is::<proxy_userland::dataplane::primary::PrimaryError>() => {
            tracing::error!("{e:#}");
            eprintln!("fastpath: {e}");
            std::process::ExitCode::from(2)
        }
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
