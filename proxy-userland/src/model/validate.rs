//! The API server's checks on Services and EndpointSlices, for objects that did not come
//! through one (the manifest file source).
//!
//! Ported in spirit from kubernetes pkg/apis/core/validation (ValidateService,
//! ValidateNonSpecialIP) and pkg/apis/discovery/validation (ValidateEndpointSlice), limited
//! to the fields a proxy reads. One addition: a cluster IP may not be one of this node's
//! own addresses. The API server allocates cluster IPs from the service range, which never
//! holds a node's address; a hand-written one that does would capture every connection the
//! node's processes make to that address and port.
//!
//! The first problem found is returned, naming the object and the field, as the rest of
//! [`super::convert`] does.

use std::{collections::HashSet, net::IpAddr};

use k8s_openapi::{
    api::{core::v1 as core, discovery::v1 as discovery},
    apimachinery::pkg::util::intstr::IntOrString,
};

use super::convert::ConvertError;

/// At most this many addresses per endpoint, endpoints and ports per slice (discovery
/// validation's maxAddresses, maxEndpoints, maxPorts).
const MAX_ADDRESSES: usize = 100;
const MAX_ENDPOINTS: usize = 1000;
const MAX_PORTS: usize = 100;

struct Check {
    kind: &'static str,
    object: String,
}

impl Check {
    fn new(
        kind: &'static str,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ) -> Self {
        let namespace = meta
            .namespace
            .as_deref()
            .filter(|n| !n.is_empty())
            .unwrap_or("default");
        let name = meta
            .name
            .as_deref()
            .filter(|n| !n.is_empty())
            .unwrap_or("<unnamed>");
        Check {
            kind,
            object: format!("{namespace}/{name}"),
        }
    }

    fn invalid(
        &self,
        field: impl ToString,
        value: impl ToString,
        reason: impl ToString,
    ) -> ConvertError {
        ConvertError::Invalid {
            kind: self.kind,
            object: self.object.clone(),
            field: field.to_string(),
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }

    fn port(&self, field: impl ToString, value: i32) -> Result<(), ConvertError> {
        if (1..=65535).contains(&value) {
            return Ok(());
        }
        Err(self.invalid(field, value, "must be between 1 and 65535, inclusive"))
    }

    /// ValidateNonSpecialIP: what may not be an endpoint or external IP.
    fn non_special_ip(&self, field: impl ToString, value: &str) -> Result<IpAddr, ConvertError> {
        let field = field.to_string();
        let ip: IpAddr = value
            .parse()
            .map_err(|_| self.invalid(&field, value, "must be a valid IP address"))?;
        match special_ip(ip) {
            Some(reason) => Err(self.invalid(field, value, reason)),
            None => Ok(ip),
        }
    }

    /// A cluster IP: a valid, non-special IP that is not multicast and not the node's.
    fn service_ip(
        &self,
        field: impl ToString,
        value: &str,
        node_ips: &[IpAddr],
    ) -> Result<IpAddr, ConvertError> {
        let field = field.to_string();
        let ip = self.non_special_ip(&field, value)?;
        if ip.is_multicast() || ip == IpAddr::from([255, 255, 255, 255]) {
            return Err(self.invalid(&field, value, "may not be a multicast or broadcast address"));
        }
        if node_ips.contains(&ip) {
            return Err(self.invalid(&field, value, "may not be an address of this node"));
        }
        Ok(ip)
    }
}

/// Why `ip` may not be an endpoint or service address, as the API server says it.
pub fn special_ip(ip: IpAddr) -> Option<&'static str> {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let (unspecified, loopback, link_local, link_local_multicast) = match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            (
                v4.is_unspecified(),
                v4.is_loopback(),
                v4.is_link_local(),
                o[0] == 224 && o[1] == 0 && o[2] == 0,
            )
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            (
                v6.is_unspecified(),
                v6.is_loopback(),
                s[0] & 0xffc0 == 0xfe80,
                s[0] & 0xff0f == 0xff02,
            )
        }
    };
    if unspecified {
        Some("may not be unspecified (0.0.0.0, ::)")
    } else if loopback {
        Some("may not be in the loopback range (127.0.0.0/8, ::1/128)")
    } else if link_local {
        Some("may not be in the link-local range (169.254.0.0/16, fe80::/10)")
    } else if link_local_multicast {
        Some("may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)")
    } else {
        None
    }
}

/// RFC 1123 label (port names, hostnames).
fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// RFC 1035 label (Service names): a DNS-1123 label that starts with a letter.
fn is_dns1035_label(s: &str) -> bool {
    is_dns1123_label(s) && s.as_bytes()[0].is_ascii_lowercase()
}

/// RFC 1123 subdomain (EndpointSlice names).
fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

/// IANA service name (a named targetPort): at most 15 lowercase letters, digits and '-',
/// at least one letter, no '-' at either end nor two in a row.
fn is_iana_svc_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() { "IPv4" } else { "IPv6" }
}

/// ValidateService for the fields a proxy uses. `node_ips` are this node's addresses, which
/// no cluster IP may be.
pub fn service(svc: &core::Service, node_ips: &[IpAddr]) -> Result<(), ConvertError> {
    let c = Check::new("Service", &svc.metadata);
    let meta = &svc.metadata;
    if let Some(name) = meta.name.as_deref().filter(|n| !n.is_empty())
        && !is_dns1035_label(name)
    {
        return Err(c.invalid("metadata.name", name, "must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter, at most 63)"));
    }
    if let Some(ns) = meta.namespace.as_deref().filter(|n| !n.is_empty())
        && !is_dns1123_label(ns)
    {
        return Err(c.invalid("metadata.namespace", ns, "must be a DNS-1123 label"));
    }
    let Some(spec) = svc.spec.as_ref() else {
        return Ok(());
    };
    let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
    if !matches!(
        type_,
        "ClusterIP" | "NodePort" | "LoadBalancer" | "ExternalName"
    ) {
        return Err(c.invalid(
            "spec.type",
            type_,
            "supported values: ClusterIP, NodePort, LoadBalancer, ExternalName",
        ));
    }
    if type_ == "ExternalName" {
        return Ok(()); // not proxied; its own rules are the DNS server's business
    }

    // clusterIP and clusterIPs.
    let cluster_ip = spec.cluster_ip.as_deref().filter(|s| !s.is_empty());
    let cluster_ips = spec.cluster_ips.as_deref().unwrap_or_default();
    if let (Some(ip), Some(first)) = (cluster_ip, cluster_ips.first())
        && ip != first
    {
        return Err(c.invalid(
            "spec.clusterIPs[0]",
            first,
            format!("must be the same as spec.clusterIP {ip:?}"),
        ));
    }
    if cluster_ips.len() > 2 {
        return Err(c.invalid(
            "spec.clusterIPs",
            cluster_ips.len(),
            "may hold at most two IPs, one per family",
        ));
    }
    let headless = cluster_ip.or(cluster_ips.first().map(String::as_str)) == Some("None");
    let mut families = Vec::new();
    if headless {
        if cluster_ips.len() > 1 {
            return Err(c.invalid("spec.clusterIPs", "None", "None must be the only value"));
        }
    } else if cluster_ips.is_empty() {
        if let Some(ip) = cluster_ip {
            families.push(c.service_ip("spec.clusterIP", ip, node_ips)?);
        }
    } else {
        for (i, ip) in cluster_ips.iter().enumerate() {
            families.push(c.service_ip(format!("spec.clusterIPs[{i}]"), ip, node_ips)?);
        }
    }
    if let [a, b] = families[..]
        && a.is_ipv4() == b.is_ipv4()
    {
        return Err(c.invalid(
            "spec.clusterIPs[1]",
            b,
            "must be of the other IP family than clusterIPs[0] (one IP per family)",
        ));
    }
    let ip_families = spec.ip_families.as_deref().unwrap_or_default();
    if ip_families.len() > 2 {
        return Err(c.invalid(
            "spec.ipFamilies",
            ip_families.len(),
            "may hold at most two families",
        ));
    }
    for (i, f) in ip_families.iter().enumerate() {
        if f != "IPv4" && f != "IPv6" {
            return Err(c.invalid(
                format!("spec.ipFamilies[{i}]"),
                f,
                "supported values: IPv4, IPv6",
            ));
        }
        if i == 1 && ip_families[0] == *f {
            return Err(c.invalid("spec.ipFamilies[1]", f, "duplicate family"));
        }
        if let Some(ip) = families.get(i)
            && family(*ip) != f
        {
            return Err(c.invalid(
                format!("spec.clusterIPs[{i}]"),
                ip,
                format!("must be an {f} address, as spec.ipFamilies[{i}] says"),
            ));
        }
    }
    if spec.ip_family_policy.as_deref() == Some("SingleStack")
        && (families.len() > 1 || ip_families.len() > 1)
    {
        return Err(c.invalid(
            "spec.ipFamilyPolicy",
            "SingleStack",
            "allows one IP family only",
        ));
    }

    // Ports.
    let ports = spec.ports.as_deref().unwrap_or_default();
    if ports.is_empty() && !headless {
        return Err(c.invalid("spec.ports", "[]", "at least one port is required"));
    }
    let mut names = HashSet::new();
    let mut port_protocols = HashSet::new();
    let mut node_ports = HashSet::new();
    for (i, p) in ports.iter().enumerate() {
        let name = p.name.as_deref().unwrap_or_default();
        if ports.len() > 1 && name.is_empty() {
            return Err(c.invalid(
                format!("spec.ports[{i}].name"),
                "",
                "is required when a service has more than one port",
            ));
        }
        if !name.is_empty() && !is_dns1123_label(name) {
            return Err(c.invalid(
                format!("spec.ports[{i}].name"),
                name,
                "must be a DNS-1123 label",
            ));
        }
        if !names.insert(name) {
            return Err(c.invalid(format!("spec.ports[{i}].name"), name, "duplicate port name"));
        }
        c.port(format!("spec.ports[{i}].port"), p.port)?;
        let protocol = p.protocol.as_deref().unwrap_or("TCP");
        if !matches!(protocol, "TCP" | "UDP" | "SCTP") {
            return Err(c.invalid(
                format!("spec.ports[{i}].protocol"),
                protocol,
                "supported values: TCP, UDP, SCTP",
            ));
        }
        if !port_protocols.insert((p.port, protocol)) {
            return Err(c.invalid(
                format!("spec.ports[{i}]"),
                format!("{}/{protocol}", p.port),
                "duplicate port and protocol",
            ));
        }
        match &p.target_port {
            None => {}
            Some(IntOrString::Int(n)) => c.port(format!("spec.ports[{i}].targetPort"), *n)?,
            // Headless services' target ports were never checked (v1 compatibility).
            Some(IntOrString::String(s)) if !headless && !is_iana_svc_name(s) => {
                return Err(c.invalid(format!("spec.ports[{i}].targetPort"), s, "must be a port number or an IANA service name (at most 15 lowercase letters, digits and '-')"));
            }
            Some(IntOrString::String(_)) => {}
        }
        match p.node_port {
            None | Some(0) => {}
            Some(n) => {
                c.port(format!("spec.ports[{i}].nodePort"), n)?;
                if type_ == "ClusterIP" {
                    return Err(c.invalid(
                        format!("spec.ports[{i}].nodePort"),
                        n,
                        "may not be used when type is ClusterIP",
                    ));
                }
                if !node_ports.insert((n, protocol)) {
                    return Err(c.invalid(
                        format!("spec.ports[{i}].nodePort"),
                        n,
                        "duplicate node port",
                    ));
                }
            }
        }
    }

    for (i, ip) in spec.external_ips.iter().flatten().enumerate() {
        let ip = c.non_special_ip(format!("spec.externalIPs[{i}]"), ip)?;
        if ip.is_multicast() {
            return Err(c.invalid(
                format!("spec.externalIPs[{i}]"),
                ip,
                "may not be a multicast address",
            ));
        }
    }

    match spec.session_affinity.as_deref() {
        None | Some("None" | "ClientIP") => {}
        Some(other) => {
            return Err(c.invalid(
                "spec.sessionAffinity",
                other,
                "supported values: None, ClientIP",
            ));
        }
    }
    for (field, value) in [
        (
            "spec.externalTrafficPolicy",
            spec.external_traffic_policy.as_deref(),
        ),
        (
            "spec.internalTrafficPolicy",
            spec.internal_traffic_policy.as_deref(),
        ),
    ] {
        if let Some(v) = value
            && v != "Cluster"
            && v != "Local"
        {
            return Err(c.invalid(field, v, "supported values: Cluster, Local"));
        }
    }
    if let Some(n) = spec.health_check_node_port.filter(|n| *n != 0) {
        c.port("spec.healthCheckNodePort", n)?;
    }
    Ok(())
}

/// ValidateEndpointSlice for the fields a proxy uses.
pub fn endpoint_slice(slice: &discovery::EndpointSlice) -> Result<(), ConvertError> {
    let c = Check::new("EndpointSlice", &slice.metadata);
    if let Some(name) = slice.metadata.name.as_deref().filter(|n| !n.is_empty())
        && !is_dns1123_subdomain(name)
    {
        return Err(c.invalid("metadata.name", name, "must be a DNS-1123 subdomain"));
    }
    let want_v4 = match slice.address_type.as_str() {
        "IPv4" => Some(true),
        "IPv6" => Some(false),
        "FQDN" => None,
        other => return Err(c.invalid("addressType", other, "supported values: IPv4, IPv6, FQDN")),
    };
    if slice.endpoints.len() > MAX_ENDPOINTS {
        return Err(c.invalid(
            "endpoints",
            slice.endpoints.len(),
            format!("may hold at most {MAX_ENDPOINTS} endpoints"),
        ));
    }
    for (i, ep) in slice.endpoints.iter().enumerate() {
        match ep.addresses.len() {
            0 => {
                return Err(c.invalid(
                    format!("endpoints[{i}].addresses"),
                    "[]",
                    "must contain at least 1 address",
                ));
            }
            n if n > MAX_ADDRESSES => {
                return Err(c.invalid(
                    format!("endpoints[{i}].addresses"),
                    n,
                    format!("may hold at most {MAX_ADDRESSES} addresses"),
                ));
            }
            _ => {}
        }
        let Some(want_v4) = want_v4 else { continue };
        for (j, address) in ep.addresses.iter().enumerate() {
            let field = format!("endpoints[{i}].addresses[{j}]");
            let ip = c.non_special_ip(&field, address)?;
            if ip.is_ipv4() != want_v4 {
                return Err(c.invalid(
                    field,
                    address,
                    format!(
                        "must be an {} address, as addressType says",
                        slice.address_type
                    ),
                ));
            }
        }
        if let Some(h) = ep.hostname.as_deref()
            && !is_dns1123_label(h)
        {
            return Err(c.invalid(
                format!("endpoints[{i}].hostname"),
                h,
                "must be a DNS-1123 label",
            ));
        }
    }
    let ports = slice.ports.as_deref().unwrap_or_default();
    if ports.len() > MAX_PORTS {
        return Err(c.invalid(
            "ports",
            ports.len(),
            format!("may hold at most {MAX_PORTS} ports"),
        ));
    }
    let mut names = HashSet::new();
    for (i, p) in ports.iter().enumerate() {
        let name = p.name.as_deref().unwrap_or_default();
        if !name.is_empty() && !is_dns1123_label(name) {
            return Err(c.invalid(format!("ports[{i}].name"), name, "must be a DNS-1123 label"));
        }
        if !names.insert(name) {
            return Err(c.invalid(format!("ports[{i}].name"), name, "duplicate port name"));
        }
        if let Some(n) = p.port {
            c.port(format!("ports[{i}].port"), n)?;
        }
        let protocol = p.protocol.as_deref().unwrap_or("TCP");
        if !matches!(protocol, "TCP" | "UDP" | "SCTP") {
            return Err(c.invalid(
                format!("ports[{i}].protocol"),
                protocol,
                "supported values: TCP, UDP, SCTP",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};

    use super::*;

    /// makeValidService's counterpart: a ClusterIP service with one named TCP port.
    fn valid_service() -> core::Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "valid", "namespace": "default"},
            "spec": {
                "type": "ClusterIP",
                "clusterIP": "198.19.0.10",
                "clusterIPs": ["198.19.0.10"],
                "sessionAffinity": "None",
                "ports": [{"name": "p", "port": 8675, "targetPort": 8675, "protocol": "TCP"}]
            }
        }))
        .unwrap()
    }

    fn port(name: &str, port: i32, protocol: &str, node_port: Option<i32>) -> ServicePort {
        ServicePort {
            name: Some(name.into()),
            port,
            protocol: Some(protocol.into()),
            node_port,
            target_port: Some(IntOrString::Int(port)),
            ..Default::default()
        }
    }

    const NODE: [u8; 4] = [198, 18, 0, 5];

    /// Cases named as in kubernetes pkg/apis/core/validation TestValidateServiceCreate
    /// where one exists; `None` means valid, `Some(field)` the field the error must name.
    #[test]
    fn validate_service_create() {
        type Tweak = fn(&mut ServiceSpec);
        let cases: &[(&str, Tweak, Option<&str>)] = &[
            ("valid 1", |_| {}, None),
            (
                "valid cluster ip - none ",
                |s| {
                    s.cluster_ip = Some("None".into());
                    s.cluster_ips = Some(vec!["None".into()])
                },
                None,
            ),
            (
                "valid cluster ip - empty",
                |s| {
                    s.cluster_ip = None;
                    s.cluster_ips = None
                },
                None,
            ),
            (
                "invalid cluster ip",
                |s| {
                    s.cluster_ip = Some("invalid".into());
                    s.cluster_ips = None
                },
                Some("spec.clusterIP"),
            ),
            (
                "invalid cluster ip localhost",
                |s| {
                    s.cluster_ip = Some("127.0.0.1".into());
                    s.cluster_ips = None
                },
                Some("spec.clusterIP"),
            ),
            (
                "invalid cluster ip unspecified",
                |s| {
                    s.cluster_ips = Some(vec!["::".into()]);
                    s.cluster_ip = None
                },
                Some("spec.clusterIPs[0]"),
            ),
            (
                "invalid cluster ip link-local",
                |s| {
                    s.cluster_ips = Some(vec!["169.254.169.254".into()]);
                    s.cluster_ip = None
                },
                Some("spec.clusterIPs[0]"),
            ),
            (
                "invalid cluster ip multicast",
                |s| {
                    s.cluster_ips = Some(vec!["239.1.1.1".into()]);
                    s.cluster_ip = None
                },
                Some("spec.clusterIPs[0]"),
            ),
            (
                "invalid cluster ip node address",
                |s| {
                    s.cluster_ip = Some("198.18.0.5".into());
                    s.cluster_ips = None
                },
                Some("spec.clusterIP"),
            ),
            (
                "invalid, clusterIPs[0] != clusterIP",
                |s| s.cluster_ips = Some(vec!["198.19.0.11".into()]),
                Some("spec.clusterIPs[0]"),
            ),
            (
                "valid dual stack",
                |s| s.cluster_ips = Some(vec!["198.19.0.10".into(), "2001:db8::10".into()]),
                None,
            ),
            (
                "invalid, more than two clusterIPs",
                |s| {
                    s.cluster_ips = Some(vec![
                        "198.19.0.10".into(),
                        "2001:db8::10".into(),
                        "198.19.0.12".into(),
                    ])
                },
                Some("spec.clusterIPs"),
            ),
            (
                "invalid, two clusterIPs of one family",
                |s| s.cluster_ips = Some(vec!["198.19.0.10".into(), "198.19.0.11".into()]),
                Some("spec.clusterIPs[1]"),
            ),
            (
                "invalid, ipFamilies do not match clusterIPs",
                |s| s.ip_families = Some(vec!["IPv6".into()]),
                Some("spec.clusterIPs[0]"),
            ),
            (
                "invalid, SingleStack with two families",
                |s| {
                    s.cluster_ips = Some(vec!["198.19.0.10".into(), "2001:db8::10".into()]);
                    s.ip_family_policy = Some("SingleStack".into())
                },
                Some("spec.ipFamilyPolicy"),
            ),
            ("missing ports", |s| s.ports = None, Some("spec.ports")),
            (
                "missing ports but headless",
                |s| {
                    s.ports = None;
                    s.cluster_ip = Some("None".into());
                    s.cluster_ips = None
                },
                None,
            ),
            (
                "empty port[1] name",
                |s| {
                    s.ports.as_mut().unwrap().push(ServicePort {
                        name: None,
                        ..port("", 12345, "TCP", None)
                    })
                },
                Some("spec.ports[1].name"),
            ),
            (
                "invalid port name",
                |s| s.ports.as_mut().unwrap()[0].name = Some("INVALID".into()),
                Some("spec.ports[0].name"),
            ),
            (
                "dup port name",
                |s| {
                    s.ports
                        .as_mut()
                        .unwrap()
                        .push(port("p", 12345, "TCP", None))
                },
                Some("spec.ports[1].name"),
            ),
            (
                "invalid protocol",
                |s| s.ports.as_mut().unwrap()[0].protocol = Some("INVALID".into()),
                Some("spec.ports[0].protocol"),
            ),
            (
                "missing port",
                |s| s.ports.as_mut().unwrap()[0].port = 0,
                Some("spec.ports[0].port"),
            ),
            (
                "invalid port",
                |s| s.ports.as_mut().unwrap()[0].port = 65536,
                Some("spec.ports[0].port"),
            ),
            (
                "invalid TargetPort int",
                |s| s.ports.as_mut().unwrap()[0].target_port = Some(IntOrString::Int(65536)),
                Some("spec.ports[0].targetPort"),
            ),
            (
                "invalid targetPort 70000",
                |s| s.ports.as_mut().unwrap()[0].target_port = Some(IntOrString::Int(70000)),
                Some("spec.ports[0].targetPort"),
            ),
            (
                "valid 3",
                |s| {
                    s.ports.as_mut().unwrap()[0].target_port =
                        Some(IntOrString::String("http".into()))
                },
                None,
            ),
            (
                "invalid targetPort name",
                |s| {
                    s.ports.as_mut().unwrap()[0].target_port =
                        Some(IntOrString::String("Not_A_Name".into()))
                },
                Some("spec.ports[0].targetPort"),
            ),
            (
                "invalid publicIPs localhost",
                |s| s.external_ips = Some(vec!["127.0.0.1".into()]),
                Some("spec.externalIPs[0]"),
            ),
            (
                "invalid publicIPs unspecified",
                |s| s.external_ips = Some(vec!["0.0.0.0".into()]),
                Some("spec.externalIPs[0]"),
            ),
            (
                "invalid publicIPs host",
                |s| s.external_ips = Some(vec!["myhost.mydomain".into()]),
                Some("spec.externalIPs[0]"),
            ),
            (
                "invalid publicIPs link-local multicast",
                |s| s.external_ips = Some(vec!["ff02::1".into()]),
                Some("spec.externalIPs[0]"),
            ),
            (
                "valid publicIPs",
                |s| s.external_ips = Some(vec!["198.18.7.7".into(), "2001:db8::7".into()]),
                None,
            ),
            (
                "invalid cluster service with NodePort",
                |s| {
                    s.ports
                        .as_mut()
                        .unwrap()
                        .push(port("q", 12345, "TCP", Some(12345)))
                },
                Some("spec.ports[1].nodePort"),
            ),
            (
                "duplicate nodeports",
                |s| {
                    s.type_ = Some("NodePort".into());
                    s.ports.as_mut().unwrap().extend([
                        port("q", 1, "TCP", Some(30001)),
                        port("r", 2, "TCP", Some(30001)),
                    ]);
                },
                Some("spec.ports[2].nodePort"),
            ),
            (
                "duplicate nodeports (different protocols)",
                |s| {
                    s.type_ = Some("NodePort".into());
                    s.ports.as_mut().unwrap().extend([
                        port("q", 1, "TCP", Some(30001)),
                        port("r", 2, "UDP", Some(30001)),
                    ]);
                },
                None,
            ),
            (
                "invalid nodePort",
                |s| {
                    s.type_ = Some("NodePort".into());
                    s.ports.as_mut().unwrap()[0].node_port = Some(65536)
                },
                Some("spec.ports[0].nodePort"),
            ),
            (
                "invalid type",
                |s| s.type_ = Some("Magic".into()),
                Some("spec.type"),
            ),
            (
                "invalid session affinity",
                |s| s.session_affinity = Some("Sticky".into()),
                Some("spec.sessionAffinity"),
            ),
            (
                "invalid externalTrafficPolicy",
                |s| s.external_traffic_policy = Some("Nearby".into()),
                Some("spec.externalTrafficPolicy"),
            ),
        ];
        let node = [IpAddr::from(NODE)];
        for (name, tweak, want) in cases {
            let mut svc = valid_service();
            tweak(svc.spec.as_mut().unwrap());
            match (service(&svc, &node), want) {
                (Ok(()), None) => {}
                (Err(e), Some(field)) => {
                    assert_eq!(e.field(), *field, "{name}: {e}");
                    assert_eq!(e.object(), "default/valid", "{name}: {e}");
                    assert!(
                        e.to_string().starts_with("Service default/valid: "),
                        "{name}: {e}"
                    );
                }
                (got, want) => panic!("{name}: got {got:?}, want an error on {want:?}"),
            }
        }
        let mut svc = valid_service();
        svc.metadata.name = Some("Invalid_Name".into());
        assert_eq!(service(&svc, &node).unwrap_err().field(), "metadata.name");
    }

    /// Cases named as in kubernetes pkg/apis/discovery/validation TestValidateEndpointSlice.
    #[test]
    fn validate_endpoint_slice() {
        let valid = || -> discovery::EndpointSlice {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "hello", "namespace": "default"},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
                "endpoints": [{"addresses": ["198.18.1.11"], "hostname": "valid-123"}]
            }))
            .unwrap()
        };
        type Tweak = fn(&mut discovery::EndpointSlice);
        let cases: &[(&str, Tweak, Option<&str>)] = &[
            ("good-slice", |_| {}, None),
            (
                "fqdn-address-type",
                |s| {
                    s.address_type = "FQDN".into();
                    s.endpoints[0].addresses = vec!["foo.example.com".into()]
                },
                None,
            ),
            (
                "ipv6-address-type",
                |s| {
                    s.address_type = "IPv6".into();
                    s.endpoints[0].addresses = vec!["2001:db8::11".into()]
                },
                None,
            ),
            (
                "bad-ip",
                |s| s.endpoints[0].addresses = vec!["123.456.789.012".into()],
                Some("endpoints[0].addresses[0]"),
            ),
            (
                "bad-ipv4",
                |s| s.endpoints[0].addresses = vec!["2001:db8::11".into()],
                Some("endpoints[0].addresses[0]"),
            ),
            (
                "bad-ipv6",
                |s| {
                    s.address_type = "IPv6".into();
                    s.endpoints[0].addresses = vec!["198.18.1.11".into()]
                },
                Some("endpoints[0].addresses[0]"),
            ),
            (
                "special-ipv4 loopback",
                |s| s.endpoints[0].addresses = vec!["127.0.0.1".into()],
                Some("endpoints[0].addresses[0]"),
            ),
            (
                "special-ipv6 link-local",
                |s| {
                    s.address_type = "IPv6".into();
                    s.endpoints[0].addresses = vec!["fe80::9656:d028:8652:66b6".into()]
                },
                Some("endpoints[0].addresses[0]"),
            ),
            (
                "empty-addresses",
                |s| s.endpoints[0].addresses = vec![],
                Some("endpoints[0].addresses"),
            ),
            (
                "too-many-addresses",
                |s| s.endpoints[0].addresses = (0..101).map(|i| format!("198.18.2.{i}")).collect(),
                Some("endpoints[0].addresses"),
            ),
            (
                "bad-hostname",
                |s| s.endpoints[0].hostname = Some("--INVALID".into()),
                Some("endpoints[0].hostname"),
            ),
            (
                "bad-address-type",
                |s| s.address_type = "IP".into(),
                Some("addressType"),
            ),
            (
                "bad-port-name-caps",
                |s| s.ports.as_mut().unwrap()[0].name = Some("aCapital".into()),
                Some("ports[0].name"),
            ),
            (
                "duplicate-port-name",
                |s| {
                    let p = s.ports.as_ref().unwrap()[0].clone();
                    s.ports.as_mut().unwrap().push(p)
                },
                Some("ports[1].name"),
            ),
            (
                "bad-port-range",
                |s| s.ports.as_mut().unwrap()[0].port = Some(70000),
                Some("ports[0].port"),
            ),
            (
                "bad-protocol",
                |s| s.ports.as_mut().unwrap()[0].protocol = Some("foo".into()),
                Some("ports[0].protocol"),
            ),
        ];
        for (name, tweak, want) in cases {
            let mut slice = valid();
            tweak(&mut slice);
            match (endpoint_slice(&slice), want) {
                (Ok(()), None) => {}
                (Err(e), Some(field)) => {
                    assert_eq!(e.field(), *field, "{name}: {e}");
                    assert!(
                        e.to_string().starts_with("EndpointSlice default/hello: "),
                        "{name}: {e}"
                    );
                }
                (got, want) => panic!("{name}: got {got:?}, want an error on {want:?}"),
            }
        }
    }

    #[test]
    fn special_ips_as_go_net_sees_them() {
        for ip in [
            "0.0.0.0",
            "::",
            "127.0.0.1",
            "127.255.0.1",
            "::1",
            "169.254.1.1",
            "fe80::1",
            "224.0.0.251",
            "ff02::fb",
            "::ffff:127.0.0.1",
        ] {
            assert!(special_ip(ip.parse().unwrap()).is_some(), "{ip}");
        }
        for ip in ["198.18.0.1", "2001:db8::1", "224.0.1.1", "ff05::1"] {
            assert!(special_ip(ip.parse().unwrap()).is_none(), "{ip}");
        }
    }
}
