//! The eBPF dataplane's tunables in the config file (`fastpath.bpfCtMax`, ...), read
//! through their flags' own parsers.
//!
//! An operator sets a DaemonSet's settings in its ConfigMap, as Cilium's users set
//! `bpf-ct-global-tcp-max` or `bpf-lb-algorithm` in `cilium-config`; editing the
//! DaemonSet's arguments restarts every daemon and drifts from the shipped manifest. Each
//! field here is the camelCase of a flag, and its value goes through that flag's parser:
//! one range, one list of choices and one message for both, which a second copy of the
//! checks would let drift apart.

use clap::{CommandFactory, parser::ValueSource};

use super::{Args, ConfigError, file::Fastpath, set};

/// Takes the tunables `fp` sets whose flags were not `given` on the command line.
pub(super) fn merge(
    args: &mut Args,
    fp: &Fastpath,
    origin: &str,
    given: &impl Fn(&str) -> bool,
) -> Result<(), ConfigError> {
    let number = |n: Option<u64>| n.map(|n| n.to_string());
    let file = File { origin, given };
    if let Some(v) = file.read("bpfLbMapMax", "bpf_lb_map_max", number(fp.bpf_lb_map_max))? {
        args.bpf_lb_map_max = Some(v);
    }
    if let Some(v) = file.read("bpfCtMax", "bpf_ct_max", number(fp.bpf_ct_max))? {
        args.bpf_ct_max = Some(v);
    }
    let gc = set(&fp.conntrack_gc_interval);
    if let Some(v) = file.read("conntrackGcInterval", "conntrack_gc_interval", gc)? {
        args.conntrack_gc_interval = v;
    }
    let algorithm = set(&fp.bpf_lb_algorithm);
    if let Some(v) = file.read("bpfLbAlgorithm", "bpf_lb_algorithm", algorithm)? {
        args.bpf_lb_algorithm = v;
    }
    let size = number(fp.bpf_lb_maglev_table_size);
    if let Some(v) = file.read("bpfLbMaglevTableSize", "bpf_lb_maglev_table_size", size)? {
        args.bpf_lb_maglev_table_size = v;
    }
    let seed = number(fp.bpf_lb_maglev_hash_seed);
    if let Some(v) = file.read("bpfLbMaglevHashSeed", "bpf_lb_maglev_hash_seed", seed)? {
        args.bpf_lb_maglev_hash_seed = v;
    }
    if let Some(v) = file.read("bpfLbMode", "bpf_lb_mode", set(&fp.bpf_lb_mode))? {
        args.bpf_lb_mode = v;
    }
    Ok(())
}

/// The file being merged, and which flags the command line gave.
struct File<'a, G> {
    origin: &'a str,
    given: &'a G,
}

impl<G: Fn(&str) -> bool> File<'_, G> {
    /// Field `field`'s `value` as flag `id` would take it, unless that flag was given.
    fn read<T: Clone + Send + Sync + 'static>(
        &self,
        field: &str,
        id: &str,
        value: Option<String>,
    ) -> Result<Option<T>, ConfigError> {
        match value {
            Some(v) if !(self.given)(id) => {
                through_flag(id, &v)
                    .map(Some)
                    .map_err(|message| ConfigError::Invalid {
                        origin: self.origin.to_string(),
                        field: format!("fastpath.{field}"),
                        message,
                    })
            }
            _ => Ok(None),
        }
    }
}

/// A flag's value of type `T`, parsed from `value` as clap parses the flag with id `id`.
fn through_flag<T: Clone + Send + Sync + 'static>(id: &str, value: &str) -> Result<T, String> {
    let cmd = Args::command();
    let long = cmd
        .get_arguments()
        .find(|a| a.get_id() == id)
        .and_then(|a| a.get_long())
        .ok_or_else(|| format!("no flag {id}"))?
        .to_string();
    let matches = cmd
        .try_get_matches_from(["fastpath".to_string(), format!("--{long}={value}")])
        .map_err(|e| clap_message(&e))?;
    // try_get_one: get_one panics where the flag stores another type than the field's.
    match (matches.value_source(id), matches.try_get_one::<T>(id)) {
        (Some(ValueSource::CommandLine), Ok(Some(v))) => Ok(v.clone()),
        _ => Err(format!("{value:?} was not taken as --{long}")),
    }
}

/// clap's error without its "error:" prefix, usage and help hint, on one line.
fn clap_message(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .map(|l| l.strip_prefix("error: ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join(" ")
}
