//! `/debug/model` on the metrics address: the model the last sync programmed, with the
//! names the maps do not know (Service, port name, endpoint conditions, node, zone), for
//! `fastpath inspect` and `fastpath explain` on the same node. The metrics address is
//! loopback by default (kube-proxy's 127.0.0.1:10249), so this is local to the node.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use serde::{Deserialize, Serialize};

use super::http::Response;
use crate::{
    config::Args,
    model::{EndpointSet, NodeInfo, ProxyState, Service, ServiceKey},
};

/// Where the daemon's programs and pins are, for explanations; set once at start.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DebugContext {
    pub cgroup: Option<PathBuf>,
    pub bpf_pin_dir: Option<PathBuf>,
    pub nodeport_devices: Vec<String>,
    /// The network namespace the iptables and userspace proxiers program (--netns), so
    /// that `inspect` reads the rules and conntrack table of the same one.
    pub netns: Option<String>,
    /// --iptables-backend: which iptables-save shows what the daemon restored.
    pub iptables_backend: String,
}

impl DebugContext {
    pub fn from_args(args: &Args) -> Self {
        Self {
            cgroup: args.cgroup_path.clone(),
            bpf_pin_dir: args.bpf_pin_dir.clone(),
            nodeport_devices: args.nodeport_devices.clone(),
            netns: args.netns.clone(),
            iptables_backend: args.iptables_backend.clone(),
        }
    }
}

/// One service's endpoints, by slice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceEndpoints {
    pub service: ServiceKey,
    #[serde(flatten)]
    pub endpoints: EndpointSet,
}

/// What `/debug/model` answers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelDump {
    /// The running dataplane ("ebpf", "iptables", "userspace"); empty before it started.
    pub mode: String,
    /// Whether a sync has programmed this model yet.
    pub synced: bool,
    pub node: NodeInfo,
    pub context: DebugContext,
    pub services: Vec<Service>,
    pub endpoints: Vec<ServiceEndpoints>,
    /// The service ranges (`--service-cluster-ip-range` and ServiceCIDR objects) as
    /// `ADDRESS/PREFIX`: an address inside them that no Service holds is refused.
    #[serde(default)]
    pub service_ranges: Vec<String>,
}

impl ModelDump {
    /// Back to the model's own shape, for the selection code.
    pub fn state(&self) -> ProxyState {
        ProxyState {
            services: self
                .services
                .iter()
                .map(|s| (s.key.clone(), Arc::new(s.clone())))
                .collect(),
            endpoints: self
                .endpoints
                .iter()
                .map(|e| (e.service.clone(), Arc::new(e.endpoints.clone())))
                .collect(),
            ..ProxyState::default()
        }
    }
}

#[derive(Default)]
struct Published {
    state: ProxyState,
    node: NodeInfo,
    synced: bool,
}

/// Written by the sync loop after each sync, read by `/debug/model`.
#[derive(Default)]
pub struct DebugState {
    published: Mutex<Published>,
    context: Mutex<DebugContext>,
}

impl DebugState {
    pub fn set_context(&self, context: DebugContext) {
        *self.context.lock().unwrap_or_else(|p| p.into_inner()) = context;
    }

    /// The model a sync just programmed (cheap: the state's values are `Arc`s).
    pub fn publish(&self, state: &ProxyState, node: &NodeInfo) {
        let mut p = self.published.lock().unwrap_or_else(|p| p.into_inner());
        *p = Published {
            state: state.clone(),
            node: node.clone(),
            synced: true,
        };
    }

    pub fn dump(&self, mode: &str) -> ModelDump {
        let context = self
            .context
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let p = self.published.lock().unwrap_or_else(|p| p.into_inner());
        let endpoints: BTreeMap<&ServiceKey, &EndpointSet> = p
            .state
            .endpoints
            .iter()
            .map(|(k, v)| (k, v.as_ref()))
            .collect();
        ModelDump {
            mode: mode.to_string(),
            synced: p.synced,
            node: p.node.clone(),
            context,
            services: p
                .state
                .services
                .values()
                .map(|s| s.as_ref().clone())
                .collect(),
            endpoints: endpoints
                .into_iter()
                .map(|(k, e)| ServiceEndpoints {
                    service: k.clone(),
                    endpoints: e.clone(),
                })
                .collect(),
            service_ranges: (p.state.service_ranges.cidrs().iter())
                .map(ToString::to_string)
                .collect(),
        }
    }

    pub fn response(&self, mode: &str) -> Response {
        match serde_json::to_string(&self.dump(mode)) {
            Ok(body) => Response::json(200, body),
            Err(e) => Response::text(500, format!("cannot encode the model: {e}\n")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Protocol, ServicePort};

    #[test]
    fn the_dump_round_trips_to_the_same_state() {
        let key = ServiceKey::new("demo", "web");
        let svc = Service::cluster_ip(
            key.clone(),
            vec!["198.19.0.10".parse().unwrap()],
            vec![ServicePort {
                name: "http".into(),
                port: 80,
                protocol: Protocol::Tcp,
                node_port: None,
            }],
        );
        let mut state = ProxyState::default();
        state.services.insert(key.clone(), Arc::new(svc));
        state
            .endpoints
            .insert(key, Arc::new(EndpointSet::default()));
        let d = DebugState::default();
        d.publish(
            &state,
            &NodeInfo {
                name: "node-a".into(),
                zone: None,
            },
        );
        let body = d.response("ebpf").body;
        let back: ModelDump = serde_json::from_str(&body).unwrap();
        assert_eq!(back.mode, "ebpf");
        assert!(back.synced);
        assert_eq!(back.state(), state);
    }
}
