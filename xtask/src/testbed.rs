//! The network-namespace test bed: a "node" namespace (the client side, where traffic to
//! Service addresses starts), "pod" namespaces joined to it by veth pairs, and a cgroup v2
//! for the client so the proxy's cgroup programs apply to it and to nothing else.
//!
//! ```text
//!   node netns  (198.18.0.1, 2001:db8:ff::1 on every fpvN)        pod netns "<id>-p-NAME"
//!   ┌──────────────────────────────┐   veth pair   ┌──────────────────────────────┐
//!   │ fpv0  route POD/32 dev fpv0  │───────────────│ eth0  POD/32                 │
//!   │ ip_forward=1                 │               │ route 198.18.0.0/15 via node │
//!   └──────────────────────────────┘               └──────────────────────────────┘
//! ```
//!
//! A second node ([`Testbed::add_peer_node`]) is a namespace `<id>-n-NAME` joined to the node
//! namespace by a veth pair (`fpnK` there, `eth0` in it) with its own address; pods on it
//! ([`Testbed::add_pod_on`]) hang off it as pods hang off the node, and the node namespace
//! routes their addresses via it. It routes the test range back through the node namespace:
//!
//! ```text
//!   ext pod ── fpv0 [node ns, 198.18.0.1] fpn0 ── eth0 [peer "b", PEER] fpv0 ── eth0 [pod]
//!              route POD/32 via PEER dev fpn0      route POD/32 dev fpv0
//!                                                  route 198.18.0.0/15 via 198.18.0.1
//! ```
//!
//! Addresses are checked to lie in 198.18.0.0/15 and 2001:db8::/32, and no namespace has a
//! route anywhere else, so test traffic cannot leave the bed.
//!
//! Names: every object carries the test bed's id `fp-<tag>-<pid>-<n>`, so [`reap_stale`] can
//! remove what a dead process left behind: netns `<id>-node`, `<id>-p-<pod>` and
//! `<id>-n-<peer node>`, cgroup `<cgroup2>/<id>/{client,helpers}`, scratch folder
//! `/run/fastpath/testbeds/<id>` (which also records the owner's pid and start time, against
//! pid reuse).
//!
//! Processes the bed starts (probe servers, a daemon) live in the `helpers` cgroup, a
//! sibling of `client`, so they are outside the proxy's reach and can all be killed at once.

use std::{
    fs,
    io::{BufRead as _, BufReader},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::unix::{ffi::OsStrExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        Once,
        atomic::{AtomicU32, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};

use crate::{cgroup, cmd::ip, netns, probe};

/// The node namespace's address on every veth (pods route the test ranges to it).
pub const NODE_IPV4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
pub const NODE_IPV6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 1);
/// Where every test bed keeps its scratch folder and owner record.
pub const RUN_DIR: &str = "/run/fastpath/testbeds";
/// How long [`Testbed::serve`] waits for a server's "ready" line.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);

const OWNER_FILE: &str = "owner";
const NAME_PREFIX: &str = "fp-";

static COUNTER: AtomicU32 = AtomicU32::new(0);
static REAP_ONCE: Once = Once::new();

/// A pod: its own network namespace, joined to the node namespace by a veth pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pod {
    pub name: String,
    /// Its network namespace (a name under /run/netns).
    pub netns: String,
    pub ipv4: Ipv4Addr,
    pub ipv6: Option<Ipv6Addr>,
    /// The veth end in the node namespace (the pod's end is `eth0`).
    pub node_veth: String,
}

/// A second node: its own network namespace (forwarding), joined to the bed's node namespace
/// by a veth pair; pods on it ([`Testbed::add_pod_on`]) are reached through it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerNode {
    pub name: String,
    /// Its network namespace (a name under /run/netns).
    pub netns: String,
    /// Its addresses on its `eth0`; pods on it route the test ranges to them.
    pub ipv4: Ipv4Addr,
    pub ipv6: Option<Ipv6Addr>,
    /// The veth end in the bed's node namespace (`fpnK`; the peer's end is `eth0`).
    pub bed_veth: String,
}

/// A peer node and how many pod veths it has (they are numbered within its namespace).
struct Peer {
    node: PeerNode,
    veths: usize,
}

struct Managed {
    child: Child,
    /// Time between SIGTERM and SIGKILL on teardown; zero: SIGKILL at once.
    grace: Duration,
}

/// See the module documentation. Everything is removed on drop (or [`Testbed::close`]).
pub struct Testbed {
    id: String,
    dir: PathBuf,
    cgroup_root: PathBuf,
    client_cgroup: PathBuf,
    helper_cgroup: PathBuf,
    node_netns: String,
    /// Namespaces we (tried to) create, node first.
    namespaces: Vec<String>,
    pods: Vec<Pod>,
    /// Pod veths ever made in the node namespace: a removed pod's name is not reused.
    pod_veths: usize,
    peers: Vec<Peer>,
    children: Vec<Managed>,
    closed: bool,
}

impl Testbed {
    /// Makes the node namespace, the cgroups and the scratch folder. `tag` (a few letters,
    /// e.g. the test's name) goes into every name. The first call in a process also reaps
    /// leftovers of dead processes. Needs root.
    pub fn new(tag: &str) -> Result<Testbed> {
        crate::require_root("the test bed")?;
        REAP_ONCE.call_once(|| match reap_stale() {
            Ok(reaped) if !reaped.is_empty() => {
                eprintln!("testbed: removed stale leftovers: {}", reaped.join(", "));
            }
            Ok(_) => {}
            Err(e) => eprintln!("testbed: reaping stale leftovers failed: {e:#}"),
        });
        let id = format!(
            "{NAME_PREFIX}{}-{}-{}",
            sanitize_tag(tag),
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let cgroup_root = cgroup::cgroup2_mount()?.join(&id);
        let mut bed = Testbed {
            dir: Path::new(RUN_DIR).join(&id),
            client_cgroup: cgroup_root.join("client"),
            helper_cgroup: cgroup_root.join("helpers"),
            cgroup_root,
            node_netns: format!("{id}-node"),
            id,
            namespaces: Vec::new(),
            pods: Vec::new(),
            pod_veths: 0,
            peers: Vec::new(),
            children: Vec::new(),
            closed: false,
        };
        // From here on, a failure drops `bed`, which removes what was made so far.
        fs::create_dir_all(&bed.dir).with_context(|| format!("creating {}", bed.dir.display()))?;
        let start = proc_start_time(std::process::id()).context("reading our own start time")?;
        fs::write(
            bed.dir.join(OWNER_FILE),
            format!("{} {start}\n", std::process::id()),
        )?;
        cgroup::create(&bed.client_cgroup)?;
        cgroup::create(&bed.helper_cgroup)?;
        bed.namespaces.push(bed.node_netns.clone());
        netns::add(&bed.node_netns)?;
        // Forwarding lets pods reach each other through the node namespace.
        netns::sysctl(&bed.node_netns, "net/ipv4/ip_forward", "1")?;
        netns::sysctl(&bed.node_netns, "net/ipv6/conf/all/forwarding", "1")?;
        Ok(bed)
    }

    /// `fp-<tag>-<pid>-<n>`: the prefix of every name this bed uses.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The node (client-side) network namespace's name.
    pub fn node_netns(&self) -> &str {
        &self.node_netns
    }

    /// The client cgroup: give this to the proxy; [`Testbed::client`] runs the probe in it.
    pub fn cgroup_path(&self) -> &Path {
        &self.client_cgroup
    }

    /// The cgroup of the processes the bed starts (servers, daemons); a sibling of
    /// [`Testbed::cgroup_path`], so the proxy's programs do not apply to them.
    pub fn helper_cgroup(&self) -> &Path {
        &self.helper_cgroup
    }

    /// A private scratch folder (manifests, logs), removed with the bed.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn node_ipv4(&self) -> Ipv4Addr {
        NODE_IPV4
    }

    pub fn node_ipv6(&self) -> Ipv6Addr {
        NODE_IPV6
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    /// Adds a pod namespace with `ipv4` (in 198.18.0.0/15) and optionally `ipv6` (in
    /// 2001:db8::/32), a veth pair to the node namespace, and routes both ways.
    pub fn add_pod(&mut self, name: &str, ipv4: Ipv4Addr, ipv6: Option<Ipv6Addr>) -> Result<Pod> {
        self.check_new_pod(name, ipv4, ipv6)?;
        let pod = Pod {
            name: name.to_string(),
            netns: format!("{}-p-{name}", self.id),
            ipv4,
            ipv6,
            node_veth: format!("fpv{}", self.pod_veths),
        };
        self.pod_veths += 1;
        self.add_netns(&pod.netns)?;
        let mut pairs = vec![(IpAddr::V4(NODE_IPV4), IpAddr::V4(ipv4))];
        pairs.extend(ipv6.map(|v6| (IpAddr::V6(NODE_IPV6), IpAddr::V6(v6))));
        wire_veth(&self.node_netns, &pod.node_veth, &pod.netns, &pairs)
            .with_context(|| format!("wiring pod {name}"))?;
        self.pods.push(pod.clone());
        Ok(pod)
    }

    /// Removes pod `name` of this node as its runtime would: its device goes with its
    /// route, and its namespace. Its address is free for [`Testbed::add_pod`] again, on a
    /// device of another name. Processes serving in it stay until the bed closes, cut off.
    pub fn remove_pod(&mut self, name: &str) -> Result<()> {
        let at = self
            .pods
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("no pod {name} on this node"))?;
        let pod = self.pods.remove(at);
        ip(["-n", &self.node_netns, "link", "del", &pod.node_veth])?;
        self.namespaces.retain(|n| *n != pod.netns);
        netns::delete(&pod.netns)
    }

    /// Adds a second node: namespace `<id>-n-<name>` (forwarding on) at `ipv4` (in
    /// 198.18.0.0/15), joined to the bed's node namespace by a veth pair (`fpnK` there,
    /// `eth0` in the peer). The peer routes the whole test range back through the bed's node,
    /// so replies to anything in the bed return the way they came. Pods go on it with
    /// [`Testbed::add_pod_on`].
    pub fn add_peer_node(&mut self, name: &str, ipv4: Ipv4Addr) -> Result<PeerNode> {
        self.add_dual_stack_peer_node(name, ipv4, None)
    }

    /// As [`Testbed::add_peer_node`], also at `ipv6` (in 2001:db8::/32) when given, routing
    /// that test range back through the bed's node too.
    pub fn add_dual_stack_peer_node(
        &mut self,
        name: &str,
        ipv4: Ipv4Addr,
        ipv6: Option<Ipv6Addr>,
    ) -> Result<PeerNode> {
        check_name("peer node", name)?;
        check_test_ipv4(ipv4)?;
        if let Some(v6) = ipv6 {
            check_test_ipv6(v6)?;
        }
        if ipv4 == NODE_IPV4 || ipv6 == Some(NODE_IPV6) {
            bail!("peer node {name}: that address belongs to the bed's node namespace");
        }
        if let Some(other) = self
            .peers
            .iter()
            .find(|p| p.node.name == name || p.node.ipv4 == ipv4)
        {
            bail!(
                "peer node {name} clashes with peer node {} (same name or address)",
                other.node.name
            );
        }
        if let Some(pod) = self.pods.iter().find(|p| p.ipv4 == ipv4) {
            bail!("peer node {name}: {ipv4} belongs to pod {}", pod.name);
        }
        let node = PeerNode {
            name: name.to_string(),
            netns: format!("{}-n-{name}", self.id),
            ipv4,
            ipv6,
            bed_veth: format!("fpn{}", self.peers.len()),
        };
        self.add_netns(&node.netns)?;
        netns::sysctl(&node.netns, "net/ipv4/ip_forward", "1")?;
        netns::sysctl(&node.netns, "net/ipv6/conf/all/forwarding", "1")?;
        let mut pairs = vec![(IpAddr::V4(NODE_IPV4), IpAddr::V4(ipv4))];
        pairs.extend(ipv6.map(|v6| (IpAddr::V6(NODE_IPV6), IpAddr::V6(v6))));
        wire_veth(&self.node_netns, &node.bed_veth, &node.netns, &pairs)
            .with_context(|| format!("wiring peer node {name}"))?;
        self.peers.push(Peer {
            node: node.clone(),
            veths: 0,
        });
        Ok(node)
    }

    /// Adds a pod (IPv4 only; see [`Testbed::add_dual_stack_pod_on`]) on peer node `node`: like [`Testbed::add_pod`], but its veth
    /// pair joins it to the peer's namespace (the returned pod's `node_veth` names the end
    /// there), and the bed's node namespace routes `ipv4` via the peer. Pod names and
    /// addresses are unique across all nodes; [`Testbed::serve`] works on it as on any pod.
    pub fn add_pod_on(&mut self, node: &PeerNode, name: &str, ipv4: Ipv4Addr) -> Result<Pod> {
        self.add_dual_stack_pod_on(node, name, ipv4, None)
    }

    /// As [`Testbed::add_pod_on`], also at `ipv6` when given (the peer node must have an
    /// IPv6 address: see [`Testbed::add_dual_stack_peer_node`]).
    pub fn add_dual_stack_pod_on(
        &mut self,
        node: &PeerNode,
        name: &str,
        ipv4: Ipv4Addr,
        ipv6: Option<Ipv6Addr>,
    ) -> Result<Pod> {
        let index = self
            .peers
            .iter()
            .position(|p| p.node.netns == node.netns)
            .ok_or_else(|| anyhow!("{} is not a peer node of this test bed", node.name))?;
        self.check_new_pod(name, ipv4, ipv6)?;
        let node = self.peers[index].node.clone();
        let v6 = match (ipv6, node.ipv6) {
            (Some(pod), Some(peer)) => Some((pod, peer)),
            (None, _) => None,
            (Some(_), None) => bail!("pod {name}: peer node {} has no IPv6 address", node.name),
        };
        let pod = Pod {
            name: name.to_string(),
            netns: format!("{}-p-{name}", self.id),
            ipv4,
            ipv6,
            node_veth: format!("fpv{}", self.peers[index].veths),
        };
        self.peers[index].veths += 1;
        self.add_netns(&pod.netns)?;
        let mut pairs = vec![(IpAddr::V4(node.ipv4), IpAddr::V4(ipv4))];
        let mut routes = vec![format!(
            "-n {} route add {ipv4}/32 via {} dev {}",
            self.node_netns, node.ipv4, node.bed_veth
        )];
        if let Some((pod_v6, peer_v6)) = v6 {
            pairs.push((IpAddr::V6(peer_v6), IpAddr::V6(pod_v6)));
            routes.push(format!(
                "-n {} -6 route add {pod_v6}/128 via {peer_v6} dev {}",
                self.node_netns, node.bed_veth
            ));
        }
        wire_veth(&node.netns, &pod.node_veth, &pod.netns, &pairs)
            .and_then(|()| {
                routes
                    .iter()
                    .try_for_each(|r| ip(r.split_whitespace()).map(drop))
            })
            .with_context(|| format!("wiring pod {name} on peer node {}", node.name))?;
        self.pods.push(pod.clone());
        Ok(pod)
    }

    /// A pod's name and addresses must be valid, in the test ranges, and not yet taken by
    /// the node, a peer node or another pod.
    fn check_new_pod(&self, name: &str, ipv4: Ipv4Addr, ipv6: Option<Ipv6Addr>) -> Result<()> {
        check_name("pod", name)?;
        check_test_ipv4(ipv4)?;
        if let Some(v6) = ipv6 {
            check_test_ipv6(v6)?;
        }
        if ipv4 == NODE_IPV4 || ipv6 == Some(NODE_IPV6) {
            bail!("pod {name}: {NODE_IPV4} and {NODE_IPV6} belong to the node namespace");
        }
        if let Some(peer) = self.peers.iter().find(|p| p.node.ipv4 == ipv4) {
            bail!("pod {name}: {ipv4} belongs to peer node {}", peer.node.name);
        }
        if let Some(other) = self
            .pods
            .iter()
            .find(|p| p.name == name || p.ipv4 == ipv4 || (ipv6.is_some() && p.ipv6 == ipv6))
        {
            bail!(
                "pod {name} clashes with pod {} (same name or address)",
                other.name
            );
        }
        Ok(())
    }

    /// Creates network namespace `name`, registered first so teardown removes it even if
    /// creating it half-fails.
    fn add_netns(&mut self, name: &str) -> Result<()> {
        self.namespaces.push(name.to_string());
        netns::add(name)
    }

    /// Creates network namespace `<id>-<suffix>` (removed with the bed), for beds built on
    /// this one (see [`crate::cluster`]). Returns its name.
    pub fn add_namespace(&mut self, suffix: &str) -> Result<String> {
        check_name("namespace", suffix)?;
        let name = format!("{}-{suffix}", self.id);
        if self.namespaces.contains(&name) {
            bail!("namespace {name} exists already");
        }
        self.add_netns(&name)?;
        Ok(name)
    }

    /// Deletes a namespace made by [`Testbed::add_namespace`] now (a pod that is gone).
    pub fn remove_namespace(&mut self, name: &str) -> Result<()> {
        self.namespaces.retain(|n| n != name);
        netns::delete(name)
    }

    /// The bed's cgroup, under which beds built on this one make their own.
    pub fn cgroup_root(&self) -> &Path {
        &self.cgroup_root
    }

    /// Sends `sig` to helper `pid` (it stays ours until [`Testbed::stop`]).
    pub fn signal(&self, pid: u32, sig: libc::c_int) -> Result<()> {
        if !self.children.iter().any(|m| m.child.id() == pid) {
            bail!("pid {pid} is not a process of this test bed");
        }
        signal(pid, sig);
        Ok(())
    }

    /// Starts `probe_bin --netns <pod> serve [--name <pod>] ARGS...` (in the helpers cgroup) and
    /// waits (at most [`READY_TIMEOUT`]) for its "ready" line. `args` are `serve`'s options,
    /// e.g. `["--tcp", "0.0.0.0:8080", "--udp", "0.0.0.0:5353"]`; `--name` defaults to the
    /// pod's name. The server is killed when the bed goes. Returns its pid.
    pub fn serve<S: AsRef<std::ffi::OsStr>>(
        &mut self,
        probe_bin: &Path,
        pod: &Pod,
        args: &[S],
    ) -> Result<u32> {
        let mut cmd = Command::new(probe_bin);
        cmd.arg("--netns").arg(&pod.netns).arg("serve");
        if !args.iter().any(|a| a.as_ref() == "--name") {
            cmd.arg("--name").arg(&pod.name);
        }
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        self.prepare_helper(&mut cmd)?;
        let what = format!("probe server in pod {}", pod.name);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {what} ({})", probe_bin.display()))?;
        let pid = child.id();
        let stdout = child.stdout.take().expect("stdout is piped");
        self.children.push(Managed {
            child,
            grace: Duration::ZERO,
        });

        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            // Keeps draining after "ready" so the server never blocks on a full pipe.
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.trim() == "ready" => return Ok(pid),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    bail!("{what} did not say \"ready\" within {READY_TIMEOUT:?}")
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.wait_exit(pid, Duration::from_secs(2));
                    bail!(
                        "{what} exited before it was ready ({})",
                        describe_status(status)
                    );
                }
            }
        }
    }

    /// A command that runs the probe in the node namespace and the client cgroup:
    /// `probe_bin --netns <node> --cgroup <client>`; add the subcommand, e.g.
    /// `.args(["tcp", "198.19.0.10:80", "--count", "5"])`.
    pub fn client(&self, probe_bin: &Path) -> Command {
        let mut cmd = Command::new(probe_bin);
        cmd.arg("--netns")
            .arg(&self.node_netns)
            .arg("--cgroup")
            .arg(&self.client_cgroup);
        cmd.stdin(Stdio::null());
        cmd
    }

    /// Runs the probe client (see [`Testbed::client`]) with `args` and parses its lines.
    /// Bounded by the probe's own timeouts.
    pub fn probe<S: AsRef<std::ffi::OsStr>>(
        &self,
        probe_bin: &Path,
        args: &[S],
    ) -> Result<Vec<probe::Outcome>> {
        let mut cmd = self.client(probe_bin);
        cmd.args(args);
        let out = crate::cmd::output(&mut cmd)?;
        Ok(probe::parse(&out))
    }

    /// Makes `cmd` start in the helpers cgroup and in its own process group (so a Ctrl-C
    /// at the terminal reaches only us, and we tear down in order).
    fn prepare_helper(&self, cmd: &mut Command) -> Result<()> {
        let procs = std::ffi::CString::new(
            self.helper_cgroup
                .join("cgroup.procs")
                .as_os_str()
                .as_bytes(),
        )?;
        // SAFETY: the closure only makes async-signal-safe syscalls (open, write, close) on
        // memory allocated before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0\n".as_ptr().cast(), 2);
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if written < 0 { Err(err) } else { Ok(()) }
            });
        }
        cmd.process_group(0);
        Ok(())
    }

    /// Starts `cmd` as a helper (in the helpers cgroup, its own process group) that the bed
    /// stops on teardown: SIGTERM, then SIGKILL after `grace`. Returns its pid.
    pub fn spawn(&mut self, cmd: &mut Command, grace: Duration) -> Result<u32> {
        self.prepare_helper(cmd)?;
        let child = cmd
            .spawn()
            .with_context(|| format!("starting `{}`", crate::cmd::describe(cmd)))?;
        let pid = child.id();
        self.children.push(Managed { child, grace });
        Ok(pid)
    }

    /// The exit status of helper `pid` if it has exited (it stays ours until [`Testbed::stop`]).
    pub fn try_wait(&mut self, pid: u32) -> Result<Option<ExitStatus>> {
        let managed = self
            .children
            .iter_mut()
            .find(|m| m.child.id() == pid)
            .ok_or_else(|| anyhow!("pid {pid} is not a process of this test bed"))?;
        Ok(managed.child.try_wait()?)
    }

    /// Stops helper `pid` (SIGTERM; SIGKILL after its grace time) and returns how it ended.
    pub fn stop(&mut self, pid: u32) -> Result<ExitStatus> {
        let index = self
            .children
            .iter()
            .position(|m| m.child.id() == pid)
            .ok_or_else(|| anyhow!("pid {pid} is not a process of this test bed"))?;
        let mut managed = self.children.remove(index);
        Ok(stop_all(std::slice::from_mut(&mut managed))
            .pop()
            .flatten()
            .unwrap_or_else(|| {
                // Could not be reaped: report it as killed.
                std::os::unix::process::ExitStatusExt::from_raw(libc::SIGKILL)
            }))
    }

    fn wait_exit(&mut self, pid: u32, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.try_wait(pid) {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
                _ => return None,
            }
        }
    }

    /// Tears everything down now, reporting what could not be removed.
    pub fn close(mut self) -> Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let mut errors = Vec::new();
        stop_all(&mut self.children);
        self.children.clear();
        if let Err(e) = cgroup::remove_tree(&self.cgroup_root, Duration::from_secs(5)) {
            errors.push(format!("{e:#}"));
        }
        for name in self.namespaces.iter().rev() {
            if let Err(e) = netns::delete(name) {
                errors.push(format!("{e:#}"));
            }
        }
        // The owner record goes last: until then reap_stale can still finish the job.
        if let Err(e) = fs::remove_dir_all(&self.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            errors.push(format!("removing {}: {e}", self.dir.display()));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(anyhow!("test bed {}: {}", self.id, errors.join("; ")))
        }
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("{e:#}");
        }
    }
}

/// SIGTERM (or SIGKILL when grace is zero) to all, wait up to the longest grace, SIGKILL
/// the rest, reap. Returns each one's status (None if it could not be reaped).
fn stop_all(children: &mut [Managed]) -> Vec<Option<ExitStatus>> {
    let mut statuses: Vec<Option<ExitStatus>> = children
        .iter_mut()
        .map(|m| m.child.try_wait().ok().flatten())
        .collect();
    let mut longest = Duration::ZERO;
    for (m, status) in children.iter_mut().zip(&statuses) {
        if status.is_some() {
            continue;
        }
        if m.grace.is_zero() {
            let _ = m.child.kill();
        } else {
            signal(m.child.id(), libc::SIGTERM);
            longest = longest.max(m.grace);
        }
    }
    let deadline = Instant::now() + longest;
    loop {
        for (m, status) in children.iter_mut().zip(statuses.iter_mut()) {
            if status.is_none() {
                *status = m.child.try_wait().ok().flatten();
            }
        }
        if statuses.iter().all(Option::is_some) || Instant::now() >= deadline {
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    for (m, status) in children.iter_mut().zip(statuses.iter_mut()) {
        if status.is_none() {
            let _ = m.child.kill();
            *status = m.child.wait().ok();
        }
    }
    statuses
}

fn signal(pid: u32, sig: libc::c_int) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill has no memory-safety preconditions; pid is our own child.
        unsafe { libc::kill(pid, sig) };
    }
}

fn describe_status(status: Option<ExitStatus>) -> String {
    status.map_or_else(|| "status unknown".to_string(), |s| s.to_string())
}

/// Joins namespace `inner_ns` to `outer_ns` by a veth pair (`outer_dev` in `outer_ns`, `eth0`
/// in `inner_ns`). For each (outer, inner) address pair (both IPv4 or both IPv6): a /32
/// (/128) address on each end, in `outer_ns` a route to the inner address over `outer_dev`,
/// in `inner_ns` the outer address on-link and the family's whole test range via it.
pub(crate) fn wire_veth(
    outer_ns: &str,
    outer_dev: &str,
    inner_ns: &str,
    pairs: &[(IpAddr, IpAddr)],
) -> Result<()> {
    ip([
        "-n", outer_ns, "link", "add", outer_dev, "type", "veth", "peer", "name", "eth0", "netns",
        inner_ns,
    ])?;
    ip(["-n", outer_ns, "link", "set", outer_dev, "up"])?;
    ip(["-n", inner_ns, "link", "set", "eth0", "up"])?;
    for &(outer, inner) in pairs {
        // IPv6 addresses skip duplicate address detection, so they are usable at once.
        let (family, len, range, addr_opts, on_link) = match (outer, inner) {
            (IpAddr::V4(_), IpAddr::V4(_)) => ("-4", 32, "198.18.0.0/15", "", "scope link"),
            (IpAddr::V6(_), IpAddr::V6(_)) => ("-6", 128, "2001:db8::/32", "nodad", ""),
            _ => bail!("{outer} and {inner} are of different address families"),
        };
        // Every word is free of whitespace (names are checked), so a line splits into args.
        let (in_outer, in_inner) = (
            format!("-n {outer_ns} {family}"),
            format!("-n {inner_ns} {family}"),
        );
        for args in [
            format!("{in_outer} addr add {outer}/{len} dev {outer_dev} {addr_opts}"),
            format!("{in_inner} addr add {inner}/{len} dev eth0 {addr_opts}"),
            format!("{in_outer} route add {inner}/{len} dev {outer_dev} src {outer}"),
            format!("{in_inner} route add {outer}/{len} dev eth0 {on_link} src {inner}"),
            format!("{in_inner} route add {range} via {outer} dev eth0 src {inner}"),
        ] {
            ip(args.split_whitespace())?;
        }
    }
    Ok(())
}

/// Removes `fp-*` network namespaces, cgroups and scratch folders whose creating process is
/// dead (or whose pid now belongs to another process). Returns what it removed.
pub fn reap_stale() -> Result<Vec<String>> {
    let mut reaped = Vec::new();
    let mut errors = Vec::new();
    for name in netns::list() {
        if stale(&name) {
            match netns::delete(&name) {
                Ok(()) => reaped.push(format!("netns {name}")),
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
    }
    if let Some(mount) = cgroup::find_cgroup2_mount()? {
        for name in dir_names(&mount) {
            if stale(&name) {
                match cgroup::remove_tree(&mount.join(&name), Duration::from_secs(5)) {
                    Ok(()) => reaped.push(format!("cgroup {name}")),
                    Err(e) => errors.push(format!("{e:#}")),
                }
            }
        }
    }
    for name in dir_names(Path::new(RUN_DIR)) {
        if stale(&name) {
            // A bed may have mounted a bpffs in its folder (see crate::cluster).
            unmount_under(&Path::new(RUN_DIR).join(&name));
            match fs::remove_dir_all(Path::new(RUN_DIR).join(&name)) {
                Ok(()) => reaped.push(format!("folder {RUN_DIR}/{name}")),
                Err(e) => errors.push(format!("removing {RUN_DIR}/{name}: {e}")),
            }
        }
    }
    if errors.is_empty() {
        Ok(reaped)
    } else {
        Err(anyhow!("{}", errors.join("; ")))
    }
}

/// Lazily unmounts every mount at or below `dir`.
fn unmount_under(dir: &Path) {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    for target in mounts.lines().filter_map(|l| l.split_whitespace().nth(1)) {
        if Path::new(target).starts_with(dir) {
            let _ = Command::new("umount").arg("-l").arg(target).status();
        }
    }
}

fn dir_names(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

/// Splits `fp-<tag>-<pid>-<n>[-...]` into (`fp-<tag>-<pid>-<n>`, pid).
pub fn parse_name(name: &str) -> Option<(String, u32)> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let mut parts = rest.splitn(4, '-');
    let (tag, pid, n) = (parts.next()?, parts.next()?, parts.next()?);
    if tag.is_empty()
        || !tag
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return None;
    }
    let pid: u32 = pid.parse().ok()?;
    n.parse::<u32>().ok()?;
    Some((format!("{NAME_PREFIX}{tag}-{pid}-{n}"), pid))
}

/// True if `name` is one of ours and its owner is gone.
fn stale(name: &str) -> bool {
    let Some((id, pid)) = parse_name(name) else {
        return false;
    };
    let Some(now) = proc_start_time(pid) else {
        return true;
    };
    let record = fs::read_to_string(Path::new(RUN_DIR).join(&id).join(OWNER_FILE)).ok();
    match record.as_deref().and_then(|r| {
        let mut f = r.split_whitespace();
        Some((
            f.next()?.parse::<u32>().ok()?,
            f.next()?.parse::<u64>().ok()?,
        ))
    }) {
        // The pid is alive: stale only if it is another process than the one recorded.
        Some((rpid, rstart)) if rpid == pid => rstart != now,
        _ => false,
    }
}

/// Field 22 of /proc/PID/stat (start time in clock ticks since boot); None if no such pid.
fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// Lowercase letters and digits only, at most 8; `tb` if nothing is left.
fn sanitize_tag(tag: &str) -> String {
    let tag: String = tag
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_lowercase())
        .take(8)
        .collect();
    if tag.is_empty() {
        "tb".to_string()
    } else {
        tag
    }
}

fn check_name(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !name.starts_with('.');
    if !ok {
        bail!("bad {what} name {name:?}: use 1-32 letters, digits, '-', '_' or '.'");
    }
    Ok(())
}

/// Test addresses must lie in 198.18.0.0/15 (RFC 2544 benchmarking space).
pub fn check_test_ipv4(ip: Ipv4Addr) -> Result<()> {
    let [a, b, ..] = ip.octets();
    if a != 198 || (b != 18 && b != 19) {
        bail!("{ip} is outside 198.18.0.0/15, the only IPv4 range tests may use");
    }
    Ok(())
}

/// Test addresses must lie in 2001:db8::/32 (documentation space).
pub fn check_test_ipv6(ip: Ipv6Addr) -> Result<()> {
    let s = ip.segments();
    if s[0] != 0x2001 || s[1] != 0xdb8 {
        bail!("{ip} is outside 2001:db8::/32, the only IPv6 range tests may use");
    }
    Ok(())
}

/// [`check_test_ipv4`] or [`check_test_ipv6`].
pub fn check_test_ip(ip: IpAddr) -> Result<()> {
    match ip {
        IpAddr::V4(v4) => check_test_ipv4(v4),
        IpAddr::V6(v6) => check_test_ipv6(v6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(
            parse_name("fp-demo-123-4-node"),
            Some(("fp-demo-123-4".into(), 123))
        );
        assert_eq!(
            parse_name("fp-demo-123-4-p-pod-1"),
            Some(("fp-demo-123-4".into(), 123))
        );
        assert_eq!(
            parse_name("fp-demo-123-4"),
            Some(("fp-demo-123-4".into(), 123))
        );
        assert_eq!(parse_name("fp-demo-x-4"), None);
        assert_eq!(parse_name("fp-Demo-1-4"), None);
        assert_eq!(parse_name("fastpath"), None);
        assert_eq!(parse_name("fp-demo-12"), None);
        assert_eq!(sanitize_tag("Pod_To-Pod v6!"), "podtopod");
        assert_eq!(sanitize_tag("--"), "tb");
    }

    #[test]
    fn only_test_ranges() {
        assert!(check_test_ipv4(Ipv4Addr::new(198, 18, 1, 1)).is_ok());
        assert!(check_test_ipv4(Ipv4Addr::new(198, 19, 0, 10)).is_ok());
        assert!(check_test_ipv4(Ipv4Addr::new(198, 20, 0, 1)).is_err());
        assert!(check_test_ipv4(Ipv4Addr::new(10, 0, 0, 1)).is_err());
        assert!(check_test_ipv6("2001:db8::1".parse().unwrap()).is_ok());
        assert!(check_test_ipv6("2001:db9::1".parse().unwrap()).is_err());
        assert!(check_test_ip("fd00::1".parse().unwrap()).is_err());
    }

    #[test]
    fn own_start_time_is_readable() {
        assert!(proc_start_time(std::process::id()).is_some());
        assert!(proc_start_time(u32::MAX).is_none());
    }
}
