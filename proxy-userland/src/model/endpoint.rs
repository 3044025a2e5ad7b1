//! Endpoints, normalized from discovery.k8s.io/v1 EndpointSlice.

use std::{net::IpAddr, sync::Arc};

use super::{intern::Name, service::Protocol, slices::Slices};

/// A port as an EndpointSlice lists it: every endpoint of that slice serves it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
}

/// One endpoint address with its conditions, as kube-proxy reads them: a missing `ready`
/// means ready, a missing `serving` means the value of `ready`, a missing `terminating`
/// means false.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Node names and zones repeat over every endpoint of a node: shared copies
    /// ([`super::intern`]).
    #[serde(with = "super::intern::opt")]
    pub node_name: Option<Name>,
    #[serde(with = "super::intern::opt")]
    pub zone: Option<Name>,
    /// hints.forZones[].name
    pub zone_hints: Hints,
    /// hints.forNodes[].name: the EndpointSlice controller writes them (with the zone
    /// hints) for `trafficDistribution: PreferSameNode`.
    #[serde(default)]
    pub node_hints: Hints,
}

/// Topology hints (zone or node names): almost always none. One pointer, null when empty,
/// where a `Vec` was three words: an endpoint is 72 bytes instead of 104, ~16 MB of the
/// model at 50,000 services of ten endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
// The Box is the point: a thin pointer in the endpoint, the Vec behind it only when there
// are hints (a `Box<[_]>` would be two words).
#[allow(clippy::box_collection)]
pub struct Hints(Option<Box<Vec<Arc<str>>>>);

impl std::ops::Deref for Hints {
    type Target = [Arc<str>];

    fn deref(&self) -> &[Arc<str>] {
        self.0.as_deref().map_or(&[], Vec::as_slice)
    }
}

impl From<Vec<Arc<str>>> for Hints {
    fn from(names: Vec<Arc<str>>) -> Self {
        Hints((!names.is_empty()).then(|| Box::new(names)))
    }
}

impl FromIterator<Arc<str>> for Hints {
    fn from_iter<I: IntoIterator<Item = Arc<str>>>(iter: I) -> Self {
        Vec::from_iter(iter).into()
    }
}

impl serde::Serialize for Hints {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        super::intern::list::serialize(self, s)
    }
}

impl<'de> serde::Deserialize<'de> for Hints {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        super::intern::list::deserialize(d).map(Hints::from)
    }
}

/// One EndpointSlice, reduced to what routing needs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SliceInfo {
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
}

/// Every slice of one service, by slice name. A service's endpoints may be split over
/// several slices, and an address may appear in more than one.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EndpointSet {
    pub slices: Slices<SliceInfo>,
}

/// An endpoint resolved for one service port: where to send, plus the conditions that
/// decide whether to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortEndpoint {
    pub ip: IpAddr,
    pub port: u16,
    pub endpoint: Endpoint,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_cost_one_word_and_read_as_a_list() {
        // The reason Hints and Name exist: Vecs and `Arc<str>`s made an endpoint 104 bytes.
        assert!(
            std::mem::size_of::<Endpoint>() <= 56,
            "{}",
            std::mem::size_of::<Endpoint>()
        );
        let none = Hints::default();
        assert!(none.is_empty());
        assert_eq!(Hints::from(vec![]), none, "an empty list holds nothing");
        let two: Hints = ["zone-a", "zone-b"].into_iter().map(Arc::from).collect();
        assert_eq!(two.len(), 2);
        let json = serde_json::to_string(&two).unwrap();
        assert_eq!(json, r#"["zone-a","zone-b"]"#);
        assert_eq!(serde_json::from_str::<Hints>(&json).unwrap(), two);
        assert_eq!(serde_json::from_str::<Hints>("[]").unwrap(), none);
    }
}
