//! Reading the output of `fastpath-probe tcp|udp` (proxy-userland/src/bin/probe.rs).
//!
//! One line per attempt:
//! `ok <reply> peer=<addr>` (tcp), `ok <reply> from=<addr> peer=<addr or ->` (udp),
//! or `err <ERRNO_NAME> <message>`. The reply is the server's name, or with `serve
//! --echo-peer` `NAME@ADDR:PORT`, the client's address as the server saw it
//! ([`Outcome::name`], [`Outcome::seen_from`]).

use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok {
        /// What the server answered: its name, or `NAME@ADDR:PORT` with `--echo-peer`.
        reply: String,
        /// getpeername() on the client socket, if known.
        peer: Option<String>,
        /// Where the UDP reply came from, as recvfrom() reported it.
        from: Option<String>,
    },
    Err {
        /// e.g. `ECONNREFUSED`, `ETIMEDOUT`.
        errno: String,
        message: String,
    },
}

impl Outcome {
    pub fn is_ok(&self) -> bool {
        matches!(self, Outcome::Ok { .. })
    }

    /// The server's whole reply, for successes.
    pub fn reply(&self) -> Option<&str> {
        match self {
            Outcome::Ok { reply, .. } => Some(reply),
            Outcome::Err { .. } => None,
        }
    }

    /// The server's name, for successes: the reply up to an `@`, or all of it.
    pub fn name(&self) -> Option<&str> {
        let reply = self.reply()?;
        Some(reply.split_once('@').map_or(reply, |(name, _)| name))
    }

    /// The client address the server saw (`ADDR:PORT`, IPv6 as `[ADDR]:PORT`), for successes
    /// from a server run with `--echo-peer`: the reply after its `@`.
    pub fn seen_from(&self) -> Option<&str> {
        Some(self.reply()?.split_once('@')?.1)
    }

    /// The errno name, for failures.
    pub fn errno(&self) -> Option<&str> {
        match self {
            Outcome::Err { errno, .. } => Some(errno),
            Outcome::Ok { .. } => None,
        }
    }
}

/// Parses one line; None if it is not a probe result line.
pub fn parse_line(line: &str) -> Option<Outcome> {
    let line = line.trim();
    if let Some(rest) = line.strip_prefix("err ") {
        let (errno, message) = rest.split_once(' ').unwrap_or((rest, ""));
        // The probe ends every line with the attempt's duration; it is not part of the error.
        let message = match message.rsplit_once(" us=") {
            Some((m, us)) if us.bytes().all(|b| b.is_ascii_digit()) => m,
            _ => message,
        };
        return Some(Outcome::Err {
            errno: errno.to_string(),
            message: message.to_string(),
        });
    }
    let rest = line.strip_prefix("ok ")?;
    let mut words = rest.split_whitespace();
    let reply = words.next()?.to_string();
    let (mut peer, mut from) = (None, None);
    for word in words {
        let (key, value) = word.split_once('=')?;
        let value = (value != "-").then(|| value.to_string());
        match key {
            "peer" => peer = value,
            "from" => from = value,
            _ => {}
        }
    }
    Some(Outcome::Ok { reply, peer, from })
}

/// Parses every result line of the probe's stdout, skipping anything else.
pub fn parse(stdout: &str) -> Vec<Outcome> {
    stdout.lines().filter_map(parse_line).collect()
}

/// How many successes each server name got (see [`Outcome::name`]).
pub fn count_replies(outcomes: &[Outcome]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for reply in outcomes.iter().filter_map(Outcome::name) {
        *counts.entry(reply.to_string()).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines() {
        assert_eq!(
            parse_line("ok pod-1 peer=198.18.1.1:8080"),
            Some(Outcome::Ok {
                reply: "pod-1".into(),
                peer: Some("198.18.1.1:8080".into()),
                from: None
            })
        );
        assert_eq!(
            parse_line("ok pod-2 from=198.19.0.10:53 peer=-"),
            Some(Outcome::Ok {
                reply: "pod-2".into(),
                peer: None,
                from: Some("198.19.0.10:53".into())
            })
        );
        assert_eq!(
            parse_line("err ECONNREFUSED connect: Connection refused"),
            Some(Outcome::Err {
                errno: "ECONNREFUSED".into(),
                message: "connect: Connection refused".into()
            })
        );
        assert_eq!(parse_line("ready"), None);
        assert_eq!(parse_line("ok"), None);
        let all = parse("ok a peer=x\nnoise\nok b peer=y\nok a peer=z\nerr ETIMEDOUT t\n");
        assert_eq!(all.len(), 4);
        assert_eq!(
            count_replies(&all),
            BTreeMap::from([("a".into(), 2), ("b".into(), 1)])
        );
    }

    #[test]
    fn splits_echo_peer_replies() {
        let v4 = parse_line("ok pod-1@198.18.2.1:40312 peer=198.18.1.11:8080 us=120").unwrap();
        assert_eq!(v4.reply(), Some("pod-1@198.18.2.1:40312"));
        assert_eq!(v4.name(), Some("pod-1"));
        assert_eq!(v4.seen_from(), Some("198.18.2.1:40312"));

        let v6 = parse_line("ok pod-2@[2001:db8:2::1]:5353 from=[2001:db8::5]:53 peer=-").unwrap();
        assert_eq!(v6.name(), Some("pod-2"));
        assert_eq!(v6.seen_from(), Some("[2001:db8:2::1]:5353"));

        let plain = parse_line("ok pod-3 peer=198.18.1.13:8080").unwrap();
        assert_eq!(plain.reply(), Some("pod-3"));
        assert_eq!(plain.name(), Some("pod-3"));
        assert_eq!(plain.seen_from(), None);

        let failed = parse_line("err ETIMEDOUT connect: no answer within 5 ms").unwrap();
        assert_eq!((failed.name(), failed.seen_from()), (None, None));

        // Counted by name: every connection comes from another port.
        assert_eq!(
            count_replies(&[v4, plain, parse_line("ok pod-1@198.18.2.1:40313").unwrap()]),
            BTreeMap::from([("pod-1".into(), 2), ("pod-3".into(), 1)])
        );
    }
}
