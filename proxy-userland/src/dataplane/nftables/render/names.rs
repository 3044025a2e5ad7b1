//! kube-proxy's nftables names (pkg/proxy/nftables/proxier.go): readable, with a short hash
//! in front, e.g. `service-ULMVA6XW-ns1/svc1/tcp/p80` and
//! `endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80`. They differ from the iptables
//! mode's `KUBE-SVC-<hash>`, so only the hash function is shared.

use std::net::SocketAddr;

use ring::digest::{SHA256, digest};

use crate::{
    dataplane::iptables::names::{base32, proto_lower},
    model::{Protocol, Service, ServicePort},
};

/// nftables object names may be 256 bytes; the longest prefix we put in front is 16.
const BASE_MAX: usize = 256 - 16;

/// kube-proxy's hashAndTruncate: 8 characters of the name's hash, a dash, the name; cut
/// (with `...`) where it would be too long.
fn hash_and_truncate(name: &str) -> String {
    let hash = base32(digest(&SHA256, name.as_bytes()).as_ref());
    let mut out = format!("{}-{name}", &hash[..8]);
    if out.len() > BASE_MAX {
        // Every character is ASCII (Kubernetes names, digits, `./_-`).
        out.truncate(BASE_MAX - 3);
        out.push_str("...");
    }
    out
}

/// `ns/name/proto/port-name`, hashed: the base of a service port's chains.
pub fn service_base(svc: &Service, port: &ServicePort) -> String {
    hash_and_truncate(&format!(
        "{}/{}/{}/{}",
        svc.key.namespace,
        svc.key.name,
        proto_lower(port.protocol),
        port.name
    ))
}

/// `ns/name/proto/port-name__ip/port`, hashed: the base of an endpoint's chain and
/// affinity set. An IPv6 address's colons (not allowed in names) become dots.
pub fn endpoint_base(svc: &Service, port_name: &str, proto: Protocol, ep: SocketAddr) -> String {
    let ip = ep.ip().to_string().replace(':', ".");
    hash_and_truncate(&format!(
        "{}/{}/{}/{}__{ip}/{}",
        svc.key.namespace,
        svc.key.name,
        proto_lower(proto),
        port_name,
        ep.port()
    ))
}

/// The chains and sets of one service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortNames {
    pub cluster: String,
    pub local: String,
    pub external: String,
    pub firewall: String,
}

impl PortNames {
    pub fn new(svc: &Service, port: &ServicePort) -> Self {
        let base = service_base(svc, port);
        PortNames {
            cluster: format!("service-{base}"),
            local: format!("local-{base}"),
            external: format!("external-{base}"),
            firewall: format!("firewall-{base}"),
        }
    }
}

/// An endpoint's chain and its affinity set.
pub fn endpoint_names(svc: &Service, port: &ServicePort, ep: SocketAddr) -> (String, String) {
    let base = endpoint_base(svc, &port.name, port.protocol, ep);
    (format!("endpoint-{base}"), format!("affinity-{base}"))
}

/// Whether `name` is one of the per-service chains: they, and only they, hold a `/`.
pub fn is_service_chain(name: &str) -> bool {
    name.contains('/')
}
