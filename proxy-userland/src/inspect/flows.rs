//! `inspect flows | affinity`: the eBPF packet path's flow table and affinity entries from
//! the pinned maps, and in iptables mode the kernel's conntrack entries the rules' DNATs
//! made, joined with the model's (or the rules') service names.

use std::{collections::BTreeMap, net::SocketAddr};

use anyhow::Context as _;
use serde::Serialize;

use super::{
    maps::ProgrammedFrontend,
    rules::{Programmed, parse_recent},
    table::Table,
    view::{Inputs, model_frontends},
};
use crate::{
    admin::debug::ModelDump,
    dataplane::{
        frontends::Frontend,
        iptables::{conntrack::Entry, names::service_port_name},
    },
    model::Protocol,
};

#[derive(Serialize, Clone, Debug)]
pub struct FlowRow {
    pub proto: String,
    pub client: String,
    pub frontend: String,
    pub service: Option<String>,
    pub backend: String,
    pub snat: Option<String>,
    /// eBPF: unanswered, established or closing; conntrack: the TCP state (lower case), or
    /// unreplied, replied, assured.
    pub state: String,
    /// eBPF: seconds since the flow's last packet.
    pub idle_secs: Option<f64>,
    /// conntrack: seconds until the entry expires without another packet.
    pub expires_secs: Option<u64>,
}

/// The service port a packet-path destination belongs to.
fn packet_service(model: &ModelDump, dst: SocketAddr, proto: Protocol) -> Option<String> {
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

/// `inspect flows`: the packet path's flow table (eBPF mode), or the conntrack entries the
/// rules translated (iptables mode).
pub fn flows(inputs: &mut Inputs) -> anyhow::Result<Vec<FlowRow>> {
    if let Some(rules) = &inputs.rules {
        let (mut entries, mut failed) = (Vec::new(), Vec::new());
        for t in &inputs.tools {
            match t.conntrack_entries() {
                Ok(e) => entries.extend(e),
                Err(e) => failed.push(format!("conntrack ({:?}): {e}", t.family())),
            }
        }
        anyhow::ensure!(
            failed.len() < inputs.tools.len(),
            "cannot list the conntrack table: {}",
            failed.join("; ")
        );
        let rows = conntrack_flows(rules, &entries);
        inputs.warnings.extend(failed);
        return Ok(rows);
    }
    let Some(maps) = &inputs.maps else {
        anyhow::bail!(
            "no flow table to read: neither the pinned maps nor the conntrack table{}",
            inputs
                .model
                .as_ref()
                .map_or(String::new(), |m| format!(" ({} mode)", m.mode))
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
            }
            .into(),
            idle_secs: Some((f.idle_secs * 10.0).round() / 10.0),
            expires_secs: None,
        })
        .collect())
}

/// The conntrack entries whose replies come from an address a KUBE-SEP chain DNATs to,
/// having been sent somewhere else: the connections the rules translated.
pub fn conntrack_flows(rules: &Programmed, entries: &[Entry]) -> Vec<FlowRow> {
    let targets = rules.dnat_targets();
    let mut rows: Vec<FlowRow> = entries
        .iter()
        .filter(|e| e.reply.src != e.orig.dst && targets.contains_key(&e.reply.src))
        .filter_map(|e| {
            let proto = Protocol::from_k8s(Some(&e.proto.to_ascii_uppercase()))?;
            let dst = e.orig.dst;
            // The rule's comment names the service port; an address behind several services'
            // DNATs that is not reached through a frontend is named by its KUBE-SEP chain.
            let service = rules
                .frontend_for(dst, proto)
                .and_then(|r| r.service.clone())
                .or_else(|| targets.get(&e.reply.src).cloned());
            let state = match (&e.state, e.unreplied, e.assured) {
                (Some(s), _, _) => s.to_ascii_lowercase(),
                (None, true, _) => "unreplied".into(),
                (None, false, true) => "assured".into(),
                (None, false, false) => "replied".into(),
            };
            Some(FlowRow {
                proto: proto.to_string(),
                client: e.orig.src.to_string(),
                frontend: dst.to_string(),
                service,
                backend: e.reply.src.to_string(),
                snat: (e.reply.dst != e.orig.src).then(|| e.reply.dst.to_string()),
                state,
                idle_secs: None,
                expires_secs: Some(e.timeout_secs),
            })
        })
        .collect();
    rows.sort_by(|a, b| (&a.frontend, &a.client).cmp(&(&b.frontend, &b.client)));
    rows
}

pub fn flows_table(rows: &[FlowRow]) -> String {
    let conntrack = rows.iter().any(|r| r.expires_secs.is_some());
    let mut t = Table::new(&[
        "PROTO",
        "CLIENT",
        "FRONTEND",
        "SERVICE",
        "BACKEND",
        "SNAT",
        "STATE",
        if conntrack { "EXPIRES" } else { "IDLE" },
    ]);
    for r in rows {
        t.row(vec![
            r.proto.clone(),
            r.client.clone(),
            r.frontend.clone(),
            r.service.clone().unwrap_or_else(|| "?".into()),
            r.backend.clone(),
            r.snat.clone().unwrap_or_else(|| "-".into()),
            r.state.clone(),
            match (r.expires_secs, r.idle_secs) {
                (Some(e), _) => format!("{e}s"),
                (None, Some(i)) => format!("{i:.1}s"),
                (None, None) => "-".into(),
            },
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
    /// eBPF: seconds since the client's last new connection (the `recent` lists keep it in
    /// jiffies, so iptables mode leaves it out).
    pub idle_secs: Option<f64>,
    pub timeout_secs: Option<u32>,
}

/// `inspect affinity`: the eBPF affinity map, in iptables mode the `recent` lists the
/// rules check, in nftables mode the `affinity-` sets.
pub fn affinity(inputs: &mut Inputs) -> anyhow::Result<Vec<AffinityRow>> {
    if let Some(rules) = &inputs.rules {
        // The lists are the namespace's, one directory for both families.
        let tool = inputs.tools.first().context("no iptables tools")?;
        let (mut rows, mut failed) = (Vec::new(), Vec::new());
        for list in rules.affinity_lists() {
            let clients = if rules.is_nftables() {
                // endpoint-X's clients are in the set affinity-X.
                let set = list.sep.replacen("endpoint-", "affinity-", 1);
                rules.nft_affinity.get(&set).cloned().unwrap_or_default()
            } else {
                match tool.recent_list(&list.sep) {
                    Ok(t) => parse_recent(&t),
                    Err(e) => {
                        failed.push(format!("{}: {e}", list.sep));
                        continue;
                    }
                }
            };
            for client in clients {
                rows.push(AffinityRow {
                    client: client.to_string(),
                    frontend: Some(list.frontend.to_string()),
                    service: list.service.clone(),
                    backend: list.backend.map(|b| b.to_string()),
                    idle_secs: None,
                    timeout_secs: list.timeout_secs,
                });
            }
        }
        inputs.warnings.extend(failed);
        return Ok(rows);
    }
    let Some(maps) = &inputs.maps else {
        anyhow::bail!("no affinity entries to read: neither the pinned maps nor the rules");
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
                backend: a.backend.map(|b| SocketAddr::new(b.ip, b.port).to_string()),
                idle_secs: Some((a.idle_secs * 10.0).round() / 10.0),
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
            r.idle_secs.map_or("-".into(), |i| format!("{i:.1}s")),
            r.timeout_secs.map_or("-".into(), |t| format!("{t}s")),
        ]);
    }
    t.render()
}
