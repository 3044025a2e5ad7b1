//! kube-proxy's nftables mode.

#[cfg(test)]
mod kube_tests;
