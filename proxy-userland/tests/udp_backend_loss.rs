//! Connected UDP clients whose backend goes away, through the real daemon and manifests:
//! what the client sees, and what the daemon says when it cannot help.

mod common;

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use common::*;

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

/// Cilium's and Calico's users meet this when the agent runs without CAP_SYS_ADMIN or the
/// client's namespace is out of reach: the reset cannot be done. It must be said and
/// counted, not skipped in silence, since the client is then cut off.
#[test]
fn a_socket_reset_that_cannot_be_done_is_logged_and_counted() {
    // Without CAP_SYS_ADMIN the daemon still loads and attaches its programs (CAP_BPF,
    // CAP_NET_ADMIN), but cannot enter the client's network namespace.
    let no_sys_admin = [
        "setpriv",
        "--inh-caps=-sys_admin",
        "--bounding-set=-sys_admin",
        "--",
    ];
    reset_cannot_be_done("rstfail", &no_sys_admin, &[], "namespaces=1");
}

/// A DaemonSet without CAP_SYS_PTRACE (the one shipped before it was added) and a client
/// that runs as another user, as most pods do. /proc/PID/ns/net of such a process is closed
/// to the daemon (EACCES), so its sockets cannot be searched: said and counted, with the
/// error, instead of skipped as if the process had exited.
#[test]
fn a_client_namespace_the_daemon_may_not_open_is_logged_and_counted() {
    let keep: String = daemonset_caps()
        .iter()
        .filter(|c| *c != "SYS_PTRACE")
        .map(|c| format!(",+{}", c.to_lowercase()))
        .collect();
    let bounding = format!("--bounding-set=-all{keep}");
    let daemon = [
        "setpriv",
        bounding.as_str(),
        "--inh-caps=-all",
        "--no-new-privs",
        "--",
    ];
    reset_cannot_be_done("rstperm", &daemon, NOBODY, "os error 13");
}

/// A client process running as another user (nobody) with no capabilities, as most pods.
const NOBODY: &[&str] = &[
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
    "--inh-caps=-all",
    "--",
];

/// A DaemonSet without `hostPID`: the daemon's PID namespace shows the clients in the
/// cgroup as pid 0, so their network namespaces cannot be found, let alone entered. Said
/// and counted too, with the fix in the warning.
#[test]
fn a_daemon_that_cannot_see_the_clients_pids_says_so() {
    let own_pid_namespace = [
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--",
    ];
    reset_cannot_be_done("rstpid", &own_pid_namespace, &[], "hostPID");
}

/// The daemon, run through `wrapper`, loses a UDP client's backend (the client run through
/// `client_wrapper` when not empty) and cannot reset the client's socket: a failed reset
/// is counted, none done, and a warning naming the service and containing `why` is logged.
fn reset_cannot_be_done(tag: &str, wrapper: &[&str], client_wrapper: &[&str], why: &str) {
    let (bed, _pods) = bed_with_pods(tag, 2);
    let dir = manifest_dir(tag);
    std::fs::write(
        dir.0.join("web.yaml"),
        web_manifest(&[pod_ip(1), pod_ip(2)]),
    )
    .unwrap();
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let daemon = ebpf_daemon(
        &bed,
        wrapper,
        &dir.0,
        &["--metrics-bind-address", &metrics_addr],
    );

    let mut cmd = node_client(&bed, client_wrapper);
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
    assert!(warning.contains(why), "and why ({why}): {warning}");
}

/// Up to `n` of the client's next lines (each waited for at most 5 s), with when each came
/// after `since`.
fn lines_since(client: &Client, since: Instant, n: usize) -> Vec<(Duration, String)> {
    let mut out = Vec::new();
    while let Ok((at, line)) = client.lines.recv_timeout(Duration::from_secs(5)) {
        out.push((at.duration_since(since), line));
        if out.len() == n {
            break;
        }
    }
    out
}

/// The daemon in eBPF mode, run through `wrapper`, serving the manifests in `dir` (polled
/// every 100 ms) with `extra` flags; returned once the ClusterIP answers.
fn ebpf_daemon(
    bed: &xtask::testbed::Testbed,
    wrapper: &[&str],
    dir: &std::path::Path,
    extra: &[&str],
) -> Daemon {
    let mut args = vec![
        "--proxy-mode",
        "ebpf",
        "--manifests",
        dir.to_str().unwrap(),
        "--manifest-poll-period",
        "100ms",
    ];
    args.extend_from_slice(extra);
    let daemon = Daemon::start_wrapped(wrapper, bed.cgroup_path(), &args);
    assert!(
        eventually(20, || tcp(bed, WEB, 1)[0].is_ok()),
        "the ClusterIP never became reachable; log:\n{}",
        daemon.log()
    );
    daemon
}

/// The probe as a client on the node: itself, or run through `wrapper` when there is one.
fn node_client(bed: &xtask::testbed::Testbed, wrapper: &[&str]) -> std::process::Command {
    if wrapper.is_empty() {
        bed.client(probe())
    } else {
        wrapped_client(bed, wrapper)
    }
}

/// The probe in the bed's client cgroup and node namespace, run through `wrapper` (e.g.
/// `setpriv` to another user), which then cannot join them itself: the shell joins the
/// cgroup, nsenter the namespace; add the probe's subcommand.
fn wrapped_client(bed: &xtask::testbed::Testbed, wrapper: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new("sh");
    cmd.arg("-c")
        .arg(r#"echo $$ > "$0/cgroup.procs" && exec "$@""#)
        .arg(bed.cgroup_path())
        .arg("nsenter")
        .arg(format!("--net=/run/netns/{}", bed.node_netns()))
        .arg("--")
        .args(wrapper)
        .arg(probe());
    cmd.stdin(std::process::Stdio::null());
    cmd
}

/// What statsd clients and DNS stubs do: one connected UDP socket, never reconnected, send
/// errors ignored. Its backend leaves the EndpointSlice (the pod still answers, so only the
/// proxy can move the flow): within a second its datagrams reach the other pod, with no
/// error on the way, replies still from the ClusterIP. And while a backend lives, the flow
/// stays on it. The client is a pod, so its UDP goes per packet through its device.
#[test]
fn a_connected_udp_client_that_never_reconnects_moves_to_a_live_backend_within_a_second() {
    let manifest = |pods: &[u8]| web_manifest(&pods.iter().map(|&i| pod_ip(i)).collect::<Vec<_>>());
    udp_client_moves("udpmove", false, WEB_DNS, &manifest, &with_prefix);
}

/// As deploy/ ships it: the ConfigMap's config file (only what a test must override
/// given: cgroup, admin addresses, node name, pin dir, the manifests instead of a
/// cluster), the DaemonSet's capabilities and its `--skip-node-setup`, in the node's
/// network namespace (hostNetwork) where the pods' veths are, no CNI prefix named. A pod's
/// connected UDP socket that never reconnects moves to a live backend when its own leaves.
#[test]
fn as_shipped_a_pods_connected_udp_client_moves_to_a_live_backend() {
    let manifest = |pods: &[u8]| web_manifest(&pods.iter().map(|&i| pod_ip(i)).collect::<Vec<_>>());
    udp_client_moves("udpship", false, WEB_DNS, &manifest, &as_shipped);
}

/// The daemon on the bed's node namespace's devices named by the bed's prefix (`fpv`).
fn with_prefix(bed: &xtask::testbed::Testbed, manifests: &std::path::Path) -> Started {
    let daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--proxy-mode",
            "ebpf",
            "--netns",
            bed.node_netns(),
            "--pod-interface-name-prefix",
            "fpv",
            "--manifests",
            manifests.to_str().unwrap(),
            "--manifest-poll-period",
            "100ms",
        ],
    );
    (None, daemon)
}

/// The daemon as deploy/ runs it, inside the bed's node namespace (see the test above).
fn as_shipped(bed: &xtask::testbed::Testbed, manifests: &std::path::Path) -> Started {
    let Shipped { daemon, pins } =
        start_as_shipped(bed, &[&format!("--manifests={}", manifests.display())]);
    (Some(pins), daemon)
}

/// A daemon, and the bpffs its pins live on (unmounted after the daemon is gone).
type Started = (Option<Bpffs>, Daemon);

/// The same over IPv6 (a dual-stack Service, the client's socket on the v6 ClusterIP): the
/// pod's v6 UDP goes per packet through its device as its v4 UDP does.
#[test]
fn a_connected_ipv6_udp_client_that_never_reconnects_moves_to_a_live_backend_within_a_second() {
    udp_client_moves("udpmove6", true, WEB6_DNS, &web_manifest_dual, &with_prefix);
}

/// The client, a pod (dual-stack with `dual`), sends to `target` through one connected
/// socket; `manifest(pods)` serves `demo/web` with pods `pods` (by index); `start(bed,
/// manifests folder)` starts the daemon.
fn udp_client_moves(
    tag: &str,
    dual: bool,
    target: &str,
    manifest: &dyn Fn(&[u8]) -> String,
    start: &dyn Fn(&xtask::testbed::Testbed, &std::path::Path) -> Started,
) {
    let (bed, client_pod) = bed_with_client(tag, dual);
    let dir = manifest_dir(tag);
    std::fs::write(dir.0.join("web.yaml"), manifest(&[1, 2])).unwrap();
    let (_pins, daemon) = start(&bed, &dir.0);
    let udp_once = ["udp", target, "--count", "1", "--timeout-ms", "300"];
    assert!(
        eventually(20, || pod_probe(&bed, &client_pod, &udp_once)[0].is_ok()),
        "the ClusterIP never answered the pod; log:\n{}",
        daemon.log()
    );

    let mut cmd = pod_client(&bed, &client_pod);
    cmd.args(["udp", target, "--connected", "--count", "150"]);
    cmd.args(["--interval-ms", "100", "--timeout-ms", "200"]);
    let client = Client::spawn(cmd);
    let mut before = Vec::new();
    for _ in 0..15 {
        before.push(client.next().expect("a probe line"));
    }
    let outcomes: Vec<_> = before
        .iter()
        .filter_map(|l| xtask::probe::parse_line(l))
        .collect();
    assert_eq!(outcomes.len(), 15, "{before:?}");
    let victim = outcomes[0]
        .reply()
        .unwrap_or_else(|| panic!("{before:?}"))
        .to_string();
    for o in &outcomes {
        assert_eq!(
            o.reply(),
            Some(victim.as_str()),
            "one flow, one backend: {before:?}"
        );
        assert_eq!(
            from(o),
            Some(target),
            "replies come from the ClusterIP: {before:?}"
        );
        assert_eq!(
            peer(o),
            Some(target),
            "the socket's peer is the ClusterIP: {before:?}"
        );
    }

    let survivor = if victim == "pod-1" { 2 } else { 1 };
    let removed_at = Instant::now();
    std::fs::write(dir.0.join("web.yaml"), manifest(&[survivor])).unwrap();
    let after = lines_since(&client, removed_at, 30);
    let parsed: Vec<_> = after
        .iter()
        .map(|(at, l)| (*at, xtask::probe::parse_line(l), l.clone()))
        .collect();
    let moved = parsed
        .iter()
        .position(|(_, o, _)| {
            o.as_ref()
                .is_some_and(|o| o.is_ok() && o.reply() != Some(victim.as_str()))
        })
        .unwrap_or_else(|| panic!("never reached the live pod after {victim} left: {after:?}"));
    assert!(
        parsed[moved].0 <= Duration::from_secs(1),
        "the first datagram served by the live pod came {:?} after the removal: {after:?}",
        parsed[moved].0
    );
    for (_, o, line) in &parsed {
        let o = o.as_ref().unwrap_or_else(|| panic!("unparsed line {line}"));
        // Timeouts are the only failure allowed (datagrams in flight while it moves); a
        // socket error would mean the socket was torn down under the client.
        assert!(
            o.is_ok() || o.errno() == Some("ETIMEDOUT"),
            "socket error: {after:?}"
        );
    }
    for (_, o, _) in &parsed[moved..] {
        let o = o.as_ref().unwrap();
        assert!(
            o.is_ok() && o.reply() != Some(victim.as_str()),
            "back to {victim}: {after:?}"
        );
        assert_eq!(from(o), Some(target), "{after:?}");
    }
}

/// kube-proxy's rule for terminating endpoints (pkg/proxy/conntrack/cleanup.go): a pod
/// that got SIGTERM but still serves (ready=false, serving=true, terminating=true) gets no
/// new flows while a ready pod exists, but keeps the ones it has until it leaves the slice.
/// A client on the node (its UDP translated at connect()) keeps getting answers from its
/// terminating backend, without a reset or any error, for as long as the endpoint serves;
/// once it leaves the slice the client lands on the live pod.
#[test]
fn a_connected_udp_client_keeps_its_terminating_backend_until_it_leaves_the_slice() {
    let tag = "udpterm";
    let (bed, _pods) = bed_with_pods(tag, 2);
    let dir = manifest_dir(tag);
    let write = |eps: &[(std::net::Ipv4Addr, &str)]| {
        std::fs::write(dir.0.join("web.yaml"), web_manifest_with(eps)).unwrap();
    };
    write(&[(pod_ip(1), READY), (pod_ip(2), READY)]);
    let daemon = ebpf_daemon(&bed, &[], &dir.0, &[]);

    let mut cmd = bed.client(probe());
    cmd.args(["udp", WEB_DNS, "--connected", "--reconnect-on-error"]);
    cmd.args([
        "--count",
        "150",
        "--interval-ms",
        "100",
        "--timeout-ms",
        "200",
    ]);
    let client = Client::spawn(cmd);
    let first = client.next().expect("a first probe line");
    let victim = xtask::probe::parse_line(&first)
        .and_then(|o| o.reply().map(str::to_string))
        .unwrap_or_else(|| panic!("first attempt failed: {first}"));
    let (victim_ip, survivor_ip) = if victim == "pod-1" {
        (pod_ip(1), pod_ip(2))
    } else {
        (pod_ip(2), pod_ip(1))
    };

    // The victim terminates but serves: 3 s of answers from it, no error.
    write(&[(victim_ip, TERMINATING_SERVING), (survivor_ip, READY)]);
    let mut draining = Vec::new();
    while draining.len() < 30 {
        match client.lines.recv_timeout(Duration::from_secs(5)) {
            Ok((_, line)) => draining.push(line),
            Err(_) => panic!("the client stopped answering: {draining:?}"),
        }
    }
    for line in &draining {
        let o = xtask::probe::parse_line(line).unwrap_or_else(|| panic!("unparsed {line}"));
        assert!(
            o.is_ok() && o.reply() == Some(victim.as_str()),
            "while {victim} terminates but serves, its client keeps it: {line} in \
             {draining:?}\nlog:\n{}",
            daemon.log()
        );
    }

    // It leaves the slice: the client moves to the live pod.
    write(&[(survivor_ip, READY)]);
    let mut after = Vec::new();
    while after.len() < 40 {
        let Ok((_, line)) = client.lines.recv_timeout(Duration::from_secs(5)) else {
            break;
        };
        after.push(line);
    }
    let outcomes: Vec<_> = after
        .iter()
        .map(|l| xtask::probe::parse_line(l).unwrap_or_else(|| panic!("unparsed {l}")))
        .collect();
    let moved = outcomes
        .iter()
        .position(|o| o.is_ok() && o.reply() != Some(victim.as_str()))
        .unwrap_or_else(|| {
            panic!(
                "still on {victim} after it left the slice: {after:?}\nlog:\n{}",
                daemon.log()
            )
        });
    // The daemon connects the socket to the Service again: no reset, no error on the way
    // (a datagram in flight may time out).
    assert!(
        outcomes[..moved]
            .iter()
            .all(|o| o.is_ok() || o.errno() == Some("ETIMEDOUT")),
        "the move needed no reset of the socket: {after:?}"
    );
    assert!(
        outcomes[moved..]
            .iter()
            .all(|o| o.is_ok() && o.reply() != Some(victim.as_str())),
        "and stays on the live pod: {after:?}"
    );
}

/// Issue 23 point 3: a client on the node itself (hostNetwork pods, node agents), whose UDP
/// the socket hooks translate once at connect(): one connected socket, never reconnected,
/// send errors ignored. When its backend leaves, the daemon connects the socket to the
/// Service again instead of destroying it (which would fail every later send with
/// EDESTADDRREQ): within a second its datagrams reach the live pod, with no socket error,
/// and replies and getpeername() still show the ClusterIP.
#[test]
fn a_connected_udp_client_on_the_node_that_never_reconnects_moves_to_a_live_backend() {
    node_client_moves("udphost", &[], &[]);
}

/// As shipped: the daemon with the DaemonSet's capabilities, the client running as another
/// user without capabilities (a hostNetwork pod's process): the socket is moved all the same.
#[test]
fn as_shipped_a_node_clients_connected_udp_socket_moves_to_a_live_backend() {
    let daemon: Vec<String> = daemonset_setpriv();
    let daemon: Vec<&str> = daemon.iter().map(String::as_str).collect();
    node_client_moves("udphostship", &daemon, NOBODY);
}

/// The daemon run through `wrapper`, the client on the node through `client_wrapper`.
fn node_client_moves(tag: &str, wrapper: &[&str], client_wrapper: &[&str]) {
    let (bed, _pods) = bed_with_pods(tag, 2);
    let dir = manifest_dir(tag);
    std::fs::write(
        dir.0.join("web.yaml"),
        web_manifest(&[pod_ip(1), pod_ip(2)]),
    )
    .unwrap();
    let daemon = ebpf_daemon(&bed, wrapper, &dir.0, &[]);
    let mut cmd = node_client(&bed, client_wrapper);
    cmd.args(["udp", WEB_DNS, "--connected", "--count", "150"]);
    cmd.args(["--interval-ms", "100", "--timeout-ms", "200"]);
    let client = Client::spawn(cmd);
    let mut before = Vec::new();
    for _ in 0..10 {
        before.push(client.next().expect("a probe line"));
    }
    let first = xtask::probe::parse_line(&before[0]).unwrap_or_else(|| panic!("{before:?}"));
    let victim = first
        .reply()
        .unwrap_or_else(|| panic!("{before:?}"))
        .to_string();
    let survivor = if victim == "pod-1" { 2 } else { 1 };

    let removed_at = Instant::now();
    std::fs::write(dir.0.join("web.yaml"), web_manifest(&[pod_ip(survivor)])).unwrap();
    let after = lines_since(&client, removed_at, 30);
    let parsed: Vec<_> = after
        .iter()
        .map(|(at, l)| {
            let o = xtask::probe::parse_line(l).unwrap_or_else(|| panic!("unparsed {l}"));
            (*at, o)
        })
        .collect();
    for (_, o) in &parsed {
        assert!(
            o.is_ok() || o.errno() == Some("ETIMEDOUT"),
            "socket error (the socket was torn down under the client): {after:?}\nlog:\n{}",
            daemon.log()
        );
    }
    let moved = parsed
        .iter()
        .position(|(_, o)| o.is_ok() && o.reply() != Some(victim.as_str()))
        .unwrap_or_else(|| {
            panic!(
                "never reached the live pod after {victim} left: {after:?}\nlog:\n{}",
                daemon.log()
            )
        });
    assert!(
        parsed[moved].0 <= Duration::from_secs(1),
        "the first datagram served by the live pod came {:?} after the removal: {after:?}",
        parsed[moved].0
    );
    for (_, o) in &parsed[moved..] {
        assert!(
            o.is_ok() && o.reply() != Some(victim.as_str()),
            "back to {victim}: {after:?}"
        );
        assert_eq!(
            from(o),
            Some(WEB_DNS),
            "replies from the ClusterIP: {after:?}"
        );
        assert_eq!(
            peer(o),
            Some(WEB_DNS),
            "getpeername() says the ClusterIP: {after:?}"
        );
    }
    assert!(
        strip_ansi(&daemon.log()).contains("moved connected UDP sockets of removed backends"),
        "{}",
        daemon.log()
    );
}
