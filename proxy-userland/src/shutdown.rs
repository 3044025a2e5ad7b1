//! The future that ends the daemon: SIGINT (Ctrl-C) or SIGTERM (kubelet stopping the pod).

use tokio::signal::unix::{SignalKind, signal};

/// Resolves on the first SIGINT or SIGTERM.
pub async fn signal_received() {
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot listen for SIGTERM ({e}); only Ctrl-C stops the proxy");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received, shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
    }
}
