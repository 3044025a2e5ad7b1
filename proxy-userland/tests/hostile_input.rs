//! Hostile input through the real `fastpath` binary: every bad flag and config file exits 2
//! at once with a message naming the flag or field, and nothing panics; hostile manifests
//! are refused one by one while the rest of the folder still programs.

mod common;

use std::{
    path::PathBuf,
    process::Stdio,
    time::{Duration, Instant},
};

use common::*;

/// A temp folder removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("fastpath-hostile-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `fastpath` with safe settings first and `args` last (the last occurrence of a flag
/// wins), so that input wrongly accepted starts nothing harmful: no admin servers, no
/// packet programs, a cgroup that does not exist. Returns (exit code, stderr, run time);
/// a run that outlives 20 s is killed and reported as such.
fn run(args: &[&str]) -> (Option<i32>, String, Duration) {
    let err = tempfile_path("stderr");
    let started = Instant::now();
    let mut child = xtask::seccomp::command(FASTPATH)
        .args(["--healthz-bind-address", "", "--metrics-bind-address", ""])
        .args([
            "--nodeport-devices",
            "none",
            "--cgroup-path",
            "/nonexistent/fastpath-test",
        ])
        .args(["--manifests", "/nonexistent/fastpath-test"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&err).unwrap()))
        .spawn()
        .expect("fastpath starts");
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    let _ = std::fs::remove_file(&err);
    (code, stderr, started.elapsed())
}

fn tempfile_path(what: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!(
        "fastpath-hostile-{}-{n}.{what}",
        std::process::id()
    ))
}

/// Every case must exit 2 within 5 s, say `field`, and not panic.
fn assert_refused(what: &str, args: &[&str], field: &str) -> Vec<String> {
    let (code, stderr, took) = run(args);
    let mut problems = Vec::new();
    if code != Some(2) {
        problems.push(format!("{what}: exit {code:?}, want 2"));
    }
    if !stderr.contains(field) {
        problems.push(format!("{what}: the message does not name {field:?}"));
    }
    if stderr.contains("panicked") {
        problems.push(format!("{what}: panicked"));
    }
    if took > Duration::from_secs(5) {
        problems.push(format!("{what}: took {took:?}"));
    }
    if !problems.is_empty() {
        problems.push(format!("  stderr: {}", stderr.trim()));
    }
    problems
}

#[test]
fn hostile_flags_exit_2_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["--sync-period", "300000000000y"], "--sync-period"),
        (&["--sync-period=-5s"], "--sync-period"),
        (&["--sync-period", "0s"], "--sync-period"),
        (
            &["--min-sync-period", "99999999999999999999s"],
            "--min-sync-period",
        ),
        (
            &["--min-sync-period", "2m", "--sync-period", "1m"],
            "--min-sync-period",
        ),
        (
            &["--manifest-poll-period", "366d"],
            "--manifest-poll-period",
        ),
        (&["--manifest-poll-period", "0s"], "--manifest-poll-period"),
        (
            &["--conntrack-tcp-timeout-established", "500ms"],
            "--conntrack-tcp-timeout-established",
        ),
        (
            &["--conntrack-tcp-timeout-close-wait", "forever"],
            "--conntrack-tcp-timeout-close-wait",
        ),
        (&["--log-level", "verbose???"], "--log-level"),
        (&["--log-level", "info,x=loud"], "--log-level"),
        (&["--log-level", ""], "--log-level"),
        (&["--log-format", "xml"], "--log-format"),
        (&["--netns", "../../etc"], "--netns"),
        (&["--netns", ".."], "--netns"),
        (&["--netns", ""], "--netns"),
        (&["--oom-score-adj", "-1001"], "--oom-score-adj"),
        (&["--oom-score-adj", "99999999999"], "--oom-score-adj"),
        (
            &["--iptables-masquerade-bit", "32"],
            "--iptables-masquerade-bit",
        ),
        (&["--bpf-lb-map-max", "0"], "--bpf-lb-map-max"),
        (&["--conntrack-min=-1"], "--conntrack-min"),
        (
            &["--conntrack-max-per-core", "4294967296"],
            "--conntrack-max-per-core",
        ),
        (
            &["--healthz-bind-address", "0.0.0.0:70000"],
            "--healthz-bind-address",
        ),
        (
            &["--metrics-bind-address", "localhost:10249"],
            "--metrics-bind-address",
        ),
        (
            &["--healthcheck-bind-address", "::ffff::1::"],
            "--healthcheck-bind-address",
        ),
        (&["--bind-address", "198.18.0.256"], "--bind-address"),
        (&["--cluster-cidr", "198.18.0.0/33"], "--cluster-cidr"),
        (
            &["--cluster-cidr", "198.18.0.0/16,198.19.0.0/16"],
            "--cluster-cidr",
        ),
        (
            &[
                "--cluster-cidr",
                "198.18.0.0/16,2001:db8::/64,2001:db8:1::/64",
            ],
            "--cluster-cidr",
        ),
        (
            &["--service-cluster-ip-range", "198.19.0.0/33"],
            "--service-cluster-ip-range",
        ),
        (
            &["--service-cluster-ip-range", "198.19.0.0/16,198.18.0.0/24"],
            "--service-cluster-ip-range",
        ),
        (
            &["--nodeport-addresses", "everything"],
            "--nodeport-addresses",
        ),
        (&["--nodeport-devices", "../eth0"], "--nodeport-devices"),
        (
            &["--nodeport-devices", "averyveryverylongname"],
            "--nodeport-devices",
        ),
        (&["--hostname-override", "Node_A!"], "--hostname-override"),
        (&["--zone=-zone-"], "--zone"),
        (&["--service-proxy-name", "a b"], "--service-proxy-name"),
        (&["--master", "not a url"], "--master"),
        (&["--master", "ftp://198.18.0.1"], "--master"),
        (&["--detect-local-mode", "Magic"], "--detect-local-mode"),
        (&["--proxy-mode", "ipvs"], "--proxy-mode"),
        (&["--iptables-backend", "magic"], "--iptables-backend"),
        (&["--manifests", ""], "--manifests"),
        (&["--kubeconfig", ""], "--kubeconfig"),
        (
            &["--config", "/nonexistent/fastpath.yaml"],
            "/nonexistent/fastpath.yaml",
        ),
    ];
    let problems: Vec<String> = cases
        .iter()
        .flat_map(|(args, field)| assert_refused(&format!("{args:?}"), args, field))
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

#[test]
fn hostile_config_files_exit_2_naming_the_field() {
    let dir = TempDir::new("config");
    let nested = format!("featureGates: {}", "[".repeat(100_000));
    let big = format!("featureGates: {{a: \"{}\"}}\n", "x".repeat(2 << 20));
    let mut laughs = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..12 {
        let prev = format!("*a{}", i - 1);
        laughs.push_str(&format!(
            "a{i}: &a{i} [{}]\n",
            [prev.as_str(); 10].join(", ")
        ));
    }
    let laughs = format!(
        "featureGates:\n{}",
        laughs
            .lines()
            .map(|l| format!("  {l}\n"))
            .collect::<String>()
    );
    let cases: &[(String, &str)] = &[
        ("syncPeriod: 300000000000y\n".into(), "syncPeriod"),
        (
            "iptables: {syncPeriod: 300000000000y}\n".into(),
            "iptables.syncPeriod",
        ),
        (
            "iptables: {minSyncPeriod: 9999999999999999999999h}\n".into(),
            "iptables.minSyncPeriod",
        ),
        ("minSyncPeriod: -1s\n".into(), "minSyncPeriod"),
        (
            "fastpath: {logLevel: 'verbose???'}\n".into(),
            "fastpath.logLevel",
        ),
        (
            "fastpath: {manifestPollPeriod: 300000000000y}\n".into(),
            "fastpath.manifestPollPeriod",
        ),
        ("fastpath: {zone: 'a b'}\n".into(), "fastpath.zone"),
        (
            "fastpath: {serviceProxyName: '-x'}\n".into(),
            "fastpath.serviceProxyName",
        ),
        (
            "fastpath: {manifests: \"a\\0b\"}\n".into(),
            "fastpath.manifests",
        ),
        (
            "fastpath: {healthcheckBindAddress: everywhere}\n".into(),
            "fastpath.healthcheckBindAddress",
        ),
        ("oomScoreAdj: 99999999999\n".into(), "oomScoreAdj"),
        ("oomScoreAdj: 1001\n".into(), "oomScoreAdj"),
        (
            "conntrack: {maxPerCore: -1}\n".into(),
            "conntrack.maxPerCore",
        ),
        (
            "conntrack: {tcpEstablishedTimeout: 500ms}\n".into(),
            "conntrack.tcpEstablishedTimeout",
        ),
        (
            "conntrack: {tcpCloseWaitTimeout: 300000000000y}\n".into(),
            "conntrack.tcpCloseWaitTimeout",
        ),
        (
            "healthzBindAddress: 0.0.0.0:99999\n".into(),
            "healthzBindAddress",
        ),
        ("metricsBindAddress: '[::1'\n".into(), "metricsBindAddress"),
        ("bindAddress: 198.18.0.256\n".into(), "bindAddress"),
        (
            "clusterCIDR: 198.18.0.0/16,198.19.0.0/16\n".into(),
            "clusterCIDR",
        ),
        (
            "nodePortAddresses: [198.18.0.0/40]\n".into(),
            "nodePortAddresses",
        ),
        ("hostnameOverride: ../../etc\n".into(), "hostnameOverride"),
        (
            "iptables: {masqueradeBit: 99}\n".into(),
            "iptables.masqueradeBit",
        ),
        ("logging: {verbosity: -1}\n".into(), "logging.verbosity"),
        ("logging: {format: xml}\n".into(), "logging.format"),
        ("mode: ipvs\n".into(), "mode"),
        ("detectLocalMode: Magic\n".into(), "detectLocalMode"),
        (
            "clientConnection: {kubeconfig: \"\\0\"}\n".into(),
            "clientConnection.kubeconfig",
        ),
        ("syncPeriod: [1, 2]\n".into(), "syncPeriod"),
        ("healthzBindAdress: 0.0.0.0:1\n".into(), "healthzBindAdress"),
        (nested, "config file"),
        (big, "config file"),
        (laughs, "config file"),
    ];
    let mut problems = Vec::new();
    for (i, (body, field)) in cases.iter().enumerate() {
        let path = dir.0.join(format!("{i}.yaml"));
        std::fs::write(&path, format!("{HEADER}{body}")).unwrap();
        let what = format!("config {:?}", body.chars().take(60).collect::<String>());
        problems.extend(assert_refused(
            &what,
            &["--config", path.to_str().unwrap()],
            field,
        ));
    }
    // Not YAML at all, and not a file.
    let binary = dir.0.join("binary.yaml");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x01]).unwrap();
    problems.extend(assert_refused(
        "binary config",
        &["--config", binary.to_str().unwrap()],
        "binary.yaml",
    ));
    problems.extend(assert_refused(
        "folder as config",
        &["--config", dir.0.to_str().unwrap()],
        "config file",
    ));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// kube-apiserver's "invalid publicIPs localhost" applied to the cluster IP, through the
/// daemon: a manifest giving a service ClusterIP 127.0.0.1 is refused with its name and
/// field, so connections from the node's processes to 127.0.0.1:9 stay local, while a valid
/// service in the same folder works, and so does the folder next to a hostile file of
/// 100,000 nested `[` (refused at once instead of blocking the load for a minute).
#[test]
fn loopback_cluster_ip_is_refused_and_the_rest_of_the_folder_programs() {
    let (bed, _pods) = bed_with_pods("hostile", 2);
    let dir = TempDir::new("manifests");
    std::fs::write(
        dir.0.join("web.yaml"),
        web_manifest(&[pod_ip(1), pod_ip(2)]),
    )
    .unwrap();
    std::fs::write(
        dir.0.join("loopback.yaml"),
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: loopback, namespace: demo}}\nspec:\n  \
             clusterIP: 127.0.0.1\n  ports: [{{port: 9, targetPort: 8080}}]\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: loopback-1\n  \
             namespace: demo\n  labels: {{kubernetes.io/service-name: loopback}}\naddressType: IPv4\n\
             ports: [{{port: 8080, protocol: TCP}}]\nendpoints: [{{addresses: [{}]}}]\n",
            pod_ip(1)
        ),
    )
    .unwrap();
    std::fs::write(dir.0.join("nested.yaml"), "[".repeat(100_000)).unwrap();

    let started = Instant::now();
    let daemon = Daemon::start(
        bed.cgroup_path(),
        &[
            "--manifests",
            dir.0.to_str().unwrap(),
            "--manifest-poll-period",
            "100ms",
        ],
    );
    assert!(
        eventually(20, || tcp(&bed, WEB, 1)[0].is_ok()),
        "the valid service never became reachable; log:\n{}",
        daemon.log()
    );
    let took = started.elapsed();
    assert_eq!(
        reached(&tcp(&bed, WEB, 30)).len(),
        2,
        "log:\n{}",
        daemon.log()
    );
    assert!(
        took < Duration::from_secs(15),
        "the hostile file held the load up: {took:?}"
    );

    let log = daemon.log();
    assert!(
        log.contains("Service demo/loopback: spec.clusterIP \"127.0.0.1\"")
            && log.contains("loopback range"),
        "the refusal names the object and field; log:\n{log}"
    );
    assert!(
        log.contains("nested.yaml"),
        "the nested file is reported; log:\n{log}"
    );
    assert!(!log.contains("panicked"), "log:\n{log}");

    // Nothing listens on 127.0.0.1:9 in the node: refused, not redirected to pod-1.
    let outcomes = tcp(&bed, "127.0.0.1:9", 3);
    assert!(
        reached(&outcomes).is_empty(),
        "127.0.0.1:9 reached a pod: {outcomes:?}\nlog:\n{log}"
    );
}
