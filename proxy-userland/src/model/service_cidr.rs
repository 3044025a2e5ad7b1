//! The service ranges: the address ranges ClusterIPs are allocated from.
//!
//! They are the union of `--service-cluster-ip-range` (kube-apiserver's flag, given to the
//! proxy too) and the `spec.cidrs` of every networking.k8s.io/v1 ServiceCIDR object (GA in
//! Kubernetes 1.33), as kube-proxy's nftables mode learns them. A dataplane refuses new
//! traffic to an address inside them that no Service serves (see docs/modes.md).

use std::{collections::BTreeMap, fmt, net::IpAddr, str::FromStr, sync::Arc};

use k8s_openapi::api::networking::v1::ServiceCIDR;

use super::convert::{ConvertError, parse_cidr};

/// An address range: `ADDRESS/PREFIX`, host bits cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(ip) & mask == u32::from(net)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(ip) & mask == u128::from(net)
            }
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        parse_cidr(s)
            .map(|(addr, prefix)| Cidr { addr, prefix })
            .map_err(|why| format!("{s:?} is not a CIDR ({why})"))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// kube-apiserver's rule for `--service-cluster-ip-range`: one CIDR, or two of different
/// families (dual stack).
pub fn check_service_ranges(cidrs: &[Cidr]) -> Result<(), String> {
    match cidrs {
        [] | [_] => Ok(()),
        [a, b] if a.addr.is_ipv4() != b.addr.is_ipv4() => Ok(()),
        [_, _] => Err("two CIDRs must be of different families (one IPv4, one IPv6)".into()),
        _ => Err("at most two CIDRs, one per family".into()),
    }
}

/// The union of the service ranges, sorted and without duplicates: what the dataplanes
/// program. Shared (`Arc`) so that a snapshot of the state costs nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceRanges(Arc<[Cidr]>);

impl ServiceRanges {
    pub fn new(mut cidrs: Vec<Cidr>) -> Self {
        cidrs.sort();
        cidrs.dedup();
        Self(cidrs.into())
    }

    pub fn cidrs(&self) -> &[Cidr] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|c| c.contains(ip))
    }
}

/// Where the ranges come from: the configured ones and each ServiceCIDR object's.
#[derive(Clone, Debug, Default)]
pub struct ServiceRangeSources {
    configured: Vec<Cidr>,
    objects: BTreeMap<String, Vec<Cidr>>,
}

impl ServiceRangeSources {
    pub fn new(configured: Vec<Cidr>) -> Self {
        Self {
            configured,
            objects: BTreeMap::new(),
        }
    }

    /// Sets (`Some`) or removes one ServiceCIDR object's ranges.
    pub fn apply(&mut self, name: String, cidrs: Option<Vec<Cidr>>) {
        match cidrs {
            Some(c) => drop(self.objects.insert(name, c)),
            None => drop(self.objects.remove(&name)),
        }
    }

    /// Replaces every object (a relist).
    pub fn replace(&mut self, objects: Vec<(String, Vec<Cidr>)>) {
        self.objects = objects.into_iter().collect();
    }

    pub fn union(&self) -> ServiceRanges {
        let all = self
            .configured
            .iter()
            .chain(self.objects.values().flatten());
        ServiceRanges::new(all.copied().collect())
    }
}

/// A ServiceCIDR as (name, its ranges). The API server allows one CIDR per family; what
/// it would refuse is refused here too, naming the field.
pub fn service_cidr(obj: &ServiceCIDR) -> Result<(String, Vec<Cidr>), ConvertError> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let cidrs = obj
        .spec
        .as_ref()
        .and_then(|s| s.cidrs.as_deref())
        .unwrap_or_default();
    let invalid = |i: usize, value: &str, reason: &'static str| ConvertError::InvalidCidr {
        kind: "ServiceCIDR",
        object: name.clone(),
        field: format!("spec.cidrs[{i}]"),
        value: value.to_owned(),
        reason,
    };
    let mut out = Vec::with_capacity(cidrs.len());
    for (i, s) in cidrs.iter().enumerate() {
        let (addr, prefix) = parse_cidr(s.trim()).map_err(|why| invalid(i, s, why))?;
        out.push(Cidr { addr, prefix });
    }
    if check_service_ranges(&out).is_err() {
        let i = out.len().saturating_sub(1);
        return Err(invalid(
            i,
            &cidrs[i],
            "at most two CIDRs, of different families",
        ));
    }
    Ok((name, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> Cidr {
        s.parse().unwrap()
    }

    #[test]
    fn a_range_holds_its_addresses_of_its_family_only() {
        let r = c("198.19.0.0/16");
        assert!(r.contains("198.19.255.1".parse().unwrap()));
        assert!(!r.contains("198.18.0.1".parse().unwrap()));
        assert!(!r.contains("2001:db8::1".parse().unwrap()));
        let r6 = c("2001:db8:5::/112");
        assert!(r6.contains("2001:db8:5::ff".parse().unwrap()));
        assert!(!r6.contains("2001:db8:6::ff".parse().unwrap()));
        assert!(c("0.0.0.0/0").contains("198.18.0.1".parse().unwrap()));
    }

    #[test]
    fn the_union_joins_the_flag_and_every_object() {
        let mut s = ServiceRangeSources::new(vec![c("198.19.0.0/16")]);
        s.apply("kubernetes".into(), Some(vec![c("198.19.0.0/16")]));
        s.apply(
            "extra".into(),
            Some(vec![c("198.18.128.0/24"), c("2001:db8::/112")]),
        );
        assert_eq!(
            s.union().cidrs(),
            [
                c("198.18.128.0/24"),
                c("198.19.0.0/16"),
                c("2001:db8::/112")
            ]
        );
        s.apply("extra".into(), None);
        assert_eq!(s.union().cidrs(), [c("198.19.0.0/16")]);
        s.replace(vec![("other".into(), vec![c("198.18.9.0/24")])]);
        assert_eq!(s.union().cidrs(), [c("198.18.9.0/24"), c("198.19.0.0/16")]);
    }

    #[test]
    fn a_service_cidr_the_api_server_would_refuse_is_refused() {
        let obj = |cidrs: &[&str]| -> ServiceCIDR {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "extra"},
                "spec": {"cidrs": cidrs},
            }))
            .unwrap()
        };
        let (name, got) = service_cidr(&obj(&["198.18.128.0/24", "2001:db8::/112"])).unwrap();
        assert_eq!(name, "extra");
        assert_eq!(got, [c("198.18.128.0/24"), c("2001:db8::/112")]);
        let e = service_cidr(&obj(&["198.18.128.0/33"])).unwrap_err();
        assert_eq!(e.field(), "spec.cidrs[0]");
        let e = service_cidr(&obj(&["198.18.0.0/24", "198.18.1.0/24"])).unwrap_err();
        assert!(e.to_string().contains("different families"), "{e}");
    }
}
