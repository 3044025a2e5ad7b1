//! `fastpath`: parse flags, set up logging, run the daemon until a signal.

use clap::Parser;
use proxy_userland::{config::Args, daemon, shutdown};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_new(&args.log_level).unwrap_or_else(|e| {
        eprintln!("invalid --log-level {:?} ({e}); using info", args.log_level);
        EnvFilter::new("info")
    });
    tracing_subscriber::fmt().with_env_filter(filter).with_target(false).init();
    match daemon::run(args, shutdown::signal_received()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
