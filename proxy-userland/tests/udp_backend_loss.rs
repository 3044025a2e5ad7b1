//! Connected UDP clients whose backend goes away, through the real daemon and manifests:
//! what the client sees, and what the daemon says when it cannot help.

mod common;

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Stdio},
    sync::mpsc,
    time::Duration,
};

use common::*;

struct RmDir(PathBuf);

impl Drop for RmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn manifest_dir(tag: &str) -> RmDir {
    let dir = std::env::temp_dir().join(format!("fastpath-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    RmDir(dir)
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET http://127.0.0.1:port/metrics, or "" if nobody answers.
fn metrics(port: u16) -> String {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The value of sample line `name` (with its labels) in a scrape.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// The log without its colour codes.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ ... final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A probe client whose lines arrive on a channel; killed on drop.
struct Client {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Client {
    fn spawn(mut cmd: std::process::Command) -> Self {
        let mut child = cmd.stdout(Stdio::piped()).spawn().expect("probe client");
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Client { child, lines }
    }

    fn next(&self) -> Option<String> {
        self.lines.recv_timeout(Duration::from_secs(5)).ok()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Cilium's and Calico's users meet this when the agent runs without CAP_SYS_ADMIN or the
/// client's namespace is out of reach: the reset cannot be done. It must be said and
/// counted, not skipped in silence, since the client is then cut off.
#[test]
fn a_socket_reset_that_cannot_be_done_is_logged_and_counted() {
    let (bed, _pods) = bed_with_pods("rstfail", 2);
    let dir = manifest_dir("rstfail");
    std::fs::write(
        dir.0.join("web.yaml"),
        web_manifest(&[pod_ip(1), pod_ip(2)]),
    )
    .unwrap();
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    // Without CAP_SYS_ADMIN the daemon still loads and attaches its programs (CAP_BPF,
    // CAP_NET_ADMIN), but cannot enter the client's network namespace.
    let no_sys_admin = [
        "setpriv",
        "--inh-caps=-sys_admin",
        "--bounding-set=-sys_admin",
        "--",
    ];
    let daemon = Daemon::start_wrapped(
        &no_sys_admin,
        bed.cgroup_path(),
        &[
            "--proxy-mode",
            "ebpf",
            "--manifests",
            dir.0.to_str().unwrap(),
            "--manifest-poll-period",
            "100ms",
            "--metrics-bind-address",
            &metrics_addr,
        ],
    );
    assert!(
        eventually(20, || tcp(&bed, WEB, 1)[0].is_ok()),
        "the ClusterIP never became reachable; log:\n{}",
        daemon.log()
    );

    let mut cmd = bed.client(probe());
    cmd.args(["udp", WEB_DNS, "--connected", "--count", "200"]);
    cmd.args(["--interval-ms", "100", "--timeout-ms", "200"]);
    let client = Client::spawn(cmd);
    let first = client.next().expect("a first probe line");
    let victim = xtask::probe::parse_line(&first)
        .and_then(|o| o.reply().map(str::to_string))
        .unwrap_or_else(|| panic!("first attempt failed: {first}"));
    let survivor = if victim == "pod-1" {
        pod_ip(2)
    } else {
        pod_ip(1)
    };
    std::fs::write(dir.0.join("web.yaml"), web_manifest(&[survivor])).unwrap();

    let failed = r#"fastpath_udp_socket_resets_total{result="failed"}"#;
    assert!(
        eventually(10, || sample(&metrics(metrics_port), failed)
            .is_some_and(|v| v >= 1.0)),
        "no failed reset counted; metrics:\n{}\nlog:\n{}",
        metrics(metrics_port),
        daemon.log()
    );
    let text = metrics(metrics_port);
    assert_eq!(
        sample(&text, r#"fastpath_udp_socket_resets_total{result="done"}"#),
        Some(0.0),
        "{text}"
    );
    let log = strip_ansi(&daemon.log());
    let warning = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains("cannot reset connected UDP sockets"))
        .unwrap_or_else(|| panic!("no warning about the reset; log:\n{log}"));
    assert!(
        warning.contains("demo/web"),
        "the warning names the service: {warning}"
    );
    assert!(
        warning.contains("namespaces=1"),
        "and how many namespaces it concerns: {warning}"
    );
}
