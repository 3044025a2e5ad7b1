//! `fastpath`: parse flags and the config file, set up logging, run the daemon until a
//! signal.

use clap::CommandFactory;
use proxy_userland::{
    config::{Args, LogFormat},
    daemon, shutdown,
};
use tracing_subscriber::EnvFilter;

/// jemalloc, not glibc's malloc. A first sync decodes and frees hundreds of thousands of
/// small objects on four threads at once: glibc, held to one arena to keep its slack down,
/// spent a fifth of that CPU coalescing free chunks and faulting trimmed pages back in.
/// With jemalloc the 50,000-service first sync took ~40% less CPU and less RSS
/// (docs/benchmarks.md).
#[global_allocator]
static HEAP: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings, read at its start (`_RJEM_MALLOC_CONF` in the environment overrides
/// them), chosen for RSS: one arena where it would make eight on two CPUs, and thread caches
/// for small sizes only. Freed pages are kept a second for reuse: given back at once, every
/// list page of a first sync faulted in fresh zeroed pages (the first sync at 50,000
/// services took 2.0 s instead of 1.4). The sync engine purges after each full sync, as the
/// idle daemon makes no allocations that would let jemalloc's decay run. With jemalloc's
/// defaults RSS was 154 MiB instead of 112 at 50,000 services (before later savings).
// The export is sound: jemalloc reads this symbol once, as a `const char *` (which an
// `Option<&u8>` is laid out as) to a NUL-terminated string, and the bytes are static.
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static JEMALLOC_CONF: Option<&u8> = Some(&JEMALLOC_CONF_TEXT[0]);
static JEMALLOC_CONF_TEXT: [u8; 63] =
    *b"narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0,tcache_max:1024\0";

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
    daemon_main(setup_only)
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
