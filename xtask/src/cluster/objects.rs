//! The API objects the cluster bed writes, as the API server would hold them.

use std::net::Ipv4Addr;

use serde_json::{Value, json};

/// The namespace every workload of the bed lives in.
pub const NAMESPACE: &str = "demo";
/// kube-proxy's zone label, which topology-aware routing reads.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// A Node with its InternalIP and zone.
pub fn node(name: &str, ip: Ipv4Addr, zone: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, ZONE_LABEL: zone},
        },
        "spec": {"podCIDR": format!("198.18.{}.0/24", ip.octets()[3])},
        "status": {"addresses": [
            {"type": "InternalIP", "address": ip.to_string()},
            {"type": "Hostname", "address": name},
        ]},
    })
}

/// One port of a workload: its name, the Service port, the pods' port, protocol, NodePort.
#[derive(Clone, Copy, Debug)]
pub struct PortSpec {
    pub name: &'static str,
    pub port: u16,
    pub target: u16,
    pub protocol: &'static str,
    pub node_port: u16,
}

/// What every workload of the bed serves (fastpath-probe serve): one-line TCP answers,
/// keep-alive HTTP, UDP.
pub const PORTS: [PortSpec; 3] = [
    PortSpec {
        name: "tcp",
        port: 80,
        target: 8080,
        protocol: "TCP",
        node_port: 30080,
    },
    PortSpec {
        name: "http",
        port: 81,
        target: 8081,
        protocol: "TCP",
        node_port: 30081,
    },
    PortSpec {
        name: "dns",
        port: 53,
        target: 5353,
        protocol: "UDP",
        node_port: 30053,
    },
];

/// A NodePort Service on `cluster_ip` with [`PORTS`], their node ports moved by `shift`
/// (so that several Services fit); with `local`, a LoadBalancer Service (the outside load
/// balancer is the test's) with externalTrafficPolicy Local and that health check node port.
pub fn service(name: &str, cluster_ip: Ipv4Addr, shift: u16, local: Option<u16>) -> Value {
    let ports: Vec<Value> = PORTS
        .iter()
        .map(|p| {
            json!({"name": p.name, "port": p.port, "targetPort": p.target,
                   "protocol": p.protocol, "nodePort": p.node_port + shift})
        })
        .collect();
    let mut svc = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "type": "NodePort",
            "clusterIP": cluster_ip.to_string(),
            "clusterIPs": [cluster_ip.to_string()],
            "ipFamilies": ["IPv4"],
            "ports": ports,
            "externalTrafficPolicy": "Cluster",
        },
    });
    if let Some(hc) = local {
        // Only LoadBalancer Services have a health check node port.
        svc["spec"]["type"] = json!("LoadBalancer");
        svc["spec"]["externalTrafficPolicy"] = json!("Local");
        svc["spec"]["healthCheckNodePort"] = json!(hc);
    }
    svc
}

/// An endpoint as the EndpointSlice controller writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    pub pod: String,
    pub ip: Ipv4Addr,
    pub node: String,
    pub zone: String,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

/// The one EndpointSlice of Service `service`, with `endpoints`.
pub fn slice(service: &str, endpoints: &[EndpointSpec]) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|e| {
            json!({
                "addresses": [e.ip.to_string()],
                "conditions": {"ready": e.ready, "serving": e.serving, "terminating": e.terminating},
                "nodeName": e.node,
                "zone": e.zone,
                "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": e.pod},
            })
        })
        .collect();
    let ports: Vec<Value> = PORTS
        .iter()
        .map(|p| json!({"name": p.name, "port": p.target, "protocol": p.protocol}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{service}-1"),
            "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": eps,
        "ports": ports,
    })
}
