//! The container image, built here (debootstrap base cached under target/image/, the test's
//! own binaries on top, so no second release build), runs the DaemonSet's command with the
//! DaemonSet's capabilities, seccomp profile, read-only root and mounts, in the test bed's
//! node namespace (as hostNetwork), and a Service works through it in every mode: iptables
//! (with `fastpath inspect` and `explain` reading the rules and conntrack inside the image),
//! userspace and eBPF, each stopped by SIGTERM, then `fastpath --cleanup`.
//!
//! The seccomp profile is deploy/seccomp/fastpath.json with one change: a call outside its
//! list kills the caller (SCMP_ACT_KILL_PROCESS) instead of failing with EPERM, so no refusal
//! can hide behind an error path that carries on. After every step the test looks for such a
//! death: the container's exit status, SIGSYS in the daemon's log (a tool it ran), and the
//! kernel's seccomp records. The same run with bpf(2) taken off the list shows that check fail.
//! Skipped, saying why, where podman or debootstrap cannot run.

mod common;
mod nat_common;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use common::*;
use xtask::image::{self, Podman};

fn deploy() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn yaml(file: &str) -> serde_json::Value {
    serde_saphyr::from_str(&std::fs::read_to_string(deploy().join(file)).unwrap()).unwrap()
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|s| s.iter().map(|x| x.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// Removes the test's containers and image, whatever happens.
struct Cleanup {
    podman: Podman,
    containers: Vec<String>,
    image: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for container in &self.containers {
            let _ = self
                .podman
                .command()
                .args(["rm", "-f", "-t", "2", container])
                .output();
        }
        let _ = Command::new("podman")
            .args(["rmi", "-f", &self.image])
            .output();
    }
}

/// `shipped` (the DaemonSet's profile), refusing by killing the caller, and without the
/// calls in `without`; written beside the bed's files.
fn loud_profile(shipped: &Path, dir: &Path, without: &[&str]) -> PathBuf {
    let mut profile: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(shipped).unwrap()).unwrap();
    assert_eq!(
        profile["defaultAction"], "SCMP_ACT_ERRNO",
        "the shipped profile refuses what it does not list"
    );
    profile["defaultAction"] = "SCMP_ACT_KILL_PROCESS".into();
    for rule in profile["syscalls"].as_array_mut().unwrap() {
        let names = rule["names"].as_array_mut().unwrap();
        names.retain(|n| !without.contains(&n.as_str().unwrap()));
    }
    let path = dir.join(format!("seccomp-without-{}.json", without.join("-")));
    std::fs::write(&path, profile.to_string()).unwrap();
    path
}

/// The kernel's seccomp records (audit type 1326: who, which call) from `since` lines on.
fn kernel_seccomp_records(since: usize) -> Vec<String> {
    let out = Command::new("dmesg")
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    String::from_utf8_lossy(&out)
        .lines()
        .skip(since)
        .filter(|l| l.contains("type=1326"))
        .map(String::from)
        .collect()
}

fn kernel_log_lines() -> usize {
    let out = Command::new("dmesg")
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    String::from_utf8_lossy(&out).lines().count()
}

/// The daemon's node: the bed, the image and the DaemonSet's container spec.
struct Node {
    podman: Podman,
    tag: String,
    caps: Vec<String>,
    command: Vec<String>,
    args: Vec<String>,
    etc: PathBuf,
    bpffs: Bpffs,
    lock: PathBuf,
    /// The kernel log's length when the test began.
    kernel_mark: usize,
    /// Last, so that it goes after the bpffs mounted in its folder.
    bed: xtask::testbed::Testbed,
}

impl Node {
    /// `podman run` of the DaemonSet's container under `profile`, running `argv` (the
    /// DaemonSet's command and args when None) plus `extra`.
    fn run(
        &self,
        name: &str,
        profile: &Path,
        detach: bool,
        argv: Option<&[&str]>,
        extra: &[&str],
    ) -> Command {
        let mut run = self.podman.command();
        run.args(["run", "--pull=never", "--name", name]);
        if detach {
            run.arg("-d");
        }
        run.args(&self.podman.run);
        run.arg(format!("--network=ns:/run/netns/{}", self.bed.node_netns()));
        run.args([
            "--cap-drop=all",
            "--security-opt=no-new-privileges",
            "--read-only",
            "--tmpfs=/tmp",
        ]);
        for cap in &self.caps {
            run.arg(format!("--cap-add={cap}"));
        }
        run.arg(format!("--security-opt=seccomp={}", profile.display()));
        // The DaemonSet's mounts: config, bpffs, the cgroup (here the bed's client cgroup
        // stands for the host's root), the xtables lock.
        run.arg(format!("--volume={}:/etc/fastpath:ro", self.etc.display()));
        run.arg(format!("--volume={}:/sys/fs/bpf", self.bpffs.0.display()));
        run.arg(format!(
            "--volume={}:/host/sys/fs/cgroup",
            self.bed.cgroup_path().display()
        ));
        run.arg(format!(
            "--volume={}:/run/xtables.lock",
            self.lock.display()
        ));
        run.arg(format!("--entrypoint={}", self.command[0]));
        run.arg(&self.tag);
        match argv {
            Some(argv) => {
                run.args(argv);
            }
            None => {
                run.args(&self.command[1..]).args(&self.args);
                // Test-only: Services from the file, no node-port devices in the bed.
                run.args([
                    "--manifests=/etc/fastpath/web.yaml",
                    "--nodeport-devices=none",
                ]);
            }
        }
        run.args(extra);
        run
    }

    /// The DaemonSet's container, started in the background.
    fn start(&self, name: &str, profile: &Path, extra: &[&str]) {
        let mut run = self.run(name, profile, true, None, extra);
        xtask::cmd::output(&mut run).unwrap_or_else(|e| panic!("podman run: {e:#}"));
    }

    fn logs(&self, name: &str) -> String {
        let out = self.podman.command().args(["logs", name]).output().unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// "true 0" while running, "false CODE" after.
    fn state(&self, name: &str) -> String {
        let out = self
            .podman
            .command()
            .args([
                "inspect",
                "-f",
                "{{.State.Running}} {{.State.ExitCode}}",
                name,
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// What shows that the profile refused a call in container `name`: its process killed
    /// by SIGSYS (exit 159), a tool it ran killed (its log), the kernel's records.
    fn refusals(&self, name: &str) -> Option<String> {
        let state = self.state(name);
        let logs = self.logs(name);
        let kernel = kernel_seccomp_records(self.kernel_mark);
        let killed = state.ends_with(" 159")
            || ["SIGSYS", "signal: 31", "Bad system call"]
                .iter()
                .any(|s| logs.contains(s))
            || !kernel.is_empty();
        killed.then(|| {
            format!(
                "a system call outside deploy/seccomp/fastpath.json was refused in {name} \
                 (state {state}); kernel records:\n{}\nlogs:\n{logs}",
                kernel.join("\n")
            )
        })
    }

    fn assert_no_refusal(&self, name: &str) {
        if let Some(report) = self.refusals(name) {
            panic!("{report}");
        }
    }

    /// SIGTERM, as the kubelet stops a pod: the daemon shuts down cleanly under the profile.
    fn stop(&self, name: &str) {
        let _ = self
            .podman
            .command()
            .args(["stop", "-t", "10", name])
            .output();
        self.assert_no_refusal(name);
        assert_eq!(
            self.state(name),
            "false 0",
            "{name} stops cleanly on SIGTERM:\n{}",
            self.logs(name)
        );
    }

    /// `fastpath ARGS` by `podman exec` (the container's profile applies), its stdout.
    fn exec(&self, name: &str, args: &[&str]) -> String {
        let out = self
            .podman
            .command()
            .args(["exec", name, "/usr/local/bin/fastpath"])
            .args(args)
            .output()
            .unwrap();
        self.assert_no_refusal(name);
        assert!(
            out.status.success(),
            "fastpath {args:?} in the image: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn exec_json(&self, name: &str, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = self.exec(name, &all);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    }

    fn works(&self) -> bool {
        let outcomes = tcp(&self.bed, WEB, 20);
        outcomes.iter().all(|o| o.is_ok()) && reached(&outcomes).len() == 2
    }

    /// A Service works through container `name` within 30 s, with no call refused.
    fn assert_service_works(&self, name: &str) {
        let worked = eventually(30, || self.works() || self.refusals(name).is_some());
        self.assert_no_refusal(name);
        assert!(
            worked,
            "demo/web never worked through {name}; logs:\n{}",
            self.logs(name)
        );
        // Every tool the mode calls is in the image (the image once lacked `ip`, and the
        // fallback modes could not read the node's addresses).
        let logs = self.logs(name);
        assert!(
            !logs.contains("cannot run `"),
            "{name} calls a tool the image lacks:\n{logs}"
        );
    }
}

#[test]
fn the_image_runs_the_daemonsets_command_under_its_seccomp_profile_in_every_mode() {
    let target = xtask::target_dir();
    if let Err(e) = image::build_base(&target) {
        eprintln!("SKIPPED: cannot build the image's base here: {e:#}");
        return;
    }
    let podman = match Podman::find() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIPPED: {e:#}");
            return;
        }
    };
    let tag = format!("localhost/fastpath:test-{}", std::process::id());
    image::build_image(&target, &image::bin_dir(FASTPATH), &tag).expect("the image builds");

    let (bed, _pods) = bed_with_pods("image", 2);
    let names =
        ["ipt", "nft", "us", "ebpf", "cleanup", "nobpf"].map(|m| format!("{}-fp-{m}", bed.id()));
    let [ipt, nft, us, ebpf, cleanup, nobpf] = &names;
    let _cleanup = Cleanup {
        podman: podman.clone(),
        containers: names.to_vec(),
        image: tag.clone(),
    };

    // The DaemonSet's container, as the manifest has it.
    let ds = yaml("daemonset.yaml");
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    let shipped = deploy()
        .join("seccomp")
        .join(sc["seccompProfile"]["localhostProfile"].as_str().unwrap());

    // /etc/fastpath: the ConfigMap's config, plus the test's Services (no cluster here).
    let etc = bed.dir().join("etc");
    std::fs::create_dir_all(&etc).unwrap();
    let cm = yaml("configmap.yaml");
    std::fs::write(
        etc.join("config.yaml"),
        cm["data"]["config.yaml"].as_str().unwrap(),
    )
    .unwrap();
    std::fs::write(etc.join("web.yaml"), web_manifest(&[pod_ip(1), pod_ip(2)])).unwrap();
    let profile = loud_profile(&shipped, bed.dir(), &[]);
    let lock = bed.dir().join("xtables.lock");
    std::fs::write(&lock, "").unwrap();
    let node = Node {
        podman,
        bpffs: Bpffs::mount(bed.dir()),
        tag,
        caps: strings(&sc["capabilities"]["add"]),
        command: strings(&c["command"]),
        args: strings(&c["args"])
            .iter()
            .map(|a| a.replace("$(NODE_NAME)", "node-a"))
            .collect(),
        etc,
        lock,
        kernel_mark: kernel_log_lines(),
        bed,
    };

    // iptables mode first: once the eBPF programs are attached they stay pinned, and would
    // translate at the socket before the rules see a packet. The image has the tools
    // `inspect` and `explain` read the rules and the conntrack table with. Its rules go when
    // it stops, so that what works afterwards is the next mode's doing.
    nat_common::route_services(&node.bed);
    node.start(
        ipt,
        &profile,
        &["--proxy-mode=iptables", "--cleanup-on-exit"],
    );
    node.assert_service_works(ipt);
    let rows = node.exec_json(ipt, &["inspect", "services"]);
    let web = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["frontend"] == "198.19.0.10:80/TCP")
        .unwrap_or_else(|| panic!("{rows:#}"));
    assert!(
        web["chain"].as_str().unwrap().starts_with("KUBE-SVC-"),
        "{web:#}"
    );
    assert_eq!(web["backends"].as_array().unwrap().len(), 2, "{web:#}");
    assert_eq!(web["in_sync"], true, "{web:#}");
    let flows = node.exec_json(ipt, &["inspect", "flows"]);
    assert!(
        flows
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["frontend"] == WEB && f["service"] == "demo/web:http"),
        "{flows:#}"
    );
    let verdict = node.exec(ipt, &["explain", "tcp", WEB]);
    assert!(verdict.contains("demo/web"), "{verdict}");
    node.stop(ipt);

    // The nftables mode, which the automatic choice takes where eBPF cannot run.
    node.start(
        nft,
        &profile,
        &["--proxy-mode=nftables", "--cleanup-on-exit"],
    );
    node.assert_service_works(nft);
    let logs = node.logs(nft);
    assert!(logs.contains(r#""mode":"nftables""#), "{logs}");
    let verdict = node.exec(nft, &["explain", "tcp", WEB]);
    assert!(verdict.contains("demo/web"), "{verdict}");
    node.stop(nft);

    // The userspace mode: relays in the node namespace behind the portal rules.
    node.start(
        us,
        &profile,
        &["--proxy-mode=userspace", "--cleanup-on-exit"],
    );
    node.assert_service_works(us);
    node.stop(us);

    // eBPF mode, as the DaemonSet runs it.
    node.start(ebpf, &profile, &[]);
    node.assert_service_works(ebpf);
    // The operator's tools work inside the image too.
    let table = node.exec(ebpf, &["inspect", "services"]);
    assert!(
        table
            .lines()
            .any(|l| l.contains("198.19.0.10:80/TCP") && l.contains("demo/web:http")),
        "{table}"
    );
    let verdict = node.exec(ebpf, &["explain", "tcp", WEB]);
    assert!(verdict.contains("demo/web"), "{verdict}");
    node.stop(ebpf);

    // What `fastpath --cleanup` does when fastpath leaves the node: the pins go.
    let mut run = node.run(
        cleanup,
        &profile,
        false,
        Some(&["--cleanup", "--bpf-pin-dir=/sys/fs/bpf/fastpath"]),
        &[],
    );
    let cleaned = run.output().unwrap();
    node.assert_no_refusal(cleanup);
    assert!(
        cleaned.status.success(),
        "--cleanup: {}",
        String::from_utf8_lossy(&cleaned.stderr)
    );
    assert!(
        eventually(3, || !tcp(&node.bed, WEB, 1)[0].is_ok()),
        "nothing translates after --cleanup"
    );

    // The check above is not blind: without bpf(2) on the list, the eBPF mode's first map
    // is refused, and the test says so.
    let profile = loud_profile(&shipped, node.bed.dir(), &["bpf"]);
    node.start(nobpf, &profile, &["--proxy-mode=ebpf"]);
    assert!(
        eventually(10, || node.state(nobpf).starts_with("false")),
        "the daemon without bpf(2) kept running:\n{}",
        node.logs(nobpf)
    );
    let report = node
        .refusals(nobpf)
        .expect("a refused bpf(2) goes unnoticed");
    eprintln!("how a refused call is reported:\n{report}");
    assert!(report.contains("(state false 159)"), "{report}");
}
