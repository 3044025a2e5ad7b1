//! What the EndpointSlice controller and the kubelet do for a Deployment, at a realistic
//! pace: pods start and are listed once ready; a rolling update (maxSurge 1, maxUnavailable
//! 0) starts a new pod, lists it, then marks an old one terminating (ready=false,
//! serving=true, terminating=true) and sends its server SIGTERM, which keeps serving for a
//! drain period; then the old one leaves the slice and, a grace period later, its server is
//! killed and its namespace deleted; a lost node takes all its pods at once, and the slice
//! hears of it a detection delay later.

use std::{
    net::Ipv4Addr,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Result;

use super::{
    Cluster,
    objects::{self, EndpointSpec},
};
use crate::testbed::Pod;

/// How long each step of a rollout waits.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// After a new pod is listed ready, before an old one starts terminating: every node
    /// hears of the new pod first (the rollout's minReadySeconds).
    pub settle: Duration,
    /// Terminating and serving: the old pod drains.
    pub drain: Duration,
    /// Out of the slice, still running: proxies that have not heard yet still reach it
    /// (terminationGracePeriodSeconds after the preStop drain).
    pub grace: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            settle: Duration::from_millis(1500),
            drain: Duration::from_secs(2),
            grace: Duration::from_millis(1500),
        }
    }
}

/// One running pod of a Deployment.
#[derive(Clone, Debug)]
pub struct PodState {
    pub endpoint: EndpointSpec,
    /// Index of its node in [`Cluster::nodes`].
    pub node: usize,
    pub pod: Pod,
    server: u32,
}

/// A Deployment behind one Service, with one EndpointSlice.
pub struct Deployment {
    pub service: String,
    pub cluster_ip: Ipv4Addr,
    pub pods: Vec<PodState>,
    generation: u32,
    made: u32,
}

/// Unix time in milliseconds, to compare with the load clients' failure times.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Deployment {
    /// Creates Service `name` on `cluster_ip` (node ports shifted by `shift`, see
    /// [`objects::service`]; externalTrafficPolicy Local with that health check node port
    /// when `local` is given) and `replicas` pods, pod k on node `placement(k)`, listed once
    /// all serve.
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        c: &mut Cluster,
        name: &str,
        cluster_ip: Ipv4Addr,
        shift: u16,
        local: Option<u16>,
        replicas: usize,
        placement: &dyn Fn(usize) -> usize,
    ) -> Result<Deployment> {
        c.api
            .apply("services", objects::service(name, cluster_ip, shift, local));
        let mut d = Deployment {
            service: name.to_string(),
            cluster_ip,
            pods: Vec::new(),
            generation: 1,
            made: 0,
        };
        for k in 0..replicas {
            let pod = d.start_pod(c, placement(k))?;
            d.pods.push(pod);
        }
        d.publish(c);
        Ok(d)
    }

    /// The slice as the pods stand now.
    fn publish(&self, c: &Cluster) {
        let eps: Vec<EndpointSpec> = self.pods.iter().map(|p| p.endpoint.clone()).collect();
        c.api
            .apply("endpointslices", objects::slice(&self.service, &eps));
    }

    /// Starts a pod on node `node` and waits until its server answers (readiness).
    fn start_pod(&mut self, c: &mut Cluster, node: usize) -> Result<PodState> {
        self.made += 1;
        let name = format!("{}-g{}-{}", self.service, self.generation, self.made);
        let n = &c.nodes[node];
        let (node_name, zone, cgroup) = (n.name.clone(), n.zone.clone(), n.cgroup.clone());
        let pod = c.add_pod_netns(node, &name)?;
        let ip = pod.ipv4;
        // In the node's cgroup, as the kubelet puts pods; serving until deleted.
        let probe = c.probe_bin().to_path_buf();
        let server = c.bed.serve(
            &probe,
            &pod,
            &[
                "--cgroup".as_ref(),
                cgroup.as_os_str(),
                "--tcp".as_ref(),
                "0.0.0.0:8080".as_ref(),
                "--http".as_ref(),
                "0.0.0.0:8081".as_ref(),
                "--udp".as_ref(),
                "0.0.0.0:5353".as_ref(),
                "--drain-ms".as_ref(),
                "600000".as_ref(),
            ],
        )?;
        Ok(PodState {
            endpoint: EndpointSpec {
                pod: name,
                ip,
                node: node_name,
                zone,
                ready: true,
                serving: true,
                terminating: false,
            },
            node,
            pod,
            server,
        })
    }

    /// Kills a pod's server and deletes its namespace (the pod is gone).
    fn delete_pod(c: &mut Cluster, pod: &PodState) -> Result<()> {
        c.bed.stop(pod.server)?;
        c.bed.remove_namespace(&pod.pod.netns)
    }

    /// Replaces every pod, one at a time; the replacement of a pod on node n goes on node
    /// `placement(n)`. See the module documentation for the steps. Stops between pods
    /// after a Ctrl-C ([`crate::signals`]).
    pub fn rolling_update(
        &mut self,
        c: &mut Cluster,
        timing: Timing,
        placement: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        self.generation += 1;
        let old: Vec<String> = self.pods.iter().map(|p| p.endpoint.pod.clone()).collect();
        for name in old {
            // The demo's Ctrl-C: leave the rest of the rollout undone.
            if crate::signals::stop_requested() {
                break;
            }
            let Some(old_node) = self
                .pods
                .iter()
                .find(|p| p.endpoint.pod == name)
                .map(|p| p.node)
            else {
                continue;
            };
            let new = self.start_pod(c, placement(old_node))?;
            self.pods.push(new);
            self.publish(c);
            std::thread::sleep(timing.settle);

            self.retire(c, &[name], timing)?;
        }
        Ok(())
    }

    /// Scales to `replicas`: new pods (pod k of the Deployment on node `placement(k)`) are
    /// listed once they serve; surplus pods, newest first, go as in a rollout (terminating
    /// and draining, out of the slice, deleted after the grace period).
    pub fn scale(
        &mut self,
        c: &mut Cluster,
        replicas: usize,
        timing: Timing,
        placement: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        while self.pods.len() < replicas {
            let pod = self.start_pod(c, placement(self.pods.len()))?;
            self.pods.push(pod);
        }
        self.publish(c);
        let surplus = self.pods.len().saturating_sub(replicas);
        if surplus == 0 {
            return Ok(());
        }
        let newest: Vec<String> = self.pods[self.pods.len() - surplus..]
            .iter()
            .map(|p| p.endpoint.pod.clone())
            .collect();
        self.retire(c, &newest, timing)
    }

    /// Takes pods `names` out as the kubelet and the EndpointSlice controller do: marked
    /// terminating (ready=false, serving=true) and sent SIGTERM, drained, out of the slice,
    /// and after the grace period killed and their namespaces deleted.
    fn retire(&mut self, c: &mut Cluster, names: &[String], timing: Timing) -> Result<()> {
        for old in self
            .pods
            .iter_mut()
            .filter(|p| names.contains(&p.endpoint.pod))
        {
            old.endpoint.ready = false;
            old.endpoint.terminating = true;
            c.bed.signal(old.server, libc::SIGTERM)?;
        }
        self.publish(c);
        std::thread::sleep(timing.drain);
        let (gone, kept): (Vec<PodState>, Vec<PodState>) = self
            .pods
            .drain(..)
            .partition(|p| names.contains(&p.endpoint.pod));
        self.pods = kept;
        self.publish(c);
        std::thread::sleep(timing.grace);
        gone.iter().try_for_each(|p| Self::delete_pod(c, p))
    }

    /// Node `node` is lost with all its pods at once (its uplink cut, its daemon and pods
    /// gone); `detect` later the slice drops them, as the node lifecycle and EndpointSlice
    /// controllers do. Returns when the slice was updated ([`unix_ms`]).
    pub fn lose_node(&mut self, c: &mut Cluster, node: usize, detect: Duration) -> Result<u64> {
        c.cut_node(node)?;
        let (gone, kept): (Vec<PodState>, Vec<PodState>) =
            self.pods.drain(..).partition(|p| p.node == node);
        self.pods = kept;
        for pod in &gone {
            Self::delete_pod(c, pod)?;
        }
        std::thread::sleep(detect);
        let at = unix_ms();
        self.publish(c);
        Ok(at)
    }

    /// The pods' names on node `node`.
    pub fn pods_on(&self, node: usize) -> Vec<String> {
        self.pods
            .iter()
            .filter(|p| p.node == node)
            .map(|p| p.endpoint.pod.clone())
            .collect()
    }
}
