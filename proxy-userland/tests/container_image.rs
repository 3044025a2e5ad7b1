//! The container image, built here (debootstrap base cached under target/image/, the test's
//! own binaries on top, so no second release build), runs the DaemonSet's command with the
//! DaemonSet's capabilities, seccomp profile, read-only root and mounts, in the test bed's
//! node namespace (as hostNetwork), and a Service works through it, in iptables mode (with
//! `fastpath inspect` reading the rules and conntrack inside the image) and in eBPF mode.
//! Skipped, saying why, where podman or debootstrap cannot run.

mod common;
mod nat_common;

use std::{path::Path, process::Command};

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

/// Removes the test's container and image, whatever happens.
struct Cleanup {
    podman: Podman,
    container: String,
    image: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = self
            .podman
            .command()
            .args(["rm", "-f", "-t", "2", &self.container])
            .output();
        let _ = Command::new("podman")
            .args(["rmi", "-f", &self.image])
            .output();
    }
}

#[test]
fn the_image_runs_the_daemonsets_command_and_a_service_works() {
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
    let name = format!("{}-fastpath", bed.id());
    let _cleanup = Cleanup {
        podman: podman.clone(),
        container: name.clone(),
        image: tag.clone(),
    };

    // The DaemonSet's container, as the manifest has it.
    let ds = yaml("daemonset.yaml");
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    let caps = strings(&sc["capabilities"]["add"]);
    let profile = deploy()
        .join("seccomp")
        .join(sc["seccompProfile"]["localhostProfile"].as_str().unwrap());
    let command = strings(&c["command"]);
    let args: Vec<String> = strings(&c["args"])
        .iter()
        .map(|a| a.replace("$(NODE_NAME)", "node-a"))
        .collect();

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
    let bpffs = Bpffs::mount(bed.dir());
    let lock = bed.dir().join("xtables.lock");
    std::fs::write(&lock, "").unwrap();

    // The DaemonSet's container; `extra` flags after its own.
    let container = |name: &str, extra: &[&str]| {
        let mut run = podman.command();
        run.args(["run", "-d", "--pull=never", "--name", name]);
        run.args(&podman.run);
        run.arg(format!("--network=ns:/run/netns/{}", bed.node_netns()));
        run.args([
            "--cap-drop=all",
            "--security-opt=no-new-privileges",
            "--read-only",
            "--tmpfs=/tmp",
        ]);
        for cap in &caps {
            run.arg(format!("--cap-add={cap}"));
        }
        run.arg(format!("--security-opt=seccomp={}", profile.display()));
        // The DaemonSet's mounts: config, bpffs, the cgroup (here the bed's client cgroup
        // stands for the host's root), the xtables lock.
        run.arg(format!("--volume={}:/etc/fastpath:ro", etc.display()));
        run.arg(format!("--volume={}:/sys/fs/bpf", bpffs.0.display()));
        run.arg(format!(
            "--volume={}:/host/sys/fs/cgroup",
            bed.cgroup_path().display()
        ));
        run.arg(format!("--volume={}:/run/xtables.lock", lock.display()));
        run.arg(format!("--entrypoint={}", command[0]));
        run.arg(&tag);
        run.args(&command[1..]).args(&args);
        // Test-only: Services from the file, no node-port devices in the bed.
        run.args([
            "--manifests=/etc/fastpath/web.yaml",
            "--nodeport-devices=none",
        ]);
        run.args(extra);
        run
    };

    // iptables mode first: once the eBPF programs are attached they stay pinned, and would
    // translate at the socket before the rules see a packet. The image has the tools
    // `inspect` reads the rules and the conntrack table with.
    nat_common::route_services(&bed);
    let ipt = format!("{}-fastpath-ipt", bed.id());
    let _ipt_cleanup = Cleanup {
        podman: podman.clone(),
        container: ipt.clone(),
        image: tag.clone(),
    };
    // Its rules go when it stops, so that what works afterwards is the eBPF mode's doing.
    let mut run = container(&ipt, &["--proxy-mode=iptables", "--cleanup-on-exit"]);
    xtask::cmd::output(&mut run).unwrap_or_else(|e| panic!("podman run: {e:#}"));
    let ipt_logs = || {
        let out = podman.command().args(["logs", &ipt]).output().unwrap();
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let works = || {
        let outcomes = tcp(&bed, WEB, 20);
        outcomes.iter().all(|o| o.is_ok()) && reached(&outcomes).len() == 2
    };
    assert!(
        eventually(30, works),
        "demo/web never worked through the iptables-mode container; logs:\n{}",
        ipt_logs()
    );
    let exec_json = |name: &str, what: &str| -> serde_json::Value {
        let out = podman
            .command()
            .args([
                "exec",
                name,
                "/usr/local/bin/fastpath",
                "inspect",
                what,
                "-o",
                "json",
            ])
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "inspect {what} in the image: {e}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
    };
    let rows = exec_json(&ipt, "services");
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
    let flows = exec_json(&ipt, "flows");
    assert!(
        flows
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["frontend"] == WEB && f["service"] == "demo/web:http"),
        "{flows:#}"
    );
    let _ = podman
        .command()
        .args(["rm", "-f", "-t", "2", &ipt])
        .output();

    // eBPF mode, as the DaemonSet runs it.
    let mut run = container(&name, &[]);
    let started = xtask::cmd::output(&mut run);
    let logs = || {
        let out = podman.command().args(["logs", &name]).output().unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    started.unwrap_or_else(|e| panic!("podman run: {e:#}"));

    let works = || {
        let outcomes = tcp(&bed, WEB, 20);
        outcomes.iter().all(|o| o.is_ok()) && reached(&outcomes).len() == 2
    };
    assert!(
        eventually(30, works),
        "demo/web never worked through the container; logs:\n{}",
        logs()
    );

    // The operator's tools work inside the image too.
    let out = podman
        .command()
        .args([
            "exec",
            &name,
            "/usr/local/bin/fastpath",
            "inspect",
            "services",
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.contains("198.19.0.10:80/TCP") && l.contains("demo/web:http")),
        "{table}"
    );
}
