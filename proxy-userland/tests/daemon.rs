//! The `fastpath` binary end to end: manifests in a folder, the daemon programming them into
//! the kernel, following edits, surviving a malformed manifest, and leaving nothing behind
//! when it stops.

mod common;

use std::path::PathBuf;

use common::*;

const BROKEN: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: broken, namespace: demo}
spec:
  clusterIP: 198.19.0.20
  ports:
  - {name: http, port: 70000, protocol: TCP}
"#;

fn our_programs() -> Vec<String> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter_map(|p| p.name_as_str().map(str::to_string))
        .filter(|n| n.starts_with("fp_"))
        .collect()
}

fn our_maps() -> Vec<String> {
    aya::maps::loaded_maps()
        .filter_map(Result::ok)
        .filter_map(|m| m.name_as_str().map(str::to_string))
        .filter(|n| n.starts_with("FP_"))
        .collect()
}

#[test]
fn daemon_follows_manifests_survives_bad_ones_and_cleans_up() {
    let (bed, _pods) = bed_with_pods("daemon", 3);
    let dir = std::env::temp_dir().join(format!("fastpath-daemon-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    struct RmDir(PathBuf);
    impl Drop for RmDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = RmDir(dir.clone());
    std::fs::write(
        dir.join("web.yaml"),
        web_manifest(&[pod_ip(1), pod_ip(2), pod_ip(3)]),
    )
    .unwrap();
    std::fs::write(dir.join("broken.yaml"), BROKEN).unwrap();

    let mut daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            dir.to_str().unwrap(),
            "--manifest-poll-period",
            "100ms",
        ],
    );
    assert!(
        eventually(20, || tcp(&bed, "198.19.0.10:80", 1)[0].is_ok()),
        "the ClusterIP never became reachable; log:\n{}",
        daemon.log()
    );
    assert_eq!(reached(&tcp(&bed, "198.19.0.10:80", 60)).len(), 3);

    // The malformed service is reported by name, and did not stop anything else.
    let log = daemon.log();
    assert!(
        log.contains("demo/broken") && log.contains("70000"),
        "log:\n{log}"
    );

    // pod-3 leaves the slice: new connections stop reaching it.
    std::fs::write(dir.join("web.yaml"), web_manifest(&[pod_ip(1), pod_ip(2)])).unwrap();
    assert!(
        eventually(10, || !reached(&tcp(&bed, "198.19.0.10:80", 30))
            .contains("pod-3")),
        "pod-3 still reached after removal; log:\n{}",
        daemon.log()
    );

    assert!(
        !our_programs().is_empty(),
        "programs are loaded while running"
    );
    let status = daemon.stop();
    assert!(
        status.success(),
        "clean exit on SIGTERM: {status:?}\n{}",
        daemon.log()
    );
    // The kernel frees programs and maps from RCU callbacks and a work queue once the last
    // reference goes: give it a moment, not forever.
    assert!(
        eventually(5, || our_programs().is_empty()),
        "programs left behind: {:?}",
        our_programs()
    );
    assert!(
        eventually(5, || our_maps().is_empty()),
        "maps left behind: {:?}",
        our_maps()
    );
    assert!(
        !tcp(&bed, "198.19.0.10:80", 1)[0].is_ok(),
        "no translation after shutdown"
    );
}
