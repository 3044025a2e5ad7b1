//! The other tools' output fastpath reads: `nft list tables`, `ipset list -n`,
//! `ip -j link`/`ip -j addr`, the iptables and kernel versions, and xt_recent's lists.
//!
//! Input: one byte choosing the parser, then the text.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proxy_userland::{
    dataplane::{
        iptables::apply,
        leftovers::{ipset, ipvs, nftables},
        mode,
    },
    inspect::rules,
};

fuzz_target!(|data: &[u8]| {
    let Some((&which, text)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    match which % 8 {
        0 => drop(nftables::kube_proxy_families(text)),
        1 => drop(ipset::kube_proxy_sets_in(text)),
        2 => drop(ipvs::link_kind(text)),
        3 => drop(apply::parse_ip_addr_json(text)),
        4 => drop(apply::has_random_fully(text)),
        5 => drop(mode::parse_kernel_release(text)),
        6 => drop(mode::parse_iptables_version(text)),
        _ => drop(rules::parse_recent(text)),
    }
});
