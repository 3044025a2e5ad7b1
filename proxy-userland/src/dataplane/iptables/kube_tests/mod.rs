//! kube-proxy's own iptables proxier tests (pkg/proxy/iptables/proxier_test.go), ported:
//! the rules our renderer writes are traced with a port of its packet tracer and checked
//! with its `checkIPTablesRuleJumps`; the proxier runs over a model of the tables
//! ([`fake`]). Each test is named after its upstream case.
//!
//! Upstream's test addresses are mapped into the ranges this project may use:
//!
//! | upstream                         | here                                |
//! |----------------------------------|-------------------------------------|
//! | pods 10.0.0.0/8 (10.0.0.2)       | 198.18.0.0/16 (198.18.0.2)          |
//! | endpoints 10.180.0.N, 10.0.1.N   | 198.18.180.N, 198.18.1.N            |
//! | cluster IPs 172.30.0.N, 172.30.1.1 | 198.19.0.N, 198.19.1.1            |
//! | node 192.168.0.2, 192.168.1.2    | 198.19.128.2, 198.19.129.2          |
//! | external IPs 192.168.99.N        | 198.19.227.N                        |
//! | LB IPs 1.2.3.4, 5.6.7.8          | 198.19.250.4, 198.19.250.8          |
//! | outside 203.0.113.0/24 (/25 allowed) | 198.19.240.0/24 (/25 allowed)   |
//! | IPv6 fd00:172:30::41, fd00:10:180::N | 2001:db8:172:30::41, 2001:db8:10:180::N |

mod fake;
mod lb_policy_test;
mod proxier_test;
mod sync_test;
mod tracer;

use std::{net::IpAddr, sync::Arc};

use super::render::{Family, LocalTraffic, RenderConfig, render};
use crate::model::{
    Endpoint, EndpointSet, NodeInfo, Protocol, ProxyState, Service, ServiceKey, ServicePort,
    SliceInfo, SlicePort,
};

pub const TEST_NODE_NAME: &str = "test-node";
pub const TEST_NODE_IP: &str = "198.19.128.2";
pub const TEST_NODE_IP_ALT: &str = "198.19.129.2";
pub const TEST_EXTERNAL_IP: &str = "198.19.227.11";
pub const TEST_NODE_IPV6: &str = "2001:db8::1";
pub const TEST_NODE_IPV6_ALT: &str = "2001:db8:1::2";
pub const TEST_EXTERNAL_CLIENT: &str = "198.19.240.2";
pub const TEST_EXTERNAL_CLIENT_BLOCKED: &str = "198.19.240.130";
/// Upstream's testNodeIPs: what the tracer counts as LOCAL (plus loopback).
pub const TEST_NODE_IPS: &[&str] = &[
    TEST_NODE_IP,
    TEST_NODE_IP_ALT,
    TEST_EXTERNAL_IP,
    TEST_NODE_IPV6,
    TEST_NODE_IPV6_ALT,
];
pub const POD_CIDR: (&str, u8) = ("198.18.0.0", 16);
pub const POD_CIDR_V6: (&str, u8) = ("2001:db8:10::", 64);

pub fn ip(s: &str) -> IpAddr {
    s.trim().parse().unwrap()
}

pub fn node() -> NodeInfo {
    NodeInfo {
        name: TEST_NODE_NAME.into(),
        zone: None,
    }
}

/// kube-proxy's NewFakeProxier settings: the pod CIDR as local detector, the node's
/// addresses, MASQUERADE without --random-fully (the fake iptables lacks it).
pub fn fake_config(family: Family) -> RenderConfig {
    let (net, len) = if family.is_v4() {
        POD_CIDR
    } else {
        POD_CIDR_V6
    };
    let mut node_ips: Vec<IpAddr> = TEST_NODE_IPS.iter().map(|s| ip(s)).collect();
    node_ips.extend([ip("127.0.0.1"), ip("::1")]);
    RenderConfig {
        local_traffic: LocalTraffic::Cidrs(vec![(ip(net), len)]),
        node_ips: node_ips
            .into_iter()
            .filter(|a| Family::of(a) == family)
            .collect(),
        ..RenderConfig::default()
    }
}

/// makeTestService: `ns/name` with one cluster IP and no ports; the closure fills in the rest.
pub fn make_test_service(
    ns: &str,
    name: &str,
    cluster_ip: &str,
    f: impl FnOnce(&mut Service),
) -> Service {
    let mut svc = Service::cluster_ip(ServiceKey::new(ns, name), vec![ip(cluster_ip)], vec![]);
    f(&mut svc);
    svc
}

pub fn port(name: &str, port: u16, protocol: Protocol, node_port: Option<u16>) -> ServicePort {
    ServicePort {
        name: name.into(),
        port,
        protocol,
        node_port,
    }
}

/// An endpoint: ready unless the conditions say otherwise; `node` None is not local.
pub fn ep(addr: &str, node: Option<&str>) -> Endpoint {
    Endpoint {
        ip: ip(addr),
        ready: true,
        serving: true,
        terminating: false,
        placement: crate::model::endpoint::Where {
            node_name: node.map(Into::into),
            ..Default::default()
        }
        .into(),
    }
}

/// An endpoint with explicit conditions (ready, serving, terminating).
pub fn ep_cond(
    addr: &str,
    node: Option<&str>,
    ready: bool,
    serving: bool,
    terminating: bool,
) -> Endpoint {
    Endpoint {
        ready,
        serving,
        terminating,
        ..ep(addr, node)
    }
}

/// makeTestEndpointSlice: one slice with these ports (name, port, protocol).
pub fn slice(endpoints: Vec<Endpoint>, ports: &[(&str, u16, Protocol)]) -> EndpointSet {
    let ports = ports
        .iter()
        .map(|&(name, port, protocol)| SlicePort {
            name: name.into(),
            port,
            protocol,
        })
        .collect();
    EndpointSet {
        slices: crate::model::Slices::from([(
            "slice-1".to_string(),
            SliceInfo { ports, endpoints },
        )]),
    }
}

pub fn state(entries: Vec<(Service, Option<EndpointSet>)>) -> ProxyState {
    let mut st = ProxyState::default();
    for (svc, eps) in entries {
        if let Some(eps) = eps {
            st.endpoints.insert(svc.key.clone(), Arc::new(eps));
        }
        st.services.insert(svc.key.clone(), Arc::new(svc));
    }
    st
}

/// The full restore text our renderer writes for `st` (kube-proxy's fp.iptablesData).
pub fn sync_text(st: &ProxyState, family: Family, cfg: &RenderConfig) -> String {
    render(st, &node(), family, cfg).restore_text(&Default::default())
}
