//! `explain`'s "hook" line: where each mode translates a frontend's traffic, named as the
//! mode's own tools show it (the eBPF program and cgroup, the iptables chains, the
//! nftables maps and chains), so an operator can look there.

use crate::{
    admin::debug::ModelDump,
    dataplane::{
        frontends::FrontendScope,
        iptables::names::{PortChains, service_port_name},
        nftables::render::PortNames,
    },
    model::Protocol,
};

use super::view::ModelFrontend;

/// The hook or chains that translate `m`'s traffic in `mode`, for a client of `scope`.
pub fn hook(
    mode: &str,
    model: &ModelDump,
    proto: Protocol,
    v4: bool,
    scope: FrontendScope,
    m: &ModelFrontend,
    kind: &str,
) -> String {
    let ctx = &model.context;
    match mode {
        "ebpf" => match scope {
            FrontendScope::Socket => {
                let fam = if v4 { "4" } else { "6" };
                let cg = ctx
                    .cgroup
                    .as_ref()
                    .map_or("the cgroup".into(), |c| c.display().to_string());
                let call = match proto {
                    Protocol::Udp => {
                        format!("cgroup/sendmsg{fam} (and connect{fam} for connected sockets)")
                    }
                    _ => format!("cgroup/connect{fam}"),
                };
                format!(
                    "eBPF {call} on {cg}: the socket is pointed at the backend before any packet \
                     exists; replies and getpeername() show the service address"
                )
            }
            FrontendScope::Packet => {
                let devs = if ctx.nodeport_devices.is_empty() {
                    "auto".into()
                } else {
                    ctx.nodeport_devices.join(",")
                };
                let snat = if m.svc.external_policy_local {
                    "the client's address kept (externalTrafficPolicy Local)"
                } else {
                    "SNAT to this node's address towards backends on other nodes"
                };
                format!("eBPF tc ingress on the node-port devices ({devs}); {snat}")
            }
        },
        "iptables" => {
            let c = PortChains::new(&service_port_name(m.svc, m.port), m.port.protocol);
            let hook = if scope == FrontendScope::Socket {
                "OUTPUT"
            } else {
                "PREROUTING"
            };
            let names = RuleNames {
                entry: format!("iptables nat {hook}"),
                by_address: "KUBE-SERVICES",
                by_node_port: "KUBE-NODEPORTS",
                external: c.ext,
                cluster: c.svc,
                local: c.svl,
                firewall: c.fw,
                firewall_on_path: true,
                to_endpoints: " -> KUBE-SEP-*",
            };
            rule_path(&names, kind, scope, m)
        }
        "nftables" => {
            let c = PortNames::new(m.svc, m.port);
            let hook = if scope == FrontendScope::Socket {
                "nat-output"
            } else {
                "nat-prerouting"
            };
            let names = RuleNames {
                entry: format!("nftables {hook} -> services"),
                by_address: "@service-ips",
                by_node_port: "@service-nodeports",
                external: c.external,
                cluster: c.cluster,
                local: c.local,
                firewall: c.firewall,
                firewall_on_path: false,
                to_endpoints: "",
            };
            rule_path(&names, kind, scope, m)
        }
        other => format!("{other} mode: iptables REDIRECT to the proxy's relay for this port"),
    }
}

/// The names a rule-based mode gives the way to a service port's backends.
struct RuleNames {
    /// Up to the dispatch: `iptables nat OUTPUT`, `nftables nat-output -> services`.
    entry: String,
    /// What dispatches by address, and what by node port.
    by_address: &'static str,
    by_node_port: &'static str,
    external: String,
    cluster: String,
    local: String,
    /// The source-range check, and whether traffic passes it on its way (iptables' KUBE-FW)
    /// or it is checked beside, in a filter chain (nftables).
    firewall: String,
    firewall_on_path: bool,
    /// After a ClusterIP's policy chain, where the endpoints are.
    to_endpoints: &'static str,
}

fn rule_path(n: &RuleNames, kind: &str, scope: FrontendScope, m: &ModelFrontend) -> String {
    let policy = |local: bool| if local { &n.local } else { &n.cluster };
    let dispatch = if kind == "NodePort" {
        n.by_node_port
    } else {
        n.by_address
    };
    let firewalled = kind == "LoadBalancer" && !m.svc.load_balancer_source_ranges.is_empty();
    match (kind, scope) {
        ("ClusterIP", _) => format!(
            "{} -> {} -> {}{}",
            n.entry,
            n.by_address,
            policy(m.svc.internal_policy_local),
            n.to_endpoints
        ),
        (_, FrontendScope::Socket) => format!(
            "{} -> {dispatch} -> {} -> {} (local traffic short-circuits to Cluster)",
            n.entry, n.external, n.cluster
        ),
        (_, FrontendScope::Packet) => {
            let (on_path, beside) = match (firewalled, n.firewall_on_path) {
                (true, true) => (format!("{} -> ", n.firewall), String::new()),
                (true, false) => (
                    String::new(),
                    format!(" (sources checked first by {})", n.firewall),
                ),
                (false, _) => (String::new(), String::new()),
            };
            format!(
                "{} -> {dispatch} -> {on_path}{} -> {}{beside}",
                n.entry,
                n.external,
                policy(m.svc.external_policy_local)
            )
        }
    }
}
