//! Which dataplane to run, as kube-proxy's getProxyMode decides it: probe the node, take the
//! best mode it can run (eBPF, else nftables, else iptables, else userspace), and say why. A mode asked for
//! with `--proxy-mode` is checked the same way and refused with the reasons if the node
//! cannot run it.
//!
//! The probes are plain data ([`Probes`]) so that the decision ([`decide`]) is a pure
//! function tests can feed a node without BPF, or without iptables.
//!
//! Starting in one mode also removes what the others left behind ([`cleanup_leftovers`]),
//! as kube-proxy's CleanupLeftovers does: their iptables chains, our pinned BPF objects, and
//! the state of every mode of kube-proxy's (see [`super::leftovers`]).
//! eBPF programs need no cleanup: they are attached through links that die with us.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
};

use tracing::{info, warn};

use super::{
    iptables::{self, Family, Table, apply::Runner},
    leftovers, netns, nftables,
    userspace::portals,
};
pub use crate::config::mode::Mode;

/// Where fastpath would pin BPF objects; removed when another mode starts.
pub const BPF_PIN_DIR: &str = "/sys/fs/bpf/fastpath";
/// BPF links (attaching cgroup programs without flags) came in Linux 5.7.
pub const MIN_KERNEL_FOR_EBPF: (u32, u32) = (5, 7);
/// kube-proxy's nftables mode requires 5.13 (as a stand-in for nft 1.0.1 or later on the
/// host, kubernetes#122743); so do we.
pub const MIN_KERNEL_FOR_NFTABLES: (u32, u32) = (5, 13);
/// `-C` and `--wait` appeared in iptables 1.4.11; kube-proxy required it.
pub const MIN_IPTABLES: (u32, u32, u32) = (1, 4, 11);

/// What the node offers. `Err` holds why a probe failed, for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probes {
    /// The bpf(2) syscall works for us (a tiny hash map could be created).
    pub bpf_syscall: Result<(), String>,
    /// The kernel loads cgroup sock_addr programs.
    pub cgroup_sock_addr: Result<(), String>,
    /// The cgroup v2 to attach to, if any.
    pub cgroup2: Option<PathBuf>,
    /// (major, minor) of the running kernel, if it could be read.
    pub kernel: Option<(u32, u32)>,
    /// `iptables --version`, e.g. "iptables v1.8.9 (nf_tables)".
    pub iptables_version: Result<String, String>,
    /// iptables-restore accepts (in test mode) the matches the iptables proxier uses.
    pub iptables_matches: Result<(), String>,
    /// iptables-restore accepts (in test mode) the userspace proxier's REDIRECT.
    pub iptables_redirect: Result<(), String>,
    /// `nft -c` accepts (checks, never commits) a table using what the nftables proxier
    /// writes.
    pub nft_check: Result<(), String>,
}

impl Probes {
    /// A node that can run everything; tests take away what they need to.
    pub fn all_good() -> Probes {
        Probes {
            bpf_syscall: Ok(()),
            cgroup_sock_addr: Ok(()),
            cgroup2: Some(PathBuf::from("/sys/fs/cgroup")),
            kernel: Some((6, 1)),
            iptables_version: Ok("iptables v1.8.9 (nf_tables)".into()),
            iptables_matches: Ok(()),
            iptables_redirect: Ok(()),
            nft_check: Ok(()),
        }
    }

    /// Probes this node. `cgroup` overrides where to look for cgroup v2; `netns` is where
    /// the iptables modes would run. `want_bpf` false skips the BPF probes (a forced
    /// iptables or userspace mode need not touch bpf(2)).
    pub fn detect(cgroup: Option<&Path>, netns: Option<&str>, want_bpf: bool) -> Probes {
        let (bpf_syscall, cgroup_sock_addr) = if want_bpf {
            let map = match aya::sys::is_map_supported(aya::maps::MapType::Hash) {
                Ok(true) => Ok(()),
                Ok(false) => Err("the kernel does not create BPF hash maps".to_string()),
                Err(e) => Err(format!(
                    "the bpf() syscall failed: {e} (no CAP_BPF/CAP_SYS_ADMIN?)"
                )),
            };
            let prog = match &map {
                Err(e) => Err(e.clone()),
                Ok(()) => {
                    match aya::sys::is_program_supported(aya::programs::ProgramType::CgroupSockAddr)
                    {
                        Ok(true) => Ok(()),
                        Ok(false) => {
                            Err("the kernel does not support cgroup sock_addr programs".to_string())
                        }
                        Err(e) => Err(format!("probing cgroup sock_addr programs failed: {e}")),
                    }
                }
            };
            (map, prog)
        } else {
            let skipped = || Err("not probed".to_string());
            (skipped(), skipped())
        };
        let cgroup2 = match cgroup {
            Some(p) if p.is_dir() => Some(p.to_path_buf()),
            Some(_) => None,
            None => crate::config::cgroup2_mount(),
        };
        let runner = Runner::new(Family::V4, netns.map(str::to_string));
        let iptables_version = runner.version().map_err(|e| e.to_string());
        let test = |text: &str| -> Result<(), String> {
            let mut cmd = netns::command(netns, "iptables-restore");
            cmd.args(["--test", "--noflush"])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            let mut child = cmd
                .spawn()
                .map_err(|e| format!("cannot run iptables-restore: {e}"))?;
            if let Some(mut stdin) = child.stdin.take() {
                let _ = std::io::Write::write_all(&mut stdin, text.as_bytes());
            }
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "iptables-restore --test: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ))
            }
        };
        let (iptables_matches, iptables_redirect) = if iptables_version.is_ok() {
            (test(MATCHES_PROBE), test(REDIRECT_PROBE))
        } else {
            let e = iptables_version.clone().map(drop);
            (e.clone(), e)
        };
        Probes {
            bpf_syscall,
            cgroup_sock_addr,
            cgroup2,
            kernel: kernel_version(),
            iptables_version,
            iptables_matches,
            iptables_redirect,
            nft_check: nft_check(netns),
        }
    }
}

/// Checked, never committed: a table with what the nftables proxier writes (verdict maps
/// over concatenations, numgen, fib, dynamic sets with timeouts, masquerade, reject).
const NFT_PROBE: &str = "add table ip fastpath-probe
add map ip fastpath-probe m { type ipv4_addr . inet_proto . inet_service : verdict ; }
add set ip fastpath-probe a { type ipv4_addr ; flags dynamic,timeout ; timeout 10s ; }
add chain ip fastpath-probe e
add chain ip fastpath-probe n { type nat hook output priority -100 ; }
add chain ip fastpath-probe f { type filter hook output priority 0 ; }
add rule ip fastpath-probe n ip daddr . meta l4proto . th dport vmap @m
add rule ip fastpath-probe n fib daddr type local ip daddr != 127.0.0.0/8 jump e
add rule ip fastpath-probe e ip saddr @a goto e
add rule ip fastpath-probe e update @a { ip saddr }
add rule ip fastpath-probe e numgen random mod 2 0 goto e
add rule ip fastpath-probe e meta l4proto tcp dnat to 198.18.0.2:1
add rule ip fastpath-probe f ct state new reject
add chain ip fastpath-probe p { type nat hook postrouting priority 100 ; }
add rule ip fastpath-probe p mark and 0x4000 == 0 return
add rule ip fastpath-probe p masquerade fully-random
";

/// `nft -c -f -` of [`NFT_PROBE`] in `netns`.
fn nft_check(netns: Option<&str>) -> Result<(), String> {
    let mut cmd = netns::command(netns, "nft");
    cmd.args(["-c", "-f", "-"]);
    iptables::apply::run_bounded(cmd, Some(NFT_PROBE))
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Checked, never committed: every match and target the iptables proxier writes.
const MATCHES_PROBE: &str = "*nat
:FASTPATH-PROBE - [0:0]
-A FASTPATH-PROBE -m comment --comment \"probe\" -m tcp -p tcp -d 198.18.0.1 --dport 1 -m addrtype --dst-type LOCAL -m mark --mark 0x4000/0x4000 -m statistic --mode random --probability 0.5 -m recent --name FASTPATH-PROBE --rcheck --seconds 1 --reap -j DNAT --to-destination 198.18.0.2:1
-A FASTPATH-PROBE -j MASQUERADE --random-fully
-A FASTPATH-PROBE -j MARK --or-mark 0x4000
COMMIT
*filter
:FASTPATH-PROBE - [0:0]
-A FASTPATH-PROBE -m conntrack --ctstate NEW -j REJECT
COMMIT
";

const REDIRECT_PROBE: &str = "*nat
:FASTPATH-PROBE - [0:0]
-A FASTPATH-PROBE -m udp -p udp -d 198.18.0.1 --dport 1 -j REDIRECT --to-ports 2
COMMIT
";

fn kernel_version() -> Option<(u32, u32)> {
    // SAFETY: utsname is plain old data; uname fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: u is a valid, writable utsname.
    if unsafe { libc::uname(&mut u) } != 0 {
        return None;
    }
    // SAFETY: uname NUL-terminates release.
    let release = unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    parse_kernel_release(&release)
}

/// "6.1.0-18-amd64" -> (6, 1).
pub fn parse_kernel_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// "iptables v1.8.9 (nf_tables)" -> ((1, 8, 9), Some("nf_tables")).
pub fn parse_iptables_version(line: &str) -> Option<((u32, u32, u32), Option<String>)> {
    let v = line.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut nums = v.split('.').map(|n| n.parse::<u32>().ok());
    let version = (
        nums.next()??,
        nums.next()??,
        nums.next().flatten().unwrap_or(0),
    );
    let backend = line
        .find('(')
        .and_then(|i| line[i + 1..].split(')').next())
        .map(str::to_string);
    Some((version, backend))
}

/// Why the node cannot run `mode`; empty if it can.
pub fn blockers(mode: Mode, p: &Probes) -> Vec<String> {
    let mut why = Vec::new();
    match mode {
        Mode::Ebpf => {
            if let Err(e) = &p.bpf_syscall {
                why.push(format!("BPF unusable: {e}"));
            } else if let Err(e) = &p.cgroup_sock_addr {
                why.push(e.clone());
            }
            if p.cgroup2.is_none() {
                why.push("no cgroup v2 is mounted (or --cgroup-path is not a directory)".into());
            }
            match p.kernel {
                Some(k) if k < MIN_KERNEL_FOR_EBPF => why.push(format!(
                    "kernel {}.{} is older than {}.{} (BPF links)",
                    k.0, k.1, MIN_KERNEL_FOR_EBPF.0, MIN_KERNEL_FOR_EBPF.1
                )),
                Some(_) => {}
                None => why.push("cannot read the kernel version".into()),
            }
        }
        Mode::Nftables => {
            match p.kernel {
                Some(k) if k < MIN_KERNEL_FOR_NFTABLES => why.push(format!(
                    "kernel {}.{} is older than {}.{} (kube-proxy's nftables requirement)",
                    k.0, k.1, MIN_KERNEL_FOR_NFTABLES.0, MIN_KERNEL_FOR_NFTABLES.1
                )),
                Some(_) => {}
                None => why.push("cannot read the kernel version".into()),
            }
            if let Err(e) = &p.nft_check {
                why.push(format!("nft unusable: {e}"));
            }
        }
        Mode::Iptables => match &p.iptables_version {
            Err(e) => why.push(format!("iptables unusable: {e}")),
            Ok(line) => {
                match parse_iptables_version(line) {
                    Some((v, _)) if v < MIN_IPTABLES => why.push(format!(
                        "{line} is older than {}.{}.{}",
                        MIN_IPTABLES.0, MIN_IPTABLES.1, MIN_IPTABLES.2
                    )),
                    Some(_) => {}
                    None => why.push(format!("cannot read the iptables version from {line:?}")),
                }
                if let Err(e) = &p.iptables_matches {
                    why.push(format!(
                        "the kernel or iptables lacks a match the iptables proxier needs: {e}"
                    ));
                }
            }
        },
        Mode::Userspace => match (&p.iptables_version, &p.iptables_redirect) {
            (Err(e), _) => why.push(format!("iptables unusable (the portals need it): {e}")),
            (Ok(_), Err(e)) => why.push(format!("iptables REDIRECT unusable: {e}")),
            _ => {}
        },
    }
    why
}

/// The mode chosen and why, for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModeDecision {
    pub mode: Mode,
    pub reasons: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ModeError {
    #[error("--proxy-mode {mode} cannot run on this node: {}", reasons.join("; "))]
    Unavailable { mode: Mode, reasons: Vec<String> },
    #[error("no proxy mode can run on this node: {}", reasons.join("; "))]
    NothingWorks { reasons: Vec<String> },
}

/// kube-proxy's getProxyMode: the requested mode if the node can run it, else an error;
/// with none requested, the first of ebpf, nftables, iptables, userspace the node can run.
pub fn decide(requested: Option<Mode>, p: &Probes) -> Result<ModeDecision, ModeError> {
    if let Some(mode) = requested {
        let why = blockers(mode, p);
        return if why.is_empty() {
            Ok(ModeDecision {
                mode,
                reasons: vec![format!("{mode} was asked for (--proxy-mode)")],
            })
        } else {
            Err(ModeError::Unavailable { mode, reasons: why })
        };
    }
    let mut reasons = Vec::new();
    for mode in [Mode::Ebpf, Mode::Nftables, Mode::Iptables, Mode::Userspace] {
        let why = blockers(mode, p);
        if why.is_empty() {
            reasons.push(format!("{mode}: the node supports it"));
            return Ok(ModeDecision { mode, reasons });
        }
        reasons.extend(why.into_iter().map(|w| format!("not {mode}: {w}")));
    }
    Err(ModeError::NothingWorks { reasons })
}

/// Removes what modes other than `mode` left: our iptables-mode and userspace portal
/// chains (both families), every mode of kube-proxy's ([`leftovers`]: its nftables tables,
/// its IPVS virtual servers, `kube-ipvs0`, IPVS-mode chains and then ipsets), and our BPF
/// pins: those under `pin_dir` (`--bpf-pin-dir`), else the default folder, which only
/// without `netns` (it is node-wide, while a namespaced proxier is one of several). The
/// pinned links keep translating until they go, so a node moved off eBPF must lose them. Failures are logged, never fatal: a node without ip6tables, say, has nothing
/// to clean there. Blocks (tools, netlink): never call it on the async runtime.
pub fn cleanup_leftovers(mode: Mode, netns: Option<&str>, pin_dir: Option<&Path>) {
    match leftovers::nftables::remove_tables(netns) {
        Ok(gone) if gone.is_empty() => {}
        Ok(gone) => {
            info!(families = ?gone, "removed kube-proxy's nftables tables (its nftables mode)")
        }
        Err(e) => warn!("cannot remove kube-proxy's nftables tables: {e}"),
    }
    remove_ipvs_state(netns);
    if mode != Mode::Nftables {
        match nftables::apply::remove_tables(netns) {
            Ok(gone) if gone.is_empty() => {}
            Ok(gone) => info!(families = ?gone, "removed the nftables mode's tables"),
            Err(e) => warn!("cannot remove the nftables mode's tables: {e}"),
        }
    }

    type Pred = fn(Table, &str) -> bool;
    let mut what: Vec<(&str, Pred)> = Vec::new();
    if mode != Mode::Iptables {
        what.push(("iptables", iptables::render::is_our_chain));
        what.push(("kube-proxy IPVS", leftovers::is_ipvs_chain));
    } else {
        // The chains it shares with kube-proxy's IPVS mode our first sync rewrites.
        what.push(("kube-proxy IPVS", leftovers::is_ipvs_only_chain));
    }
    if mode != Mode::Userspace {
        what.push(("userspace", portals::is_userspace_chain));
    }
    for family in [Family::V4, Family::V6] {
        let runner = Runner::new(family, netns.map(str::to_string));
        if runner.version().is_err() {
            continue;
        }
        for (name, pred) in &what {
            match iptables::apply::remove_chains(&runner, pred) {
                Ok(0) => {}
                Ok(n) => info!(
                    ?family,
                    chains = n,
                    "removed the {name} mode's leftover chains"
                ),
                Err(e) => warn!(?family, "cannot remove the {name} mode's leftovers: {e}"),
            }
        }
        // Whatever still matches kube-proxy's ipsets would keep them alive.
        match leftovers::remove_set_rules(&runner) {
            Ok(0) => {}
            Ok(n) => info!(
                ?family,
                rules = n,
                "removed rules matching kube-proxy's ipsets"
            ),
            Err(e) => warn!(
                ?family,
                "cannot remove rules matching kube-proxy's ipsets: {e}"
            ),
        }
    }
    // Only now: a set that an iptables rule still matches cannot be destroyed.
    match leftovers::ipset::destroy(netns) {
        Ok(gone) if gone.is_empty() => {}
        Ok(gone) => info!(sets = ?gone, "removed kube-proxy's ipsets (its IPVS mode)"),
        Err(e) => warn!("cannot remove kube-proxy's ipsets: {e}"),
    }
    let pins = pin_dir
        .map(Path::to_path_buf)
        .or_else(|| netns.is_none().then(|| BPF_PIN_DIR.into()));
    if let Some(pins) = pins.filter(|p| mode != Mode::Ebpf && p.exists()) {
        match crate::dataplane::bpf::loader::remove_pinned(&pins) {
            Ok(()) => info!(pins = %pins.display(), "removed pinned BPF objects"),
            Err(e) => warn!(pins = %pins.display(), "cannot remove pinned BPF objects: {e}"),
        }
    }
}

/// kube-proxy's IPVS virtual servers and its dummy device: they keep translating service
/// addresses (to endpoints that may be long gone) until removed.
fn remove_ipvs_state(netns: Option<&str>) {
    use leftovers::ipvs::{self, Device, Flush};
    match ipvs::flush_virtual_servers(netns) {
        Ok(Flush::Flushed) => info!("flushed the IPVS table (kube-proxy's IPVS mode)"),
        // Said at every start: where IPVS state cannot exist, nobody need look for it.
        Ok(Flush::NoIpvs) => info!(
            "this kernel has no IPVS (ip_vs not loaded, no \"IPVS\" generic netlink family): \
             no virtual servers to clear"
        ),
        Err(e) => warn!("cannot flush the IPVS table: {e}"),
    }
    match ipvs::remove_dummy_device(netns) {
        Ok(Device::Absent) => {}
        Ok(Device::Deleted) => info!(
            device = ipvs::DUMMY_DEVICE,
            "removed kube-proxy's IPVS dummy device"
        ),
        Ok(Device::NotDummy(kind)) => warn!(
            device = ipvs::DUMMY_DEVICE,
            kind, "not a dummy device, so not kube-proxy's: left alone"
        ),
        Err(e) => warn!(
            device = ipvs::DUMMY_DEVICE,
            "cannot remove kube-proxy's IPVS device: {e}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capable_node_runs_ebpf() {
        let d = decide(None, &Probes::all_good()).unwrap();
        assert_eq!(d.mode, Mode::Ebpf);
    }

    #[test]
    fn without_the_bpf_syscall_nftables_is_chosen_and_the_reason_given() {
        let p = Probes {
            bpf_syscall: Err("EPERM".into()),
            ..Probes::all_good()
        };
        let d = decide(None, &p).unwrap();
        assert_eq!(d.mode, Mode::Nftables);
        assert!(
            d.reasons
                .iter()
                .any(|r| r.starts_with("not ebpf") && r.contains("EPERM")),
            "{:?}",
            d.reasons
        );
    }

    #[test]
    fn old_kernels_and_missing_cgroup2_rule_out_ebpf() {
        let p = Probes {
            kernel: Some((5, 4)),
            cgroup2: None,
            ..Probes::all_good()
        };
        let d = decide(None, &p).unwrap();
        assert_eq!(d.mode, Mode::Iptables);
        assert!(
            d.reasons
                .iter()
                .any(|r| r.contains("5.4 is older than 5.7")),
            "{:?}",
            d.reasons
        );
        assert!(
            d.reasons.iter().any(|r| r.contains("cgroup v2")),
            "{:?}",
            d.reasons
        );
    }

    #[test]
    fn without_the_matches_userspace_is_the_last_resort() {
        let p = Probes {
            bpf_syscall: Err("ENOSYS".into()),
            iptables_matches: Err("no statistic match".into()),
            nft_check: Err("nft: not found".into()),
            ..Probes::all_good()
        };
        assert_eq!(decide(None, &p).unwrap().mode, Mode::Userspace);
        let old = Probes {
            bpf_syscall: Err("ENOSYS".into()),
            iptables_version: Ok("iptables v1.4.7".into()),
            kernel: Some((5, 10)),
            ..Probes::all_good()
        };
        assert_eq!(decide(None, &old).unwrap().mode, Mode::Userspace);
    }

    #[test]
    fn nothing_usable_is_an_error_listing_every_reason() {
        let p = Probes {
            bpf_syscall: Err("ENOSYS".into()),
            iptables_version: Err("iptables: not found".into()),
            iptables_matches: Err("iptables: not found".into()),
            iptables_redirect: Err("iptables: not found".into()),
            nft_check: Err("nft: not found".into()),
            ..Probes::all_good()
        };
        let e = decide(None, &p).unwrap_err().to_string();
        assert!(
            e.contains("not ebpf")
                && e.contains("not nftables")
                && e.contains("not iptables")
                && e.contains("not userspace"),
            "{e}"
        );
    }

    #[test]
    fn a_forced_mode_is_checked_not_trusted() {
        let p = Probes {
            bpf_syscall: Err("EPERM".into()),
            ..Probes::all_good()
        };
        let e = decide(Some(Mode::Ebpf), &p).unwrap_err().to_string();
        assert!(
            e.contains("--proxy-mode ebpf cannot run") && e.contains("EPERM"),
            "{e}"
        );
        // Even though eBPF would work, iptables was asked for.
        assert_eq!(
            decide(Some(Mode::Iptables), &Probes::all_good())
                .unwrap()
                .mode,
            Mode::Iptables
        );
    }

    #[test]
    fn nftables_needs_kernel_5_13_and_a_working_nft_else_iptables() {
        let no_bpf = Probes {
            bpf_syscall: Err("EPERM".into()),
            ..Probes::all_good()
        };
        let old = Probes {
            kernel: Some((5, 10)),
            ..no_bpf.clone()
        };
        let d = decide(None, &old).unwrap();
        assert_eq!(d.mode, Mode::Iptables);
        assert!(
            d.reasons
                .iter()
                .any(|r| r.starts_with("not nftables") && r.contains("5.10 is older than 5.13")),
            "{:?}",
            d.reasons
        );
        let no_nft = Probes {
            nft_check: Err("Error: Could not process rule".into()),
            ..no_bpf
        };
        assert_eq!(decide(None, &no_nft).unwrap().mode, Mode::Iptables);
        let e = decide(Some(Mode::Nftables), &no_nft)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--proxy-mode nftables cannot run") && e.contains("nft unusable"),
            "{e}"
        );
        assert_eq!(
            decide(Some(Mode::Nftables), &Probes::all_good())
                .unwrap()
                .mode,
            Mode::Nftables
        );
    }

    #[test]
    fn versions_parse() {
        assert_eq!(parse_kernel_release("6.18.44-fc-v1045"), Some((6, 18)));
        assert_eq!(parse_kernel_release("5.7.0"), Some((5, 7)));
        assert_eq!(parse_kernel_release("garbage"), None);
        assert_eq!(
            parse_iptables_version("iptables v1.8.9 (nf_tables)"),
            Some(((1, 8, 9), Some("nf_tables".into())))
        );
        assert_eq!(
            parse_iptables_version("iptables v1.4.7"),
            Some(((1, 4, 7), None))
        );
        assert_eq!(parse_iptables_version("nonsense"), None);
        assert_eq!("IPTABLES".parse::<Mode>(), Ok(Mode::Iptables));
        assert!("ipvs".parse::<Mode>().is_err());
    }
}
