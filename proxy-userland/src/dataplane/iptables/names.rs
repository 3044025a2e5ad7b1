//! Chain names as kube-proxy spells them, so that tooling and people reading
//! `iptables-save` recognise them: `KUBE-SVC-` plus the first 16 characters of the base32 of
//! the SHA-256 of the service port name and protocol (`ns/name:port` + `tcp`), and for an
//! endpoint the same over the name, the protocol and `ip:port`.

use std::net::SocketAddr;

use ring::digest::{SHA256, digest};

use crate::model::{Protocol, Service, ServicePort};

/// kube-proxy's `ServicePortName.String()`: `ns/name`, plus `:port` when the port is named.
pub fn service_port_name(svc: &Service, port: &ServicePort) -> String {
    if port.name.is_empty() {
        format!("{}/{}", svc.key.namespace, svc.key.name)
    } else {
        format!("{}/{}:{}", svc.key.namespace, svc.key.name, port.name)
    }
}

/// The protocol as kube-proxy hashes it and as iptables matches it: lower case.
pub fn proto_lower(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// RFC 4648 base32 (upper case, padded), as Go's `base32.StdEncoding`.
pub fn base32(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(data.len().div_ceil(5) * 8);
    for chunk in data.chunks(5) {
        let mut buf = [0u8; 5];
        buf[..chunk.len()].copy_from_slice(chunk);
        let bits = buf.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
        // 5 bytes make 8 characters; a short chunk makes ceil(len * 8 / 5) and padding.
        let chars = (chunk.len() * 8).div_ceil(5);
        for i in 0..8 {
            if i < chars {
                out.push(ALPHABET[((bits >> (35 - i * 5)) & 31) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn hash16(input: &str) -> String {
    let mut s = base32(digest(&SHA256, input.as_bytes()).as_ref());
    s.truncate(16);
    s
}

/// The hash kube-proxy's `portProtoHash` computes.
pub fn port_proto_hash(spn: &str, proto: Protocol) -> String {
    hash16(&format!("{spn}{}", proto_lower(proto)))
}

/// The chains of one service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortChains {
    /// Cluster traffic policy: every usable endpoint.
    pub svc: String,
    /// Local traffic policy: this node's endpoints.
    pub svl: String,
    /// External destinations (node ports, external and load balancer IPs).
    pub ext: String,
    /// Load balancer source ranges.
    pub fw: String,
}

impl PortChains {
    pub fn new(spn: &str, proto: Protocol) -> Self {
        let h = port_proto_hash(spn, proto);
        PortChains {
            svc: format!("KUBE-SVC-{h}"),
            svl: format!("KUBE-SVL-{h}"),
            ext: format!("KUBE-EXT-{h}"),
            fw: format!("KUBE-FW-{h}"),
        }
    }
}

/// `KUBE-SEP-<hash>` for one endpoint of a service port (`ep` as `ip:port`, `[ip]:port`).
pub fn endpoint_chain(spn: &str, proto: Protocol, ep: SocketAddr) -> String {
    format!(
        "KUBE-SEP-{}",
        hash16(&format!("{spn}{}{ep}", proto_lower(proto)))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base32_matches_rfc4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "MY======"),
            ("fo", "MZXQ===="),
            ("foo", "MZXW6==="),
            ("foob", "MZXW6YQ="),
            ("fooba", "MZXW6YTB"),
            ("foobar", "MZXW6YTBOI======"),
        ] {
            assert_eq!(base32(input.as_bytes()), want, "{input:?}");
        }
    }

    #[test]
    fn chain_names_are_kube_proxys() {
        // From kube-proxy's own iptables proxier tests (pkg/proxy/iptables/proxier_test.go):
        // ns1/svc1:p80 over TCP is KUBE-SVC-XPGD46QRK7WJZT7O.
        assert_eq!(
            PortChains::new("ns1/svc1:p80", Protocol::Tcp).svc,
            "KUBE-SVC-XPGD46QRK7WJZT7O"
        );
        // ...and its endpoint 10.180.0.1:80 is KUBE-SEP-SXIVWICOYRO3J4NJ. The name hashes the
        // address, so upstream's address stays: it is data here, never configured.
        assert_eq!(
            endpoint_chain(
                "ns1/svc1:p80",
                Protocol::Tcp,
                "10.180.0.1:80".parse().unwrap()
            ),
            "KUBE-SEP-SXIVWICOYRO3J4NJ"
        );
    }

    #[test]
    fn names_are_stable_and_distinct() {
        let a = PortChains::new("demo/web:http", Protocol::Tcp);
        assert_eq!(a, PortChains::new("demo/web:http", Protocol::Tcp));
        assert_ne!(a.svc, PortChains::new("demo/web:http", Protocol::Udp).svc);
        assert_eq!(a.svc.len(), "KUBE-SVC-".len() + 16);
        // All four chains share the hash.
        assert_eq!(&a.svc[9..], &a.ext[9..]);
        // iptables chain names may be at most 28 characters.
        assert!(a.svc.len() <= 28 && a.fw.len() <= 28);
    }
}
