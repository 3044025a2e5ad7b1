//! API objects as the watch delivers them (JSON) through the same decoding as the kube
//! source (its two steps, `source::lazy`: metadata and field text, then k8s-openapi's
//! types) and conversion into the model.
//!
//! Input: one byte choosing the kind (Service, EndpointSlice, Node), then the JSON.
#![no_main]

use k8s_openapi::api::{core::v1, discovery::v1::EndpointSlice};
use libfuzzer_sys::fuzz_target;
use proxy_userland::{
    model::convert,
    source::{kube, lazy::Lazy},
};

/// `json` decoded as the kube source decodes a list item (the error is formatted, as the
/// source logs it).
macro_rules! decoded {
    ($kind:ty, $json:expr) => {
        serde_json::from_slice::<Lazy<$kind>>($json)
            .ok()
            .and_then(|lazy| lazy.decode().map_err(|m| m.to_string()).ok())
    };
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, json)) = data.split_first() else {
        return;
    };
    match kind % 3 {
        0 => {
            if let Some(svc) = decoded!(v1::Service, json) {
                for proxy_name in [None, Some("fastpath")] {
                    if let Err(e) = convert::service(&svc, proxy_name) {
                        let _ = (e.to_string(), e.field(), e.object());
                    }
                }
            }
        }
        1 => {
            if let Some(slice) = decoded!(EndpointSlice, json)
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
