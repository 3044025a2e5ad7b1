//! The manifests in deploy/ are what a cluster will be given: each must decode into its
//! Kubernetes type, the ConfigMap's config must pass the daemon's own validation, RBAC must
//! stay least-privilege, and the DaemonSet's probes must point at the health port.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use proxy_userland::config::{Args, KubeProxyConfiguration, Listen, mode::Mode};

fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

#[derive(Default)]
struct Manifests {
    daemonsets: Vec<DaemonSet>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    config_maps: Vec<ConfigMap>,
}

/// Every document of every YAML file in deploy/, decoded by kind; an unknown kind fails.
fn load() -> Manifests {
    let mut m = Manifests::default();
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .expect("deploy/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in deploy/");
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for value in docs {
            if value.is_null() {
                continue;
            }
            let kind = value["kind"].as_str().unwrap_or_default().to_string();
            let what = format!("{} ({kind})", path.display());
            fn decode<T: serde::de::DeserializeOwned>(v: serde_json::Value, what: &str) -> T {
                serde_json::from_value(v).unwrap_or_else(|e| panic!("{what}: {e}"))
            }
            match kind.as_str() {
                "DaemonSet" => m.daemonsets.push(decode(value, &what)),
                "ServiceAccount" => m.service_accounts.push(decode(value, &what)),
                "ClusterRole" => m.cluster_roles.push(decode(value, &what)),
                "ClusterRoleBinding" => m.bindings.push(decode(value, &what)),
                "ConfigMap" => m.config_maps.push(decode(value, &what)),
                other => panic!("{what}: unexpected kind {other:?}"),
            }
        }
    }
    m
}

/// The config the DaemonSet runs with, as the daemon would load it (no flags given).
fn daemon_config(m: &Manifests) -> Args {
    let cm = &m.config_maps[0];
    let text = &cm.data.as_ref().expect("ConfigMap data")["config.yaml"];
    let cfg = KubeProxyConfiguration::parse(text, "deploy/configmap.yaml")
        .expect("the embedded config parses");
    let mut args = Args::try_from_iter(["fastpath"]).unwrap();
    args.merge_file(&cfg, "deploy/configmap.yaml", |_| false)
        .expect("the embedded config is valid");
    args.validate().expect("the merged config is valid");
    assert!(
        args.config_warnings.is_empty(),
        "{:?}",
        args.config_warnings
    );
    args
}

#[test]
fn every_manifest_decodes_and_the_set_is_complete() {
    let m = load();
    assert_eq!(
        (
            m.daemonsets.len(),
            m.service_accounts.len(),
            m.cluster_roles.len(),
            m.bindings.len(),
            m.config_maps.len()
        ),
        (1, 1, 1, 1, 1)
    );
}

#[test]
fn the_config_map_passes_validation_and_turns_node_setup_on() {
    let m = load();
    let args = daemon_config(&m);
    assert_eq!(
        args.healthz_bind_address,
        Listen(Some("0.0.0.0:10256".parse().unwrap()))
    );
    assert!(
        args.node_setup().is_some(),
        "the DaemonSet's config sets the node up"
    );
    assert!(args.cgroup_path.is_some());
}

/// kube-proxy's 1 s minimum sync period spaces out iptables-restore runs; shipped at the top
/// level it would hold back every eBPF change under churn by up to that second.
#[test]
fn the_shipped_config_holds_back_only_the_iptables_mode() {
    let args = daemon_config(&load());
    assert_eq!(args.min_sync_period_for(Mode::Ebpf), Duration::ZERO);
    assert_eq!(args.min_sync_period_for(Mode::Userspace), Duration::ZERO);
    assert_eq!(
        args.min_sync_period_for(Mode::Iptables),
        Duration::from_secs(1)
    );
}

#[test]
fn rbac_is_read_only_except_events() {
    let m = load();
    let role = &m.cluster_roles[0];
    let mut granted: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for rule in role.rules.as_ref().expect("rules") {
        let groups = rule.api_groups.clone().unwrap_or_default();
        let resources = rule.resources.clone().unwrap_or_default();
        assert!(
            !rule.verbs.iter().any(|v| v == "*"),
            "no wildcard verbs: {rule:?}"
        );
        assert!(
            !resources.iter().any(|r| r == "*") && !groups.iter().any(|g| g == "*"),
            "no wildcards: {rule:?}"
        );
        for resource in &resources {
            let allowed: &[&str] = if resource == "events" {
                &["create", "patch"]
            } else {
                &["get", "list", "watch"]
            };
            for verb in &rule.verbs {
                assert!(
                    allowed.contains(&verb.as_str()),
                    "{verb} on {resource} is more than needed"
                );
            }
            for group in &groups {
                granted
                    .entry((group.clone(), resource.clone()))
                    .or_default()
                    .extend(rule.verbs.clone());
            }
        }
    }
    for (group, resource, verbs) in [
        ("", "services", &["get", "list", "watch"][..]),
        ("", "nodes", &["get", "list", "watch"]),
        (
            "discovery.k8s.io",
            "endpointslices",
            &["get", "list", "watch"],
        ),
        (
            "networking.k8s.io",
            "servicecidrs",
            &["get", "list", "watch"],
        ),
        ("events.k8s.io", "events", &["create", "patch"]),
        ("", "events", &["create", "patch"]),
    ] {
        let have = granted
            .get(&(group.to_string(), resource.to_string()))
            .cloned()
            .unwrap_or_default();
        for v in verbs {
            assert!(
                have.iter().any(|h| h == v),
                "missing {v} on {group}/{resource}"
            );
        }
    }
    // The binding gives that role to that service account.
    let binding = &m.bindings[0];
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let sa = &m.service_accounts[0];
    let subject = &binding.subjects.as_ref().unwrap()[0];
    assert_eq!(
        (subject.kind.as_str(), Some(&subject.name)),
        ("ServiceAccount", sa.metadata.name.as_ref())
    );
    assert_eq!(subject.namespace, sa.metadata.namespace);
}

#[test]
fn the_daemonset_runs_as_a_node_proxy_with_probes_on_the_health_port() {
    let m = load();
    let args = daemon_config(&m);
    let health_port = i32::from(args.healthz_bind_address.0.unwrap().port());
    let ds = &m.daemonsets[0];
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert!(
        pod.tolerations
            .as_ref()
            .is_some_and(|t| t.iter().any(|t| t.operator.as_deref() == Some("Exists")))
    );
    assert_eq!(
        pod.service_account_name,
        m.service_accounts[0].metadata.name
    );
    assert_eq!(pod.containers.len(), 1);
    let c = &pod.containers[0];

    let probe_port = |p: &Option<k8s_openapi::api::core::v1::Probe>, path: &str| {
        let get = p
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("{path} probe"));
        assert_eq!(get.path.as_deref(), Some(path));
        match &get.port {
            IntOrString::Int(n) => *n,
            IntOrString::String(name) => {
                c.ports
                    .as_ref()
                    .unwrap()
                    .iter()
                    .find(|p| p.name.as_ref() == Some(name))
                    .unwrap()
                    .container_port
            }
        }
    };
    assert_eq!(probe_port(&c.liveness_probe, "/livez"), health_port);
    assert_eq!(probe_port(&c.readiness_probe, "/readyz"), health_port);

    check_least_privilege(pod);

    // The host paths the daemon needs, and the config file where --config looks.
    let volumes = pod.volumes.as_ref().unwrap();
    let host_path = |path: &str| {
        volumes
            .iter()
            .find(|v| v.host_path.as_ref().is_some_and(|h| h.path == path))
            .map(|v| v.name.clone())
    };
    let mounts = c.volume_mounts.as_ref().unwrap();
    let mount_of = |volume: &str| {
        mounts
            .iter()
            .find(|m| m.name == volume)
            .map(|m| m.mount_path.clone())
    };
    assert_eq!(
        mount_of(&host_path("/sys/fs/bpf").expect("bpffs volume")).as_deref(),
        Some("/sys/fs/bpf")
    );
    let cgroup_mount =
        mount_of(&host_path("/sys/fs/cgroup").expect("cgroup volume")).expect("cgroup mounted");
    assert_eq!(
        args.cgroup_path.as_deref(),
        Some(std::path::Path::new(&cgroup_mount)),
        "cgroupPath is the host cgroup mount"
    );

    let config_volume = volumes
        .iter()
        .find(|v| {
            v.config_map
                .as_ref()
                .is_some_and(|cm| Some(&cm.name) == m.config_maps[0].metadata.name.as_ref())
        })
        .expect("config volume");
    let config_dir = mount_of(&config_volume.name).expect("config mounted");
    let container_args = c.args.clone().unwrap_or_default();
    assert!(
        container_args.contains(&format!("--config={config_dir}/config.yaml")),
        "{container_args:?}"
    );
    // The container's flags are the daemon's flags.
    let mut argv = vec!["fastpath".to_string()];
    argv.extend(
        container_args
            .iter()
            .filter(|a| !a.starts_with("--config="))
            .map(|a| a.replace("$(NODE_NAME)", "node-a")),
    );
    Args::try_from_iter(argv).expect("the DaemonSet's flags parse");
}

/// The capabilities the daemon's container may have: the ones measured for eBPF mode (BPF,
/// NET_ADMIN, PERFMON), SYS_ADMIN for the cross-namespace UDP socket reset, SYS_PTRACE to
/// reach clients running as another user and move their sockets (tests/udp_backend_loss.rs
/// shows both: the move as shipped, the EACCES without it), NET_RAW for iptables-legacy.
/// tests/least_privilege.rs runs the binary with exactly the DaemonSet's.
const ALLOWED_CAPS: [&str; 6] = [
    "BPF",
    "NET_ADMIN",
    "PERFMON",
    "SYS_ADMIN",
    "SYS_PTRACE",
    "NET_RAW",
];

/// Not privileged, the measured capabilities and no others, a read-only root, limits, and
/// a Localhost seccomp profile shipped in deploy/seccomp/ that lets bpf(2) through; node
/// set-up in a privileged init container that installs that profile.
fn check_least_privilege(pod: &k8s_openapi::api::core::v1::PodSpec) {
    let c = &pod.containers[0];
    let sc = c.security_context.as_ref().expect("securityContext");
    assert_ne!(
        sc.privileged,
        Some(true),
        "the daemon's container is not privileged"
    );
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    let add = caps.add.clone().unwrap_or_default();
    for need in ["BPF", "NET_ADMIN", "PERFMON"] {
        assert!(add.iter().any(|c| c == need), "{need} missing from {add:?}");
    }
    for cap in &add {
        assert!(
            ALLOWED_CAPS.contains(&cap.as_str()),
            "{cap} was not measured as needed"
        );
    }
    let args = c.args.clone().unwrap_or_default();
    assert!(
        args.iter().any(|a| a == "--skip-node-setup"),
        "node set-up is the init container's: {args:?}"
    );

    let res = c.resources.as_ref().expect("resources");
    for (what, list) in [("requests", &res.requests), ("limits", &res.limits)] {
        let list = list.as_ref().unwrap_or_else(|| panic!("resource {what}"));
        assert!(
            list.contains_key("cpu") && list.contains_key("memory"),
            "{what}: {list:?}"
        );
    }
    assert!(
        c.volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .any(|m| m.mount_path == "/tmp"),
        "a writable /tmp beside the read-only root"
    );

    // Seccomp: a Localhost profile from deploy/seccomp/ that allows what the daemon calls.
    let seccomp = sc.seccomp_profile.as_ref().expect("seccompProfile");
    assert_eq!(seccomp.type_, "Localhost");
    let name = seccomp
        .localhost_profile
        .as_deref()
        .expect("localhostProfile");
    let profile: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(deploy_dir().join("seccomp").join(name))
            .unwrap_or_else(|e| panic!("deploy/seccomp/{name}: {e}")),
    )
    .expect("the profile is JSON");
    // An allow-list: what is not listed is refused (xtask/src/seccomp.rs makes it from a
    // trace; tests/container_image.rs runs the daemon under it in every mode).
    assert_eq!(profile["defaultAction"], "SCMP_ACT_ERRNO", "{profile}");
    assert_eq!(
        profile["defaultErrnoRet"], 1,
        "EPERM, as a refused capability"
    );
    let arches = profile["architectures"].as_array().expect("architectures");
    for arch in ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"] {
        assert!(arches.iter().any(|a| a == arch), "{arch} missing");
    }
    let rules = profile["syscalls"].as_array().unwrap();
    for rule in rules {
        assert_eq!(rule["action"], "SCMP_ACT_ALLOW", "only allow rules: {rule}");
        assert!(
            rule["comment"].as_str().is_some_and(|c| !c.is_empty()),
            "every rule says why: {rule}"
        );
    }
    let allowed = xtask::seccomp::allowed(&profile);
    for needed in [
        "bpf",
        "setns",
        "socket",
        "sendmsg",
        "mount",
        "statfs",
        "execve",
        "clone3",
        "epoll_wait",
        "epoll_pwait",
        "openat",
    ] {
        assert!(allowed.contains(needed), "the profile refuses {needed}");
    }
    // What the old deny-list named, and io_uring, stay refused.
    for dangerous in xtask::seccomp::NEVER {
        assert!(
            !allowed.contains(*dangerous),
            "the profile allows {dangerous}"
        );
    }
    // Nothing but the trace and the documented extras: the file is what the tracer writes.
    let traced: std::collections::BTreeSet<String> = rules[0]["names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        xtask::seccomp::profile(&traced).unwrap(),
        profile,
        "deploy/seccomp/{name} differs from what `cargo xtask seccomp-trace --no-run` writes"
    );

    // The init container: node set-up, privileged (sysctls), installs the profile under
    // the kubelet's seccomp root as the name the daemon's container asks for.
    let inits = pod.init_containers.as_ref().expect("init containers");
    assert_eq!(inits.len(), 1);
    let init = &inits[0];
    assert_eq!(
        init.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    let script = init.command.clone().unwrap_or_default().join(" ");
    assert!(script.contains("fastpath node-setup --config="), "{script}");
    assert!(
        script.contains(&format!("/host/seccomp/{name}")),
        "{script}"
    );
    let volumes = pod.volumes.as_ref().unwrap();
    let seccomp_volume = init
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.mount_path == "/host/seccomp")
        .expect("the seccomp root is mounted");
    let host = volumes
        .iter()
        .find(|v| v.name == seccomp_volume.name)
        .unwrap();
    assert_eq!(
        host.host_path.as_ref().unwrap().path,
        "/var/lib/kubelet/seccomp"
    );
    assert!(init.resources.as_ref().is_some_and(|r| r.limits.is_some()));
}

/// The ConfigMap spells out the eBPF load balancer's settings for operators to change;
/// shipped, they are the flags' defaults, so a node configured by it behaves as the flags
/// document and as the tests that run without it.
#[test]
fn the_shipped_ebpf_settings_are_the_flags_defaults() {
    let shipped = daemon_config(&load());
    let defaults = Args::try_from_iter(["fastpath"]).unwrap();
    assert_eq!(shipped.bpf_lb_algorithm, defaults.bpf_lb_algorithm);
    assert_eq!(shipped.bpf_lb_mode, defaults.bpf_lb_mode);
    assert_eq!(
        shipped.conntrack_gc_interval,
        defaults.conntrack_gc_interval
    );
    assert_eq!(defaults.bpf_ct_max, None);
    assert_eq!(shipped.bpf_ct_max, Some(proxy_common::maps::CT_MAX));
}
