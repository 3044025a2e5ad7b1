//! Taking over a node that ran kube-proxy, in each of kube-proxy's modes: the `fastpath`
//! binary, run for a test bed's node namespace, removes what kube-proxy left there (as
//! kube-proxy's own CleanupLeftovers removes its other modes' state) and nothing else, and a
//! connection kube-proxy translated keeps working across the swap.
//!
//! kube-proxy's state comes from fixtures in `tests/fixtures`, taken from the expectations
//! of kube-proxy's own tests (real kube-proxy output) with addresses moved into the test
//! ranges.

mod common;
mod nat_common;

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::*;
use nat_common::*;
use xtask::testbed::Testbed;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
const MODES: [&str; 4] = ["ebpf", "nftables", "iptables", "userspace"];

/// kube-proxy's nftables mode's tables, and the foreign tables that must stay.
const KUBE_PROXY_TABLES: [&str; 2] = ["ip kube-proxy", "ip6 kube-proxy"];
const FOREIGN_TABLES: &str = "add table inet kube-proxy
add table ip fp-foreign
add chain ip fp-foreign keep { type filter hook input priority 0 ; }
add rule ip fp-foreign keep ip saddr 198.18.9.9 counter accept
";

/// Runs `program args` in the bed's node namespace with `input` on stdin; its stdout, or a
/// panic with its stderr.
fn in_node(bed: &Testbed, program: &str, args: &[&str], input: Option<&str>) -> String {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", bed.node_netns(), program])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn");
    let mut stdin = child.stdin.take().unwrap();
    if let Some(text) = input {
        stdin.write_all(text.as_bytes()).unwrap();
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}/{name}")).unwrap()
}

/// `nft list tables` in the node namespace, as "family name" strings.
fn nft_tables(bed: &Testbed) -> Vec<String> {
    in_node(bed, "nft", &["list", "tables"], None)
        .lines()
        .filter_map(|l| l.strip_prefix("table "))
        .map(str::to_string)
        .collect()
}

/// The daemon in `mode` for the bed's node namespace, serving `manifests`.
fn start(bed: &Testbed, mode: &str, extra: &[&str]) -> Daemon {
    let manifests = bed.dir().join("manifests.yaml");
    if !manifests.exists() {
        std::fs::write(&manifests, web_manifest(&[pod_ip(1)])).unwrap();
    }
    start_in_node(bed, mode, &manifests, extra)
}

/// The proxier reports itself ready (after the leftovers went).
fn ready(d: &Daemon) -> bool {
    let log = d.log();
    [
        "eBPF socket load-balancing attached",
        "nftables proxier ready",
        "iptables proxier ready",
        "userspace proxier ready",
    ]
    .iter()
    .any(|l| log.contains(l))
}

#[test]
fn kube_proxys_nftables_tables_go_in_every_mode_and_nothing_else() {
    let bed = Testbed::new("kpnft").expect("test bed");
    for mode in MODES {
        in_node(
            &bed,
            "nft",
            &["-f", "-"],
            Some(&fixture("kube-proxy-nftables.nft")),
        );
        in_node(&bed, "nft", &["-f", "-"], Some(FOREIGN_TABLES));
        let before = nft_tables(&bed);
        for t in KUBE_PROXY_TABLES {
            assert!(before.iter().any(|x| x == t), "{t} loaded: {before:?}");
        }

        let mut d = start(&bed, mode, &["--cleanup-on-exit"]);
        assert!(
            eventually(20, || ready(&d)),
            "{mode} never started:\n{}",
            d.log()
        );
        let after = nft_tables(&bed);
        for t in KUBE_PROXY_TABLES {
            assert!(
                !after.iter().any(|x| x == t),
                "{mode}: {t} is still there: {after:?}\n{}",
                d.log()
            );
        }
        // Someone else's tables stay, an `inet kube-proxy` included (not kube-proxy's family).
        for t in ["inet kube-proxy", "ip fp-foreign"] {
            assert!(after.iter().any(|x| x == t), "{mode}: {t} went: {after:?}");
        }
        let log = d.log();
        assert!(
            log.contains("removed kube-proxy's nftables tables"),
            "{log}"
        );
        assert!(d.stop().success(), "{}", d.log());
    }
}

/// Whether our own `mode` left its state in the node namespace: the nftables mode's
/// tables, the iptables mode's KUBE-SERVICES, the userspace mode's portal chains.
fn our_state(bed: &Testbed, mode: &str) -> bool {
    let nat = || in_node(bed, "iptables-save", &["-t", "nat"], None);
    match mode {
        "nftables" => nft_tables(bed).iter().any(|t| t == "ip fastpath"),
        "iptables" => nat().contains(":KUBE-SERVICES"),
        "userspace" => nat().contains(":KUBE-PORTALS-HOST"),
        _ => false,
    }
}

/// Switching modes on a node: each mode, stopped without --cleanup-on-exit, leaves its
/// rules in place (Services keep working while the daemon is away), and whichever mode
/// starts next removes them, the nftables mode's tables included, both ways.
#[test]
fn each_mode_removes_what_our_other_modes_left() {
    let bed = Testbed::new("fpswap").expect("test bed");
    let order = [
        "nftables",
        "iptables",
        "nftables",
        "userspace",
        "nftables",
        "ebpf",
        "iptables",
    ];
    let mut previous: Option<&str> = None;
    for mode in order {
        let mut d = start(&bed, mode, &[]);
        assert!(
            eventually(20, || d.log().contains("initial sync done")),
            "{mode} never synced:\n{}",
            d.log()
        );
        if let Some(prev) = previous.filter(|p| *p != mode) {
            assert!(
                !our_state(&bed, prev),
                "{mode} left the {prev} mode's rules in place:\n{}",
                d.log()
            );
        }
        assert!(d.stop().success(), "{}", d.log());
        if mode != "ebpf" {
            assert!(
                our_state(&bed, mode),
                "{mode} keeps its rules when it stops without --cleanup-on-exit"
            );
        }
        previous = Some(mode);
    }
}

/// kube-proxy's IPVS-mode sets and chains in the node namespace, and a foreign set with a
/// rule matching it (both must stay).
fn load_ipvs_mode(bed: &Testbed) {
    let sets: String = fixture("kube-proxy-ipvs.ipset")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    in_node(bed, "ipset", &["restore", "-exist"], Some(&sets));
    in_node(
        bed,
        "ipset",
        &["create", "-exist", "fp-foreign", "hash:ip"],
        None,
    );
    in_node(
        bed,
        "iptables-restore",
        &["--noflush"],
        Some(&fixture("kube-proxy-ipvs.rules")),
    );
    in_node(
        bed,
        "ip6tables-restore",
        &["--noflush"],
        Some(&fixture("kube-proxy-ipvs6.rules")),
    );
    in_node(
        bed,
        "iptables-restore",
        &["--noflush"],
        Some(
            "*filter\n:FP-FOREIGN - [0:0]\n-A FP-FOREIGN -m set --match-set fp-foreign src -j RETURN\nCOMMIT\n",
        ),
    );
}

fn ipsets(bed: &Testbed) -> Vec<String> {
    in_node(bed, "ipset", &["list", "-n"], None)
        .lines()
        .map(str::to_string)
        .collect()
}

/// The IPVS-mode chains present in either family (KUBE-SERVICES and the other names our
/// iptables mode shares are left out: that mode rewrites them).
fn ipvs_chains_left(bed: &Testbed) -> Vec<String> {
    let mut left = Vec::new();
    for tool in ["iptables-save", "ip6tables-save"] {
        let saved = saved(bed.node_netns(), tool);
        for c in [
            "KUBE-NODE-PORT",
            "KUBE-LOAD-BALANCER",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
        ] {
            if chains_with(&saved, c).iter().any(|x| x == c) {
                left.push(format!("{tool}: {c}"));
            }
        }
        left.extend(
            saved
                .lines()
                .filter(|l| l.contains("--match-set KUBE-"))
                .map(|l| format!("{tool}: {l}")),
        );
    }
    left
}

#[test]
fn kube_proxys_ipvs_sets_and_chains_go_in_every_mode_and_nothing_else() {
    let bed = Testbed::new("kpipvs").expect("test bed");
    // kube-ipvs0 is a dummy device; a kernel without the dummy driver cannot have one.
    let dummy = Command::new("ip")
        .args([
            "-n",
            bed.node_netns(),
            "link",
            "add",
            "kube-ipvs0",
            "type",
            "dummy",
        ])
        .status()
        .is_ok_and(|s| s.success());
    if !dummy {
        eprintln!("no dummy devices on this kernel: kube-ipvs0's removal is not checked");
        // A device of that name that is not a dummy is not kube-proxy's: it must stay.
        xtask::cmd::ip([
            "-n",
            bed.node_netns(),
            "link",
            "add",
            "kube-ipvs0",
            "type",
            "veth",
            "peer",
            "name",
            "fp-ipvs-peer",
        ])
        .expect("a veth named kube-ipvs0");
    }
    for mode in MODES {
        load_ipvs_mode(&bed);
        let before = ipsets(&bed);
        assert!(before.iter().any(|s| s == "KUBE-CLUSTER-IP"), "{before:?}");
        assert!(!ipvs_chains_left(&bed).is_empty());

        let mut d = start(&bed, mode, &[]);
        assert!(
            eventually(20, || ready(&d)),
            "{mode} never started:\n{}",
            d.log()
        );
        let sets = ipsets(&bed);
        assert_eq!(sets, ["fp-foreign"], "{mode}: sets left\n{}", d.log());
        let chains = ipvs_chains_left(&bed);
        assert!(chains.is_empty(), "{mode}: {chains:#?}\n{}", d.log());
        let filter = saved(bed.node_netns(), "iptables-save");
        assert!(
            filter.contains("-A FP-FOREIGN -m set --match-set fp-foreign src -j RETURN"),
            "{mode}: a foreign rule went:\n{filter}"
        );
        let links = xtask::cmd::ip(["-n", bed.node_netns(), "link", "show"]).unwrap();
        let log = d.log();
        if dummy {
            assert!(!links.contains("kube-ipvs0"), "{mode}: {links}");
        } else {
            assert!(links.contains("kube-ipvs0"), "{mode}: a veth went: {links}");
            assert!(log.contains("not a dummy device"), "{log}");
        }
        assert!(log.contains("removed kube-proxy's ipsets"), "{log}");
        if !std::path::Path::new("/sys/module/ip_vs").exists() {
            assert!(log.contains("this kernel has no IPVS"), "{log}");
        }
        assert!(d.stop().success(), "{}", d.log());
    }
}

/// An echo server on `addr` in `netns` for one connection, on a thread; it gives up after
/// `limit` without a client.
fn echo_once(netns: &str, addr: SocketAddr, limit: Duration) -> std::thread::JoinHandle<()> {
    let listener = xtask::netns::in_netns(netns, || TcpListener::bind(addr))
        .unwrap()
        .unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let deadline = Instant::now() + limit;
        let conn = loop {
            match listener.accept() {
                Ok((c, _)) => break c,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(_) => return,
            }
        };
        conn.set_nonblocking(false).unwrap();
        conn.set_read_timeout(Some(limit)).unwrap();
        let mut writer = conn.try_clone().unwrap();
        for line in BufReader::new(conn).lines().map_while(Result::ok) {
            if writer
                .write_all(format!("echo {line}\n").as_bytes())
                .is_err()
            {
                return;
            }
        }
    })
}

fn round_trip(stream: &mut BufReader<TcpStream>, word: &str) -> std::io::Result<String> {
    stream.get_mut().write_all(format!("{word}\n").as_bytes())?;
    let mut line = String::new();
    stream.read_line(&mut line)?;
    Ok(line.trim_end().to_string())
}

/// The kubelet's own firewall rule, on every node beside kube-proxy's. It matches
/// conntrack state, and so keeps netfilter conntrack (and with it the translation of flows
/// kube-proxy's DNAT set up) running in the namespace once kube-proxy's rules are gone: in
/// a namespace where nothing else used conntrack, removing kube-proxy's rules would turn
/// it off there and those flows would stop (see docs/modes.md).
const KUBELET_FIREWALL: &str = "*filter
:KUBE-FIREWALL - [0:0]
-A INPUT -j KUBE-FIREWALL
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment \"block incoming localnet connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
COMMIT
";

/// kube-proxy's nftables mode adding a ClusterIP service, ns7/svc7:p80 at 198.19.0.47:80,
/// with one endpoint, 198.18.1.11:9090, to the fixture's ruleset (its chain names hashed
/// as kube-proxy hashes them).
const NFT_SVC7: &str = "
add chain ip kube-proxy service-H5D5N55F-ns7/svc7/tcp/p80
add chain ip kube-proxy endpoint-QJ5SCCXB-ns7/svc7/tcp/p80__198.18.1.11/9090
add rule ip kube-proxy service-H5D5N55F-ns7/svc7/tcp/p80 ip daddr 198.19.0.47 ip saddr != 198.18.0.0/16 jump mark-for-masquerade
add rule ip kube-proxy service-H5D5N55F-ns7/svc7/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-QJ5SCCXB-ns7/svc7/tcp/p80__198.18.1.11/9090 }
add rule ip kube-proxy endpoint-QJ5SCCXB-ns7/svc7/tcp/p80__198.18.1.11/9090 ip saddr 198.18.1.11 jump mark-for-masquerade
add rule ip kube-proxy endpoint-QJ5SCCXB-ns7/svc7/tcp/p80__198.18.1.11/9090 meta l4proto tcp dnat to 198.18.1.11:9090
add element ip kube-proxy cluster-ips { 198.19.0.47 }
add element ip kube-proxy service-ips { 198.19.0.47 . tcp . 80 : goto service-H5D5N55F-ns7/svc7/tcp/p80 }
";

/// A CNI's masquerade rule for pod traffic leaving the cluster range, as on any node: with
/// it the node keeps a nat table of its own, whose hooks translate established flows once
/// kube-proxy's nftables table (which held the only other nat chains) is gone.
const CNI_MASQUERADE: &str = "*nat
-A POSTROUTING -s 198.18.0.0/16 ! -d 198.18.0.0/15 -m comment --comment \"cni masquerade\" -j MASQUERADE
COMMIT
";

#[test]
fn a_connection_kube_proxys_iptables_mode_translated_survives_the_swap_to_ebpf() {
    let (bed, pods) = bed_with_pods("kpswapipt", 2);
    route_services(&bed);
    in_node(
        &bed,
        "iptables-restore",
        &["--noflush"],
        Some(KUBELET_FIREWALL),
    );
    in_node(
        &bed,
        "iptables-restore",
        &["--noflush"],
        Some(&fixture("kube-proxy-iptables.rules")),
    );
    survives_the_swap(&bed, &pods, ("ns1", "svc1", "198.19.0.41"), || {
        let nat = saved(bed.node_netns(), "iptables-save");
        let left = chains_with(&nat, "KUBE-");
        (left != ["KUBE-FIREWALL"])
            .then(|| format!("kube-proxy's chains stayed, or the kubelet's went:\n{nat}"))
    });
}

#[test]
fn a_connection_kube_proxys_nftables_mode_translated_survives_the_swap_to_ebpf() {
    let (bed, pods) = bed_with_pods("kpswapnft", 2);
    route_services(&bed);
    in_node(
        &bed,
        "iptables-restore",
        &["--noflush"],
        Some(KUBELET_FIREWALL),
    );
    in_node(
        &bed,
        "iptables-restore",
        &["--noflush"],
        Some(CNI_MASQUERADE),
    );
    let ruleset = fixture("kube-proxy-nftables.nft") + NFT_SVC7;
    in_node(&bed, "nft", &["-f", "-"], Some(&ruleset));
    survives_the_swap(&bed, &pods, ("ns7", "svc7", "198.19.0.47"), || {
        let tables = nft_tables(&bed);
        KUBE_PROXY_TABLES
            .iter()
            .any(|t| tables.iter().any(|x| x == t))
            .then(|| format!("kube-proxy's tables stayed: {tables:?}"))
    });
}

/// kube-proxy's rules (loaded by the caller) send `service` to pod-1's echo server on 9090:
/// a connection made through them before fastpath (eBPF mode) starts still carries data
/// after; new ones go where fastpath's Service says (pod-2's server on 8080); and
/// `kube_proxy_left` (a description of what stayed, if anything did) finds nothing.
fn survives_the_swap(
    bed: &Testbed,
    pods: &[xtask::testbed::Pod],
    (namespace, name, cluster_ip): (&str, &str, &str),
    kube_proxy_left: impl Fn() -> Option<String>,
) {
    let target = format!("{cluster_ip}:80");
    let echo = echo_once(
        &pods[0].netns,
        "198.18.1.11:9090".parse().unwrap(),
        Duration::from_secs(60),
    );
    let stream = xtask::netns::in_netns(bed.node_netns(), || {
        TcpStream::connect_timeout(&target.parse().unwrap(), Duration::from_secs(2))
    })
    .unwrap()
    .expect("kube-proxy's rules translate the ClusterIP");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut stream = BufReader::new(stream);
    assert_eq!(round_trip(&mut stream, "before").unwrap(), "echo before");

    std::fs::write(
        bed.dir().join("manifests.yaml"),
        format!(
            r#"
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  clusterIP: {cluster_ip}
  ports: [{{name: p80, port: 80, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: {namespace}, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: p80, port: 8080}}]
endpoints: [{{addresses: [198.18.1.12]}}]
"#
        ),
    )
    .unwrap();
    let mut d = start(bed, "ebpf", &[]);
    assert!(
        eventually(20, || tcp(bed, &target, 1)[0].reply() == Some("pod-2")),
        "new connections never went through fastpath:\n{}",
        d.log()
    );
    // kube-proxy's state is gone...
    if let Some(left) = kube_proxy_left() {
        panic!("{left}\n{}", d.log());
    }
    // ...and the connection it translated still carries data both ways.
    let after = round_trip(&mut stream, "after");
    assert_eq!(
        after.as_deref().ok(),
        Some("echo after"),
        "the old connection stopped working: {after:?}\n{}",
        d.log()
    );
    // Every new connection is fastpath's.
    let all = tcp(bed, &target, 10);
    assert_eq!(reached(&all), ["pod-2".to_string()].into(), "{all:?}");
    assert!(d.stop().success(), "{}", d.log());
    drop(stream);
    let _ = echo.join();
}
