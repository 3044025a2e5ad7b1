//! The synthetic cluster the daemon bench feeds the real `fastpath` binary: N services x 10
//! endpoints as Kubernetes JSON, loaded into the in-repo API server or written as manifest
//! files; the changes the bench makes (one endpoint replaced) and the churn around them.
#![allow(dead_code)]

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use serde_json::{Value, json};
use xtask::apiserver::ApiServer;

pub const NAMESPACE: &str = "bench";
pub const ENDPOINTS: u32 = 10;
/// The service connections run through while the bench measures (one pod, in the bed).
pub const WEB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
pub const WEB_POD: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 11);

/// Service `i`'s ClusterIP: 198.19.1.0 upwards (198.19.0.x is the bed's own).
pub fn service_ip(i: u32) -> Ipv4Addr {
    let n = i + 256;
    Ipv4Addr::new(198, 19, (n >> 8) as u8, n as u8)
}

/// The k-th synthetic endpoint address: 198.18.16.0 - 198.18.255.255 (clear of the bed's
/// node, pods and the bench's marker addresses), reused after 61,440.
pub fn endpoint_ip(k: u32) -> Ipv4Addr {
    let n = 16 * 256 + k % (240 * 256);
    Ipv4Addr::new(198, 18, (n >> 8) as u8, n as u8)
}

/// The address the k-th measured change brings in: 198.18.3.0 - 198.18.15.255, never one
/// the service had, so its arrival in the dataplane is unambiguous.
pub fn marker_ip(k: u32) -> Ipv4Addr {
    let n = 3 * 256 + k % (13 * 256);
    Ipv4Addr::new(198, 18, (n >> 8) as u8, n as u8)
}

pub fn service_name(i: u32) -> String {
    format!("svc-{i}")
}

pub fn service(name: &str, ip: Ipv4Addr) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP", "clusterIP": ip.to_string(), "clusterIPs": [ip.to_string()],
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
        }
    })
}

pub fn slice(service: &str, ips: &[Ipv4Addr]) -> Value {
    let endpoints: Vec<Value> = ips
        .iter()
        .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": "node-b"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-1"), "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

/// Service `i`'s endpoints as first created.
pub fn initial_endpoints(i: u32) -> Vec<Ipv4Addr> {
    (0..ENDPOINTS)
        .map(|j| endpoint_ip(i * ENDPOINTS + j))
        .collect()
}

/// Service `i`'s endpoints with the first replaced by `ip`.
pub fn changed_endpoints(i: u32, ip: Ipv4Addr) -> Vec<Ipv4Addr> {
    let mut eps = initial_endpoints(i);
    eps[0] = ip;
    eps
}

pub fn node() -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}})
}

/// Every object of a cluster with `n` services, plus `web` (the connections' service).
pub fn objects(n: u32) -> (Vec<Value>, Vec<Value>) {
    let mut services = vec![service("web", WEB_IP)];
    let mut slices = vec![slice("web", &[WEB_POD])];
    for i in 0..n {
        let name = service_name(i);
        services.push(service(&name, service_ip(i)));
        slices.push(slice(&name, &initial_endpoints(i)));
    }
    (services, slices)
}

/// Loads a cluster of `n` services into a fresh API server, then drops the history of the
/// load (nobody watches yet), as a long-running server would have compacted it.
pub fn api_server(n: u32) -> anyhow::Result<ApiServer> {
    let api = ApiServer::start()?;
    api.create("nodes", node());
    let (services, slices) = objects(n);
    for s in services {
        api.try_create("services", s)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    for s in slices {
        api.try_create("endpointslices", s)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    api.compact();
    Ok(api)
}

/// A folder of manifests for a cluster of `n` services: JSON `List`s of `chunk` objects
/// (FASTPATH_BENCH_MANIFEST_CHUNK, default 500; 1 is a file per object), so a change
/// rewrites one file. Removed on drop.
pub struct Manifests {
    pub dir: PathBuf,
    pub chunk: u32,
}

impl Manifests {
    pub fn write(n: u32, chunk: u32) -> anyhow::Result<Manifests> {
        let dir = std::env::temp_dir().join(format!(
            "fastpath-bench-manifests-{}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let chunk = chunk.max(1);
        let m = Manifests { dir, chunk };
        let (services, _) = objects(n);
        for (c, part) in services.chunks(chunk as usize).enumerate() {
            write_list(&m.dir.join(format!("services-{c:05}.json")), part)?;
        }
        write_list(&m.dir.join("slices-web.json"), &[slice("web", &[WEB_POD])])?;
        for c in 0..n.div_ceil(chunk) {
            m.write_slices(n, c, None)?;
        }
        Ok(m)
    }

    /// The slice file holding service `i`, with `i`'s endpoints as `eps`, as (path, text):
    /// made before the change is timed, as an editor or a ConfigMap update has its text
    /// ready before it writes; [`write_file`] writes it.
    pub fn change(&self, n: u32, i: u32, eps: &[Ipv4Addr]) -> anyhow::Result<(PathBuf, Vec<u8>)> {
        self.slices_file(n, i / self.chunk, Some((i, eps)))
    }

    fn write_slices(
        &self,
        n: u32,
        chunk: u32,
        change: Option<(u32, &[Ipv4Addr])>,
    ) -> anyhow::Result<()> {
        let (path, text) = self.slices_file(n, chunk, change)?;
        write_file(&path, &text)
    }

    fn slices_file(
        &self,
        n: u32,
        chunk: u32,
        change: Option<(u32, &[Ipv4Addr])>,
    ) -> anyhow::Result<(PathBuf, Vec<u8>)> {
        let size = self.chunk;
        let items: Vec<Value> = (chunk * size..((chunk + 1) * size).min(n))
            .map(|i| match change {
                Some((c, eps)) if c == i => slice(&service_name(i), eps),
                _ => slice(&service_name(i), &initial_endpoints(i)),
            })
            .collect();
        let path = self.dir.join(format!("slices-{chunk:05}.json"));
        Ok((path, list_text(&items)?))
    }
}

impl Drop for Manifests {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes a `List` atomically (a temporary file renamed over the old one), so the daemon
/// never reads half a file.
fn write_list(path: &Path, items: &[Value]) -> anyhow::Result<()> {
    write_file(path, &list_text(items)?)
}

fn list_text(items: &[Value]) -> anyhow::Result<Vec<u8>> {
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    Ok(serde_json::to_vec(&list)?)
}

/// Writes `text` atomically (a temporary file renamed over the old one).
pub fn write_file(path: &Path, text: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Steady churn on the odd services of `n` (the measured changes go to even ones): `rate`
/// endpoint changes a second written to `api`, until `stop` or `for_at_most` is over;
/// counts them in `churned` and returns for how long it ran, in seconds.
pub fn churn(
    api: &ApiServer,
    n: u32,
    rate: u32,
    for_at_most: std::time::Duration,
    stop: &std::sync::atomic::AtomicBool,
    churned: &std::sync::atomic::AtomicUsize,
) -> f64 {
    use std::{
        sync::atomic::Ordering,
        time::{Duration, Instant},
    };
    if rate == 0 {
        return 0.0;
    }
    let period = Duration::from_secs_f64(1.0 / f64::from(rate));
    let begun = Instant::now();
    let deadline = begun + for_at_most;
    let mut next = begun;
    let mut k: u32 = 0;
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        let i = ((k.wrapping_mul(7_919) % n) | 1).min(n - 1);
        if i % 2 == 1 {
            let ip = endpoint_ip(1_000_000 + k);
            let _ = api.try_update(
                "endpointslices",
                slice(&service_name(i), &changed_endpoints(i, ip)),
            );
            churned.fetch_add(1, Ordering::Relaxed);
        }
        k = k.wrapping_add(1);
        next += period;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    begun.elapsed().as_secs_f64()
}
