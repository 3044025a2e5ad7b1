//! iptables-save output through what reads it: the iptables mode's `Saved` (its jumps,
//! chain clean-up and the removal of kube-proxy's ipset rules) and `inspect`'s view of the
//! programmed rules (frontends, the chains each resolves through, affinity lists).
#![no_main]

use libfuzzer_sys::fuzz_target;
use proxy_userland::{
    dataplane::{
        iptables::{Family, Table, apply, apply::Saved, render},
        leftovers,
    },
    inspect::rules::Programmed,
};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let saved = Saved::parse(text);
    for table in [Table::Filter, Table::Nat] {
        let _ = saved.chains_matching(table, render::is_our_chain);
        let _ = saved.chains_matching(table, leftovers::is_ipvs_only_chain);
    }
    let _ = apply::removal_text(&saved, &[Table::Filter, Table::Nat], render::is_our_chain);
    let _ = leftovers::set_rules_removal(&saved);

    let mut programmed = Programmed::default();
    programmed.add(Family::V4, &saved);
    programmed.add(Family::V6, &saved);
    for (key, _) in programmed.frontends.iter() {
        let _ = programmed.resolve(key, false);
        let _ = programmed.resolve(key, true);
    }
    let _ = programmed.as_frontends();
    let _ = programmed.affinity_lists();
    let _ = programmed.dnat_targets();
});
