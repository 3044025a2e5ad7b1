//! An admin HTTP request: arbitrary bytes sent as one client connection into the admin
//! servers' real hyper service (the health handler, or the metrics one when the first byte
//! is odd), over an in-memory pipe. The answer must be nothing (the connection closed) or
//! one well-formed HTTP/1.x status line and head.
#![no_main]

use std::{sync::OnceLock, time::Duration};

use libfuzzer_sys::fuzz_target;
use proxy_userland::admin::{AdminState, health_handler, http, metrics_handler};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    let state = AdminState::new(Duration::from_secs(10));
    let handler = match data.first() {
        Some(b) if b % 2 == 1 => metrics_handler(state),
        _ => health_handler(state),
    };
    let request = data.to_vec();
    let answer = runtime().block_on(async move {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let served = tokio::spawn(http::serve_one(server, handler));
        // The server may answer and close before taking it all.
        let _ = client.write_all(&request).await;
        let _ = client.shutdown().await;
        let mut answer = Vec::new();
        let _ = client.read_to_end(&mut answer).await;
        let _ = served.await.expect("the connection task does not panic");
        answer
    });
    if answer.is_empty() {
        return;
    }
    let head_end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete head");
    let head = std::str::from_utf8(&answer[..head_end]).expect("a text head");
    let status = head.lines().next().unwrap_or_default();
    let mut parts = status.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().unwrap_or_default();
    assert!(
        matches!(version, "HTTP/1.1" | "HTTP/1.0")
            && code.len() == 3
            && code.bytes().all(|b| b.is_ascii_digit()),
        "bad status line {status:?}"
    );
});
