//! kube-proxy's NewFakeProxier, as settings for our renderer: the pod CIDR as local
//! detector, the node's addresses, node ports on the node IP only, the service range.

use std::net::IpAddr;

use super::{Dump, TEST_NODE_IP, TEST_NODE_IPS, TEST_NODE_IPV6, ip};
use crate::{
    dataplane::{
        iptables::{
            kube_tests::node,
            render::{Family, LocalTraffic, RenderConfig},
        },
        nftables::{listing::inline_text, render::render_full},
    },
    model::ProxyState,
};

#[derive(Clone, Debug)]
pub struct FakeProxier {
    pub family: Family,
    pub masquerade_all: bool,
    /// false: kube-proxy's no-op local detector (nothing counts as a pod).
    pub local_detector: bool,
    pub nodeport_addresses: Vec<(IpAddr, u8)>,
    /// The service range in the settings (the proxier's own sync takes it from the model
    /// instead).
    pub service_range: bool,
}

impl FakeProxier {
    pub fn v4() -> Self {
        Self::new(Family::V4)
    }

    pub fn v6() -> Self {
        Self::new(Family::V6)
    }

    fn new(family: Family) -> Self {
        FakeProxier {
            family,
            masquerade_all: false,
            local_detector: true,
            nodeport_addresses: vec![(ip(TEST_NODE_IP), 32), (ip(TEST_NODE_IPV6), 128)],
            service_range: true,
        }
    }

    pub fn config(&self) -> RenderConfig {
        let v4 = self.family.is_v4();
        let pods = if v4 {
            ("198.18.0.0", 16)
        } else {
            ("2001:db8:10::", 64)
        };
        let range = if v4 {
            ("198.19.0.0", 17)
        } else {
            ("2001:db8:10:96::", 112)
        };
        let mut node_ips: Vec<IpAddr> = TEST_NODE_IPS.iter().map(|s| ip(s)).collect();
        node_ips.extend([ip("127.0.0.1"), ip("::1")]);
        RenderConfig {
            masquerade_all: self.masquerade_all,
            local_traffic: LocalTraffic::Cidrs(if self.local_detector {
                vec![(ip(pods.0), pods.1)]
            } else {
                Vec::new()
            }),
            nodeport_addresses: self.nodeport_addresses.clone(),
            node_ips: node_ips
                .into_iter()
                .filter(|a| Family::of(a) == self.family)
                .collect(),
            service_ranges: if self.service_range {
                vec![(ip(range.0), range.1)]
            } else {
                Vec::new()
            },
            ..RenderConfig::default()
        }
    }

    /// What a full sync writes for `st` (upstream's `nft.Dump()` after syncProxyRules),
    /// with the endpoint maps read as the spreads they stand for, as upstream writes them.
    pub fn text(&self, st: &ProxyState) -> String {
        inline_text(&render_full(st, &node(), self.family, &self.config()))
    }

    /// The same, parsed for tracing; the text is shown if it does not parse.
    pub fn sync(&self, st: &ProxyState) -> Dump {
        let text = self.text(st);
        Dump::parse(&text).unwrap_or_else(|e| panic!("our render does not parse: {e}\n{text}"))
    }
}
