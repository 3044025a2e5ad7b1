//! Command lines through clap and the checks `Args::from_matches` runs. `--config` is left
//! to the config_file target: here it would read whatever file a command line names.
//!
//! Input: the arguments after the program's name, separated by NUL bytes (as in
//! /proc/PID/cmdline), so that seeds and the dictionary are plain flags.
#![no_main]

use clap::{CommandFactory, FromArgMatches};
use libfuzzer_sys::fuzz_target;
use proxy_userland::config::Args;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let argv = std::iter::once("fastpath").chain(text.split('\0').filter(|a| !a.is_empty()));
    let matches = match Args::command().try_get_matches_from(argv) {
        Ok(matches) => matches,
        Err(e) => {
            let _ = e.render();
            return;
        }
    };
    let args = match Args::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(e) => {
            let _ = e.render();
            return;
        }
    };
    if args.config.is_some() {
        return;
    }
    if let Err(e) = args.validate() {
        let _ = e.to_string();
    }
});
