//! Where the daemon's memory goes, measured piece by piece in the bench's own process with
//! the counting allocator (support/heap.rs), on the same objects the daemon is fed:
//!
//! - the Kubernetes objects as kube-rs decodes them (k8s-openapi types): what a reflector
//!   cache would hold; the daemon's watchers keep none after converting, but decode every
//!   list page and watch event into them;
//! - the model: the real converter's Services and EndpointSlices in a `ProxyState`;
//! - the eBPF programmer's state after a full sync of that model (the maps themselves are
//!   kernel memory, not the daemon's RSS).
//!
//! What the daemon's VmRSS holds beyond these (by difference) is the rest: the program
//! object and loader, the runtime's threads and buffers, allocator slack, copies the sync
//! loop keeps, and the libraries' code.
#![allow(dead_code)]

use std::{collections::BTreeMap, fmt::Write as _, sync::Arc};

use anyhow::{Context as _, Result};
use k8s_openapi::api::{core::v1::Service as K8sService, discovery::v1::EndpointSlice};
use proxy_userland::{
    dataplane::{Dataplane, Scope, bpf::BpfDataplane},
    model::{EndpointSet, NodeInfo, ProxyState, convert},
};
use serde::Deserialize as _;

use super::{cluster, heap};

pub struct MemRow {
    pub services: u32,
    pub k8s_objects: isize,
    pub model: isize,
    pub ebpf_programmer: Option<isize>,
}

pub fn breakdown(n: u32) -> Result<MemRow> {
    let (services_json, slices_json) = cluster::objects(n);
    let before = heap::live();
    // Decoded from references, so the JSON stays alive and only the typed objects count.
    let services: Vec<K8sService> = services_json
        .iter()
        .map(K8sService::deserialize)
        .collect::<Result<_, _>>()
        .context("decoding services")?;
    let slices: Vec<EndpointSlice> = slices_json
        .iter()
        .map(EndpointSlice::deserialize)
        .collect::<Result<_, _>>()
        .context("decoding slices")?;
    let k8s_objects = heap::live() - before;

    let before = heap::live();
    let mut state = ProxyState::default();
    for s in &services {
        if let Ok(Some(svc)) = convert::service(s, None) {
            state.services.insert(svc.key.clone(), Arc::new(svc));
        }
    }
    let mut sets: BTreeMap<_, EndpointSet> = BTreeMap::new();
    for s in &slices {
        if let Ok(Some((key, name, info))) = convert::endpoint_slice(s) {
            sets.entry(key).or_default().slices.insert(name, info);
        }
    }
    state.endpoints = sets.into_iter().map(|(k, v)| (k, Arc::new(v))).collect();
    let model = heap::live() - before;
    drop((services, slices));

    let ebpf_programmer = programmer(&state)
        .map_err(|e| eprintln!("bench: eBPF programmer not measured: {e:#}"))
        .ok();
    Ok(MemRow {
        services: n,
        k8s_objects,
        model,
        ebpf_programmer,
    })
}

fn programmer(state: &ProxyState) -> Result<isize> {
    let bed = xtask::testbed::Testbed::new("benchmem")?;
    let mut lb_max = proxy_common::maps::SERVICES_MAX;
    while (lb_max as usize) < state.services.len() * 22 {
        lb_max *= 2;
    }
    let opts = proxy_userland::dataplane::bpf::AttachOptions {
        lb_map_max: Some(lb_max),
        ..Default::default()
    };
    let mut dp = BpfDataplane::attach_with(bed.cgroup_path(), &opts)?;
    let before = heap::live();
    let report = dp.sync(state, &NodeInfo::default(), Scope::Full);
    anyhow::ensure!(
        report.failed.is_empty(),
        "sync failed: {:?}",
        report.failed.first()
    );
    Ok(heap::live() - before)
}

fn mib(bytes: isize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// `rss`: (mode, services, VmRSS KiB) of the kube-source rows.
pub fn table(out: &mut String, rows: &[MemRow], rss: &[(&str, u32, u64)]) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\n## Where the memory goes (measured in the bench process with a counting allocator)\n\n\
         | services | Kubernetes objects, decoded (MiB) | model (MiB) | eBPF programmer state (MiB) | eBPF daemon VmRSS (MiB) | rest of the eBPF daemon, by difference (MiB) |\n\
         | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for r in rows {
        let daemon = rss
            .iter()
            .find(|(m, n, _)| *m == "ebpf" && *n == r.services)
            .map(|x| x.2 as f64 / 1024.0);
        let prog = r.ebpf_programmer.map(mib);
        let rest = daemon.map(|d| d - mib(r.model) - prog.unwrap_or(0.0));
        let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
        let _ = writeln!(
            out,
            "| {} | {:.1} | {:.1} | {} | {} | {} |",
            r.services,
            mib(r.k8s_objects),
            mib(r.model),
            f(prog),
            f(daemon),
            f(rest)
        );
    }
    let _ = writeln!(
        out,
        "\nThe Kubernetes objects are what kube-rs decodes (every list page, every watch event); \
         the daemon converts and drops them, so they count only in the peak (VmHWM), one list page \
         (500 objects) at a time. The rest is everything else: the program object and loader, \
         threads and buffers, allocator slack, any copy of the model the sync loop keeps."
    );
}
