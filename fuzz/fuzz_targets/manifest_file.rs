//! A manifest file (multi-document YAML, JSON, Lists) through the file source's reader
//! down to the model, then a second read of a changed text reusing the first read, as the
//! daemon does when a watched file is saved again.
//!
//! Input: the first file's text, then optionally a NUL byte and the second's. The re-read
//! must give what a fresh read of the same text gives: reuse is an optimisation only.
#![no_main]

use std::{net::IpAddr, path::Path};

use libfuzzer_sys::fuzz_target;
use proxy_userland::source::file::{self, Loaded, Previous};

fn objects(loaded: &Loaded) -> (Vec<String>, Vec<String>, usize, usize) {
    (
        loaded.services.iter().map(|s| format!("{s:?}")).collect(),
        loaded.slices.iter().map(|s| format!("{s:?}")).collect(),
        loaded.errors.len(),
        loaded.skipped,
    )
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (first, second) = text.split_once('\0').unwrap_or((text, text));
    let path = Path::new("fuzz.yaml");
    let node_ips: [IpAddr; 2] = [
        "198.18.0.1".parse().unwrap(),
        "2001:db8::1".parse().unwrap(),
    ];

    let (before, pieces) = file::load_file_text(path, first.to_owned(), &node_ips, None);
    for e in &before.errors {
        let _ = e.to_string();
    }
    let previous = Previous {
        services: &before.services,
        slices: &before.slices,
        pieces: &pieces,
    };
    let (reread, _) = file::load_file_text(path, second.to_owned(), &node_ips, Some(previous));
    let (fresh, _) = file::load_file_text(path, second.to_owned(), &node_ips, None);
    assert_eq!(
        objects(&reread),
        objects(&fresh),
        "a re-read differs from a fresh read"
    );
});
