//! What one endpoint change costs through the sync engine with the real eBPF dataplane,
//! with the kernel-filled maps empty and then full: the socket reverse-NAT map (262,144
//! entries) and the ClientIP affinity map (65,536); for a service without affinity and for
//! one with it. Counting the reverse-NAT map used to be part of every sync (65,000 bpf()
//! calls, 200-500 ms); and every backend leaving any frontend used to walk the whole
//! affinity map to forget clients of that backend (a bpf() call per entry). Now the
//! programmer's own counts serve the metrics, the kernel-filled maps are counted off the
//! sync path, and a backend that leaves a frontend with affinity costs one delete in the
//! affinity match map, so the two cases must cost the same few milliseconds. Run with
//! `--nocapture` to see the numbers.

mod common;

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use aya::maps::{HashMap, Map, MapData};
use common::*;
use proxy_common::{
    AffinityKey, AffinityValue, SockRevNat4Key, SockRevNat4Value,
    maps::{AFFINITY_MAX, SOCK_REVNAT_MAX},
};
use proxy_userland::{
    dataplane::{Proxier, bpf::BpfDataplane},
    model::{ServiceKey, SliceInfo},
    source::SourceEvent,
    sync::{Engine, EngineConfig, EngineEvent, SyncPeriods},
};
use tokio::sync::mpsc;

const SERVICES: u8 = 100;
const CHANGES: usize = 40;

fn slice_with(pod: Ipv4Addr) -> SliceInfo {
    web_endpoints(vec![ready(pod)])
        .slices
        .remove("slice-a")
        .unwrap()
}

/// Time from an endpoint change entering the engine to its sync being reported.
async fn endpoint_changes(
    tx: &mpsc::Sender<SourceEvent>,
    out: &mut mpsc::UnboundedReceiver<EngineEvent>,
    service: &str,
) -> Vec<Duration> {
    let mut took = Vec::new();
    let started = Instant::now();
    for i in 0..CHANGES {
        if started.elapsed() > Duration::from_secs(60) {
            break;
        }
        let pod = Ipv4Addr::new(198, 18, 1, 1 + (i % 200) as u8);
        let t = Instant::now();
        tx.send(SourceEvent::Slice {
            namespace: "demo".into(),
            owner: Some(ServiceKey::new("demo", service)),
            name: "slice-a".into(),
            slice: Some(slice_with(pod)),
        })
        .await
        .unwrap();
        loop {
            match tokio::time::timeout(Duration::from_secs(10), out.recv()).await {
                Ok(Some(EngineEvent::Synced(o))) => {
                    assert_eq!(o.record.failed, 0);
                    break;
                }
                Ok(Some(_)) => {}
                other => panic!("no sync: {other:?}"),
            }
        }
        took.push(t.elapsed());
    }
    took.sort();
    took
}

fn summary(took: &[Duration]) -> (Duration, Duration) {
    (took[took.len() / 2], *took.last().unwrap())
}

#[tokio::test]
async fn an_endpoint_change_costs_the_same_with_the_kernel_filled_maps_full() {
    let (bed, _pods) = bed_with_pods("synccost", 1);
    let dir = std::env::temp_dir().join(format!("fastpath-synccost-{}", std::process::id()));
    let bpffs = Bpffs::mount(&dir);
    let dp = BpfDataplane::attach_pinned(bed.cgroup_path(), Some(&bpffs.0)).expect("attach");

    let (tx, input) = mpsc::channel(1024);
    let cfg = EngineConfig {
        periods: SyncPeriods::default(),
        node: node(),
        service_ranges: Vec::new(),
    };
    let (engine, mut out) = Engine::spawn(Proxier::Bpf(Box::new(dp)), cfg, input).unwrap();
    // svc-0 without affinity, svc-1 with.
    let services = (0..SERVICES)
        .map(|i| {
            let mut svc = web_service(&format!("svc-{i}"), Ipv4Addr::new(198, 19, 1, i));
            svc.affinity_timeout = (i == 1).then_some(600);
            svc
        })
        .collect();
    let slices = (0..SERVICES)
        .map(|i| {
            let key = ServiceKey::new("demo", format!("svc-{i}"));
            (key, "slice-a".to_string(), slice_with(pod_ip(1)))
        })
        .collect();
    tx.send(SourceEvent::ReplaceAll { services, slices })
        .await
        .unwrap();
    tx.send(SourceEvent::Synced).await.unwrap();
    let empty = endpoint_changes(&tx, &mut out, "svc-0").await;
    let sticky_empty = endpoint_changes(&tx, &mut out, "svc-1").await;

    // Fill the socket reverse-NAT map as a node with many open connections would.
    let mut revnat: HashMap<MapData, SockRevNat4Key, SockRevNat4Value> =
        pinned(&bpffs.0, proxy_common::maps::SOCK_REVNAT4);
    let fill = Instant::now();
    for cookie in 0..u64::from(SOCK_REVNAT_MAX) {
        let key = SockRevNat4Key {
            cookie: cookie + 1,
            address: u32::from_ne_bytes([198, 18, 1, 1]),
            port: 8080u16.to_be(),
            _pad: [0; 2],
        };
        let value = SockRevNat4Value {
            address: u32::from_ne_bytes([198, 19, 1, 0]),
            port: 80u16.to_be(),
            rev_nat_index: 1,
        };
        revnat.insert(key, value, 0).unwrap();
        assert!(
            fill.elapsed() < Duration::from_secs(120),
            "filling took too long"
        );
    }
    let walk = Instant::now();
    let entries = revnat.keys().take(SOCK_REVNAT_MAX as usize + 1).count();
    let walk = walk.elapsed();
    assert!(
        entries as u32 >= SOCK_REVNAT_MAX * 9 / 10,
        "only {entries} entries"
    );
    // And the affinity map, as ClientIP-affinity services with many clients would.
    let mut affinity: HashMap<MapData, AffinityKey, AffinityValue> =
        pinned(&bpffs.0, proxy_common::maps::AFFINITY);
    let fill = Instant::now();
    for client in 0..u64::from(AFFINITY_MAX) {
        let key = AffinityKey {
            client: client + 1,
            // Every frontend's, svc-1's among them.
            rev_nat_index: 1 + (client % (2 * u64::from(SERVICES))) as u16,
            _pad: [0; 6],
        };
        let value = AffinityValue {
            backend_id: 1 + (client % 200) as u32,
            _pad: 0,
            last_used_ns: 0,
        };
        affinity.insert(key, value, 0).unwrap();
        assert!(
            fill.elapsed() < Duration::from_secs(60),
            "filling took too long"
        );
    }
    let affinity_walk = Instant::now();
    let affinity_entries = affinity.keys().take(AFFINITY_MAX as usize + 1).count();
    let affinity_walk = affinity_walk.elapsed();
    assert!(
        affinity_entries as u32 >= AFFINITY_MAX * 9 / 10,
        "only {affinity_entries} affinity entries"
    );
    let full = endpoint_changes(&tx, &mut out, "svc-0").await;
    let sticky_full = endpoint_changes(&tx, &mut out, "svc-1").await;

    println!(
        "endpoint change through the engine, {SERVICES} services; full maps: reverse-NAT \
         {entries} entries (one walk of it takes {walk:?}), affinity {affinity_entries} \
         entries (one walk {affinity_walk:?})"
    );
    let walks = walk.min(affinity_walk);
    for (what, empty, full) in [
        ("without affinity", &empty, &full),
        ("with affinity", &sticky_empty, &sticky_full),
    ] {
        let (empty_p50, empty_max) = summary(empty);
        let (full_p50, full_max) = summary(full);
        println!(
            "  a service {what}: maps empty: p50 {empty_p50:?}, max {empty_max:?}; \
             full: p50 {full_p50:?}, max {full_max:?}"
        );
        // Counting the reverse-NAT map or walking the affinity map per sync would add at
        // least one walk of it to every change.
        assert!(
            full_p50 < empty_p50 + walks / 2,
            "{what}: full maps slow syncs: {full_p50:?} against {empty_p50:?} empty"
        );
        assert!(
            full_p50 < Duration::from_millis(20),
            "{what}: p50 {full_p50:?}"
        );
    }

    engine.shutdown().await.unwrap();
    drop((revnat, affinity));
    drop(bpffs_cleanup(&bpffs.0));
}

/// A map the dataplane pinned under `dir`, by name.
fn pinned<K: aya::Pod, V: aya::Pod>(dir: &std::path::Path, name: &str) -> HashMap<MapData, K, V> {
    let path = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path().join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("the pinned {name}"));
    let map = Map::from_map_data(MapData::from_pin(&path).unwrap()).unwrap();
    HashMap::try_from(map).unwrap()
}

fn bpffs_cleanup(dir: &std::path::Path) -> Result<(), String> {
    proxy_userland::dataplane::bpf::loader::remove_pinned(dir).map_err(|e| e.to_string())
}
