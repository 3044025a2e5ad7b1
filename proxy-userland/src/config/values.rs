//! Typed values of flags and config fields, each parsed and range-checked once.
//!
//! Every parser here returns `Err(message)` for anything it cannot use; the message says
//! what was wrong and the caller (clap for flags, [`super::Args::merge_file`] for the file)
//! puts the flag or field name in front of it. None of them panics, whatever the input.

use std::{fmt, str::FromStr, time::Duration};

/// The longest duration any setting takes. Longer ones are typos (`30000s` for `30s`) or
/// attacks; refusing them keeps every later `Instant + d` and `d * 2` from overflowing.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// A duration as kube-proxy's flags write them (`30s`, `1m30s`, `24h`), at most a year.
pub fn duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration ({e}); e.g. 30s, 1m, 24h"))?;
    if d > MAX_DURATION {
        return Err(format!("{s:?} is longer than the limit of 365 days"));
    }
    Ok(d)
}

/// A duration the kernel takes in whole seconds (conntrack timeouts): 0 ("leave alone") or
/// at least one second, so that `500ms` is not silently written as 0.
pub fn seconds(s: &str) -> Result<Duration, String> {
    let d = duration(s)?;
    if !d.is_zero() && d < Duration::from_secs(1) {
        return Err(format!(
            "{s:?} is under 1s; the kernel counts whole seconds (0 leaves it alone)"
        ));
    }
    Ok(d)
}

/// A period of background work: at least one second, so that a typo (`0s`, `30ms`) does
/// not turn it into a busy loop.
pub fn interval(s: &str) -> Result<Duration, String> {
    let d = duration(s)?;
    if d < Duration::from_secs(1) {
        return Err(format!("{s:?} is under 1s"));
    }
    Ok(d)
}

/// `--log-level`: one level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or tracing
/// directives `TARGET=LEVEL` separated by commas (`info,proxy_userland::sync=debug`).
/// Checked strictly: tracing's own filter parser takes any word as a target name, so a
/// typo such as `verbose` would silently turn logging off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLevel(String);

const LEVELS: &[&str] = &["off", "error", "warn", "info", "debug", "trace"];

impl LogLevel {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The level a klog verbosity (`logging.verbosity`, kube-proxy's `-v`) maps to.
    pub fn from_verbosity(v: u32) -> Self {
        LogLevel(
            match v {
                0..=3 => "info",
                4 => "debug",
                _ => "trace",
            }
            .into(),
        )
    }
}

impl Default for LogLevel {
    fn default() -> Self {
        LogLevel("info".into())
    }
}

impl fmt::Display for LogLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for LogLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let level_ok = |l: &str| LEVELS.iter().any(|x| x.eq_ignore_ascii_case(l));
        let target_ok = |t: &str| {
            !t.is_empty()
                && t.len() <= 256
                && t.split("::").all(|part| {
                    !part.is_empty()
                        && part
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                })
        };
        if s.is_empty() || s.len() > 4096 {
            return Err(format!(
                "{s:?} is not a log level (error, warn, info, debug, trace, off)"
            ));
        }
        for directive in s.split(',') {
            let ok = match directive.split_once('=') {
                None => level_ok(directive),
                Some((target, level)) => target_ok(target) && level_ok(level),
            };
            if !ok {
                return Err(format!(
                    "{directive:?} is neither a log level (error, warn, info, debug, trace, off) \
                     nor TARGET=LEVEL"
                ));
            }
        }
        // The grammar above is a subset of tracing's; its parser has the last word.
        tracing_subscriber::EnvFilter::try_new(s).map_err(|e| format!("{s:?}: {e}"))?;
        Ok(LogLevel(s.to_string()))
    }
}

/// A network namespace name as `ip netns` makes them: a plain file name under /run/netns.
pub fn netns_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 255 || s == "." || s == ".." || s.contains(['/', '\0']) {
        return Err(format!(
            "{s:?} is not a network namespace name (a plain name under /run/netns, no '/')"
        ));
    }
    Ok(s.to_string())
}

/// A network device name as the kernel takes it (at most 15 bytes, no '/', ':' or white
/// space), or the words `auto` and `none` of `--nodeport-devices`.
pub fn device_name(s: &str) -> Result<String, String> {
    let s = s.trim();
    // An empty item (`eth0,`) is dropped later, as before.
    if s.is_empty() || s == "auto" || s == "none" {
        return Ok(s.to_string());
    }
    if s.len() > 15
        || s == "."
        || s == ".."
        || s.bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace() || b < 0x20)
    {
        return Err(format!(
            "{s:?} is not a network device name (at most 15 characters, no '/', ':' or spaces)"
        ));
    }
    Ok(s.to_string())
}

/// A label value (zone, service proxy name), as the API server checks them: at most 63
/// characters, alphanumerics and `-_.` inside, alphanumeric at both ends.
pub fn label_value(s: &str) -> Result<String, String> {
    let ok = s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric());
    if s.is_empty() || !ok {
        return Err(format!(
            "{s:?} is not a label value (at most 63 letters, digits, '-', '_' or '.', \
             starting and ending with a letter or digit)"
        ));
    }
    Ok(s.to_string())
}

/// A node name (`--hostname-override`): an RFC 1123 subdomain once lowercased, as the API
/// server checks Node names; returned lowercased.
pub fn node_name(s: &str) -> Result<String, String> {
    let lower = s.trim().to_lowercase();
    let ok = !lower.is_empty()
        && lower.len() <= 253
        && lower.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if !ok {
        return Err(format!(
            "{s:?} is not a valid node name (lowercase letters, digits, '-' and '.', at most 253)"
        ));
    }
    Ok(lower)
}

/// The API server URL: http or https with a host.
pub fn url(s: &str) -> Result<String, String> {
    let s = s.trim();
    let uri: http::Uri = s.parse().map_err(|e| format!("{s:?} is not a URL ({e})"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none_or(str::is_empty) {
        return Err(format!("{s:?} is not an http(s)://HOST[:PORT] URL"));
    }
    Ok(s.to_string())
}

/// A file or folder path from the config file: not empty and without NUL bytes (which no
/// system call takes).
pub fn path(s: &str) -> Result<std::path::PathBuf, String> {
    if s.is_empty() || s.contains('\0') {
        return Err(format!("{s:?} is not a path"));
    }
    Ok(s.into())
}

pub use crate::model::Cidr;

/// One `--nodeport-addresses` item: a CIDR, or `primary` (the node's primary addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    Primary,
    Cidr(Cidr),
}

impl FromStr for NodePortAddress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "primary" {
            return Ok(NodePortAddress::Primary);
        }
        s.parse()
            .map(NodePortAddress::Cidr)
            .map_err(|e| format!("{e}; expected a CIDR or \"primary\""))
    }
}

/// `--bpf-lb-maglev-table-size`: one of the primes Cilium accepts.
pub fn maglev_table_size(s: &str) -> Result<u32, String> {
    let sizes = proxy_common::maglev::TABLE_SIZES;
    s.parse::<u32>()
        .ok()
        .filter(|m| sizes.contains(m))
        .ok_or_else(|| format!("{s:?} is not one of the table sizes {sizes:?}"))
}

/// How to choose host routing (`--bpf-host-routing`; the daemon's default is `Auto`, a
/// configuration built in code has it off unless it says otherwise).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HostRouting {
    /// On while nothing in the host's netfilter acts on forwarded traffic.
    Auto,
    /// Always on.
    True,
    /// Always off.
    #[default]
    False,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_bounded() {
        assert_eq!(duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(duration("365d"), Ok(MAX_DURATION));
        for bad in [
            "300000000000y",
            "366d",
            "99999999999999999999s",
            "5 parsecs",
            "",
            "-1s",
        ] {
            assert!(duration(bad).is_err(), "{bad}");
        }
        assert!(seconds("500ms").is_err());
        assert_eq!(seconds("0s"), Ok(Duration::ZERO));
        assert_eq!(interval("1m"), Ok(Duration::from_secs(60)));
        assert!(interval("0s").is_err() && interval("999ms").is_err() && interval("x").is_err());
    }

    #[test]
    fn log_levels_are_levels_or_directives() {
        for good in [
            "info",
            "DEBUG",
            "off",
            "warn,proxy_userland::sync=trace",
            "kube-client=debug",
        ] {
            assert!(good.parse::<LogLevel>().is_ok(), "{good}");
        }
        for bad in [
            "verbose???",
            "",
            "verbose",
            "info,",
            "x=loud",
            "=info",
            "a[span]=info",
            "a::=info",
        ] {
            assert!(bad.parse::<LogLevel>().is_err(), "{bad}");
        }
    }

    #[test]
    fn names_are_plain() {
        assert!(netns_name("fastpath-node-1").is_ok());
        for bad in ["../../etc", "..", ".", "", "a/b", "a\0b"] {
            assert!(netns_name(bad).is_err(), "{bad:?}");
        }
        assert!(device_name("eth0").is_ok());
        for bad in ["../eth0", "averyveryverylongname", "eth 0", "eth0:1"] {
            assert!(device_name(bad).is_err(), "{bad:?}");
        }
        assert!(label_value("zone-a.b_c").is_ok());
        for bad in ["-a", "a-", "", "a b", &"z".repeat(64)] {
            assert!(label_value(bad).is_err(), "{bad:?}");
        }
        assert!(url("https://198.18.0.1:6443").is_ok());
        for bad in ["198.18.0.1:6443", "ftp://x", "https://", "http://[::1"] {
            assert!(url(bad).is_err(), "{bad:?}");
        }
    }

    /// A cheap property test: random strings built from the pieces hostile input is made
    /// of never panic any parser, and whatever parses is within range.
    #[test]
    fn no_input_panics_a_parser() {
        const PIECES: &[&str] = &[
            "0",
            "1",
            "9",
            "18446744073709551616",
            "300000000000",
            "-",
            "+",
            ".",
            "/",
            ":",
            "=",
            ",",
            "s",
            "ms",
            "y",
            "d",
            "h",
            "info",
            "::",
            "[",
            "]",
            "{",
            "}",
            "\0",
            " ",
            "é",
            "198.18.0.1",
            "2001:db8::1",
            "/33",
            "/129",
            "..",
            "primary",
            "http://",
            "?",
        ];
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let len = (next() % 8) as usize;
            let s: String = (0..len)
                .map(|_| PIECES[(next() % PIECES.len() as u64) as usize])
                .collect();
            if let Ok(d) = duration(&s) {
                assert!(d <= MAX_DURATION, "{s:?}");
            }
            let _ = seconds(&s);
            let _ = s.parse::<LogLevel>();
            if let Ok(n) = netns_name(&s) {
                assert!(!n.contains('/'), "{s:?}");
            }
            let _ = device_name(&s);
            let _ = label_value(&s);
            let _ = url(&s);
            let _ = path(&s);
            let _ = node_name(&s);
            if let Ok(c) = s.parse::<Cidr>() {
                assert!(c.prefix <= if c.addr.is_ipv4() { 32 } else { 128 }, "{s:?}");
            }
            let _ = s.parse::<NodePortAddress>();
        }
    }
}
