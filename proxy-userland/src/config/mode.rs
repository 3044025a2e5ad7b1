//! The proxy modes a user can ask for (`--proxy-mode`, the config file's `mode`). A leaf:
//! choosing and starting one is [`crate::dataplane::mode`]'s job.

use std::{fmt, str::FromStr};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Mode {
    Ebpf,
    Nftables,
    Iptables,
    Userspace,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Nftables => "nftables",
            Mode::Iptables => "iptables",
            Mode::Userspace => "userspace",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "ebpf" => Ok(Mode::Ebpf),
            "nftables" => Ok(Mode::Nftables),
            "iptables" => Ok(Mode::Iptables),
            "userspace" => Ok(Mode::Userspace),
            other => Err(format!(
                "unknown proxy mode {other:?} (ebpf, nftables, iptables or userspace)"
            )),
        }
    }
}
