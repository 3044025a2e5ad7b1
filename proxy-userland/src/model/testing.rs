//! Small models for the dataplanes' unit tests: a ready endpoint, one slice of port `p80`,
//! a state from services and their endpoints, and node-a.

use std::sync::Arc;

use super::{Endpoint, EndpointSet, NodeInfo, Protocol, ProxyState, Service, SliceInfo, SlicePort};

/// A ready, serving endpoint on `node`.
pub fn ep(ip: &str, node: &str) -> Endpoint {
    Endpoint {
        ip: ip.parse().unwrap(),
        ready: true,
        serving: true,
        terminating: false,
        placement: crate::model::endpoint::Where::on_node(node).into(),
    }
}

/// `list` as one slice whose only port is `p80`, TCP 80.
pub fn eps(list: Vec<Endpoint>) -> EndpointSet {
    let ports = vec![SlicePort {
        name: "p80".into(),
        port: 80,
        protocol: Protocol::Tcp,
    }];
    EndpointSet {
        slices: super::Slices::from([(
            "s".into(),
            SliceInfo {
                ports,
                endpoints: list,
            },
        )]),
    }
}

/// A state holding these services, with their endpoints where given.
pub fn state(entries: Vec<(Service, Option<EndpointSet>)>) -> ProxyState {
    let mut st = ProxyState::default();
    for (s, e) in entries {
        if let Some(e) = e {
            st.endpoints.insert(s.key.clone(), Arc::new(e));
        }
        st.services.insert(s.key.clone(), Arc::new(s));
    }
    st
}

/// node-a, in no zone.
pub fn node() -> NodeInfo {
    NodeInfo {
        name: "node-a".into(),
        zone: None,
    }
}
