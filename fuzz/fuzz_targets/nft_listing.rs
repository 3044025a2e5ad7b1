//! `nft list table` output, and our own statements, through what reads them: the listing
//! model (`Dump`) and `inspect`'s view of the nftables mode's table (frontends, the chains
//! each resolves through, the endpoints' shares, affinity sets). Never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proxy_userland::{dataplane::nftables::listing::Dump, inspect::nft_rules};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let dumps: Vec<Dump> = [Dump::from_listing(text), Dump::parse(text)]
        .into_iter()
        .flatten()
        .collect();
    for dump in &dumps {
        let _ = dump.to_statements();
        let _ = dump.hooked("prerouting");
    }
    let programmed = nft_rules::programmed(&dumps);
    for key in programmed.frontends.keys() {
        let _ = programmed.resolve(key, false);
        let _ = programmed.resolve(key, true);
    }
    let _ = programmed.as_frontends();
    let _ = programmed.affinity_lists();
    let _ = programmed.dnat_targets();
});
