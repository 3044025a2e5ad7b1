//! The capabilities deploy/daemonset.yaml gives the daemon are enough, and the measured
//! minimum is needed: the real binary runs under `setpriv` with exactly those capabilities
//! (bounding set; no new privileges, as allowPrivilegeEscalation: false) and a Service works.

mod common;
mod nat_common;

use std::{
    collections::BTreeSet,
    process::{Child, Command, Stdio},
    time::Duration,
};

use common::*;

/// The daemon under `setpriv`, killed on drop.
struct Confined {
    child: Child,
    log: std::path::PathBuf,
}

impl Confined {
    /// `prefix` (e.g. `ip netns exec NS`), then setpriv keeping only `caps`, then fastpath.
    fn start(bed: &xtask::testbed::Testbed, prefix: &[&str], caps: &[&str], args: &[&str]) -> Self {
        let log = bed.dir().join(format!("fastpath-{}.log", caps.join("-")));
        let keep: String = caps
            .iter()
            .map(|c| format!(",+{}", c.to_lowercase()))
            .collect();
        let setpriv = [
            "setpriv".to_string(),
            format!("--bounding-set=-all{keep}"),
            "--inh-caps=-all".into(),
            "--no-new-privs".into(),
            "--".into(),
        ];
        let mut argv: Vec<String> = prefix.iter().map(|s| s.to_string()).collect();
        argv.extend(setpriv);
        argv.extend(xtask::seccomp::prefix());
        argv.push(FASTPATH.into());
        argv.extend(
            [
                "--hostname-override",
                "node-a",
                "--nodeport-devices",
                "none",
                "--healthz-bind-address",
                "127.0.0.1:0",
                "--metrics-bind-address",
                "127.0.0.1:0",
            ]
            .map(String::from),
        );
        argv.extend(args.iter().map(|s| s.to_string()));
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
            .stderr(Stdio::from(
                std::fs::File::options().append(true).open(&log).unwrap(),
            ))
            .spawn()
            .expect("setpriv runs");
        Self { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The exit status, if it exits within `secs`.
    fn exited(&mut self, secs: u64) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + Duration::from_secs(secs);
        while std::time::Instant::now() < deadline {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }

    /// The effective capabilities of the running daemon, by name.
    fn effective_caps(&self) -> BTreeSet<String> {
        let status = std::fs::read_to_string(format!(
            "/proc/{}/status",
            xtask::seccomp::tracee(self.child.id())
        ))
        .unwrap();
        let hex = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .unwrap()
            .trim();
        let out = Command::new("capsh")
            .arg(format!("--decode={hex}"))
            .output()
            .unwrap();
        // "0x...=cap_net_admin,cap_bpf"
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .split_once('=')
            .map(|(_, list)| {
                list.split(',')
                    .map(|c| c.trim_start_matches("cap_").to_uppercase())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Confined {
    fn drop(&mut self) {
        let daemon = xtask::seccomp::tracee(self.child.id());
        if daemon != self.child.id() {
            // SAFETY: kill only takes integers and touches no memory of ours.
            unsafe { libc::kill(daemon as i32, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn web_works(bed: &xtask::testbed::Testbed) -> bool {
    let outcomes = tcp(bed, WEB, 20);
    outcomes.iter().all(|o| o.is_ok()) && reached(&outcomes).len() == 2
}

#[test]
fn ebpf_mode_runs_with_the_daemonsets_capabilities_and_needs_perfmon() {
    let caps = daemonset_caps();
    let (bed, _pods) = bed_with_pods("leastpriv", 2);
    let manifest = bed.dir().join("web.yaml");
    std::fs::write(&manifest, web_manifest(&[pod_ip(1), pod_ip(2)])).unwrap();
    let cgroup = bed.cgroup_path().to_str().unwrap().to_string();
    let args = [
        "--proxy-mode",
        "ebpf",
        "--cgroup-path",
        &cgroup,
        "--manifests",
        manifest.to_str().unwrap(),
    ];

    // The DaemonSet's set, and the measured minimum for eBPF mode.
    let minimum = ["BPF", "NET_ADMIN", "PERFMON"].map(String::from).to_vec();
    for set in [caps.clone(), minimum] {
        let names: Vec<&str> = set.iter().map(String::as_str).collect();
        let mut d = Confined::start(&bed, &[], &names, &args);
        assert!(
            eventually(20, || web_works(&bed)),
            "{set:?}: demo/web never worked; log:\n{}",
            d.log()
        );
        assert_eq!(
            d.exited(0),
            None,
            "{set:?}: the daemon exited; log:\n{}",
            d.log()
        );
        assert_eq!(
            d.effective_caps(),
            set.iter().cloned().collect(),
            "{set:?}: the daemon's CapEff"
        );
        drop(d);
    }

    // Without PERFMON the programs do not load: the measurement the manifest rests on.
    // (SYS_ADMIN would stand in for it, as the kernel still accepts it for PERFMON.)
    let mut d = Confined::start(&bed, &[], &["BPF", "NET_ADMIN"], &args);
    let status = d
        .exited(20)
        .unwrap_or_else(|| panic!("fastpath ran without PERFMON; log:\n{}", d.log()));
    let log = d.log();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("Permission denied"),
        "the verifier refused the programs: {log}"
    );
}

#[test]
fn iptables_mode_runs_with_net_admin_alone() {
    let (bed, _pods) = bed_with_pods("leastpriv-ipt", 2);
    nat_common::route_services(&bed);
    let manifest = bed.dir().join("web.yaml");
    std::fs::write(&manifest, web_manifest(&[pod_ip(1), pod_ip(2)])).unwrap();
    // In the node's namespace already (as hostNetwork): no setns, so no SYS_ADMIN.
    let prefix = ["ip", "netns", "exec", bed.node_netns()];
    let args = [
        "--proxy-mode",
        "iptables",
        "--manifests",
        manifest.to_str().unwrap(),
        "--cleanup-on-exit",
    ];
    let mut d = Confined::start(&bed, &prefix, &["NET_ADMIN"], &args);
    assert!(
        eventually(20, || web_works(&bed)),
        "demo/web never worked; log:\n{}",
        d.log()
    );
    assert_eq!(d.exited(0), None, "the daemon exited; log:\n{}", d.log());
    assert_eq!(
        d.effective_caps(),
        BTreeSet::from(["NET_ADMIN".to_string()])
    );
    // SIGTERM, so --cleanup-on-exit removes the chains from the bed's namespace.
    // SAFETY: kill only takes integers and touches no memory of ours (and the child, seen
    // running just above, is not reaped, so the pid is still its own).
    unsafe { libc::kill(xtask::seccomp::tracee(d.child.id()) as i32, libc::SIGTERM) };
    let _ = d.exited(10);
}
