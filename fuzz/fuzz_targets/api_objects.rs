//! API objects as the watch delivers them (JSON) through the same decoding (serde into
//! k8s-openapi's types, as kube does) and conversion into the model as the kube source.
//!
//! Input: one byte choosing the kind (Service, EndpointSlice, Node), then the JSON.
#![no_main]

use k8s_openapi::api::{core::v1, discovery::v1::EndpointSlice};
use libfuzzer_sys::fuzz_target;
use proxy_userland::{model::convert, source::kube};

fuzz_target!(|data: &[u8]| {
    let Some((&kind, json)) = data.split_first() else {
        return;
    };
    match kind % 3 {
        0 => {
            if let Ok(svc) = serde_json::from_slice::<v1::Service>(json) {
                for proxy_name in [None, Some("fastpath")] {
                    if let Err(e) = convert::service(&svc, proxy_name) {
                        let _ = (e.to_string(), e.field(), e.object());
                    }
                }
            }
        }
        1 => {
            if let Ok(slice) = serde_json::from_slice::<EndpointSlice>(json)
                && let Err(e) = convert::endpoint_slice(&slice)
            {
                let _ = (e.to_string(), e.field(), e.object());
            }
        }
        _ => {
            if let Ok(node) = serde_json::from_slice::<v1::Node>(json) {
                let _ = kube::node_eligible(&node);
            }
        }
    }
});
