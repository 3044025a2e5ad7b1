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
            let policy_chain = |local: bool| if local { c.svl.clone() } else { c.svc.clone() };
            match (kind, scope) {
                ("ClusterIP", _) => format!(
                    "iptables nat {} -> KUBE-SERVICES -> {} -> KUBE-SEP-*",
                    if scope == FrontendScope::Socket {
                        "OUTPUT"
                    } else {
                        "PREROUTING"
                    },
                    policy_chain(m.svc.internal_policy_local)
                ),
                (_, FrontendScope::Socket) => format!(
                    "iptables nat OUTPUT -> {} -> {} -> {} (local traffic short-circuits to Cluster)",
                    if kind == "NodePort" {
                        "KUBE-NODEPORTS"
                    } else {
                        "KUBE-SERVICES"
                    },
                    c.ext,
                    c.svc
                ),
                (_, FrontendScope::Packet) => format!(
                    "iptables nat PREROUTING -> {} -> {}{} -> {}",
                    if kind == "NodePort" {
                        "KUBE-NODEPORTS"
                    } else {
                        "KUBE-SERVICES"
                    },
                    if kind == "LoadBalancer" && !m.svc.load_balancer_source_ranges.is_empty() {
                        format!("{} -> ", c.fw)
                    } else {
                        String::new()
                    },
                    c.ext,
                    policy_chain(m.svc.external_policy_local)
                ),
            }
        }
        "nftables" => {
            let c = PortNames::new(m.svc, m.port);
            let policy_chain = |local: bool| if local { &c.local } else { &c.cluster };
            let hook = if scope == FrontendScope::Socket {
                "nat-output"
            } else {
                "nat-prerouting"
            };
            match (kind, scope) {
                ("ClusterIP", _) => format!(
                    "nftables {hook} -> services -> @service-ips -> {}",
                    policy_chain(m.svc.internal_policy_local)
                ),
                (_, FrontendScope::Socket) => format!(
                    "nftables {hook} -> services -> {} -> {} -> {} (local traffic short-circuits to Cluster)",
                    if kind == "NodePort" {
                        "@service-nodeports"
                    } else {
                        "@service-ips"
                    },
                    c.external,
                    c.cluster
                ),
                (_, FrontendScope::Packet) => format!(
                    "nftables {hook} -> services -> {} -> {} -> {}{}",
                    if kind == "NodePort" {
                        "@service-nodeports"
                    } else {
                        "@service-ips"
                    },
                    c.external,
                    policy_chain(m.svc.external_policy_local),
                    if kind == "LoadBalancer" && !m.svc.load_balancer_source_ranges.is_empty() {
                        format!(" (sources checked first by {})", c.firewall)
                    } else {
                        String::new()
                    },
                ),
            }
        }
        other => format!("{other} mode: iptables REDIRECT to the proxy's relay for this port"),
    }
}
