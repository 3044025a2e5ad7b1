//! Endpoints, normalized from discovery.k8s.io/v1 EndpointSlice.

use std::{net::IpAddr, sync::Arc};

use super::{
    intern::{ArcPool, Name},
    service::Protocol,
    slices::Slices,
};

static PLACEMENTS: ArcPool<Where> = ArcPool::new();

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
    /// Its node, zone and topology hints, which repeat over every endpoint of a node.
    #[serde(flatten)]
    pub placement: Placement,
}

impl Endpoint {
    pub fn node_name(&self) -> Option<&str> {
        self.placement.get().and_then(|p| p.node_name.as_deref())
    }

    pub fn zone(&self) -> Option<&str> {
        self.placement.get().and_then(|p| p.zone.as_deref())
    }

    /// This endpoint, placed elsewhere: `change` edits a copy of its placement.
    pub fn placed(mut self, change: impl FnOnce(&mut Where)) -> Self {
        let mut at = self.placement.get().cloned().unwrap_or_default();
        change(&mut at);
        self.placement = Placement::new(at);
        self
    }

    /// hints.forZones[].name
    pub fn zone_hints(&self) -> &[Arc<str>] {
        self.placement.get().map_or(&[], |p| &p.zone_hints)
    }

    /// hints.forNodes[].name: the EndpointSlice controller writes them (with the zone
    /// hints) for `trafficDistribution: PreferSameNode`.
    pub fn node_hints(&self) -> &[Arc<str>] {
        self.placement.get().map_or(&[], |p| &p.node_hints)
    }
}

/// Where an endpoint runs and the topology hints it carries.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Where {
    #[serde(with = "super::intern::opt")]
    pub node_name: Option<Name>,
    #[serde(with = "super::intern::opt")]
    pub zone: Option<Name>,
    #[serde(with = "super::intern::list")]
    pub zone_hints: Vec<Arc<str>>,
    #[serde(default, with = "super::intern::list")]
    pub node_hints: Vec<Arc<str>>,
}

impl Where {
    pub fn on_node(node: &str) -> Self {
        Where {
            node_name: Some(node.into()),
            ..Default::default()
        }
    }
}

/// A [`Where`], one shared copy per distinct value ([`super::intern`]) behind a pointer
/// that is null when nothing is known. Every endpoint of a node holds the same one: the
/// node name, zone and two hint lists were 32 of an endpoint's 56 bytes, ~11 MiB of the
/// model at 50,000 services of ten endpoints; now they are 8.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Placement(Option<Arc<Where>>);

impl Placement {
    pub fn new(at: Where) -> Self {
        if at == Where::default() {
            Placement(None)
        } else {
            Placement(Some(PLACEMENTS.shared(at)))
        }
    }

    pub fn get(&self) -> Option<&Where> {
        self.0.as_deref()
    }
}

impl From<Where> for Placement {
    fn from(at: Where) -> Self {
        Placement::new(at)
    }
}

impl serde::Serialize for Placement {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match &self.0 {
            Some(at) => at.serialize(s),
            None => Where::default().serialize(s),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Placement {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Where::deserialize(d).map(Placement::new)
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
    fn an_endpoints_placement_is_one_shared_word() {
        // The reason Placement and Name exist: Vecs and `Arc<str>`s made an endpoint 104
        // bytes.
        assert!(
            std::mem::size_of::<Endpoint>() <= 32,
            "{}",
            std::mem::size_of::<Endpoint>()
        );
        assert_eq!(Placement::new(Where::default()), Placement::default());
        assert!(
            Placement::default().get().is_none(),
            "nothing known, nothing held"
        );
        let a = Placement::new(Where::on_node("placement-test-node"));
        let b = Placement::new(Where::on_node("placement-test-node"));
        assert!(Arc::ptr_eq(a.0.as_ref().unwrap(), b.0.as_ref().unwrap()));
        assert_ne!(a, Placement::new(Where::on_node("placement-test-other")));
    }

    #[test]
    fn an_endpoint_reads_and_writes_its_placement_as_plain_fields() {
        let ep = Endpoint {
            ip: "198.18.0.1".parse().unwrap(),
            ready: true,
            serving: true,
            terminating: false,
            placement: Where {
                zone: Some("zone-a".into()),
                zone_hints: vec!["zone-a".into(), "zone-b".into()],
                ..Where::on_node("node-a")
            }
            .into(),
        };
        let json = serde_json::to_string(&ep).unwrap();
        assert_eq!(
            json,
            r#"{"ip":"198.18.0.1","ready":true,"serving":true,"terminating":false,"node_name":"node-a","zone":"zone-a","zone_hints":["zone-a","zone-b"],"node_hints":[]}"#
        );
        assert_eq!(serde_json::from_str::<Endpoint>(&json).unwrap(), ep);
        assert_eq!(ep.zone_hints().len(), 2);
        assert!(ep.node_hints().is_empty());
    }
}
