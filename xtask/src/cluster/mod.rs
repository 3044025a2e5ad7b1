//! The cluster test bed: a few nodes, one real `fastpath` daemon each, fed by the in-repo API
//! server over list/watch, the way a DaemonSet runs it.
//!
//! ```text
//!                 fabric netns (the bed's "node" namespace, 198.18.0.1; API server here)
//!        fpn0 ┌──────────────┬──────────────┬──────────────┐ fpv0
//!   node-1 netns         node-2 netns    node-3 netns      outside netns (198.18.0.200)
//!   eth0 198.18.0.11     eth0 .12        eth0 .13          an outside client / "load balancer"
//!   fppK ── pods 198.18.11.K/32 (gateway 198.18.11.1 on each fppK)
//! ```
//!
//! The fabric routes each node's pod range (198.18.(10+N).0/24) to that node; every node
//! routes the rest of the test range, and its default route, to the fabric, which has no
//! route out of the test ranges, so nothing leaves the bed. Each node has its own cgroup
//! (its pods and host clients live there, as under the kubelet's kubepods), its own pin dir
//! and its Node object (InternalIP, zone label). Its daemon runs inside the node's namespace
//! with the config of deploy/configmap.yaml and, through setpriv, exactly the capability set
//! of deploy/daemonset.yaml; only the mode can differ per node (a mixed cluster, as during a
//! migration). The pods and their EndpointSlice are run by [`controller`], clients by
//! [`load`].

pub mod controller;
pub mod demo;
pub mod load;
pub mod objects;

use std::{
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use serde_json::Value;

use crate::{
    apiserver::ApiServer,
    cgroup,
    cmd::ip,
    netns,
    testbed::{NODE_IPV4, Pod, Testbed, wire_veth},
};

/// The outside client's address, on the fabric.
pub const OUTSIDE_IPV4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 200);
/// How long a daemon may take to say it is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// SIGTERM to SIGKILL for a daemon: its graceful shutdown.
const DAEMON_GRACE: Duration = Duration::from_secs(10);

/// How a node's daemon runs: what deploy/ ships, and the mode.
#[derive(Clone, Debug)]
pub struct Shipped {
    /// deploy/configmap.yaml's `config.yaml`.
    pub config: String,
    /// deploy/daemonset.yaml's container `capabilities.add`.
    pub caps: Vec<String>,
    /// deploy/daemonset.yaml's container args that do not name a path of the pod
    /// (`--config`, `--bpf-pin-dir` are the bed's; `$(NODE_NAME)` is the node's name).
    pub args: Vec<String>,
}

impl Shipped {
    /// Reads what deploy/ ships.
    pub fn load(deploy: &Path) -> Result<Shipped> {
        let cm: Value = read_yaml(&deploy.join("configmap.yaml"))?;
        let config = cm["data"]["config.yaml"]
            .as_str()
            .ok_or_else(|| anyhow!("configmap.yaml has no data.config.yaml"))?
            .to_string();
        let ds: Value = read_yaml(&deploy.join("daemonset.yaml"))?;
        let container = &ds["spec"]["template"]["spec"]["containers"][0];
        let caps = container["securityContext"]["capabilities"]["add"]
            .as_array()
            .ok_or_else(|| anyhow!("daemonset.yaml: no capabilities.add"))?
            .iter()
            .filter_map(|c| c.as_str().map(str::to_string))
            .collect();
        let args = container["args"]
            .as_array()
            .ok_or_else(|| anyhow!("daemonset.yaml: no container args"))?
            .iter()
            .filter_map(|a| a.as_str())
            .filter(|a| !a.starts_with("--config") && !a.starts_with("--bpf-pin-dir"))
            .map(str::to_string)
            .collect();
        Ok(Shipped { config, caps, args })
    }
}

fn read_yaml(path: &Path) -> Result<Value> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_saphyr::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// What to build.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// The proxy mode of each node (`ebpf`, `iptables`): one node each.
    pub modes: Vec<String>,
    pub fastpath: PathBuf,
    pub probe: PathBuf,
    pub shipped: Shipped,
    /// Flags after the shipped ones (a test's deliberate difference from what ships).
    pub extra_args: Vec<String>,
}

/// One node of the cluster.
#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    /// 1-based, as in the name.
    pub index: u8,
    pub netns: String,
    pub ipv4: Ipv4Addr,
    pub zone: String,
    pub mode: String,
    /// Its pods and host clients live here; the daemon attaches here.
    pub cgroup: PathBuf,
    pub pin_dir: PathBuf,
    /// The fabric's end of its uplink.
    fabric_veth: String,
    daemon: Option<u32>,
    /// Pod veths made so far (`fppK`).
    veths: u32,
    /// The last host number given out in its pod range (the gateway is .1).
    last_host: u8,
    /// Log files of its daemons, oldest first.
    pub logs: Vec<PathBuf>,
}

impl Node {
    /// The gateway address pods on this node route through (on every pod veth).
    pub fn pod_gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, 10 + self.index, 1)
    }

    /// A pod address never given out on this node before (as a CNI's IPAM would).
    pub fn next_pod_ip(&mut self) -> Result<Ipv4Addr> {
        if self.last_host >= 254 {
            bail!("{} has no pod address left", self.name);
        }
        self.last_host += 1;
        Ok(Ipv4Addr::new(198, 18, 10 + self.index, self.last_host))
    }
}

/// See the module documentation. Everything goes on drop.
pub struct Cluster {
    // Declared first: dropped first, while the namespaces it serves in still exist.
    pub api: ApiServer,
    pub bed: Testbed,
    pub nodes: Vec<Node>,
    pub outside: Pod,
    opts: ClusterOptions,
    kubeconfig: PathBuf,
    config: PathBuf,
}

impl Cluster {
    /// Builds the fabric, the nodes (with their Node objects) and the outside client, and
    /// starts one daemon per node; returns once every daemon is ready.
    pub fn start(tag: &str, opts: ClusterOptions) -> Result<Cluster> {
        let mut cluster = Cluster::build(tag, opts)?;
        for i in 0..cluster.nodes.len() {
            cluster.start_daemon(i)?;
        }
        for i in 0..cluster.nodes.len() {
            cluster.wait_ready(i)?;
        }
        Ok(cluster)
    }

    /// [`Cluster::start`] without the daemons: the caller fills the API server first (a
    /// bench's thousands of Services) and starts them with [`Cluster::start_daemon`].
    pub fn build(tag: &str, opts: ClusterOptions) -> Result<Cluster> {
        if opts.modes.is_empty() || opts.modes.len() > 9 {
            bail!("a cluster has 1 to 9 nodes, not {}", opts.modes.len());
        }
        let mut bed = Testbed::new(tag)?;
        // The fabric holds its address once a veth is wired: the outside client's first.
        let outside = bed.add_pod("outside", OUTSIDE_IPV4, None)?;
        let api = ApiServer::start_in(bed.node_netns(), IpAddr::V4(NODE_IPV4))?;
        let kubeconfig = bed.dir().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let bpffs = bed.dir().join("bpffs");
        fs::create_dir_all(&bpffs)?;
        crate::cmd::run(Command::new("mount").args(["-t", "bpf", "bpf"]).arg(&bpffs))
            .context("mounting the bed's bpffs")?;
        let config = bed.dir().join("config.yaml");
        fs::write(&config, &opts.shipped.config)?;
        let mut cluster = Cluster {
            api,
            bed,
            nodes: Vec::new(),
            outside,
            opts,
            kubeconfig,
            config,
        };
        for (i, mode) in cluster.opts.modes.clone().iter().enumerate() {
            cluster.add_node(i as u8 + 1, mode)?;
        }
        Ok(cluster)
    }

    fn add_node(&mut self, index: u8, mode: &str) -> Result<()> {
        let name = format!("node-{index}");
        let netns = self.bed.add_namespace(&format!("n-{name}"))?;
        let ipv4 = Ipv4Addr::new(198, 18, 0, 10 + index);
        let fabric_veth = format!("fpn{index}");
        netns::sysctl(&netns, "net/ipv4/ip_forward", "1")?;
        netns::sysctl(&netns, "net/ipv6/conf/all/forwarding", "1")?;
        let fabric = self.bed.node_netns().to_string();
        wire_veth(
            &fabric,
            &fabric_veth,
            &netns,
            &[(IpAddr::V4(NODE_IPV4), IpAddr::V4(ipv4))],
        )
        .with_context(|| format!("wiring {name} to the fabric"))?;
        // A node's uplink carries its default route (nodeport device detection looks for
        // it); the fabric drops what is not for the test ranges.
        ip([
            "-n",
            &netns,
            "route",
            "add",
            "default",
            "via",
            "198.18.0.1",
            "dev",
            "eth0",
        ])?;
        let pods = format!("198.18.{}.0/24", 10 + index);
        ip([
            "-n",
            &fabric,
            "route",
            "add",
            &pods,
            "via",
            &ipv4.to_string(),
            "dev",
            &fabric_veth,
        ])?;
        let cgroup = self.bed.cgroup_root().join(&name);
        cgroup::create(&cgroup)?;
        // Each node's pins in the bed's own bpffs (the host may have none mounted), as the
        // DaemonSet's /sys/fs/bpf/fastpath on a node.
        let pin_dir = self.bed.dir().join("bpffs").join(&name);
        let zone = format!("zone-{}", (b'a' + (index - 1) % 2) as char);
        self.api.create("nodes", objects::node(&name, ipv4, &zone));
        self.nodes.push(Node {
            name,
            index,
            netns,
            ipv4,
            zone,
            mode: mode.to_string(),
            cgroup,
            pin_dir,
            fabric_veth,
            daemon: None,
            veths: 0,
            last_host: 1,
            logs: Vec::new(),
        });
        Ok(())
    }

    /// Starts node `i`'s daemon as the DaemonSet does: inside the node's namespace, under
    /// setpriv with the DaemonSet's capabilities and no new privileges, with the shipped
    /// config and args. A running one is left alone (see [`Cluster::upgrade`]).
    pub fn start_daemon(&mut self, i: usize) -> Result<u32> {
        let node = &self.nodes[i];
        if let Some(pid) = node.daemon {
            return Ok(pid);
        }
        let keep: String = self
            .opts
            .shipped
            .caps
            .iter()
            .map(|c| format!(",+{}", c.to_lowercase()))
            .collect();
        let log = self
            .bed
            .dir()
            .join(format!("{}-{}.log", node.name, node.logs.len()));
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", netns::path(&node.netns).display()))
            .args(["--", "setpriv"])
            .arg(format!("--bounding-set=-all{keep}"))
            .args(["--inh-caps=-all", "--no-new-privs", "--"])
            .arg(&self.opts.fastpath)
            .arg(format!("--config={}", self.config.display()))
            .args(
                self.opts
                    .shipped
                    .args
                    .iter()
                    .map(|a| a.replace("$(NODE_NAME)", &node.name)),
            )
            .arg(format!("--bpf-pin-dir={}", node.pin_dir.display()))
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg(format!("--cgroup-path={}", node.cgroup.display()))
            .arg(format!("--proxy-mode={}", node.mode))
            .args(&self.opts.extra_args)
            .stdin(Stdio::null())
            .stdout(fs::File::create(&log)?)
            .stderr(fs::File::options().append(true).open(&log)?);
        let pid = self.bed.spawn(&mut cmd, DAEMON_GRACE)?;
        let node = &mut self.nodes[i];
        node.daemon = Some(pid);
        node.logs.push(log);
        Ok(pid)
    }

    /// Waits for node `i`'s daemon to answer /readyz with 200 (its first sync is done).
    pub fn wait_ready(&mut self, i: usize) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(pid) = self.nodes[i].daemon
                && let Some(status) = self.bed.try_wait(pid)?
            {
                bail!(
                    "{}'s daemon exited ({status}); log:\n{}",
                    self.nodes[i].name,
                    self.daemon_log(i)
                );
            }
            if self
                .http_get(i, 10256, "/readyz")
                .is_ok_and(|(code, _)| code == 200)
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "{}'s daemon not ready within {READY_TIMEOUT:?}; log:\n{}",
                    self.nodes[i].name,
                    self.daemon_log(i)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The process id of node `i`'s daemon, while one runs (nsenter and setpriv exec it, so
    /// it is the daemon itself).
    pub fn daemon_pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].daemon
    }

    /// Whether node `i`'s daemon has exited, and how (reaped then).
    pub fn daemon_exited(&mut self, i: usize) -> Result<Option<std::process::ExitStatus>> {
        match self.nodes[i].daemon {
            Some(pid) => self.bed.try_wait(pid),
            None => Ok(None),
        }
    }

    /// Stops node `i`'s daemon (SIGTERM, as the kubelet does; SIGKILL after its grace).
    pub fn stop_daemon(&mut self, i: usize) -> Result<std::process::ExitStatus> {
        let pid = self.nodes[i]
            .daemon
            .take()
            .ok_or_else(|| anyhow!("{} has no daemon running", self.nodes[i].name))?;
        self.bed.stop(pid)
    }

    /// Upgrades node `i` in place, as a DaemonSet rolling update does: the old daemon gets
    /// SIGTERM and exits, a new one starts and adopts the pinned state; returns once the new
    /// one is ready.
    pub fn upgrade(&mut self, i: usize) -> Result<()> {
        let status = self.stop_daemon(i)?;
        if !status.success() {
            bail!(
                "{}'s daemon did not exit cleanly on SIGTERM ({status}); log:\n{}",
                self.nodes[i].name,
                self.daemon_log(i)
            );
        }
        self.start_daemon(i)?;
        self.wait_ready(i)
    }

    /// The latest daemon log of node `i`.
    pub fn daemon_log(&self, i: usize) -> String {
        self.nodes[i]
            .logs
            .last()
            .and_then(|p| fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// A GET to `127.0.0.1:port` inside node `i`'s namespace (the daemon's health and
    /// metrics servers): the status and the body.
    pub fn http_get(&self, i: usize, port: u16, path: &str) -> Result<(u16, String)> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        netns::in_netns(&self.nodes[i].netns, || http_get(addr, path))?
    }

    /// Makes a pod's namespace on node `i` with the node's next pod address, its veth
    /// (`fppK` on the node, with the node's pod gateway) and routes.
    pub fn add_pod_netns(&mut self, i: usize, name: &str) -> Result<Pod> {
        let ipv4 = self.nodes[i].next_pod_ip()?;
        let node = &self.nodes[i];
        let pod = Pod {
            name: name.to_string(),
            netns: self.bed.add_namespace(&format!("p-{name}"))?,
            ipv4,
            ipv6: None,
            node_veth: format!("fpp{}", node.veths),
        };
        let node = &mut self.nodes[i];
        node.veths += 1;
        wire_veth(
            &node.netns,
            &pod.node_veth,
            &pod.netns,
            &[(IpAddr::V4(node.pod_gateway()), IpAddr::V4(ipv4))],
        )
        .with_context(|| format!("wiring pod {name} on {}", node.name))?;
        Ok(pod)
    }

    /// The probe, run as a process of node `i` (in its cgroup) in network namespace `netns`.
    pub fn probe_on(&self, i: usize, netns: &str) -> Command {
        let mut cmd = Command::new(&self.opts.probe);
        cmd.arg("--cgroup")
            .arg(&self.nodes[i].cgroup)
            .arg("--netns")
            .arg(netns);
        cmd.stdin(Stdio::null());
        cmd
    }

    /// The probe, run from the outside client's namespace (no node's cgroup).
    pub fn probe_outside(&self) -> Command {
        let mut cmd = Command::new(&self.opts.probe);
        cmd.arg("--netns").arg(&self.outside.netns);
        cmd.stdin(Stdio::null());
        cmd
    }

    pub fn probe_bin(&self) -> &Path {
        &self.opts.probe
    }

    /// Cuts node `i` off the fabric and stops its daemon: the node is lost.
    pub fn cut_node(&mut self, i: usize) -> Result<()> {
        let fabric = self.bed.node_netns().to_string();
        ip(["-n", &fabric, "link", "del", &self.nodes[i].fabric_veth])?;
        if self.nodes[i].daemon.is_some() {
            self.stop_daemon(i)?;
        }
        Ok(())
    }

    /// Starts counting, in the fabric, the packets each node's uplink sends to the outside
    /// client (an nftables counter per node; restarted by each call). Read them with
    /// [`Cluster::packets_to_outside`].
    pub fn count_to_outside(&self) -> Result<()> {
        let table = ["table", "ip", "fpcount"];
        self.fabric_nft(&[&["add"][..], &table].concat())?;
        self.fabric_nft(&[&["flush"][..], &table].concat())?;
        let chain = "{ type filter hook forward priority 0 ; }";
        self.fabric_nft(&["add", "chain", "ip", "fpcount", "tally", chain])?;
        for n in &self.nodes {
            let rule = format!(
                "iifname \"{}\" ip daddr {} counter",
                n.fabric_veth, self.outside.ipv4
            );
            self.fabric_nft(&["add", "rule", "ip", "fpcount", "tally", &rule])?;
        }
        Ok(())
    }

    /// Packets each node sent the outside client since [`Cluster::count_to_outside`].
    pub fn packets_to_outside(&self) -> Result<Vec<u64>> {
        let listing = self.fabric_nft(&["list", "table", "ip", "fpcount"])?;
        self.nodes
            .iter()
            .map(|n| {
                listing
                    .lines()
                    .find(|l| l.contains(&format!("\"{}\"", n.fabric_veth)))
                    .and_then(|l| l.split("packets ").nth(1))
                    .and_then(|rest| rest.split_whitespace().next())
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| anyhow!("no counter for {} in:\n{listing}", n.name))
            })
            .collect()
    }

    /// `nft` in the fabric's namespace.
    fn fabric_nft(&self, args: &[&str]) -> Result<String> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", self.bed.node_netns(), "nft"])
            .args(args);
        crate::cmd::output(&mut cmd).with_context(|| format!("nft {args:?}"))
    }

    /// The fabric routes traffic for `addr` to node `i`, as a router in front of the
    /// nodes (a load balancer, an ECMP next hop) would.
    pub fn route_to_node(&self, addr: Ipv4Addr, i: usize) -> Result<()> {
        let (dst, via) = (format!("{addr}/32"), self.nodes[i].ipv4.to_string());
        ip([
            "-n",
            self.bed.node_netns(),
            "route",
            "replace",
            &dst,
            "via",
            &via,
        ])
        .map(drop)
    }

    /// A daemon counter from node `i`'s /metrics: the sum of the samples of `name` whose
    /// labels contain `labels` (e.g. `result="failed"`).
    pub fn metric(&self, i: usize, name: &str, labels: &str) -> Result<f64> {
        let (code, body) = self.http_get(i, 10249, "/metrics")?;
        if code != 200 {
            bail!("/metrics answered {code}");
        }
        Ok(body
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.rsplit_once(' '))
            .filter(|(k, _)| {
                (k.starts_with(&format!("{name}{{")) || *k == name) && k.contains(labels)
            })
            .filter_map(|(_, v)| v.parse::<f64>().ok())
            .sum())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Daemons first, then the pins (their bpffs): the bed removes namespaces, cgroups
        // and its folder, not mounts.
        for i in 0..self.nodes.len() {
            if self.nodes[i].daemon.is_some() {
                let _ = self.stop_daemon(i);
            }
        }
        let bpffs = self.bed.dir().join("bpffs");
        if let Err(e) = crate::cmd::run(Command::new("umount").arg(&bpffs)) {
            eprintln!("cluster: unmounting {}: {e:#}", bpffs.display());
        }
    }
}

/// A plain HTTP/1.1 GET with `Connection: close`: the status and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let timeout = Duration::from_secs(2);
    let stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    let mut reader = BufReader::new(stream);
    write!(
        reader.get_mut(),
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut status = String::new();
    reader.read_line(&mut status)?;
    let code: u16 = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {status:?}"))?;
    let mut rest = String::new();
    reader.take(4 << 20).read_to_string(&mut rest)?;
    let body = rest
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    Ok((code, body))
}
