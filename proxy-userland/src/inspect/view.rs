//! `inspect services | flows | affinity` as rows: the model's names joined with what the
//! maps hold. Frontends come from the same code the dataplanes program from
//! ([`crate::dataplane::frontends`]), so a frontend here is spelt as the maps key it.

use std::{collections::BTreeMap, net::IpAddr};

use serde::Serialize;

use super::{
    Source,
    maps::{PinnedMaps, ProgrammedFrontend},
    table::Table,
};
use crate::{
    admin::debug::ModelDump,
    dataplane::{
        frontends::{self, BackendAddr, DesiredFrontend, Frontend, FrontendScope},
        iptables::names::{PortChains, service_port_name},
    },
    model::{Endpoint, EndpointSet, Service, ServicePort, select},
};

/// What the views are built from; either part may be missing.
pub struct Inputs {
    pub model: Option<ModelDump>,
    pub maps: Option<PinnedMaps>,
    pub warnings: Vec<String>,
}

impl Inputs {
    pub fn read(source: &Source, _services: bool) -> anyhow::Result<Self> {
        let mut warnings = Vec::new();
        let model = match super::fetch_model(&source.admin) {
            Ok(m) => Some(m),
            Err(e) => {
                warnings.push(format!("{e:#}; showing addresses only"));
                None
            }
        };
        let want_maps = model.as_ref().is_none_or(|m| m.mode == "ebpf");
        let maps = if want_maps {
            match PinnedMaps::open(&source.bpf_pin_dir) {
                Ok(m) => Some(m),
                Err(e) => {
                    warnings.push(format!("{e:#}"));
                    None
                }
            }
        } else {
            None
        };
        if model.is_none() && maps.is_none() {
            anyhow::bail!("nothing to read: {}", warnings.join("; "));
        }
        Ok(Self {
            model,
            maps,
            warnings,
        })
    }
}

/// A frontend as the model derives it, with the names the maps lack.
pub struct ModelFrontend<'a> {
    pub svc: &'a Service,
    pub port: &'a ServicePort,
    pub endpoints: Option<&'a EndpointSet>,
    pub desired: DesiredFrontend,
}

/// The service port a frontend of `svc` belongs to.
pub fn port_of<'a>(svc: &'a Service, fe: &Frontend) -> Option<&'a ServicePort> {
    let node_port = fe.ip.is_unspecified();
    svc.ports.iter().find(|p| {
        p.protocol == fe.proto
            && if node_port {
                p.node_port == Some(fe.port)
            } else {
                p.port == fe.port
            }
    })
}

/// Every frontend the model asks for on its node, socket and packet scope.
pub fn model_frontends(model: &ModelDump) -> BTreeMap<Frontend, ModelFrontend<'_>> {
    let eps: BTreeMap<_, _> = model
        .endpoints
        .iter()
        .map(|e| (&e.service, &e.endpoints))
        .collect();
    let mut out = BTreeMap::new();
    for svc in &model.services {
        let set = eps.get(&svc.key).copied();
        let node = &model.node;
        let all = frontends::desired_frontends(svc, set, node)
            .into_iter()
            .chain(frontends::desired_external_socket_frontends(svc, set, node))
            .chain(frontends::desired_packet_frontends(svc, set, node));
        for (fe, desired) in all {
            if let Some(port) = port_of(svc, &fe) {
                out.insert(
                    fe,
                    ModelFrontend {
                        svc,
                        port,
                        endpoints: set,
                        desired,
                    },
                );
            }
        }
    }
    out
}

/// An endpoint's conditions in a word.
pub fn state_word(ep: &Endpoint) -> &'static str {
    match (ep.ready, ep.serving, ep.terminating) {
        (true, _, false) => "ready",
        (true, _, true) => "ready-terminating",
        (false, true, true) => "serving-terminating",
        (false, true, false) => "serving",
        (false, false, true) => "terminating",
        (false, false, false) => "not-ready",
    }
}

#[derive(Serialize, Clone, Debug)]
pub struct BackendRow {
    pub address: String,
    /// ready, serving-terminating, ...; "unknown" when the model does not list it.
    pub state: String,
    pub node: Option<String>,
    pub local: bool,
}

#[derive(Serialize, Clone, Debug)]
pub struct ServiceRow {
    pub frontend: String,
    /// socket (connections made on this node) or packet (traffic from other hosts).
    pub scope: &'static str,
    /// `namespace/name:port`, when the daemon answered.
    pub service: Option<String>,
    /// The traffic policy that picks this frontend's backends.
    pub policy: Option<String>,
    pub affinity_timeout: Option<u32>,
    pub source_ranges: Vec<String>,
    /// Packet path: the source becomes the node's address towards other nodes' backends.
    pub snat: bool,
    /// What the dataplane sends to: the maps' backends in eBPF mode, else the model's.
    pub backends: Vec<BackendRow>,
    /// With no backend: what happens to a connection.
    pub no_backends: Option<&'static str>,
    /// iptables mode: the chain the service port's traffic jumps to.
    pub chain: Option<String>,
    /// eBPF mode with both sources: whether the maps hold what the model asks for.
    pub in_sync: Option<bool>,
}

fn backend_row(b: &BackendAddr, m: Option<&ModelFrontend>) -> BackendRow {
    let ep = m.and_then(|m| {
        let set = m.endpoints?;
        select::endpoints_for_port(set, m.port)
            .into_iter()
            .find(|pe| pe.ip == b.ip && pe.port == b.port)
    });
    let address = std::net::SocketAddr::new(b.ip, b.port).to_string();
    BackendRow {
        address,
        state: ep
            .as_ref()
            .map_or("unknown", |pe| state_word(&pe.endpoint))
            .to_string(),
        node: ep.and_then(|pe| pe.endpoint.node_name),
        local: b.local,
    }
}

fn policy_of(m: &ModelFrontend, fe: &Frontend) -> String {
    let local = |l: bool| if l { "Local" } else { "Cluster" };
    let is_cluster_ip = m.svc.cluster_ips.contains(&fe.ip);
    match (fe.scope, is_cluster_ip) {
        (FrontendScope::Socket, true) => format!("internal={}", local(m.svc.internal_policy_local)),
        // External addresses reached from this node go to the Cluster endpoints.
        (FrontendScope::Socket, false) => "external, from this node=Cluster".into(),
        (FrontendScope::Packet, _) => format!("external={}", local(m.svc.external_policy_local)),
    }
}

fn scope_word(s: FrontendScope) -> &'static str {
    match s {
        FrontendScope::Socket => "socket",
        FrontendScope::Packet => "packet",
    }
}

fn no_backend_outcome(scope: FrontendScope, mode: &str, m: Option<&ModelFrontend>) -> &'static str {
    // iptables tells "no endpoints at all" (REJECT) from "none this policy may use here"
    // (DROP); the eBPF socket hooks refuse both.
    let anywhere = m.is_some_and(|m| {
        let set = m.endpoints.cloned().unwrap_or_default();
        select::endpoints_for_port(&set, m.port)
            .iter()
            .any(|e| e.endpoint.ready || (e.endpoint.serving && e.endpoint.terminating))
    });
    match (mode, scope) {
        ("iptables", _) if anywhere => "dropped (no endpoint this policy may use here)",
        ("iptables", _) => "rejected",
        (_, FrontendScope::Socket) => "refused (ECONNREFUSED)",
        (_, FrontendScope::Packet) => "dropped",
    }
}

/// `inspect services`.
pub fn services(inputs: &Inputs) -> anyhow::Result<Vec<ServiceRow>> {
    let mode = inputs.model.as_ref().map_or("ebpf", |m| m.mode.as_str());
    let model = inputs
        .model
        .as_ref()
        .map(model_frontends)
        .unwrap_or_default();
    let programmed: Option<BTreeMap<Frontend, ProgrammedFrontend>> = inputs
        .maps
        .as_ref()
        .map(PinnedMaps::frontends)
        .transpose()?;
    let mut keys: Vec<Frontend> = model.keys().copied().collect();
    if let Some(p) = &programmed {
        keys.extend(p.keys().filter(|k| !model.contains_key(k)));
    }
    keys.sort_by_key(|fe| (fe.scope, fe.ip, fe.port, fe.proto));
    keys.dedup();
    let mut rows = Vec::new();
    for fe in keys {
        let m = model.get(&fe);
        let p = programmed.as_ref().and_then(|p| p.get(&fe));
        let backends: Vec<BackendAddr> = match (p, m) {
            (Some(p), _) => p.backends.clone(),
            (None, Some(m)) if programmed.is_none() => m.desired.backends.clone(),
            (None, _) => vec![],
        };
        let in_sync = match (&programmed, m) {
            (Some(_), Some(m)) => Some(p.is_some_and(|p| {
                let mut a = p.backends.clone();
                a.sort();
                a == m.desired.backends
            })),
            _ => None,
        };
        let chain = (mode == "iptables").then(|| {
            m.map(|m| {
                let c = PortChains::new(&service_port_name(m.svc, m.port), m.port.protocol);
                match fe.scope {
                    FrontendScope::Packet => c.ext,
                    FrontendScope::Socket if m.svc.cluster_ips.contains(&fe.ip) => {
                        if m.svc.internal_policy_local {
                            c.svl
                        } else {
                            c.svc
                        }
                    }
                    FrontendScope::Socket => c.svc,
                }
            })
        });
        rows.push(ServiceRow {
            frontend: fe.to_string(),
            scope: scope_word(fe.scope),
            service: m.map(|m| service_port_name(m.svc, m.port)),
            policy: m.map(|m| policy_of(m, &fe)),
            affinity_timeout: m
                .and_then(|m| m.desired.affinity_timeout)
                .or(p.map(|p| p.affinity_timeout).filter(|t| *t > 0)),
            source_ranges: m
                .map(|m| {
                    m.desired
                        .source_ranges
                        .iter()
                        .map(|(ip, len)| format!("{ip}/{len}"))
                        .collect()
                })
                .unwrap_or_default(),
            snat: m.is_some_and(|m| m.desired.snat),
            no_backends: backends
                .is_empty()
                .then(|| no_backend_outcome(fe.scope, mode, m)),
            backends: backends.iter().map(|b| backend_row(b, m)).collect(),
            chain: chain.flatten(),
            in_sync,
        });
    }
    Ok(rows)
}

pub fn services_table(rows: &[ServiceRow]) -> String {
    let iptables = rows.iter().any(|r| r.chain.is_some());
    let mut head = vec![
        "FRONTEND", "SCOPE", "SERVICE", "POLICY", "AFFINITY", "BACKEND", "STATE", "NODE",
    ];
    if iptables {
        head.push("CHAIN");
    }
    let mut t = Table::new(&head);
    for r in rows {
        let mut first = vec![
            r.frontend.clone(),
            r.scope.to_string(),
            r.service.clone().unwrap_or_else(|| "?".into()),
            r.policy.clone().unwrap_or_default()
                + &if r.source_ranges.is_empty() {
                    String::new()
                } else {
                    format!(" from {}", r.source_ranges.join(","))
                }
                + if r.snat { " snat" } else { "" }
                + match r.in_sync {
                    Some(false) => " (maps differ from the model)",
                    _ => "",
                },
            r.affinity_timeout
                .map_or("-".into(), |t| format!("ClientIP {t}s")),
        ];
        let backend = |b: &BackendRow| {
            vec![
                b.address.clone(),
                b.state.clone(),
                b.node.clone().unwrap_or_else(|| {
                    if b.local {
                        "(this node)".into()
                    } else {
                        "-".into()
                    }
                }),
            ]
        };
        match r.backends.split_first() {
            None => first.extend([
                format!("(none: {})", r.no_backends.unwrap_or("")),
                String::new(),
                String::new(),
            ]),
            Some((b, _)) => first.extend(backend(b)),
        }
        if iptables {
            first.push(r.chain.clone().unwrap_or_default());
        }
        t.row(first);
        for b in r.backends.iter().skip(1) {
            let mut row = vec![String::new(); 5];
            row.extend(backend(b));
            t.row(row);
        }
    }
    t.render()
}

#[derive(Serialize, Clone, Debug)]
pub struct FlowRow {
    pub proto: String,
    pub client: String,
    pub frontend: String,
    pub service: Option<String>,
    pub backend: String,
    pub snat: Option<String>,
    /// unanswered, established or closing.
    pub state: &'static str,
    pub idle_secs: f64,
}

/// The service port a packet-path destination belongs to.
fn packet_service(
    model: &ModelDump,
    dst: std::net::SocketAddr,
    proto: crate::model::Protocol,
) -> Option<String> {
    model.services.iter().find_map(|svc| {
        let external = svc
            .external_ips
            .iter()
            .chain(&svc.load_balancer_ips)
            .any(|ip| *ip == dst.ip());
        let port = svc.ports.iter().find(|p| {
            p.protocol == proto
                && ((external && p.port == dst.port()) || p.node_port == Some(dst.port()))
        })?;
        Some(service_port_name(svc, port))
    })
}

/// `inspect flows`: the packet path's flow table (eBPF mode).
pub fn flows(inputs: &Inputs) -> anyhow::Result<Vec<FlowRow>> {
    let Some(maps) = &inputs.maps else {
        anyhow::bail!(
            "the flow table is the eBPF packet path's; in {} mode the kernel's conntrack holds \
             the flows (`conntrack -L`)",
            inputs.model.as_ref().map_or("this", |m| m.mode.as_str())
        );
    };
    Ok(maps
        .flows()?
        .into_iter()
        .map(|f| FlowRow {
            proto: f.proto.map_or("?".into(), |p| p.to_string()),
            client: f.client.to_string(),
            frontend: f.frontend.to_string(),
            service: inputs
                .model
                .as_ref()
                .zip(f.proto)
                .and_then(|(m, p)| packet_service(m, f.frontend, p)),
            backend: f.backend.to_string(),
            snat: f.snat.map(|s| s.to_string()),
            state: if f.closing {
                "closing"
            } else if f.seen_reply {
                "established"
            } else {
                "unanswered"
            },
            idle_secs: (f.idle_secs * 10.0).round() / 10.0,
        })
        .collect())
}

pub fn flows_table(rows: &[FlowRow]) -> String {
    let mut t = Table::new(&[
        "PROTO", "CLIENT", "FRONTEND", "SERVICE", "BACKEND", "SNAT", "STATE", "IDLE",
    ]);
    for r in rows {
        t.row(vec![
            r.proto.clone(),
            r.client.clone(),
            r.frontend.clone(),
            r.service.clone().unwrap_or_else(|| "?".into()),
            r.backend.clone(),
            r.snat.clone().unwrap_or_else(|| "-".into()),
            r.state.to_string(),
            format!("{:.1}s", r.idle_secs),
        ]);
    }
    t.render()
}

#[derive(Serialize, Clone, Debug)]
pub struct AffinityRow {
    /// The client: its address (packet path) or `netns:<cookie>` (socket path).
    pub client: String,
    pub frontend: Option<String>,
    pub service: Option<String>,
    pub backend: Option<String>,
    pub idle_secs: f64,
    pub timeout_secs: Option<u32>,
}

/// `inspect affinity` (eBPF mode).
pub fn affinity(inputs: &Inputs) -> anyhow::Result<Vec<AffinityRow>> {
    let Some(maps) = &inputs.maps else {
        anyhow::bail!(
            "affinity entries are the eBPF maps'; in iptables mode they are the `recent` match's \
             lists, /proc/net/xt_recent/KUBE-SEP-*"
        );
    };
    let fronts = maps.frontends()?;
    let model = inputs
        .model
        .as_ref()
        .map(model_frontends)
        .unwrap_or_default();
    let by_index: BTreeMap<u16, (&Frontend, &ProgrammedFrontend)> = fronts
        .iter()
        .map(|(fe, p)| (p.rev_nat_index, (fe, p)))
        .collect();
    Ok(maps
        .affinity()?
        .into_iter()
        .map(|a| {
            let fe = by_index.get(&a.rev_nat_index);
            AffinityRow {
                client: match (a.client_ip, a.netns_cookie) {
                    (Some(ip), _) => ip.to_string(),
                    (None, Some(c)) => format!("netns:{c}"),
                    (None, None) => "?".into(),
                },
                frontend: fe.map(|(f, _)| f.to_string()),
                service: fe
                    .and_then(|(f, _)| model.get(f))
                    .map(|m| service_port_name(m.svc, m.port)),
                backend: a
                    .backend
                    .map(|b| std::net::SocketAddr::new(b.ip, b.port).to_string()),
                idle_secs: (a.idle_secs * 10.0).round() / 10.0,
                timeout_secs: fe.map(|(_, p)| p.affinity_timeout),
            }
        })
        .collect())
}

pub fn affinity_table(rows: &[AffinityRow]) -> String {
    let mut t = Table::new(&[
        "CLIENT", "FRONTEND", "SERVICE", "BACKEND", "IDLE", "TIMEOUT",
    ]);
    for r in rows {
        t.row(vec![
            r.client.clone(),
            r.frontend.clone().unwrap_or_else(|| "?".into()),
            r.service.clone().unwrap_or_else(|| "?".into()),
            r.backend.clone().unwrap_or_else(|| "(gone)".into()),
            format!("{:.1}s", r.idle_secs),
            r.timeout_secs.map_or("-".into(), |t| format!("{t}s")),
        ]);
    }
    t.render()
}

/// Whether `ip` is one of the model's pods on its node.
pub fn is_local_pod(model: &ModelDump, ip: IpAddr) -> bool {
    model
        .endpoints
        .iter()
        .flat_map(|e| e.endpoints.slices.values())
        .flat_map(|s| &s.endpoints)
        .any(|ep| ep.ip == ip && select::is_local(ep, &model.node))
}
