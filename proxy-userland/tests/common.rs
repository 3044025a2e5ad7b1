//! Shared by the integration tests: a test bed with pods serving their names, a model built
//! in code, and the probe client that reports where each connection landed.
#![allow(dead_code)]

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use proxy_userland::model::{
    Endpoint, EndpointSet, Protocol, ProxyState, Service, ServiceKey, ServicePort, SliceInfo,
    SlicePort,
};
use xtask::{
    probe::Outcome,
    testbed::{Pod, Testbed},
};

pub const PROBE: &str = env!("CARGO_BIN_EXE_fastpath-probe");

/// The ClusterIP most tests give their `demo/web` service, and its two ports.
pub const WEB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
pub const WEB: &str = "198.19.0.10:80";
pub const WEB_DNS: &str = "198.19.0.10:53";

/// A LoadBalancer with externalTrafficPolicy Local and two ready endpoints, one on NODE1
/// (filled in: "node-a" for the tests' daemon) and one on node-b; its health check node
/// port HCPORT is filled in too.
pub const LOCAL_LB: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 198.19.0.40
  clusterIPs: [198.19.0.40]
  externalTrafficPolicy: Local
  healthCheckNodePort: HCPORT
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}
status:
  loadBalancer:
    ingress: [{ip: 198.19.100.1}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: demo, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- {addresses: [198.18.1.11], conditions: {ready: true}, nodeName: NODE1}
- {addresses: [198.18.1.12], conditions: {ready: true}, nodeName: node-b}
"#;

/// The node the tests' proxy runs as ("node-a", no zone).
pub fn node() -> proxy_userland::model::NodeInfo {
    proxy_userland::model::NodeInfo {
        name: "node-a".into(),
        zone: None,
    }
}

/// The IPv6 ClusterIP of the dual-stack `demo/web` ([`web_manifest_dual`]), its two ports.
pub const WEB6: &str = "[2001:db8:ff00::10]:80";
pub const WEB6_DNS: &str = "[2001:db8:ff00::10]:53";

/// Manifests for `demo/web` on [`WEB_IP`] (http TCP 80->8080, dns UDP 53->5353) with one
/// EndpointSlice listing `pods` as ready endpoints.
pub fn web_manifest(pods: &[Ipv4Addr]) -> String {
    let ips: Vec<IpAddr> = pods.iter().map(|&ip| ip.into()).collect();
    let mut yaml = web_service_yaml(&["198.19.0.10"]);
    yaml.push_str(&web_slice_yaml("web-abc", "IPv4", &ips));
    yaml
}

/// As [`web_manifest`], a NodePort (http on 30080) whose endpoints are on this node.
pub fn web_node_port_manifest(pods: &[Ipv4Addr]) -> String {
    web_manifest(pods)
        .replace(
            "  - {name: http, port: 80, targetPort: 8080, protocol: TCP}",
            "  - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}",
        )
        .replace("spec:\n", "spec:\n  type: NodePort\n")
        .replace(
            "  conditions: {ready: true}",
            "  conditions: {ready: true}\n  nodeName: node-a",
        )
}

/// Conditions of a ready endpoint, and of a terminating one that still serves (its pod
/// got SIGTERM and drains).
pub const READY: &str = "{ready: true}";
pub const TERMINATING_SERVING: &str = "{ready: false, serving: true, terminating: true}";

/// As [`web_manifest`], each endpoint with its EndpointSlice `conditions` (e.g.
/// [`READY`], [`TERMINATING_SERVING`]).
pub fn web_manifest_with(endpoints: &[(Ipv4Addr, &str)]) -> String {
    let mut yaml = web_service_yaml(&["198.19.0.10"]);
    yaml.push_str(&slice_yaml(
        "web-abc",
        "IPv4",
        endpoints.iter().map(|&(ip, c)| (ip.into(), c)),
    ));
    yaml
}

/// As [`web_manifest`], dual-stack: the ClusterIPs 198.19.0.10 and 2001:db8:ff00::10, and an
/// EndpointSlice per family listing pods `pods` (by index) at [`pod_ip`] and [`pod_ip6`].
pub fn web_manifest_dual(pods: &[u8]) -> String {
    let v4: Vec<IpAddr> = pods.iter().map(|&i| pod_ip(i).into()).collect();
    let v6: Vec<IpAddr> = pods.iter().map(|&i| pod_ip6(i).into()).collect();
    let mut yaml = web_service_yaml(&["198.19.0.10", "2001:db8:ff00::10"]);
    yaml.push_str(&web_slice_yaml("web-v4", "IPv4", &v4));
    yaml.push_str("---\n");
    yaml.push_str(&web_slice_yaml("web-v6", "IPv6", &v6));
    yaml
}

/// The Service `demo/web` on `cluster_ips` (the first is its clusterIP) and a separator.
fn web_service_yaml(cluster_ips: &[&str]) -> String {
    let families: Vec<&str> = cluster_ips
        .iter()
        .map(|ip| if ip.contains(':') { "IPv6" } else { "IPv4" })
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: demo}}\nspec:\n  \
         clusterIP: {first}\n  clusterIPs: [{all}]\n  ipFamilies: [{families}]\n  ports:\n  \
         - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}\n  \
         - {{name: dns, port: 53, targetPort: 5353, protocol: UDP}}\n---\n",
        first = cluster_ips[0],
        all = cluster_ips.join(", "),
        families = families.join(", "),
    )
}

/// An EndpointSlice of `demo/web` listing `ips` as ready endpoints.
fn web_slice_yaml(name: &str, address_type: &str, ips: &[IpAddr]) -> String {
    slice_yaml(name, address_type, ips.iter().map(|&ip| (ip, READY)))
}

/// An EndpointSlice of `demo/web` listing each (address, conditions).
fn slice_yaml<'a>(
    name: &str,
    address_type: &str,
    endpoints: impl ExactSizeIterator<Item = (IpAddr, &'a str)>,
) -> String {
    let mut yaml = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  \
         namespace: demo\n  labels: {{kubernetes.io/service-name: web}}\naddressType: {address_type}\n\
         ports:\n- {{name: http, port: 8080, protocol: TCP}}\n- {{name: dns, port: 5353, protocol: UDP}}\n"
    );
    if endpoints.len() == 0 {
        yaml.push_str("endpoints: []\n");
    } else {
        yaml.push_str("endpoints:\n");
    }
    for (ip, conditions) in endpoints {
        yaml.push_str(&format!(
            "- addresses: [\"{ip}\"]\n  conditions: {conditions}\n"
        ));
    }
    yaml
}
pub const FASTPATH: &str = env!("CARGO_BIN_EXE_fastpath");

pub fn probe() -> &'static Path {
    Path::new(PROBE)
}

/// Pod `i` (1-based) lives at 198.18.1.(10+i).
pub fn pod_ip(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, 10 + i)
}

/// `endpoints` without the one of the pod that answered as `pod` ("pod-3").
pub fn without_pod(endpoints: &[Endpoint], pod: &str) -> Vec<Endpoint> {
    let i: u8 = (pod.strip_prefix("pod-").and_then(|i| i.parse().ok()))
        .unwrap_or_else(|| panic!("not a pod's answer: {pod}"));
    let ip = std::net::IpAddr::V4(pod_ip(i));
    endpoints.iter().filter(|e| e.ip != ip).cloned().collect()
}

/// Pod `i` of a dual-stack bed also lives at 2001:db8:1::(10+i) (hex).
pub fn pod_ip6(i: u8) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10 + u16::from(i))
}

/// A test bed with `n` pods, each answering with its name ("pod-1", ...) on TCP 8080 and
/// UDP 5353.
pub fn bed_with_pods(tag: &str, n: u8) -> (Testbed, Vec<Pod>) {
    bed_with_pods_serving(tag, n, &[], false)
}

/// As [`bed_with_pods`], the pods answering `NAME@<address they saw>` (see
/// `Outcome::name` and `Outcome::seen_from`).
pub fn bed_with_echoing_pods(tag: &str, n: u8) -> (Testbed, Vec<Pod>) {
    bed_with_pods_serving(tag, n, &["--echo-peer"], false)
}

/// As [`bed_with_pods`] (with the servers' `extra` flags), each pod also at [`pod_ip6`]
/// and serving there too.
pub fn bed_with_dual_stack_pods(tag: &str, n: u8, extra: &[&str]) -> (Testbed, Vec<Pod>) {
    bed_with_pods_serving(tag, n, extra, true)
}

/// Two serving pods (dual-stack with `dual`, see [`bed_with_dual_stack_pods`]) and a
/// client pod that serves nothing at [`pod_ip`]`(9)` (and [`pod_ip6`]`(9)`).
pub fn bed_with_client(tag: &str, dual: bool) -> (Testbed, Pod) {
    let (mut bed, _pods) = if dual {
        bed_with_dual_stack_pods(tag, 2, &[])
    } else {
        bed_with_pods(tag, 2)
    };
    let client = bed
        .add_pod("client", pod_ip(9), dual.then(|| pod_ip6(9)))
        .expect("client pod");
    (bed, client)
}

fn bed_with_pods_serving(tag: &str, n: u8, extra: &[&str], v6: bool) -> (Testbed, Vec<Pod>) {
    let mut bed = Testbed::new(tag).expect("test bed");
    let mut pods = Vec::new();
    for i in 1..=n {
        let pod = bed
            .add_pod(&format!("pod-{i}"), pod_ip(i), v6.then(|| pod_ip6(i)))
            .expect("pod");
        let name = format!("pod-{i}");
        let mut args = vec![
            "--name",
            &name,
            "--tcp",
            "0.0.0.0:8080",
            "--udp",
            "0.0.0.0:5353",
        ];
        if v6 {
            args.extend(["--tcp", "[::]:8080", "--udp", "[::]:5353"]);
        }
        args.extend_from_slice(extra);
        bed.serve(probe(), &pod, &args).expect("pod server");
        pods.push(pod);
    }
    (bed, pods)
}

pub fn ready(ip: Ipv4Addr) -> Endpoint {
    Endpoint {
        ip: IpAddr::V4(ip),
        ready: true,
        serving: true,
        terminating: false,
        placement: Default::default(),
    }
}

/// [`ready`] at pod `i`'s IPv6 address ([`pod_ip6`]).
pub fn ready6(i: u8) -> Endpoint {
    Endpoint {
        ip: IpAddr::V6(pod_ip6(i)),
        ..ready(pod_ip(i))
    }
}

/// A service `demo/<name>` on `cluster_ip` with http TCP 80->8080 and dns UDP 53->5353.
pub fn web_service(name: &str, cluster_ip: Ipv4Addr) -> Service {
    Service::cluster_ip(
        ServiceKey::new("demo", name),
        vec![IpAddr::V4(cluster_ip)],
        vec![
            ServicePort {
                name: "http".into(),
                port: 80,
                protocol: Protocol::Tcp,
                node_port: None,
            },
            ServicePort {
                name: "dns".into(),
                port: 53,
                protocol: Protocol::Udp,
                node_port: None,
            },
        ],
    )
}

pub fn web_endpoints(endpoints: Vec<Endpoint>) -> EndpointSet {
    let ports = vec![
        SlicePort {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Tcp,
        },
        SlicePort {
            name: "dns".into(),
            port: 5353,
            protocol: Protocol::Udp,
        },
    ];
    EndpointSet {
        slices: proxy_userland::model::Slices::from([(
            "slice-a".to_string(),
            SliceInfo { ports, endpoints },
        )]),
    }
}

pub fn state_of(entries: Vec<(Service, Option<EndpointSet>)>) -> ProxyState {
    let mut state = ProxyState::default();
    for (svc, eps) in entries {
        if let Some(eps) = eps {
            state.endpoints.insert(svc.key.clone(), Arc::new(eps));
        }
        state.services.insert(svc.key.clone(), Arc::new(svc));
    }
    state
}

/// Runs the probe client in the bed's node namespace and cgroup; one outcome per attempt.
pub fn run_probe(bed: &Testbed, args: &[&str]) -> Vec<Outcome> {
    let outcomes = bed.probe(probe(), args).expect("probe runs");
    assert!(!outcomes.is_empty(), "probe printed no result for {args:?}");
    outcomes
}

pub fn tcp(bed: &Testbed, target: &str, count: usize) -> Vec<Outcome> {
    run_probe(
        bed,
        &[
            "tcp",
            target,
            "--count",
            &count.to_string(),
            "--timeout-ms",
            "2000",
        ],
    )
}

/// The pods that answered.
pub fn reached(outcomes: &[Outcome]) -> BTreeSet<String> {
    outcomes
        .iter()
        .filter_map(|o| o.reply().map(str::to_string))
        .collect()
}

pub fn peer(o: &Outcome) -> Option<&str> {
    match o {
        Outcome::Ok { peer, .. } => peer.as_deref(),
        Outcome::Err { .. } => None,
    }
}

pub fn from(o: &Outcome) -> Option<&str> {
    match o {
        Outcome::Ok { from, .. } => from.as_deref(),
        Outcome::Err { .. } => None,
    }
}

pub struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    /// Starts `fastpath` on the bed's cgroup as node "node-a", with `args` naming the source.
    pub fn start(cgroup: &Path, args: &[&str]) -> Self {
        Self::start_wrapped(&[], cgroup, args)
    }

    /// As [`Daemon::start`], run through `wrapper` (e.g. `setpriv` with its options) when
    /// it is not empty.
    pub fn start_wrapped(wrapper: &[&str], cgroup: &Path, args: &[&str]) -> Self {
        let log = Self::new_log("started");
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).args(xtask::seccomp::prefix()).arg(FASTPATH);
                c
            }
            None => xtask::seccomp::command(FASTPATH),
        };
        let child = cmd
            .arg("--cgroup-path")
            .arg(cgroup)
            .args(["--hostname-override", "node-a"])
            // The daemon runs in the host's namespace: keep its packet programs off the
            // host's devices.
            .args(["--nodeport-devices", "none"])
            // Admin servers on loopback, on ports the kernel picks, so parallel tests never
            // collide or listen on every address; a test's own `args` override these.
            .args([
                "--healthz-bind-address",
                "127.0.0.1:0",
                "--metrics-bind-address",
                "127.0.0.1:0",
            ])
            .args(args)
            .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
            .stderr(Stdio::from(
                std::fs::File::options().append(true).open(&log).unwrap(),
            ))
            .spawn()
            .expect("fastpath starts");
        Daemon { child, log }
    }

    /// `wrapper` (e.g. nsenter, setpriv), then `fastpath args`, with no flag of ours
    /// added: for running the daemon as deploy/ runs it.
    pub fn start_as_deployed(wrapper: &[&str], args: &[&str]) -> Self {
        let log = Self::new_log("deployed");
        let (program, rest) = wrapper.split_first().expect("a wrapper");
        let child = Command::new(program)
            .args(rest)
            .args(xtask::seccomp::prefix())
            .arg(FASTPATH)
            .args(args)
            .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
            .stderr(Stdio::from(
                std::fs::File::options().append(true).open(&log).unwrap(),
            ))
            .spawn()
            .expect("fastpath starts");
        Daemon { child, log }
    }

    /// A log file no other daemon of this test binary writes: tests run in parallel, and
    /// two daemons sharing a log truncate each other's.
    fn new_log(how: &str) -> PathBuf {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::env::temp_dir().join(format!(
            "fastpath-test-{}-{how}-{n}.log",
            std::process::id()
        ))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The daemon's process id (for /proc/PID/status and signals), strace's child when
    /// `cargo xtask seccomp-trace` runs the test.
    pub fn pid(&self) -> u32 {
        xtask::seccomp::tracee(self.child.id())
    }

    /// Waits up to `secs` for the daemon to exit by itself.
    pub fn wait_exit(&mut self, secs: u64) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// SIGTERM, as the kubelet stops a pod, and the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill only takes integers and touches no memory of ours.
        unsafe { libc::kill(self.pid() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "fastpath did not stop within 10 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Under a trace, strace writes its count once the daemon is gone.
        let daemon = self.pid();
        if daemon != self.child.id() {
            // SAFETY: kill only takes integers and touches no memory of ours.
            unsafe { libc::kill(daemon as i32, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // FASTPATH_KEEP_LOGS=1 keeps the daemon's log for a look after the run.
        if std::env::var_os("FASTPATH_KEEP_LOGS").is_some() {
            eprintln!("daemon log kept: {}", self.log.display());
        } else {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// The daemon in eBPF mode on the bed's node namespace, with the pod path on the devices
/// named in `pod_devices` (comma-separated prefixes), the node-port programs on `ext`'s
/// device, the Services of the manifests in `dir`, and `extra` flags.
pub fn node_port_daemon(
    bed: &Testbed,
    pod_devices: &str,
    ext: &Pod,
    dir: &Path,
    extra: &[&str],
) -> Daemon {
    let args = [
        "--proxy-mode",
        "ebpf",
        "--netns",
        bed.node_netns(),
        "--pod-interface-name-prefix",
        pod_devices,
        "--nodeport-devices",
        &ext.node_veth,
        "--manifests",
        dir.to_str().unwrap(),
        "--manifest-poll-period",
        "100ms",
    ];
    Daemon::start(bed.cgroup_path(), &[&args[..], extra].concat())
}

/// Polls `check` every 100 ms for up to `secs`; the last result is returned.
pub fn eventually(secs: u64, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if check() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A private bpffs instance for one test: pins made there vanish with the unmount.
pub struct Bpffs(pub PathBuf);

impl Bpffs {
    pub fn mount(under: &Path) -> Self {
        let dir = under.join("bpffs");
        std::fs::create_dir_all(&dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(ok.success(), "mounting a bpffs at {}", dir.display());
        Bpffs(dir)
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Removes its folder on drop.
pub struct RmDir(pub PathBuf);

impl Drop for RmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh scratch folder for manifests, removed on drop.
pub fn manifest_dir(tag: &str) -> RmDir {
    let dir = std::env::temp_dir().join(format!("fastpath-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    RmDir(dir)
}

/// A probe client whose lines arrive on a channel; killed on drop.
pub struct Client {
    child: Child,
    /// Each line, with when it arrived.
    pub lines: std::sync::mpsc::Receiver<(Instant, String)>,
}

impl Client {
    pub fn spawn(mut cmd: std::process::Command) -> Self {
        use std::io::BufRead as _;
        let mut child = cmd.stdout(Stdio::piped()).spawn().expect("probe client");
        let (tx, lines) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send((Instant::now(), line));
            }
        });
        Client { child, lines }
    }

    pub fn next(&self) -> Option<String> {
        self.lines
            .recv_timeout(Duration::from_secs(5))
            .ok()
            .map(|(_, l)| l)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `fastpath-probe --netns <pod> --cgroup <the bed's client cgroup>`: a client in a pod's
/// own namespace that the socket hooks still see (pods live under the hooks' cgroup).
pub fn pod_client(bed: &Testbed, pod: &Pod) -> Command {
    let mut cmd = Command::new(probe());
    cmd.arg("--netns")
        .arg(&pod.netns)
        .arg("--cgroup")
        .arg(bed.cgroup_path());
    cmd.stdin(Stdio::null());
    cmd
}

/// Runs [`pod_client`] with `args` and parses its lines.
pub fn pod_probe(bed: &Testbed, pod: &Pod, args: &[&str]) -> Vec<Outcome> {
    let out = pod_client(bed, pod)
        .args(args)
        .output()
        .expect("probe runs");
    xtask::probe::parse(&String::from_utf8_lossy(&out.stdout))
}

/// A port nobody listens on right now, on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `capabilities.add` of the DaemonSet's daemon container, as deploy/daemonset.yaml says.
pub fn daemonset_caps() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml");
    let ds: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let add =
        &ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"];
    add.as_array()
        .expect("capabilities.add")
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect()
}

/// `setpriv` keeping exactly the DaemonSet's capabilities (bounding set, none inherited,
/// no new privileges as allowPrivilegeEscalation: false); the program follows.
pub fn daemonset_setpriv() -> Vec<String> {
    let keep: String = daemonset_caps()
        .iter()
        .map(|c| format!(",+{}", c.to_lowercase()))
        .collect();
    vec![
        "setpriv".into(),
        format!("--bounding-set=-all{keep}"),
        "--inh-caps=-all".into(),
        "--no-new-privs".into(),
        "--".into(),
    ]
}

/// The config file deploy/configmap.yaml ships (its `config.yaml`), written to `dir`.
pub fn shipped_config(dir: &Path) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/configmap.yaml");
    let cm: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let text = cm["data"]["config.yaml"]
        .as_str()
        .expect("data.config.yaml");
    let out = dir.join("config.yaml");
    std::fs::write(&out, text).unwrap();
    out
}

/// `resources.limits.memory` of the DaemonSet's daemon container, in bytes, as
/// deploy/daemonset.yaml says (a Kubernetes quantity: `512Mi`, `1G`, `536870912`).
pub fn daemonset_memory_limit() -> u64 {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml");
    let ds: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let limit = &ds["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"];
    let text = match limit {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        other => panic!("the daemon container has no memory limit: {other}"),
    };
    quantity_bytes(&text).unwrap_or_else(|| panic!("not a memory quantity: {text:?}"))
}

/// A Kubernetes memory quantity in bytes (the binary and decimal suffixes; no fractions).
fn quantity_bytes(text: &str) -> Option<u64> {
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit: u64 = match &text[digits.len()..] {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    digits.parse::<u64>().ok()?.checked_mul(unit)
}

/// A daemon started as deploy/ runs it, and the private bpffs its pins live on (fields drop
/// in order: the daemon goes before its bpffs is unmounted).
pub struct Shipped {
    pub daemon: Daemon,
    pub pins: Bpffs,
}

/// The daemon as deploy/ runs it, inside the bed's node namespace (hostNetwork): the
/// ConfigMap's config file, the DaemonSet's capabilities (setpriv) and its
/// `--skip-node-setup`, maps pinned on a private bpffs; given only what a test must
/// override: cgroup, node name, pin dir, admin servers on the namespace's loopback
/// (ports the kernel picks). `extra` follows: the source (`--manifests=...`,
/// `--kubeconfig=...`) and anything a test sets deliberately (later flags win).
pub fn start_as_shipped(bed: &Testbed, extra: &[&str]) -> Shipped {
    start_as_shipped_wrapped(&[], bed, extra)
}

/// As [`start_as_shipped`], run through `outer` first when it is not empty (e.g. a shell
/// that joins a cgroup and execs the rest).
pub fn start_as_shipped_wrapped(outer: &[&str], bed: &Testbed, extra: &[&str]) -> Shipped {
    start_shipped(outer, bed, &|text| text.to_string(), extra)
}

/// As [`start_as_shipped`], with the ConfigMap's config as `edit` leaves it: what an
/// operator changes there, where the DaemonSet's flags stay as shipped.
pub fn start_as_configured(
    bed: &Testbed,
    edit: &dyn Fn(&str) -> String,
    extra: &[&str],
) -> Shipped {
    start_shipped(&[], bed, edit, extra)
}

fn start_shipped(
    outer: &[&str],
    bed: &Testbed,
    edit: &dyn Fn(&str) -> String,
    extra: &[&str],
) -> Shipped {
    let config = shipped_config(bed.dir());
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, edit(&text)).unwrap();
    // The DaemonSet pins under /sys/fs/bpf; a private bpffs goes with the test.
    let pins = Bpffs::mount(bed.dir());
    let mut wrapper: Vec<String> = outer.iter().map(|s| s.to_string()).collect();
    wrapper.extend([
        "nsenter".to_string(),
        format!("--net=/run/netns/{}", bed.node_netns()),
        "--".into(),
    ]);
    wrapper.extend(daemonset_setpriv());
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let mut args = vec![
        format!("--config={}", config.display()),
        "--hostname-override=node-a".into(),
        format!("--bpf-pin-dir={}", pins.0.join("fastpath").display()),
        "--skip-node-setup".into(),
        format!("--cgroup-path={}", bed.cgroup_path().display()),
        "--healthz-bind-address=127.0.0.1:0".into(),
        "--metrics-bind-address=127.0.0.1:0".into(),
        "--healthcheck-bind-address=127.0.0.1".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let daemon = Daemon::start_as_deployed(&wrapper, &args);
    Shipped { daemon, pins }
}

/// The answer to `GET path` on 127.0.0.1:`port` in network namespace `netns`, where a
/// daemon run as shipped listens (bash's /dev/tcp: no HTTP client in the image), or "".
pub fn http_get(netns: &str, port: u16, path: &str) -> String {
    let script = format!(
        "exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' >&3 && timeout 5 cat <&3"
    );
    Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .args(["--", "bash", "-c", &script])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// The daemon in `mode` for the bed's node namespace (`--netns`), serving the manifest file
/// `manifests`, without admin servers, plus `extra` flags.
pub fn start_in_node(bed: &Testbed, mode: &str, manifests: &Path, extra: &[&str]) -> Daemon {
    let mut args = vec![
        "--proxy-mode",
        mode,
        "--netns",
        bed.node_netns(),
        "--manifests",
        manifests.to_str().unwrap(),
        "--healthz-bind-address",
        "",
        "--metrics-bind-address",
        "",
    ];
    args.extend_from_slice(extra);
    Daemon::start(bed.cgroup_path(), &args)
}

/// `nft` in network namespace `netns`; its output.
pub fn netns_nft(netns: &str, args: &[&str]) -> String {
    netns_tool(netns, "nft", args)
}

/// `ip ARGS` in `netns`, which must succeed; its output.
pub fn netns_ip(netns: &str, args: &[&str]) -> String {
    netns_tool(netns, "ip", args)
}

/// Makes `pod` send (from its `eth0`) with its checksums computed in full, as packets from
/// another host's NIC arrive, and not left partial for a device to finish, as a veth does
/// by default: the receiving stack trusts a partial checksum and would not notice one our
/// programs got wrong, while a full one it verifies, dropping the packet when it is wrong.
pub fn send_full_checksums(pod: &xtask::testbed::Pod) {
    netns_tool(&pod.netns, "ethtool", &["-K", "eth0", "tx", "off"]);
}

fn netns_tool(netns: &str, tool: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, tool])
        .args(args)
        .output()
        .expect(tool);
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts counting, on `netns`'s forward hook, the TCP and UDP packets `selector` (an nft
/// match, may be empty) picks out; [`forwarded`] reads the count.
pub fn count_forwarded(netns: &str, selector: &str) {
    let rule = format!("{selector} meta l4proto {{ tcp, udp }} counter");
    let chain = "{ type filter hook forward priority 0 ; }";
    netns_nft(netns, &["add", "table", "inet", "fpfwd"]);
    netns_nft(netns, &["add", "chain", "inet", "fpfwd", "tally", chain]);
    netns_nft(netns, &["add", "rule", "inet", "fpfwd", "tally", &rule]);
}

/// What [`count_forwarded`] counted in `netns`.
pub fn forwarded(netns: &str) -> u64 {
    let listing = netns_nft(netns, &["list", "table", "inet", "fpfwd"]);
    listing
        .split("packets ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter in:\n{listing}"))
}

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

/// Turns the kernel's program statistics on and puts the old setting back when dropped.
pub struct BpfStatsOn(String);

impl BpfStatsOn {
    pub fn enable() -> Self {
        let old = std::fs::read_to_string(BPF_STATS).expect("bpf_stats_enabled readable");
        std::fs::write(BPF_STATS, "1").expect("bpf_stats_enabled writable");
        BpfStatsOn(old.trim().to_string())
    }
}

impl Drop for BpfStatsOn {
    fn drop(&mut self) {
        let _ = std::fs::write(BPF_STATS, &self.0);
    }
}

/// (run_time_ns, run_cnt) summed over this process's programs of `prog_type`
/// (`enum bpf_prog_type`), from their descriptors' fdinfo.
pub fn prog_stats(prog_type: u64) -> (u64, u64) {
    own_programs()
        .iter()
        .filter(|p| p.prog_type == prog_type)
        .fold((0, 0), |(ns, cnt), p| (ns + p.run_time_ns, cnt + p.run_cnt))
}

/// (run_time_ns, run_cnt) summed over this process's programs named `name`.
pub fn prog_stats_named(name: &str) -> (u64, u64) {
    let ids: std::collections::BTreeSet<u64> = own_programs().iter().map(|p| p.id).collect();
    aya::programs::loaded_programs()
        .flatten()
        .filter(|p| ids.contains(&u64::from(p.id())) && p.name_as_str() == Some(name))
        .fold((0, 0), |(ns, cnt), p| {
            (ns + p.run_time().as_nanos() as u64, cnt + p.run_count())
        })
}

struct OwnProgram {
    id: u64,
    prog_type: u64,
    run_time_ns: u64,
    run_cnt: u64,
}

/// The BPF programs this process holds a descriptor of, from their fdinfo.
fn own_programs() -> Vec<OwnProgram> {
    let mut programs = Vec::new();
    for fd in std::fs::read_dir("/proc/self/fd")
        .expect("fd dir")
        .flatten()
    {
        if std::fs::read_link(fd.path()).ok().as_deref() != Some(Path::new("anon_inode:bpf-prog")) {
            continue;
        }
        let info_path = Path::new("/proc/self/fdinfo").join(fd.file_name());
        let Ok(info) = std::fs::read_to_string(info_path) else {
            continue;
        };
        let field = |name: &str| -> u64 {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        programs.push(OwnProgram {
            id: field("prog_id:"),
            prog_type: field("prog_type:"),
            run_time_ns: field("run_time_ns:"),
            run_cnt: field("run_cnt:"),
        });
    }
    programs
}

/// `enum bpf_map_type` values the tests create maps of.
pub const BPF_MAP_TYPE_HASH: u32 = 1;
pub const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
pub const BPF_MAP_TYPE_LRU_HASH: u32 = 9;

/// A new map of `kind` (preallocated, as the programs' own), named `name`, with raw
/// bpf(2): what an earlier version pinned, or a table for the daemon's code to work on.
pub fn create_map(kind: u32, name: &str, key: u32, value: u32, max: u32) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd as _;
    const BPF_MAP_CREATE: libc::c_long = 0;
    // union bpf_attr for BPF_MAP_CREATE: type, key and value sizes, max entries, flags,
    // inner map fd, NUMA node, then the name (16 bytes at offset 28).
    let mut attr = [0u8; 128];
    for (at, v) in [(0, kind), (4, key), (8, value), (12, max)] {
        attr[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
    attr[28..28 + name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: bpf(2) reads `attr`, a live buffer of the size passed.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, attr.as_ptr(), attr.len()) };
    assert!(
        fd >= 0,
        "BPF_MAP_CREATE: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a new descriptor the kernel just gave us, owned by nothing else.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) }
}
