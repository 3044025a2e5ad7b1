//! kube-proxy's nftables mode, in tables of our own (`ip fastpath`, `ip6 fastpath`).
//!
//! - [`render`]: the model as an nftables transaction, a pure function.

pub mod render;

#[cfg(test)]
mod kube_tests;
