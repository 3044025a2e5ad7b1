//! `inspect services | flows | affinity` as rows: the model's names joined with what the
//! maps hold. Frontends come from the same code the dataplanes program from
//! ([`crate::dataplane::frontends`]), so a frontend here is spelt as the maps key it.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use serde::Serialize;

use super::{
    Source,
    maps::{PinnedMaps, ProgrammedFrontend},
    rules::{self, Programmed},
    table::Table,
};
use crate::{
    admin::debug::ModelDump,
    dataplane::{
        frontends::{self, BackendAddr, DesiredFrontend, Frontend, FrontendScope},
        iptables::{apply::Tools, names::service_port_name},
    },
    model::{Endpoint, EndpointSet, Service, ServicePort, select},
};

/// What the views are built from; any part may be missing.
pub struct Inputs {
    pub model: Option<ModelDump>,
    pub maps: Option<PinnedMaps>,
    /// iptables mode: what the nat and filter tables hold; nftables mode: our tables.
    pub rules: Option<Programmed>,
    /// iptables mode: the tools the rules were read with, for the conntrack table and the
    /// affinity lists.
    pub tools: Vec<Box<dyn Tools>>,
    pub warnings: Vec<String>,
}

impl Inputs {
    /// Reads the daemon's model and what its mode programmed: the pinned maps (eBPF), the
    /// rules (iptables). Without the daemon, the maps, else the rules of `--netns`.
    pub fn read(source: &Source) -> anyhow::Result<Self> {
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
        let want_rules = match &model {
            Some(m) => m.mode == "iptables" || m.mode == "nftables",
            None => maps.is_none(),
        };
        let nftables = model.as_ref().is_some_and(|m| m.mode == "nftables");
        let (mut rules, mut tools) = (None, Vec::new());
        if want_rules {
            let netns = source
                .netns
                .clone()
                .or_else(|| model.as_ref().and_then(|m| m.context.netns.clone()));
            let backend = model
                .as_ref()
                .map_or("system", |m| m.context.iptables_backend.as_str());
            // nftables mode reads conntrack with the same tools, not the rules.
            tools = rules::runners(netns.as_deref(), backend);
            let read = if nftables {
                super::nft_rules::read(netns.as_deref())
            } else {
                Programmed::read(&tools)
            };
            match read {
                Ok((p, failed)) => {
                    // Tools that ran and failed: a family this node does not have, say.
                    warnings.extend(failed.into_iter().map(|f| format!("rules not read: {f}")));
                    rules = Some(p);
                }
                Err(e) => warnings.push(format!("{e:#}")),
            }
        }
        if model.is_none() && maps.is_none() && rules.is_none() {
            anyhow::bail!("nothing to read: {}", warnings.join("; "));
        }
        Ok(Self {
            model,
            maps,
            rules,
            tools,
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
    /// iptables: the share of new connections the balancing rules give it.
    pub probability: Option<f64>,
    /// iptables: its KUBE-SEP chain.
    pub chain: Option<String>,
}

#[derive(Serialize, Clone, Debug)]
pub struct ServiceRow {
    pub frontend: String,
    /// socket (connections made on this node) or packet (traffic from other hosts).
    pub scope: &'static str,
    /// `namespace/name:port`, when the daemon answered (or the rules' comment says).
    pub service: Option<String>,
    /// The traffic policy that picks this frontend's backends.
    pub policy: Option<String>,
    pub affinity_timeout: Option<u32>,
    pub source_ranges: Vec<String>,
    /// Packet path: the source becomes the node's address towards other nodes' backends.
    pub snat: bool,
    /// What the dataplane sends to: the maps' or the rules' backends, else the model's.
    pub backends: Vec<BackendRow>,
    /// With no backend: what happens to a connection.
    pub no_backends: Option<String>,
    /// iptables mode: the chains the frontend's traffic passes (`KUBE-EXT-x -> KUBE-SVC-x`).
    pub chain: Option<String>,
    /// With the model and what is programmed: whether they agree.
    pub in_sync: Option<bool>,
    /// How what is programmed differs from the model, e.g. "programmed: 2 backends,
    /// model: 3; not programmed: 198.18.1.13:8080".
    pub difference: Option<String>,
}

fn backend_row(b: &BackendAddr, m: Option<&ModelFrontend>) -> BackendRow {
    let ep = m.and_then(|m| {
        let set = m.endpoints?;
        select::endpoints_for_port(set, m.port)
            .into_iter()
            .find(|pe| pe.ip == b.ip && pe.port == b.port)
    });
    let address = SocketAddr::new(b.ip, b.port).to_string();
    BackendRow {
        address,
        state: ep
            .as_ref()
            .map_or("unknown", |pe| state_word(&pe.endpoint))
            .to_string(),
        node: ep.and_then(|pe| pe.endpoint.node_name().map(str::to_owned)),
        local: b.local,
        probability: None,
        chain: None,
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
    // iptables and nftables tell "no endpoints at all" (reject) from "none this policy may
    // use here" (drop); the eBPF socket hooks refuse both.
    let anywhere = m.is_some_and(|m| {
        let set = m.endpoints.cloned().unwrap_or_default();
        select::endpoints_for_port(&set, m.port)
            .iter()
            .any(|e| e.endpoint.ready || (e.endpoint.serving && e.endpoint.terminating))
    });
    match (mode, scope) {
        ("iptables" | "nftables", _) if anywhere => {
            "dropped (no endpoint this policy may use here)"
        }
        ("iptables" | "nftables", _) => "rejected",
        (_, FrontendScope::Socket) => "refused (ECONNREFUSED)",
        (_, FrontendScope::Packet) => "dropped",
    }
}

/// The parts of a row that come from the model alone.
fn model_row(fe: &Frontend, m: Option<&ModelFrontend>) -> ServiceRow {
    ServiceRow {
        frontend: fe.to_string(),
        scope: scope_word(fe.scope),
        service: m.map(|m| service_port_name(m.svc, m.port)),
        policy: m.map(|m| policy_of(m, fe)),
        affinity_timeout: m.and_then(|m| m.desired.affinity_timeout),
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
        backends: vec![],
        no_backends: None,
        chain: None,
        in_sync: None,
        difference: None,
    }
}

/// `inspect services`.
pub fn services(inputs: &Inputs) -> anyhow::Result<Vec<ServiceRow>> {
    let model = inputs
        .model
        .as_ref()
        .map(model_frontends)
        .unwrap_or_default();
    if let Some(rules) = &inputs.rules {
        return Ok(rule_rows(&model, rules));
    }
    let mode = inputs.model.as_ref().map_or("ebpf", |m| m.mode.as_str());
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
        let mut row = model_row(&fe, m);
        if row.affinity_timeout.is_none() {
            row.affinity_timeout = p.map(|p| p.affinity_timeout).filter(|t| *t > 0);
        }
        if let (Some(_), Some(m)) = (&programmed, m) {
            let mut have: Vec<BackendAddr> = p.map(|p| p.backends.clone()).unwrap_or_default();
            have.sort();
            let have: BTreeSet<SocketAddr> = have.iter().map(sockaddr).collect();
            let want: BTreeSet<SocketAddr> = m.desired.backends.iter().map(sockaddr).collect();
            row.difference = backend_difference(&have, &want);
            row.in_sync = Some(row.difference.is_none());
        }
        row.no_backends = backends
            .is_empty()
            .then(|| no_backend_outcome(fe.scope, mode, m).to_string());
        row.backends = backends.iter().map(|b| backend_row(b, m)).collect();
        rows.push(row);
    }
    Ok(rows)
}

fn sockaddr(b: &BackendAddr) -> SocketAddr {
    SocketAddr::new(b.ip, b.port)
}

/// "programmed: 2 backends, model: 3; not programmed: X" when the sets differ.
fn backend_difference(have: &BTreeSet<SocketAddr>, want: &BTreeSet<SocketAddr>) -> Option<String> {
    if have == want {
        return None;
    }
    let list = |s: Vec<&SocketAddr>| s.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let mut d = vec![format!(
        "programmed: {} backend{}, model: {}",
        have.len(),
        if have.len() == 1 { "" } else { "s" },
        want.len()
    )];
    let missing = list(want.difference(have).collect());
    if !missing.is_empty() {
        d.push(format!("not programmed: {}", missing.join(", ")));
    }
    let extra = list(have.difference(want).collect());
    if !extra.is_empty() {
        d.push(format!("not in the model: {}", extra.join(", ")));
    }
    Some(d.join("; "))
}

/// iptables mode: each frontend of the model, and each the rules have that the model lacks,
/// with the backends the rules really send to.
fn rule_rows(model: &BTreeMap<Frontend, ModelFrontend>, rules: &Programmed) -> Vec<ServiceRow> {
    let mut fronts: Vec<(Frontend, Option<&ModelFrontend>)> =
        model.iter().map(|(fe, m)| (*fe, Some(m))).collect();
    let known: BTreeSet<rules::Key> = model.keys().map(|f| (f.ip, f.port, f.proto)).collect();
    for (&(ip, port, proto), rf) in &rules.frontends {
        if !known.contains(&(ip, port, proto)) {
            let scope = if rf.kind == "cluster IP" {
                FrontendScope::Socket
            } else {
                FrontendScope::Packet
            };
            fronts.push((
                Frontend {
                    ip,
                    port,
                    proto,
                    scope,
                },
                None,
            ));
        }
    }
    fronts.sort_by_key(|(fe, _)| (fe.scope, fe.ip, fe.port, fe.proto));
    let mut rows = Vec::new();
    for (fe, m) in fronts {
        let key = (fe.ip, fe.port, fe.proto);
        let rf = rules.frontends.get(&key);
        // From this node, an external address or node port goes the way of local sources.
        let from_node = fe.scope == FrontendScope::Socket
            && m.is_none_or(|m| !m.svc.cluster_ips.contains(&fe.ip));
        let resolved = rules.resolve(&key, from_node);
        let mut row = model_row(&fe, m);
        if row.service.is_none() {
            row.service = rf.and_then(|r| r.service.clone());
        }
        let mut have = BTreeSet::new();
        if let Some(r) = &resolved {
            row.chain = Some(r.path.join(" -> "));
            if !r.source_ranges.is_empty() {
                row.source_ranges = r.source_ranges.clone();
            }
            for b in &r.backends {
                let mut br = match b.addr {
                    Some(a) => {
                        have.insert(a);
                        let local = m.is_some_and(|m| {
                            m.desired
                                .backends
                                .iter()
                                .any(|d| sockaddr(d) == a && d.local)
                        });
                        let addr = BackendAddr {
                            ip: a.ip(),
                            port: a.port(),
                            proto: fe.proto,
                            local,
                        };
                        backend_row(&addr, m)
                    }
                    None => BackendRow {
                        address: format!("(no DNAT rule in {})", b.sep),
                        state: "unknown".into(),
                        node: None,
                        local: false,
                        probability: None,
                        chain: None,
                    },
                };
                br.probability = Some((b.probability * 10_000.0).round() / 10_000.0);
                br.chain = Some(b.sep.clone());
                row.backends.push(br);
            }
        }
        let programmed_affinity = resolved.as_ref().and_then(|r| r.affinity_timeout);
        if let Some(m) = m {
            let want: BTreeSet<SocketAddr> = m.desired.backends.iter().map(sockaddr).collect();
            let mut diff: Vec<String> = backend_difference(&have, &want).into_iter().collect();
            if !have.is_empty() && programmed_affinity != m.desired.affinity_timeout {
                diff.push(format!(
                    "affinity programmed: {}, model: {}",
                    programmed_affinity.map_or("none".into(), |t| format!("{t}s")),
                    m.desired
                        .affinity_timeout
                        .map_or("none".into(), |t| format!("{t}s"))
                ));
            }
            row.difference = (!diff.is_empty()).then(|| diff.join("; "));
            row.in_sync = Some(diff.is_empty());
        } else {
            row.difference = Some("the model has no such frontend".into());
            row.in_sync = Some(false);
        }
        row.affinity_timeout = programmed_affinity;
        if row.backends.is_empty() {
            row.no_backends = Some(match rules.refused.get(&key) {
                Some((verdict, why)) => format!("{verdict} by the filter table: {why}"),
                None if rf.is_some() => "not translated (the chains lead to no backend)".into(),
                None => "not translated (no rule for it)".into(),
            });
        }
        rows.push(row);
    }
    rows
}

pub fn services_table(rows: &[ServiceRow]) -> String {
    let iptables = rows.iter().any(|r| r.chain.is_some());
    let shares = rows
        .iter()
        .any(|r| r.backends.iter().any(|b| b.probability.is_some()));
    let mut head = vec![
        "FRONTEND", "SCOPE", "SERVICE", "POLICY", "AFFINITY", "BACKEND",
    ];
    if shares {
        head.push("SHARE");
    }
    head.extend(["STATE", "NODE"]);
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
                    Some(false) => " (DIFFERS, see below)",
                    _ => "",
                },
            r.affinity_timeout
                .map_or("-".into(), |t| format!("ClientIP {t}s")),
        ];
        let backend = |b: &BackendRow| {
            let mut cells = vec![b.address.clone()];
            if shares {
                cells.push(
                    b.probability
                        .map_or("-".into(), |p| format!("{:.1}%", p * 100.0)),
                );
            }
            cells.push(b.state.clone());
            cells.push(b.node.clone().unwrap_or_else(|| {
                if b.local {
                    "(this node)".into()
                } else {
                    "-".into()
                }
            }));
            cells
        };
        match r.backends.split_first() {
            None => {
                first.push(format!(
                    "(none: {})",
                    r.no_backends.as_deref().unwrap_or("")
                ));
                first.extend(std::iter::repeat_n(
                    String::new(),
                    if shares { 3 } else { 2 },
                ));
            }
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
    let mut out = t.render();
    for r in rows {
        if let Some(d) = &r.difference {
            out.push_str(&format!("{} differs: {d}\n", r.frontend));
        }
    }
    out
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
