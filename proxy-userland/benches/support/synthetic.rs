//! Synthetic models for the benches that drive a proxier directly: N ClusterIP services
//! (`bench/svc-i`, 198.19.1.0 upwards) x 10 endpoints (198.18.16.0 upwards), as
//! `ProxyState`.
#![allow(dead_code)]

use std::net::Ipv4Addr;

use proxy_userland::model::{Protocol, ProxyState, Service, ServiceKey, ServicePort};

use super::common;

pub const ENDPOINTS_PER_SERVICE: u32 = 10;

pub fn service_ip(i: u32) -> Ipv4Addr {
    // 198.19.0.0/16, leaving 198.19.0.x for the benches' own services.
    let n = i + 256;
    Ipv4Addr::new(198, 19, (n >> 8) as u8, n as u8)
}

pub fn endpoint_ip(k: u32) -> Ipv4Addr {
    // 198.18.16.0 - 198.18.255.255: clear of the bench pods in 198.18.1.x.
    let n = 16 * 256 + k % (240 * 256);
    Ipv4Addr::new(198, 18, (n >> 8) as u8, n as u8)
}

pub fn service(i: u32) -> Service {
    let mut svc = common::web_service(&format!("svc-{i}"), service_ip(i));
    svc.key = ServiceKey::new("bench", format!("svc-{i}"));
    svc.ports = vec![ServicePort {
        name: "http".into(),
        port: 80,
        protocol: Protocol::Tcp,
        node_port: None,
    }];
    svc
}

/// `n` services; `salt` shifts every endpoint address.
pub fn state(n: u32, salt: u32) -> ProxyState {
    let entries = (0..n)
        .map(|i| {
            let eps = (0..ENDPOINTS_PER_SERVICE)
                .map(|j| common::ready(endpoint_ip(i * ENDPOINTS_PER_SERVICE + j + salt)))
                .collect();
            (service(i), Some(common::web_endpoints(eps)))
        })
        .collect();
    common::state_of(entries)
}

/// Adds `extra`'s services and endpoints to `state`.
pub fn merge(state: &mut ProxyState, extra: ProxyState) {
    state.services.extend(extra.services);
    state.endpoints.extend(extra.endpoints);
}
