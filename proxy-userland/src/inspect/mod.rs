//! `fastpath inspect` and `fastpath explain`: an operator's view of what the proxy on this
//! node does, from the running daemon's model (`/debug/model` on its metrics address, which
//! knows the Services' names and endpoint conditions) and from what is really programmed:
//! in eBPF mode the pinned maps (`--bpf-pin-dir`, which the programs read), in iptables mode
//! the rules (`iptables-save`), in nftables mode our tables (`nft list table`), and the
//! conntrack table of the daemon's network namespace.
//!
//! These are short-lived tools with no async runtime: running iptables-save and conntrack
//! blocks nothing but the tool itself.
//!
//! - [`view`]: `inspect services` as rows, and what the views read ([`view::Inputs`]).
//! - [`flows`]: `inspect flows | affinity`: the eBPF flow table and affinity entries, or in
//!   iptables mode the conntrack entries the rules translated.
//! - [`rules`]: iptables mode: what the nat and filter tables really hold, per frontend.
//! - [`nft_rules`]: nftables mode: the same, read from `nft list table`.
//! - [`explain`]: which frontend a destination matches, which backends are eligible and why.
//! - [`hook`]: where each mode translates a frontend's traffic, for `explain`.
//! - [`maps`]: reading the pinned maps.
//! - [`table`]: the plain-text table both print.
//!
//! Dispatched from `main` before the daemon's flags are parsed, so the subcommands never
//! collide with them.

pub mod explain;
pub mod flows;
pub mod hook;
pub mod maps;
pub mod nft_rules;
pub mod rules;
pub mod table;
pub mod view;

use std::{
    ffi::OsString,
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    path::PathBuf,
    process::ExitCode,
    time::Duration,
};

use anyhow::Context as _;
use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};

use crate::{admin::debug::ModelDump, model::Protocol};

/// The first words that select these tools instead of the daemon.
pub const SUBCOMMANDS: [&str; 2] = ["inspect", "explain"];

#[derive(Parser, Debug)]
#[command(
    name = "fastpath",
    about = "What the proxy on this node does with traffic"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Lists what is programmed: `services`, `flows` (packet path) or `affinity`.
    Inspect {
        #[command(subcommand)]
        what: What,
        #[command(flatten)]
        source: Source,
    },
    /// Explains what happens to a connection to DESTINATION: the Service it matches, the
    /// backends it may reach and why, the hook or chain that translates it, and the outcome.
    Explain {
        /// tcp, udp or sctp.
        #[arg(value_parser = parse_proto)]
        proto: Protocol,
        /// IP:PORT (IPv6 as [IP]:PORT).
        destination: SocketAddr,
        /// The client's address; without it, a process on this node. An address that is
        /// not one of this node's pods counts as a client on another host.
        #[arg(long)]
        from: Option<IpAddr>,
        #[command(flatten)]
        source: Source,
    },
}

#[derive(Subcommand, Debug, Clone, Copy)]
enum What {
    /// Frontends (address, port, protocol, scope) with their backends and policies.
    Services,
    /// Translated connections: client, frontend, backend, SNAT, state, idle time (eBPF
    /// packet path) or time to expiry (iptables mode: the conntrack table).
    Flows,
    /// ClientIP affinity entries: which client sticks to which backend (eBPF maps, or the
    /// iptables `recent` lists).
    Affinity,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Table,
    Json,
}

/// Where to read from.
#[derive(ClapArgs, Debug, Clone)]
pub struct Source {
    /// The daemon's metrics address (its --metrics-bind-address), for /debug/model.
    #[arg(long, global = true, default_value = "127.0.0.1:10249")]
    pub admin: String,
    /// Where the daemon pins its maps (its --bpf-pin-dir).
    #[arg(long, global = true, default_value = "/sys/fs/bpf/fastpath")]
    pub bpf_pin_dir: PathBuf,
    /// iptables mode: the network namespace (`/run/netns/NAME`) whose rules and conntrack
    /// table to read; default: the daemon's --netns, else this one.
    #[arg(long, global = true, value_name = "NAME", value_parser = crate::config::values::netns_name)]
    pub netns: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, global = true, value_enum, default_value = "table")]
    pub output: Output,
}

fn parse_proto(s: &str) -> Result<Protocol, String> {
    Protocol::from_k8s(Some(&s.to_ascii_uppercase()))
        .ok_or_else(|| format!("{s:?} is not tcp, udp or sctp"))
}

/// The model the daemon at `admin` runs with.
pub fn fetch_model(admin: &str) -> anyhow::Result<ModelDump> {
    let addr: SocketAddr = admin
        .parse()
        .with_context(|| format!("--admin {admin:?}"))?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("no fastpath daemon answers on {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /debug/model HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    // Bounded: a model of 10,000 services is a few MiB.
    s.take(256 << 20).read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").context("not an HTTP answer")?;
    let status = head.split(' ').nth(1).unwrap_or("");
    anyhow::ensure!(
        status == "200",
        "{addr}/debug/model answered {status}: {body}"
    );
    serde_json::from_str(body).context("decoding /debug/model")
}

/// `fastpath inspect ...` / `fastpath explain ...`; `argv` includes the program name.
pub fn main(argv: Vec<OsString>) -> ExitCode {
    let cli = Cli::parse_from(argv);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fastpath: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out)?;
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Inspect { what, source } => {
            let mut inputs = view::Inputs::read(&source)?;
            let json = source.output == Output::Json;
            match what {
                What::Services => {
                    let rows = view::services(&inputs)?;
                    if json {
                        print_json(&rows)?
                    } else {
                        print!("{}", view::services_table(&rows));
                        let ranges = inputs.model.as_ref().map(|m| &m.service_ranges);
                        if let Some(ranges) = ranges.filter(|r| !r.is_empty()) {
                            println!(
                                "service ranges: {} (an address in them that no Service holds is refused)",
                                ranges.join(", ")
                            );
                        }
                    }
                }
                What::Flows => {
                    let rows = flows::flows(&mut inputs)?;
                    if json {
                        print_json(&rows)?
                    } else {
                        print!("{}", flows::flows_table(&rows))
                    }
                }
                What::Affinity => {
                    let rows = flows::affinity(&mut inputs)?;
                    if json {
                        print_json(&rows)?
                    } else {
                        print!("{}", flows::affinity_table(&rows))
                    }
                }
            }
            for w in &inputs.warnings {
                eprintln!("note: {w}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Explain {
            proto,
            destination,
            from,
            source,
        } => {
            let model = fetch_model(&source.admin)?;
            // What is really programmed, to compare with the model's answer.
            let programmed = match model.mode.as_str() {
                "ebpf" => maps::PinnedMaps::open(&source.bpf_pin_dir)
                    .and_then(|m| m.frontends())
                    .ok(),
                "iptables" => {
                    let netns = source.netns.clone().or(model.context.netns.clone());
                    rules::read_node(netns.as_deref(), &model.context.iptables_backend)
                        .ok()
                        .map(|(r, _)| r.as_frontends())
                }
                "nftables" => {
                    let netns = source.netns.clone().or(model.context.netns.clone());
                    nft_rules::read(netns.as_deref())
                        .ok()
                        .map(|(r, _)| r.as_frontends())
                }
                _ => None,
            };
            let ex = explain::explain(&model, programmed.as_ref(), proto, destination, from);
            if source.output == Output::Json {
                print_json(&ex)?;
            } else {
                print!("{}", ex.text());
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
