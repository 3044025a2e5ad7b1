//! Kubernetes objects to model values, applying kube-proxy's rules for what to skip.
//!
//! A conversion has three outcomes. `Ok(Some(_))` is something to program. `Ok(None)` means
//! the object is well formed but is not ours to proxy (headless, ExternalName, another
//! proxy's, an FQDN slice): kube-proxy ignores those silently, and so do we. `Err(_)` means
//! the object is malformed; the error names the object and the field path, so that the
//! person reading the log can find the line to fix without our having to echo the object.
//!
//! Objects that came through the API server have been validated, so errors mostly come from
//! hand-written manifests (the file source). For that reason a Service is refused as a
//! whole rather than programmed half-right: a service with one bad cluster IP or port would
//! otherwise silently behave differently from what its author wrote.

use std::{fmt, net::IpAddr};

use k8s_openapi::{
    api::{core::v1 as core, discovery::v1 as discovery},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use tracing::{debug, warn};

use super::{
    Endpoint, Protocol, ServiceKey, ServicePort, SliceInfo, SlicePort,
    endpoint::{Placement, Where},
    intern::{Name, intern},
};

/// Services that carry this label belong to the proxy it names.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Services that carry this label (with any value) are treated as headless by kube-proxy.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Names the Service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Names the controller that wrote an EndpointSlice; only logged, to help find the culprit
/// when a slice is malformed.
pub const LABEL_MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
/// The pre-field way of setting loadBalancerSourceRanges, still honoured when the field is
/// empty.
pub const ANNOTATION_LB_SOURCE_RANGES: &str =
    "service.beta.kubernetes.io/load-balancer-source-ranges";
/// Topology Aware Routing's opt-in.
pub const ANNOTATION_TOPOLOGY_MODE: &str = "service.kubernetes.io/topology-mode";
/// A service's packet-path backend choice, `random` or `maglev` (Cilium's annotation, so
/// services annotated for Cilium keep their choice).
pub const ANNOTATION_LB_ALGORITHM: &str = "service.cilium.io/lb-algorithm";
/// The older spelling of [`ANNOTATION_TOPOLOGY_MODE`].
pub const ANNOTATION_TOPOLOGY_AWARE_HINTS: &str = "service.kubernetes.io/topology-aware-hints";

/// The API server's default for sessionAffinityConfig.clientIP.timeoutSeconds (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;
/// The largest affinity timeout the API server accepts (1 day).
pub const MAX_AFFINITY_TIMEOUT: u32 = 86_400;

/// Why an object cannot be converted. Every variant carries the object's kind, its
/// `namespace/name` and the field path, and displays as
/// `Service default/web: spec.ports[1].port 70000 is out of range 1-65535`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    #[error("{kind} {object}: {field} is missing")]
    Missing {
        kind: &'static str,
        object: String,
        field: String,
    },

    #[error("{kind} {object}: {field} {value} is out of range {min}-{max}")]
    OutOfRange {
        kind: &'static str,
        object: String,
        field: String,
        value: i64,
        min: i64,
        max: i64,
    },

    #[error("{kind} {object}: {field} {value:?} is not an IP address")]
    InvalidIp {
        kind: &'static str,
        object: String,
        field: String,
        value: String,
    },

    #[error("{kind} {object}: {field} {value:?} is not an {family} address, as addressType says")]
    WrongFamily {
        kind: &'static str,
        object: String,
        field: String,
        value: String,
        family: &'static str,
    },

    #[error("{kind} {object}: {field} {value:?} is not a CIDR: {reason}")]
    InvalidCidr {
        kind: &'static str,
        object: String,
        field: String,
        value: String,
        reason: &'static str,
    },

    #[error("{kind} {object}: {field} {value:?} is not a supported protocol (TCP, UDP or SCTP)")]
    UnsupportedProtocol {
        kind: &'static str,
        object: String,
        field: String,
        value: String,
    },

    /// A value the API server would refuse (see [`super::validate`]).
    #[error("{kind} {object}: {field} {value:?}: {reason}")]
    Invalid {
        kind: &'static str,
        object: String,
        field: String,
        value: String,
        reason: String,
    },
}

impl ConvertError {
    /// `Service` or `EndpointSlice`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Missing { kind, .. }
            | Self::OutOfRange { kind, .. }
            | Self::InvalidIp { kind, .. }
            | Self::WrongFamily { kind, .. }
            | Self::InvalidCidr { kind, .. }
            | Self::UnsupportedProtocol { kind, .. }
            | Self::Invalid { kind, .. } => kind,
        }
    }

    /// `namespace/name` of the offending object (`namespace/<unnamed>` without a name).
    pub fn object(&self) -> &str {
        match self {
            Self::Missing { object, .. }
            | Self::OutOfRange { object, .. }
            | Self::InvalidIp { object, .. }
            | Self::WrongFamily { object, .. }
            | Self::InvalidCidr { object, .. }
            | Self::UnsupportedProtocol { object, .. }
            | Self::Invalid { object, .. } => object,
        }
    }

    /// The field path, e.g. `spec.ports[1].port`.
    pub fn field(&self) -> &str {
        match self {
            Self::Missing { field, .. }
            | Self::OutOfRange { field, .. }
            | Self::InvalidIp { field, .. }
            | Self::WrongFamily { field, .. }
            | Self::InvalidCidr { field, .. }
            | Self::UnsupportedProtocol { field, .. }
            | Self::Invalid { field, .. } => field,
        }
    }
}

/// The object being converted, so that every error names it the same way. Field paths are
/// taken as `impl Display` (usually `format_args!`) and only rendered on failure, which
/// keeps converting a 1000-endpoint slice free of string building.
struct Ctx {
    kind: &'static str,
    object: String,
}

impl Ctx {
    fn new(kind: &'static str, namespace: &str, name: Option<&str>) -> Self {
        let name = name.filter(|n| !n.is_empty()).unwrap_or("<unnamed>");
        Self {
            kind,
            object: format!("{namespace}/{name}"),
        }
    }

    fn missing(&self, field: impl fmt::Display) -> ConvertError {
        ConvertError::Missing {
            kind: self.kind,
            object: self.object.clone(),
            field: field.to_string(),
        }
    }

    fn port(&self, field: impl fmt::Display, value: i32) -> Result<u16, ConvertError> {
        match u16::try_from(value) {
            Ok(port) if port != 0 => Ok(port),
            _ => Err(ConvertError::OutOfRange {
                kind: self.kind,
                object: self.object.clone(),
                field: field.to_string(),
                value: value.into(),
                min: 1,
                max: u16::MAX.into(),
            }),
        }
    }

    fn protocol(
        &self,
        field: impl fmt::Display,
        value: Option<&str>,
    ) -> Result<Protocol, ConvertError> {
        Protocol::from_k8s(value).ok_or_else(|| ConvertError::UnsupportedProtocol {
            kind: self.kind,
            object: self.object.clone(),
            field: field.to_string(),
            value: value.unwrap_or_default().to_owned(),
        })
    }

    /// An address as kube-proxy reads it (leading zeros allowed, see [`super::sloppy_ip`]).
    fn ip(&self, field: impl fmt::Display, value: &str) -> Result<IpAddr, ConvertError> {
        super::sloppy_ip::parse_ip(value).ok_or_else(|| ConvertError::InvalidIp {
            kind: self.kind,
            object: self.object.clone(),
            field: field.to_string(),
            value: value.to_owned(),
        })
    }

    fn cidr(&self, field: impl fmt::Display, value: &str) -> Result<(IpAddr, u8), ConvertError> {
        parse_cidr(value.trim()).map_err(|reason| ConvertError::InvalidCidr {
            kind: self.kind,
            object: self.object.clone(),
            field: field.to_string(),
            value: value.to_owned(),
            reason,
        })
    }
}

/// Parses `address/prefix` and clears the host bits, so that `198.19.2.3/15` and `198.18.0.0/15`
/// are the same range (Go's ParseCIDR, which the API server and kube-proxy use, does the
/// same). Leading zeros are read as kube-proxy's ParseCIDRSloppy does.
pub fn parse_cidr(s: &str) -> Result<(IpAddr, u8), &'static str> {
    let (addr, prefix) = super::sloppy_ip::parse_cidr_parts(s)?;
    match addr {
        IpAddr::V4(v4) if prefix <= 32 => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            Ok((IpAddr::V4((u32::from(v4) & mask).into()), prefix))
        }
        IpAddr::V6(v6) if prefix <= 128 => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            Ok((IpAddr::V6((u128::from(v6) & mask).into()), prefix))
        }
        _ => Err("prefix length too long for the address family"),
    }
}

/// Metadata's namespace, defaulted as the API server would for a namespaced object: a
/// manifest without one lands in `default`.
fn namespace_of(meta: &ObjectMeta) -> &str {
    meta.namespace
        .as_deref()
        .filter(|ns| !ns.is_empty())
        .unwrap_or("default")
}

fn label<'a>(meta: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    meta.labels.as_ref()?.get(key).map(String::as_str)
}

fn annotation<'a>(meta: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    meta.annotations.as_ref()?.get(key).map(String::as_str)
}

/// Converts a v1 Service.
///
/// `proxy_name` is this proxy's `service.kubernetes.io/service-proxy-name`: services labelled
/// for another proxy are left alone, and so are all labelled services when we have no name,
/// which is how kube-proxy lets an alternative proxy take over some services.
///
/// `externalTrafficPolicy: Local` is kept only for externally accessible services
/// (NodePort, LoadBalancer, or ClusterIP with externalIPs), as kube-proxy's
/// `ExternalPolicyLocal` does: on anything else there is no external traffic for it to
/// apply to, and carrying the flag would make the endpoint selection compute a Local list
/// nobody uses. The health check node port exists only for a LoadBalancer with that policy.
pub fn service(
    svc: &core::Service,
    proxy_name: Option<&str>,
) -> Result<Option<super::Service>, ConvertError> {
    let meta = &svc.metadata;
    let namespace = namespace_of(meta);
    let ctx = Ctx::new("Service", namespace, meta.name.as_deref());
    let name = meta
        .name
        .as_deref()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ctx.missing("metadata.name"))?;
    let key = ServiceKey::new(namespace, name);

    if let Some(reason) = skip_reason(svc, proxy_name) {
        debug!(service = %key, reason, "not proxying service");
        return Ok(None);
    }
    // skip_reason treats a missing spec as headless, so there is one here.
    let Some(spec) = svc.spec.as_ref() else {
        return Ok(None);
    };

    let cluster_ips = match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips
            .iter()
            .enumerate()
            .map(|(i, ip)| ctx.ip(format_args!("spec.clusterIPs[{i}]"), ip))
            .collect::<Result<Vec<_>, _>>()?,
        _ => vec![ctx.ip(
            "spec.clusterIP",
            spec.cluster_ip.as_deref().unwrap_or_default(),
        )?],
    };

    let mut ports = Vec::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let node_port = match p.node_port {
            // The API treats 0 as "not set" (it allocates one), and so does kube-proxy.
            None | Some(0) => None,
            Some(n) => Some(ctx.port(format_args!("spec.ports[{i}].nodePort"), n)?),
        };
        ports.push(ServicePort {
            name: p.name.clone().unwrap_or_default(),
            port: ctx.port(format_args!("spec.ports[{i}].port"), p.port)?,
            protocol: ctx.protocol(
                format_args!("spec.ports[{i}].protocol"),
                p.protocol.as_deref(),
            )?,
            node_port,
        });
    }

    // Pushed one at a time: a Vec grown that way holds four, and the model keeps it.
    ports.shrink_to_fit();
    let external_ips = spec
        .external_ips
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, ip)| ctx.ip(format_args!("spec.externalIPs[{i}]"), ip))
        .collect::<Result<Vec<_>, _>>()?;

    let mut load_balancer_ips = Vec::new();
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for (i, ing) in ingress.into_iter().flatten().enumerate() {
        // Hostname-only ingress (some cloud LBs) has nothing for us to match on; ipMode Proxy
        // means the load balancer rewrites the destination itself, so the node must not
        // capture that IP (kube-proxy's IsVIPMode).
        let Some(ip) = ing.ip.as_deref().filter(|ip| !ip.is_empty()) else {
            continue;
        };
        if ing.ip_mode.as_deref().is_some_and(|mode| mode != "VIP") {
            continue;
        }
        load_balancer_ips.push(ctx.ip(format_args!("status.loadBalancer.ingress[{i}].ip"), ip)?);
    }

    load_balancer_ips.shrink_to_fit();
    let load_balancer_source_ranges = source_ranges(&ctx, svc)?;

    let affinity_timeout = match spec.session_affinity.as_deref() {
        Some("ClientIP") => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match timeout {
                None => Some(DEFAULT_AFFINITY_TIMEOUT),
                Some(t) => match u32::try_from(t) {
                    Ok(t) if (1..=MAX_AFFINITY_TIMEOUT).contains(&t) => Some(t),
                    _ => {
                        return Err(ConvertError::OutOfRange {
                            kind: ctx.kind,
                            object: ctx.object.clone(),
                            field: "spec.sessionAffinityConfig.clientIP.timeoutSeconds".into(),
                            value: t.into(),
                            min: 1,
                            max: MAX_AFFINITY_TIMEOUT.into(),
                        });
                    }
                },
            }
        }
        _ => None,
    };

    let service_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    let externally_accessible = matches!(service_type, "NodePort" | "LoadBalancer")
        || (service_type == "ClusterIP" && !external_ips.is_empty());
    let external_policy_local =
        externally_accessible && spec.external_traffic_policy.as_deref() == Some("Local");
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");

    let health_check_node_port = match spec.health_check_node_port {
        Some(n) if n != 0 && external_policy_local && service_type == "LoadBalancer" => {
            Some(ctx.port("spec.healthCheckNodePort", n)?)
        }
        _ => None,
    };

    let topology_auto = |key| annotation(meta, key).is_some_and(|v| v.eq_ignore_ascii_case("auto"));
    let prefer_close = matches!(
        spec.traffic_distribution.as_deref(),
        Some("PreferClose" | "PreferSameZone")
    ) || topology_auto(ANNOTATION_TOPOLOGY_MODE)
        || topology_auto(ANNOTATION_TOPOLOGY_AWARE_HINTS);

    let lb_algorithm = lb_algorithm(&key, meta);
    Ok(Some(super::Service {
        key,
        cluster_ips,
        ports,
        external_ips,
        load_balancer_ips,
        load_balancer_source_ranges,
        affinity_timeout,
        external_policy_local,
        internal_policy_local,
        health_check_node_port,
        prefer_close,
        lb_algorithm,
    }))
}

/// The service's own packet-path algorithm (Cilium's annotation). A value that is neither
/// algorithm is warned about and the node's default used, as Cilium does: a typo in an
/// optimisation should not take the service down.
fn lb_algorithm(key: &ServiceKey, meta: &ObjectMeta) -> Option<super::LbAlgorithm> {
    let value = annotation(meta, ANNOTATION_LB_ALGORITHM)?;
    match value.trim().parse() {
        Ok(a) => Some(a),
        Err(e) => {
            warn!(service = %key, "annotation {ANNOTATION_LB_ALGORITHM}: {e}; using --bpf-lb-algorithm");
            None
        }
    }
}

/// Why kube-proxy would not proxy this service at all, if it would not.
fn skip_reason(svc: &core::Service, proxy_name: Option<&str>) -> Option<&'static str> {
    let meta = &svc.metadata;
    if let Some(owner) = label(meta, LABEL_SERVICE_PROXY_NAME)
        && Some(owner) != proxy_name
    {
        return Some("labelled for another proxy");
    }
    if label(meta, LABEL_HEADLESS).is_some() {
        return Some("labelled headless");
    }
    let Some(spec) = svc.spec.as_ref() else {
        return Some("headless (no spec)");
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some("ExternalName");
    }
    // clusterIPs[0] is clusterIP when both are set; either may be the only one present in
    // a hand-written manifest.
    let primary = spec
        .cluster_ips
        .as_deref()
        .and_then(<[String]>::first)
        .or(spec.cluster_ip.as_ref())
        .map(String::as_str)
        .unwrap_or_default();
    if primary.is_empty() || primary == "None" || spec.cluster_ip.as_deref() == Some("None") {
        return Some("headless");
    }
    None
}

/// spec.loadBalancerSourceRanges, or the older annotation when the field is empty (the
/// field wins when both are set, as in the API server's GetLoadBalancerSourceRanges).
/// Entries are trimmed because the annotation is routinely written as `a, b`.
fn source_ranges(ctx: &Ctx, svc: &core::Service) -> Result<Vec<(IpAddr, u8)>, ConvertError> {
    let field = svc
        .spec
        .as_ref()
        .and_then(|s| s.load_balancer_source_ranges.as_deref())
        .unwrap_or_default();
    if !field.is_empty() {
        return field
            .iter()
            .enumerate()
            .map(|(i, r)| ctx.cidr(format_args!("spec.loadBalancerSourceRanges[{i}]"), r))
            .collect();
    }
    let Some(value) = annotation(&svc.metadata, ANNOTATION_LB_SOURCE_RANGES) else {
        return Ok(Vec::new());
    };
    value
        .split(',')
        // A trailing comma or an empty annotation means nothing, not an invalid range.
        .filter(|r| !r.trim().is_empty())
        .map(|r| {
            ctx.cidr(
                format_args!("metadata.annotations[{ANNOTATION_LB_SOURCE_RANGES:?}]"),
                r,
            )
        })
        .collect()
}

/// Converts a discovery.k8s.io/v1 EndpointSlice into its owner service, its name and its
/// contents.
///
/// `Ok(None)` for slices kube-proxy ignores: no `kubernetes.io/service-name` label (not
/// attached to a service) and FQDN (or unknown) address types.
///
/// Problems confined to one port or one endpoint do not reject the slice. A port without a
/// number cannot be routed and is skipped. An endpoint whose address is not an IP of the
/// slice's family is dropped with a warning: the alternative, refusing the slice, would take
/// every healthy endpoint in it out of service because of one bad entry, and a service with
/// fewer backends is better than a service with none. Malformed port numbers or protocols
/// do reject the slice, since every endpoint in it would be affected anyway.
///
/// Only `addresses[0]` is read: the API defines no meaning for further addresses, and
/// kube-proxy ignores them.
pub fn endpoint_slice(
    slice: &discovery::EndpointSlice,
) -> Result<Option<(ServiceKey, String, SliceInfo)>, ConvertError> {
    let meta = &slice.metadata;
    let namespace = namespace_of(meta);
    let ctx = Ctx::new("EndpointSlice", namespace, meta.name.as_deref());
    let name = meta
        .name
        .as_deref()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ctx.missing("metadata.name"))?;
    let managed_by = label(meta, LABEL_MANAGED_BY).unwrap_or("unknown");

    let Some(service_name) = label(meta, LABEL_SERVICE_NAME).filter(|s| !s.is_empty()) else {
        debug!(slice = %ctx.object, managed_by, "EndpointSlice has no {LABEL_SERVICE_NAME} label; ignoring it");
        return Ok(None);
    };
    let want_v4 = match slice.address_type.as_str() {
        "IPv4" => true,
        "IPv6" => false,
        other => {
            debug!(slice = %ctx.object, managed_by, address_type = other, "ignoring EndpointSlice of unsupported addressType");
            return Ok(None);
        }
    };

    let mut ports = Vec::new();
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        let Some(number) = p.port else {
            warn!(slice = %ctx.object, managed_by, index = i, "EndpointSlice port has no port number; skipping that port");
            continue;
        };
        ports.push(SlicePort {
            name: p.name.clone().unwrap_or_default(),
            port: ctx.port(format_args!("ports[{i}].port"), number)?,
            protocol: ctx.protocol(format_args!("ports[{i}].protocol"), p.protocol.as_deref())?,
        });
    }

    // See service(): the model keeps what a push left spare.
    ports.shrink_to_fit();
    let mut endpoints = Vec::with_capacity(slice.endpoints.len());
    let mut placements = Placements::default();
    for (i, ep) in slice.endpoints.iter().enumerate() {
        match endpoint(&ctx, i, ep, want_v4, &mut placements) {
            Ok(e) => endpoints.push(e),
            Err(err) => {
                warn!(slice = %ctx.object, managed_by, index = i, "dropping endpoint: {err}")
            }
        }
    }

    endpoints.shrink_to_fit();
    debug!(slice = %ctx.object, managed_by, ports = ports.len(), endpoints = endpoints.len(), "converted EndpointSlice");
    Ok(Some((
        ServiceKey::new(namespace, service_name),
        name.to_owned(),
        SliceInfo { ports, endpoints },
    )))
}

/// `endpoints[i].addresses[0]`, rendered only when an error needs it.
#[derive(Clone, Copy)]
struct FirstAddress(usize);

impl fmt::Display for FirstAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "endpoints[{}].addresses[0]", self.0)
    }
}

fn endpoint<'a>(
    ctx: &Ctx,
    i: usize,
    ep: &'a discovery::Endpoint,
    want_v4: bool,
    placements: &mut Placements<'a>,
) -> Result<Endpoint, ConvertError> {
    let field = FirstAddress(i);
    let address = ep.addresses.first().ok_or_else(|| ctx.missing(field))?;
    let ip = ctx.ip(field, address)?;
    if ip.is_ipv4() != want_v4 {
        return Err(ConvertError::WrongFamily {
            kind: ctx.kind,
            object: ctx.object.clone(),
            field: field.to_string(),
            value: address.clone(),
            family: if want_v4 { "IPv4" } else { "IPv6" },
        });
    }
    let conditions = ep.conditions.as_ref();
    let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
    Ok(Endpoint {
        ip,
        ready,
        serving: conditions.and_then(|c| c.serving).unwrap_or(ready),
        terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
        placement: placements.of(ep),
    })
}

/// The placement of a slice's endpoints: they almost always share a few nodes, so the last
/// one is kept and reused while the next endpoint names the same node, zone and hints.
#[derive(Default)]
struct Placements<'a> {
    last: Option<(&'a discovery::Endpoint, Placement)>,
}

impl<'a> Placements<'a> {
    fn of(&mut self, ep: &'a discovery::Endpoint) -> Placement {
        if let Some((seen, placement)) = &self.last
            && seen.node_name == ep.node_name
            && seen.zone == ep.zone
            && seen.hints == ep.hints
        {
            return placement.clone();
        }
        let hints = ep.hints.as_ref();
        let placement = Placement::new(Where {
            node_name: ep.node_name.as_deref().map(Name::new),
            zone: ep.zone.as_deref().map(Name::new),
            zone_hints: hints
                .and_then(|h| h.for_zones.as_ref())
                .map(|zones| zones.iter().map(|z| intern(&z.name)).collect())
                .unwrap_or_default(),
            node_hints: hints
                .and_then(|h| h.for_nodes.as_ref())
                .map(|nodes| nodes.iter().map(|n| intern(&n.name)).collect())
                .unwrap_or_default(),
        });
        self.last = Some((ep, placement.clone()));
        placement
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    fn k8s_service(yaml: &str) -> core::Service {
        serde_saphyr::from_str(yaml).expect("test Service must decode")
    }

    fn k8s_slice(yaml: &str) -> discovery::EndpointSlice {
        serde_saphyr::from_str(yaml).expect("test EndpointSlice must decode")
    }

    fn convert_ok(yaml: &str) -> super::super::Service {
        service(&k8s_service(yaml), None)
            .expect("converts")
            .expect("is proxied")
    }

    fn convert_err(yaml: &str) -> String {
        service(&k8s_service(yaml), None)
            .expect_err("must be refused")
            .to_string()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const FULL: &str = r#"
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: shop
spec:
  type: LoadBalancer
  clusterIP: 198.19.96.10
  clusterIPs: [198.19.96.10, "2001:db8::10"]
  ports:
  - {name: http, port: 80, targetPort: 8080, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, nodePort: 30053}
  - {name: sig, port: 9000, protocol: SCTP, nodePort: 30900}
  externalIPs: [198.19.2.7]
  loadBalancerSourceRanges: [" 198.19.2.3/15 ", "2001:db8::1/32"]
  sessionAffinity: ClientIP
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  healthCheckNodePort: 32000
  trafficDistribution: PreferClose
status:
  loadBalancer:
    ingress:
    - ip: 198.19.113.1
    - hostname: lb.example.com
    - {ip: 198.19.113.2, ipMode: Proxy}
    - {ip: 198.19.113.3, ipMode: VIP}
"#;

    #[test]
    fn converts_every_field() {
        let svc = convert_ok(FULL);
        assert_eq!(svc.key, ServiceKey::new("shop", "web"));
        assert_eq!(
            svc.cluster_ips,
            vec![ip("198.19.96.10"), ip("2001:db8::10")]
        );
        assert_eq!(
            svc.ports,
            vec![
                ServicePort {
                    name: "http".into(),
                    port: 80,
                    protocol: Protocol::Tcp,
                    node_port: Some(30080)
                },
                ServicePort {
                    name: "dns".into(),
                    port: 53,
                    protocol: Protocol::Udp,
                    node_port: Some(30053)
                },
                ServicePort {
                    name: "sig".into(),
                    port: 9000,
                    protocol: Protocol::Sctp,
                    node_port: Some(30900)
                },
            ]
        );
        assert_eq!(svc.external_ips, vec![ip("198.19.2.7")]);
        // Hostname-only and ipMode Proxy ingress are not ours to capture.
        assert_eq!(
            svc.load_balancer_ips,
            vec![ip("198.19.113.1"), ip("198.19.113.3")]
        );
        assert_eq!(
            svc.load_balancer_source_ranges,
            vec![(ip("198.18.0.0"), 15), (ip("2001:db8::"), 32)]
        );
        assert_eq!(svc.affinity_timeout, Some(DEFAULT_AFFINITY_TIMEOUT));
        assert!(svc.external_policy_local);
        assert!(svc.internal_policy_local);
        assert_eq!(svc.health_check_node_port, Some(32000));
        assert!(svc.prefer_close);
    }

    #[test]
    fn minimal_service_gets_the_api_defaults() {
        let svc = convert_ok(
            "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 198.18.0.1, ports: [{port: 80}]}\n",
        );
        assert_eq!(svc.key, ServiceKey::new("default", "web"));
        assert_eq!(svc.cluster_ips, vec![ip("198.18.0.1")]);
        assert_eq!(
            svc.ports,
            vec![ServicePort {
                name: String::new(),
                port: 80,
                protocol: Protocol::Tcp,
                node_port: None
            }]
        );
        assert!(svc.external_ips.is_empty() && svc.load_balancer_ips.is_empty());
        assert!(svc.load_balancer_source_ranges.is_empty());
        assert_eq!(svc.affinity_timeout, None);
        assert!(!svc.external_policy_local && !svc.internal_policy_local && !svc.prefer_close);
        assert_eq!(svc.health_check_node_port, None);
    }

    #[test]
    fn node_port_zero_means_unset() {
        let svc = convert_ok(
            "metadata: {name: web}\nspec: {type: NodePort, clusterIP: 198.18.0.1, ports: [{port: 80, nodePort: 0}]}\n",
        );
        assert_eq!(svc.ports[0].node_port, None);
    }

    #[test]
    fn skips_what_kube_proxy_skips() {
        let cases = [
            (
                "ExternalName",
                "spec: {type: ExternalName, externalName: example.com}",
            ),
            (
                "clusterIP None",
                "spec: {clusterIP: None, ports: [{port: 80}]}",
            ),
            (
                "clusterIPs None",
                "spec: {clusterIPs: [None], ports: [{port: 80}]}",
            ),
            ("no cluster IP", "spec: {ports: [{port: 80}]}"),
            (
                "empty cluster IP",
                "spec: {clusterIP: '', clusterIPs: [], ports: [{port: 80}]}",
            ),
            ("no spec", ""),
        ];
        for (what, spec) in cases {
            let yaml = format!("metadata: {{name: web}}\n{spec}\n");
            assert_eq!(service(&k8s_service(&yaml), None).unwrap(), None, "{what}");
        }
    }

    #[test]
    fn skips_headless_label_whatever_its_value() {
        let yaml = "metadata: {name: web, labels: {service.kubernetes.io/headless: ''}}\nspec: {clusterIP: 198.18.0.1}\n";
        assert_eq!(service(&k8s_service(yaml), None).unwrap(), None);
    }

    #[test]
    fn service_proxy_name_label_selects_the_proxy() {
        let yaml = "metadata: {name: web, labels: {service.kubernetes.io/service-proxy-name: fastpath}}\n\
                    spec: {clusterIP: 198.18.0.1}\n";
        let svc = k8s_service(yaml);
        assert_eq!(
            service(&svc, None).unwrap(),
            None,
            "labelled, and we have no name"
        );
        assert_eq!(
            service(&svc, Some("other")).unwrap(),
            None,
            "labelled for another proxy"
        );
        assert!(
            service(&svc, Some("fastpath")).unwrap().is_some(),
            "labelled for us"
        );

        let unlabelled = k8s_service("metadata: {name: web}\nspec: {clusterIP: 198.18.0.1}\n");
        assert!(
            service(&unlabelled, Some("fastpath")).unwrap().is_some(),
            "unlabelled is everyone's"
        );
    }

    #[test]
    fn skipping_does_not_hide_a_missing_name() {
        let err = convert_err("metadata: {namespace: shop}\nspec: {clusterIP: None}\n");
        assert_eq!(err, "Service shop/<unnamed>: metadata.name is missing");
    }

    #[test]
    fn errors_name_the_object_and_the_field() {
        let base = |spec: &str| {
            format!(
                "metadata: {{name: web, namespace: default}}\nspec: {{clusterIP: 198.18.0.1, {spec}}}\n"
            )
        };
        let cases = [
            (
                "ports: [{port: 80}, {port: 70000}]",
                "Service default/web: spec.ports[1].port 70000 is out of range 1-65535",
            ),
            (
                "ports: [{port: 0}]",
                "Service default/web: spec.ports[0].port 0 is out of range 1-65535",
            ),
            (
                "ports: [{port: -1}]",
                "Service default/web: spec.ports[0].port -1 is out of range 1-65535",
            ),
            (
                "ports: [{port: 80, protocol: HTTP}]",
                r#"Service default/web: spec.ports[0].protocol "HTTP" is not a supported protocol (TCP, UDP or SCTP)"#,
            ),
            (
                "ports: [{port: 80, nodePort: 65536}]",
                "Service default/web: spec.ports[0].nodePort 65536 is out of range 1-65535",
            ),
            (
                "clusterIPs: [198.18.0.1, '2001:db8::zz']",
                r#"Service default/web: spec.clusterIPs[1] "2001:db8::zz" is not an IP address"#,
            ),
            (
                "externalIPs: [198.18.3.4, 1.2.x]",
                r#"Service default/web: spec.externalIPs[1] "1.2.x" is not an IP address"#,
            ),
            (
                "loadBalancerSourceRanges: [198.18.0.0]",
                r#"Service default/web: spec.loadBalancerSourceRanges[0] "198.18.0.0" is not a CIDR: missing /prefix"#,
            ),
            (
                "loadBalancerSourceRanges: [198.18.0.0/33]",
                r#"Service default/web: spec.loadBalancerSourceRanges[0] "198.18.0.0/33" is not a CIDR: prefix length too long for the address family"#,
            ),
            (
                "sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}",
                "Service default/web: spec.sessionAffinityConfig.clientIP.timeoutSeconds 0 is out of range 1-86400",
            ),
            (
                "sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 86401}}",
                "Service default/web: spec.sessionAffinityConfig.clientIP.timeoutSeconds 86401 is out of range 1-86400",
            ),
            (
                "type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 99999",
                "Service default/web: spec.healthCheckNodePort 99999 is out of range 1-65535",
            ),
        ];
        for (spec, want) in cases {
            assert_eq!(convert_err(&base(spec)), want, "{spec}");
        }
    }

    #[test]
    fn bad_cluster_ip_is_an_error() {
        let err = convert_err("metadata: {name: web}\nspec: {clusterIP: 198.18.0.300}\n");
        assert_eq!(
            err,
            r#"Service default/web: spec.clusterIP "198.18.0.300" is not an IP address"#
        );
    }

    #[test]
    fn bad_load_balancer_ingress_ip_is_an_error() {
        let err = convert_err(
            "metadata: {name: web}\nspec: {clusterIP: 198.18.0.1}\nstatus: {loadBalancer: {ingress: [{ip: 198.18.3.4}, {ip: nope}]}}\n",
        );
        assert_eq!(
            err,
            r#"Service default/web: status.loadBalancer.ingress[1].ip "nope" is not an IP address"#
        );
    }

    #[test]
    fn error_accessors() {
        let err = service(
            &k8s_service(
                "metadata: {name: web}\nspec: {clusterIP: 198.18.0.1, ports: [{port: 70000}]}\n",
            ),
            None,
        )
        .unwrap_err();
        assert_eq!(
            (err.kind(), err.object(), err.field()),
            ("Service", "default/web", "spec.ports[0].port")
        );
    }

    #[test]
    fn affinity_timeout_is_read() {
        let svc = convert_ok(
            "metadata: {name: web}\nspec: {clusterIP: 198.18.0.1, sessionAffinity: ClientIP, \
             sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}}\n",
        );
        assert_eq!(svc.affinity_timeout, Some(60));
        let svc = convert_ok(
            "metadata: {name: web}\nspec: {clusterIP: 198.18.0.1, sessionAffinity: None}\n",
        );
        assert_eq!(svc.affinity_timeout, None);
    }

    #[test]
    fn source_ranges_annotation_is_read_only_when_the_field_is_empty() {
        let annotated = |spec: &str| {
            format!(
                "metadata: {{name: web, annotations: {{service.beta.kubernetes.io/load-balancer-source-ranges: ' 198.18.0.0/15, 198.18.1.0/24 ,'}}}}\n\
                 spec: {{type: LoadBalancer, clusterIP: 198.18.0.1{spec}}}\n"
            )
        };
        let svc = convert_ok(&annotated(""));
        assert_eq!(
            svc.load_balancer_source_ranges,
            vec![(ip("198.18.0.0"), 15), (ip("198.18.1.0"), 24)]
        );
        let svc = convert_ok(&annotated(", loadBalancerSourceRanges: []"));
        assert_eq!(
            svc.load_balancer_source_ranges.len(),
            2,
            "an empty field is no field"
        );
        let svc = convert_ok(&annotated(", loadBalancerSourceRanges: [198.19.0.0/16]"));
        assert_eq!(
            svc.load_balancer_source_ranges,
            vec![(ip("198.19.0.0"), 16)],
            "the field wins"
        );

        let err = convert_err(
            "metadata: {name: web, annotations: {service.beta.kubernetes.io/load-balancer-source-ranges: '198.18.0.0/15,bad'}}\n\
             spec: {clusterIP: 198.18.0.1}\n",
        );
        assert_eq!(
            err,
            r#"Service default/web: metadata.annotations["service.beta.kubernetes.io/load-balancer-source-ranges"] "bad" is not a CIDR: missing /prefix"#
        );
    }

    #[test]
    fn external_policy_only_for_externally_accessible_services() {
        let with = |spec: &str| {
            convert_ok(&format!(
                "metadata: {{name: web}}\nspec: {{clusterIP: 198.18.0.1, externalTrafficPolicy: Local, healthCheckNodePort: 32000, {spec}}}\n"
            ))
        };
        let plain = with("type: ClusterIP");
        assert!(!plain.external_policy_local);
        assert_eq!(plain.health_check_node_port, None);

        let with_external_ip = with("externalIPs: [198.19.2.1]");
        assert!(
            with_external_ip.external_policy_local,
            "ClusterIP with externalIPs is externally accessible"
        );
        assert_eq!(
            with_external_ip.health_check_node_port, None,
            "health checks are for load balancers"
        );

        let node_port = with("type: NodePort");
        assert!(node_port.external_policy_local);
        assert_eq!(node_port.health_check_node_port, None);

        let lb = with("type: LoadBalancer");
        assert!(lb.external_policy_local);
        assert_eq!(lb.health_check_node_port, Some(32000));

        let cluster_policy = convert_ok(
            "metadata: {name: web}\nspec: {type: LoadBalancer, clusterIP: 198.18.0.1, externalTrafficPolicy: Cluster, healthCheckNodePort: 32000}\n",
        );
        assert!(!cluster_policy.external_policy_local);
        assert_eq!(cluster_policy.health_check_node_port, None);
    }

    #[test]
    fn prefer_close_from_field_or_annotations() {
        let cases = [
            ("", "trafficDistribution: PreferClose", true),
            ("", "trafficDistribution: PreferSameZone", true),
            ("", "trafficDistribution: PreferSameNode", false),
            (
                "annotations: {service.kubernetes.io/topology-mode: Auto}",
                "",
                true,
            ),
            (
                "annotations: {service.kubernetes.io/topology-mode: auto}",
                "",
                true,
            ),
            (
                "annotations: {service.kubernetes.io/topology-mode: Disabled}",
                "",
                false,
            ),
            (
                "annotations: {service.kubernetes.io/topology-aware-hints: Auto}",
                "",
                true,
            ),
            ("", "", false),
        ];
        for (meta, spec, want) in cases {
            let svc = convert_ok(&format!(
                "metadata: {{name: web, {meta}}}\nspec: {{clusterIP: 198.18.0.1, {spec}}}\n"
            ));
            assert_eq!(svc.prefer_close, want, "{meta} {spec}");
        }
    }

    #[test]
    fn cidr_parsing() {
        assert_eq!(parse_cidr("198.19.2.3/15"), Ok((ip("198.18.0.0"), 15)));
        assert_eq!(parse_cidr("198.18.3.4/32"), Ok((ip("198.18.3.4"), 32)));
        assert_eq!(
            parse_cidr("198.18.3.4/0"),
            Ok((IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
        );
        assert_eq!(
            parse_cidr("2001:db8:1:2::5/48"),
            Ok((ip("2001:db8:1::"), 48))
        );
        assert_eq!(
            parse_cidr("::/0"),
            Ok((IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0))
        );
        assert_eq!(parse_cidr("2001:db8::1/128"), Ok((ip("2001:db8::1"), 128)));
        for bad in [
            "198.18.0.0",
            "198.18.0.0/",
            "198.18.0.0/33",
            "2001:db8::/129",
            "198.18.0.0/+8",
            "198.18.0/8",
            "x/8",
            "198.18.0.0/8/8",
        ] {
            assert!(parse_cidr(bad).is_err(), "{bad}");
        }
    }

    const SLICE: &str = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: shop
  labels:
    kubernetes.io/service-name: web
    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io
addressType: IPv4
ports:
- {name: http, port: 8080}
- {name: dns, port: 5353, protocol: UDP}
- {name: unusable}
endpoints:
- addresses: [198.18.1.1]
  nodeName: node-a
  zone: zone-a
  hints: {forZones: [{name: zone-a}, {name: zone-b}], forNodes: [{name: node-a}]}
- addresses: [198.18.1.2]
  conditions: {ready: false}
- addresses: [198.18.1.3, 198.18.9.9]
  conditions: {ready: false, serving: true, terminating: true}
- addresses: [198.18.1.4]
  conditions: {ready: true, serving: false}
"#;

    #[test]
    fn converts_a_slice() {
        let (owner, name, info) = endpoint_slice(&k8s_slice(SLICE)).unwrap().unwrap();
        assert_eq!(owner, ServiceKey::new("shop", "web"));
        assert_eq!(name, "web-abc");
        assert_eq!(
            info.ports,
            vec![
                SlicePort {
                    name: "http".into(),
                    port: 8080,
                    protocol: Protocol::Tcp
                },
                SlicePort {
                    name: "dns".into(),
                    port: 5353,
                    protocol: Protocol::Udp
                },
            ],
            "a port without a number is skipped"
        );
        let ep = |ip_: &str, ready, serving, terminating| Endpoint {
            ip: ip(ip_),
            ready,
            serving,
            terminating,
            placement: Default::default(),
        };
        assert_eq!(
            info.endpoints,
            vec![
                (ep("198.18.1.1", true, true, false)).placed(|at| {
                    at.node_name = Some("node-a".into());
                    at.zone = Some("zone-a".into());
                    at.zone_hints = ["zone-a", "zone-b"].into_iter().map(Into::into).collect();
                    at.node_hints = std::iter::once("node-a".into()).collect();
                }),
                ep("198.18.1.2", false, false, false),
                // Only the first address counts.
                ep("198.18.1.3", false, true, true),
                ep("198.18.1.4", true, false, false),
            ]
        );
    }

    #[test]
    fn slice_port_name_and_protocol_default() {
        let slice = k8s_slice(
            "metadata: {name: s, labels: {kubernetes.io/service-name: web}}\naddressType: IPv6\n\
             ports: [{port: 80}]\nendpoints: [{addresses: ['2001:db8::1']}]\n",
        );
        let (owner, _, info) = endpoint_slice(&slice).unwrap().unwrap();
        assert_eq!(owner, ServiceKey::new("default", "web"));
        assert_eq!(
            info.ports,
            vec![SlicePort {
                name: String::new(),
                port: 80,
                protocol: Protocol::Tcp
            }]
        );
        assert_eq!(info.endpoints[0].ip, ip("2001:db8::1"));
    }

    #[test]
    fn slices_kube_proxy_ignores() {
        let no_owner = k8s_slice("metadata: {name: s}\naddressType: IPv4\nendpoints: []\n");
        assert_eq!(endpoint_slice(&no_owner).unwrap(), None);
        let fqdn = k8s_slice(
            "metadata: {name: s, labels: {kubernetes.io/service-name: web}}\naddressType: FQDN\n\
             endpoints: [{addresses: [example.com]}]\n",
        );
        assert_eq!(endpoint_slice(&fqdn).unwrap(), None);
    }

    #[test]
    fn bad_endpoints_are_dropped_and_the_rest_kept() {
        let slice = k8s_slice(
            "metadata: {name: s, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\n\
             ports: [{port: 80}]\n\
             endpoints: [{addresses: [1.2.x]}, {addresses: []}, {addresses: ['2001:db8::1']}, {addresses: [198.18.0.1]}]\n",
        );
        let (_, _, info) = endpoint_slice(&slice).unwrap().unwrap();
        assert_eq!(
            info.endpoints.iter().map(|e| e.ip).collect::<Vec<_>>(),
            vec![ip("198.18.0.1")]
        );
    }

    #[test]
    fn endpoint_errors_name_slice_and_index() {
        let ctx = Ctx::new("EndpointSlice", "default", Some("web-abc"));
        let ep = |addresses: &[&str]| discovery::Endpoint {
            addresses: addresses.iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        };
        let err = |e, v4| {
            endpoint(&ctx, 0, &e, v4, &mut Placements::default())
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err(ep(&["1.2.x"]), true),
            r#"EndpointSlice default/web-abc: endpoints[0].addresses[0] "1.2.x" is not an IP address"#
        );
        assert_eq!(
            err(ep(&[]), true),
            "EndpointSlice default/web-abc: endpoints[0].addresses[0] is missing"
        );
        assert_eq!(
            err(ep(&["198.18.0.1"]), false),
            r#"EndpointSlice default/web-abc: endpoints[0].addresses[0] "198.18.0.1" is not an IPv6 address, as addressType says"#
        );
    }

    #[test]
    fn bad_slice_ports_refuse_the_slice() {
        let with_ports = |ports: &str| {
            k8s_slice(&format!(
                "metadata: {{name: web-abc, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: {ports}\nendpoints: []\n"
            ))
        };
        let err = endpoint_slice(&with_ports("[{port: 80}, {port: 70000}]")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "EndpointSlice default/web-abc: ports[1].port 70000 is out of range 1-65535"
        );
        let err = endpoint_slice(&with_ports("[{port: 80, protocol: ICMP}]")).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"EndpointSlice default/web-abc: ports[0].protocol "ICMP" is not a supported protocol (TCP, UDP or SCTP)"#
        );
    }

    #[test]
    fn slice_without_name_is_an_error() {
        let slice = k8s_slice(
            "metadata: {labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: []\n",
        );
        assert_eq!(
            endpoint_slice(&slice).unwrap_err().to_string(),
            "EndpointSlice default/<unnamed>: metadata.name is missing"
        );
    }
}
