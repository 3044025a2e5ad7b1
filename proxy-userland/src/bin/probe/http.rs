//! `serve --http`: an HTTP/1.1 keep-alive server answering every GET with the server's name,
//! and `serve --drain-ms`: what a well-behaved pod does on SIGTERM. It keeps serving (new
//! connections too, since proxies may not have heard of its termination yet), answers on
//! kept-alive connections with `Connection: close` so their clients move elsewhere, and exits
//! after the drain period (or when the kubelet's SIGKILL comes first).

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::Duration,
};

use super::serve::Replier;

/// Set by SIGTERM when draining is asked for.
static DRAINING: AtomicBool = AtomicBool::new(false);
/// Longest request head we accept.
const MAX_HEAD: usize = 8192;

extern "C" fn on_term(_: libc::c_int) {
    DRAINING.store(true, Ordering::SeqCst);
}

/// Makes SIGTERM start a drain of `drain`, after which the process exits 0.
pub fn drain_on_sigterm(drain: Duration) {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe { libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t) };
    thread::spawn(move || {
        while !DRAINING.load(Ordering::SeqCst) {
            thread::sleep(Duration::from_millis(10));
        }
        thread::sleep(drain);
        std::process::exit(0);
    });
}

pub fn http_server(listener: &TcpListener, replier: &Replier) {
    loop {
        match listener.accept() {
            Ok((conn, from)) => {
                let replier = replier.clone();
                thread::spawn(move || http_conn(conn, from, &replier));
            }
            Err(e) => {
                eprintln!("fastpath-probe: accept: {e}");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Serves requests on one connection until the client closes it, a head is bad, or we say
/// `Connection: close` (client's wish, or draining).
fn http_conn(conn: TcpStream, from: SocketAddr, replier: &Replier) {
    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
    let mut reader = BufReader::new(conn);
    loop {
        let mut head = 0usize;
        let mut first = true;
        let mut client_close = false;
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(n) => head += n,
            }
            if head > MAX_HEAD {
                return;
            }
            let line = line.trim_end();
            if first {
                first = false;
                continue;
            }
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':')
                && k.trim().eq_ignore_ascii_case("connection")
                && v.trim().eq_ignore_ascii_case("close")
            {
                client_close = true;
            }
        }
        let close = client_close || DRAINING.load(Ordering::SeqCst);
        let body = replier.reply(from);
        let response = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: {}\r\n\r\n{body}",
            body.len(),
            if close { "close" } else { "keep-alive" }
        );
        if reader.get_mut().write_all(response.as_bytes()).is_err() || close {
            return;
        }
    }
}
