//! conntrack's listings: `conntrack -L` as the iptables mode reads it for stale UDP flows,
//! and the entries `inspect flows` shows.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proxy_userland::dataplane::iptables::conntrack;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = conntrack::parse_list(text);
    let _ = conntrack::parse_entries(text);
});
