//! The built-in demo of `cargo xtask run`: three pods behind a Service, served by the real
//! daemon, probed from a client namespace and cgroup.

use std::{
    fs,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    probe::{self, Outcome},
    signals,
    testbed::{Pod, Testbed},
};

pub const WEB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
pub const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
/// web's NodePort for http, and the address of the client on "another host".
pub const WEB_NODE_PORT: u16 = 30080;
pub const OUTSIDE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 1);
/// The node the demo's daemon runs as; the pods run on it.
pub const NODE_NAME: &str = "demo-node";
const READY_TIMEOUT: Duration = Duration::from_secs(15);
const UPDATE_TIMEOUT: Duration = Duration::from_secs(15);
const DAEMON_GRACE: Duration = Duration::from_secs(5);

/// The demo's Services, and web's EndpointSlice over `pods`.
pub fn web_service_yaml() -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: demo
spec:
  type: NodePort
  clusterIP: {WEB_IP}
  clusterIPs: [\"{WEB_IP}\"]
  ipFamilies: [IPv4]
  ipFamilyPolicy: SingleStack
  selector:
    app: web
  ports:
    - name: http
      protocol: TCP
      port: 80
      targetPort: 8080
      nodePort: {WEB_NODE_PORT}
    - name: dns
      protocol: UDP
      port: 53
      targetPort: 5353
"
    )
}

pub fn empty_service_yaml() -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata:
  name: empty
  namespace: demo
spec:
  type: ClusterIP
  clusterIP: {EMPTY_IP}
  clusterIPs: [\"{EMPTY_IP}\"]
  ipFamilies: [IPv4]
  ipFamilyPolicy: SingleStack
  selector:
    app: nothing
  ports:
    - name: http
      protocol: TCP
      port: 80
      targetPort: 8080
"
    )
}

pub fn web_slice_yaml(pods: &[&Pod]) -> String {
    let mut endpoints = String::new();
    for pod in pods {
        endpoints.push_str(&format!(
            "  - addresses: [\"{}\"]
    conditions:
      ready: true
      serving: true
      terminating: false
    nodeName: {NODE_NAME}
    targetRef:
      kind: Pod
      namespace: demo
      name: {}
",
            pod.ipv4, pod.name
        ));
    }
    let endpoints = if pods.is_empty() {
        "endpoints: []\n".to_string()
    } else {
        format!("endpoints:\n{endpoints}")
    };
    format!(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-demo
  namespace: demo
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
{endpoints}ports:
  - name: http
    protocol: TCP
    port: 8080
  - name: dns
    protocol: UDP
    port: 5353
"
    )
}

struct Demo<'a> {
    bed: Testbed,
    probe: &'a Path,
    daemon: u32,
    log: PathBuf,
    manifests: PathBuf,
    surprises: usize,
}

/// Runs the demo until Ctrl-C; everything it made is gone when it returns.
pub fn demo(
    daemon_bin: &Path,
    probe_bin: &Path,
    log_level: Option<&str>,
    extra: &[String],
) -> Result<()> {
    crate::require_root("the demo")?;
    signals::install().context("installing the Ctrl-C handler")?;
    let mut bed = Testbed::new("demo")?;
    println!(
        "demo: made network namespace {} (the client side) and cgroup {}",
        bed.node_netns(),
        bed.cgroup_path().display()
    );

    let mut pods = Vec::new();
    for i in 1..=3u8 {
        let pod = bed.add_pod(&format!("pod-{i}"), Ipv4Addr::new(198, 18, 1, i), None)?;
        bed.serve(
            probe_bin,
            &pod,
            &["--tcp", "0.0.0.0:8080", "--udp", "0.0.0.0:5353"],
        )?;
        pods.push(pod);
    }
    for pod in &pods {
        let got = bed.probe(
            probe_bin,
            &["tcp", &format!("{}:8080", pod.ipv4), "--timeout-ms", "2000"],
        )?;
        match got.first() {
            Some(Outcome::Ok { reply, .. }) if *reply == pod.name => {}
            other => bail!(
                "pod {} does not answer on {}:8080 directly: {other:?}",
                pod.name,
                pod.ipv4
            ),
        }
    }
    let names: Vec<String> = pods
        .iter()
        .map(|p| format!("{} {}", p.name, p.ipv4))
        .collect();
    println!(
        "demo: 3 pods ({}) answer on TCP 8080 and UDP 5353",
        names.join(", ")
    );

    // A client on "another host": its own namespace, reaching the node over a veth pair.
    let outside = bed.add_pod("outside", OUTSIDE_IP, None)?;
    println!(
        "demo: made namespace {} ({OUTSIDE_IP}), a client on another host that reaches the node ({}) over {}",
        outside.netns,
        bed.node_ipv4(),
        outside.node_veth
    );

    let manifests = bed.dir().join("manifests");
    fs::create_dir_all(&manifests)?;
    fs::write(manifests.join("web-service.yaml"), web_service_yaml())?;
    fs::write(
        manifests.join("web-slice.yaml"),
        web_slice_yaml(&pods.iter().collect::<Vec<_>>()),
    )?;
    fs::write(manifests.join("empty-service.yaml"), empty_service_yaml())?;
    println!(
        "demo: wrote Services demo/web ({WEB_IP}: http 80->8080/TCP with NodePort {WEB_NODE_PORT}, dns 53->5353/UDP) and demo/empty ({EMPTY_IP}, no endpoints) to {}",
        manifests.display()
    );

    let log = bed.dir().join("fastpath.log");
    let log_file = fs::File::create(&log)?;
    let mut cmd = Command::new(daemon_bin);
    cmd.arg("--manifests")
        .arg(&manifests)
        .arg("--cgroup-path")
        .arg(bed.cgroup_path())
        // Node ports on the node namespace's device towards "another host" only: never on
        // this machine's own devices.
        .args([
            "--netns",
            bed.node_netns(),
            "--nodeport-devices",
            &outside.node_veth,
        ])
        .args(["--hostname-override", NODE_NAME]);
    if let Some(level) = log_level {
        cmd.args(["--log-level", level]);
    }
    cmd.args(extra)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    println!(
        "demo: starting `{}` (log: {})",
        crate::cmd::describe(&cmd),
        log.display()
    );
    let daemon = bed.spawn(&mut cmd, DAEMON_GRACE)?;

    let mut demo = Demo {
        bed,
        probe: probe_bin,
        daemon,
        log,
        manifests,
        surprises: 0,
    };
    demo.wait_ready()?;
    demo.show_tcp_spread(&pods)?;
    demo.show_udp(&pods)?;
    demo.show_empty()?;
    demo.show_node_port(&outside)?;
    demo.show_removal(&pods)?;

    println!();
    if demo.surprises > 0 {
        println!(
            "demo: {} of the checks above did not go as expected (marked !!); see {}",
            demo.surprises,
            demo.log.display()
        );
    }
    println!("Press Ctrl-C to stop");
    let ended = loop {
        if signals::stop_requested() {
            break None;
        }
        if let Some(status) = demo.bed.try_wait(demo.daemon)? {
            break Some(status);
        }
        thread::sleep(Duration::from_millis(200));
    };
    let surprises = demo.surprises;
    if let Some(status) = ended {
        let tail = log_tail(&demo.log);
        demo.bed.close()?;
        bail!("fastpath exited on its own ({status}); the end of its log:\n{tail}");
    }
    println!("demo: stopping fastpath (SIGTERM)");
    let status = demo.bed.stop(demo.daemon)?;
    println!("demo: fastpath exited ({status})");
    demo.bed.close()?;
    println!("demo: removed the namespaces, the cgroup and the temporary files");
    if surprises > 0 {
        bail!("{surprises} of the demo's checks did not go as expected");
    }
    Ok(())
}

impl Demo<'_> {
    fn probe(&self, args: &[&str]) -> Result<Vec<Outcome>> {
        if signals::stop_requested() {
            bail!("interrupted by Ctrl-C");
        }
        self.bed.probe(self.probe, args)
    }

    fn surprise(&mut self, what: String) {
        self.surprises += 1;
        println!("   !! {what}");
    }

    fn wait_ready(&mut self) -> Result<()> {
        let started = Instant::now();
        let target = format!("{WEB_IP}:80");
        loop {
            if let Some(status) = self.bed.try_wait(self.daemon)? {
                bail!(
                    "fastpath exited while starting ({status}); the end of its log:\n{}",
                    log_tail(&self.log)
                );
            }
            let got = self.probe(&["tcp", &target, "--timeout-ms", "500"])?;
            match got.first() {
                Some(Outcome::Ok { .. }) => break,
                last if started.elapsed() >= READY_TIMEOUT => bail!(
                    "fastpath did not become ready within {}s: TCP connections to {target} from the \
                     client cgroup kept failing (last: {}). The end of its log:\n{}",
                    READY_TIMEOUT.as_secs(),
                    last.map_or_else(|| "no output".to_string(), describe),
                    log_tail(&self.log)
                ),
                _ => thread::sleep(Duration::from_millis(250)),
            }
        }
        println!(
            "demo: fastpath is ready after {:.1}s",
            started.elapsed().as_secs_f64()
        );
        println!();
        Ok(())
    }

    fn show_tcp_spread(&mut self, pods: &[Pod]) -> Result<()> {
        let got = self.probe(&[
            "tcp",
            &format!("{WEB_IP}:80"),
            "--count",
            "12",
            "--timeout-ms",
            "1000",
        ])?;
        println!("1. 12 TCP connections from the client to web's ClusterIP {WEB_IP}:80 reached:");
        print_spread(pods, &got);
        let failed = got.iter().filter(|o| !o.is_ok()).count();
        if got.len() != 12 || failed > 0 {
            self.surprise(format!("{failed} of {} connections failed", got.len()));
        }
        let reached = probe::count_replies(&got).len();
        if reached < 2 {
            self.surprise(format!(
                "all connections went to {reached} pod(s); expected a spread"
            ));
        }
        let peers = distinct(got.iter().filter_map(|o| match o {
            Outcome::Ok { peer, .. } => peer.clone(),
            Outcome::Err { .. } => None,
        }));
        println!(
            "   getpeername() on the client's sockets said: {}",
            peers.join(", ")
        );
        Ok(())
    }

    fn show_udp(&mut self, pods: &[Pod]) -> Result<()> {
        let target = format!("{WEB_IP}:53");
        let got = self.probe(&["udp", &target, "--timeout-ms", "1000"])?;
        match got.first() {
            Some(Outcome::Ok { reply, from, .. }) => {
                let pod = pods.iter().find(|p| p.name == *reply);
                let pod_addr = pod.map_or_else(|| "?".to_string(), |p| format!("{}:5353", p.ipv4));
                let from = from.clone().unwrap_or_else(|| "?".to_string());
                println!(
                    "2. A UDP request to {target} was answered by {reply} ({pod_addr}); the reply came from {from}."
                );
                if from == target {
                    println!(
                        "   That is the ClusterIP, not the pod: the client only ever sees the address it asked."
                    );
                } else {
                    self.surprise(format!("the reply should have come from {target}"));
                }
            }
            other => {
                println!(
                    "2. A UDP request to {target} got no answer: {}",
                    other.map_or("no output".into(), describe)
                );
                self.surprise("expected a reply from a pod".into());
            }
        }
        Ok(())
    }

    fn show_empty(&mut self) -> Result<()> {
        let target = format!("{EMPTY_IP}:80");
        let started = Instant::now();
        let got = self.probe(&["tcp", &target, "--timeout-ms", "3000"])?;
        let ms = started.elapsed().as_millis();
        match got.first() {
            Some(Outcome::Err { errno, message }) => {
                println!(
                    "3. Connecting to empty ({target}, no endpoints) failed after {ms} ms: {errno} ({message})."
                );
                if ms > 1000 || errno == "ETIMEDOUT" {
                    self.surprise("expected the connection to be refused at once".into());
                }
            }
            other => {
                println!(
                    "3. Connecting to empty ({target}, no endpoints): {}",
                    other.map_or("no output".into(), describe)
                );
                self.surprise("expected the connection to be refused".into());
            }
        }
        Ok(())
    }

    fn show_node_port(&mut self, outside: &Pod) -> Result<()> {
        let target = format!("{}:{WEB_NODE_PORT}", self.bed.node_ipv4());
        let mut cmd = Command::new(self.probe);
        cmd.arg("--netns").arg(&outside.netns).args([
            "tcp",
            &target,
            "--count",
            "6",
            "--timeout-ms",
            "2000",
        ]);
        let got = probe::parse(&crate::cmd::output(&mut cmd)?);
        let answered: Vec<&str> = got.iter().filter_map(Outcome::reply).collect();
        println!(
            "4. From another host ({OUTSIDE_IP}), 6 connections to the node's NodePort {target} were answered by {}.",
            if answered.is_empty() {
                "nobody".to_string()
            } else {
                answered.join(", ")
            }
        );
        let peers_ok = got
            .iter()
            .all(|o| matches!(o, Outcome::Ok { peer: Some(p), .. } if *p == target));
        if answered.len() == got.len() && !got.is_empty() && peers_ok {
            println!(
                "   tc programs on {} translated each packet; the client only saw {target}.",
                outside.node_veth
            );
        } else {
            self.surprise(format!(
                "expected every connection to reach a pod through {target}: {got:?}"
            ));
        }
        Ok(())
    }

    fn show_removal(&mut self, pods: &[Pod]) -> Result<()> {
        let (gone, kept) = pods.split_last().expect("the demo has pods");
        // Write next to the folder, then rename into it: the daemon never sees half a file.
        let staged = self.bed.dir().join("web-slice.yaml.new");
        fs::write(&staged, web_slice_yaml(&kept.iter().collect::<Vec<_>>()))?;
        fs::rename(&staged, self.manifests.join("web-slice.yaml"))?;
        let started = Instant::now();
        let args = [
            "tcp",
            &format!("{WEB_IP}:80"),
            "--count",
            "12",
            "--timeout-ms",
            "1000",
        ];
        loop {
            let got = self.probe(&args)?;
            let counts = probe::count_replies(&got);
            if !counts.contains_key(&gone.name) && got.iter().all(Outcome::is_ok) {
                break;
            }
            if started.elapsed() >= UPDATE_TIMEOUT {
                println!(
                    "5. Removed {} from web's EndpointSlice, but after {}s connections still reach it:",
                    gone.name,
                    UPDATE_TIMEOUT.as_secs()
                );
                print_spread(pods, &got);
                self.surprise(format!("{} should no longer get connections", gone.name));
                return Ok(());
            }
            thread::sleep(Duration::from_millis(200));
        }
        let took = started.elapsed().as_secs_f64();
        let got = self.probe(&args)?;
        println!(
            "5. Removed {} from web's EndpointSlice (fastpath applied it within {took:.1}s). 12 new connections reached:",
            gone.name
        );
        print_spread(pods, &got);
        if probe::count_replies(&got).contains_key(&gone.name) {
            self.surprise(format!("{} still got connections", gone.name));
        }
        println!(
            "   ({} still runs; it is just no longer an endpoint.)",
            gone.name
        );
        Ok(())
    }
}

fn print_spread(pods: &[Pod], got: &[Outcome]) {
    let counts = probe::count_replies(got);
    for pod in pods {
        let n = counts.get(&pod.name).copied().unwrap_or(0);
        println!("     {:<6} ({}): {n}", pod.name, pod.ipv4);
    }
    let errors: Vec<String> = got.iter().filter(|o| !o.is_ok()).map(describe).collect();
    if !errors.is_empty() {
        println!("     failed: {}", distinct(errors.into_iter()).join("; "));
    }
}

fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Ok { reply, .. } => format!("answered by {reply}"),
        Outcome::Err { errno, message } => format!("{errno} {message}"),
    }
}

fn distinct(items: impl Iterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

/// The last lines of a log, indented, for error messages.
fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(25)..];
    if tail.is_empty() {
        return "  (empty)".to_string();
    }
    tail.iter()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_lists_the_pods() {
        let pod = |n: u8| Pod {
            name: format!("pod-{n}"),
            netns: String::new(),
            ipv4: Ipv4Addr::new(198, 18, 1, n),
            ipv6: None,
            node_veth: String::new(),
        };
        let (a, b) = (pod(1), pod(2));
        let yaml = web_slice_yaml(&[&a, &b]);
        assert!(yaml.contains("addresses: [\"198.18.1.1\"]"));
        assert!(yaml.contains("addresses: [\"198.18.1.2\"]"));
        assert!(yaml.contains("kubernetes.io/service-name: web"));
        assert!(web_slice_yaml(&[]).contains("endpoints: []"));
        assert!(web_service_yaml().contains("clusterIP: 198.19.0.10"));
        assert!(empty_service_yaml().contains("clusterIP: 198.19.0.11"));
    }
}
