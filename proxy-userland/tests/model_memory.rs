//! The model's memory per service, counted exactly: the change tracker fed the same
//! synthetic cluster as the daemon bench (services of one port, one EndpointSlice of ten
//! ready endpoints each), through the real converter. At 50,000 services the model is most
//! of the daemon's heap, so a change that makes every service bigger shows here long
//! before anyone runs the bench. The bound is loose (about a third above what the model
//! holds now): it catches a regression of the kind fixed before (Vecs with spare capacity,
//! a copy of every name, a `String` per endpoint), not a few bytes.

#[path = "../benches/support/heap.rs"]
mod heap;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_userland::model::{convert, tracker::ChangeTracker};
use serde_json::json;

#[global_allocator]
static ALLOC: heap::Counting = heap::Counting;

const SERVICES: u32 = 5_000;
const ENDPOINTS: u32 = 10;
/// What the tracker may hold per service (bytes asked of the allocator). It holds 1,065
/// (2026-12-05; 1,305 before an endpoint's placement became one shared pointer, 1,465
/// before node and zone names became thin pointers).
const MAX_BYTES_PER_SERVICE: isize = 1_300;

fn objects() -> (Vec<Service>, Vec<EndpointSlice>) {
    let mut services = Vec::new();
    let mut slices = Vec::new();
    for i in 0..SERVICES {
        let name = format!("svc-{i}");
        let n = i + 256;
        let ip = format!("198.19.{}.{}", (n >> 8) & 0xff, n & 0xff);
        services.push(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "bench"},
                "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                         "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}
            }))
            .unwrap(),
        );
        let endpoints: Vec<_> = (0..ENDPOINTS)
            .map(|j| {
                let k = 16 * 256 + (i * ENDPOINTS + j) % (240 * 256);
                json!({"addresses": [format!("198.18.{}.{}", k >> 8, k & 0xff)],
                       "conditions": {"ready": true}, "nodeName": "node-b"})
            })
            .collect();
        slices.push(
            serde_json::from_value(json!({
                "metadata": {"name": format!("{name}-1"), "namespace": "bench",
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": endpoints
            }))
            .unwrap(),
        );
    }
    (services, slices)
}

#[test]
fn model_bytes_per_service_stay_bounded() {
    let (services, slices) = objects();
    let before = heap::live();
    let mut tracker = ChangeTracker::new();
    {
        let services = services
            .iter()
            .map(|s| convert::service(s, None).unwrap().unwrap())
            .collect();
        let slices = slices
            .iter()
            .map(|s| convert::endpoint_slice(s).unwrap().unwrap())
            .collect();
        tracker.replace_services(services);
        tracker.replace_slices(slices);
    }
    let changes = tracker.take_changes();
    assert_eq!(changes.changed.len(), SERVICES as usize);
    assert_eq!(changes.state.endpoints.len(), SERVICES as usize);
    drop(changes);
    let per_service = (heap::live() - before) / SERVICES as isize;
    eprintln!("model: {per_service} bytes a service (bound {MAX_BYTES_PER_SERVICE})");
    assert!(
        per_service <= MAX_BYTES_PER_SERVICE,
        "the model holds {per_service} bytes a service, more than {MAX_BYTES_PER_SERVICE}"
    );
    drop((services, slices, tracker));
}
