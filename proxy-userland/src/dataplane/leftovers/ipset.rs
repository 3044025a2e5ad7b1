//! kube-proxy's IPVS mode matches its services through ipsets (pkg/proxy/ipvs/ipset.go).
//! Like its CleanupLeftovers we destroy exactly the sets it makes, by name, and only after
//! the iptables rules that match them are gone (the kernel keeps a set that a rule uses).

use crate::dataplane::{
    iptables::apply::{ApplyError, run_bounded},
    netns,
};

/// The IPv4 sets kube-proxy's IPVS mode makes (ipsetInfo, and KUBE-IPVS-IPS of 1.26+).
const SETS: [&str; 17] = [
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
];

/// The longest name ipset takes; kube-proxy cuts its IPv6 names to it.
const MAX_NAME: usize = 31;

/// Every name kube-proxy may have given a set: the IPv4 ones, and the IPv6 ones it derives
/// from them ("KUBE-" becomes "KUBE-6-", cut to 31 characters).
pub fn kube_proxy_set_names() -> Vec<String> {
    let mut names: Vec<String> = SETS.iter().map(|s| s.to_string()).collect();
    for s in SETS {
        let mut v6 = s.replacen("KUBE-", "KUBE-6-", 1);
        v6.truncate(MAX_NAME);
        names.push(v6);
    }
    names
}

/// Destroys kube-proxy's sets in `netns`; returns their names. Without `ipset` there is
/// nothing to do.
pub fn destroy(netns: Option<&str>) -> Result<Vec<String>, ApplyError> {
    if !super::tool_exists("ipset") {
        return Ok(Vec::new());
    }
    let mut list = netns::command(netns, "ipset");
    list.args(["list", "-n"]);
    let present = kube_proxy_sets_in(&run_bounded(list, None)?);
    for name in &present {
        let mut destroy = netns::command(netns, "ipset");
        destroy.args(["destroy", name]);
        run_bounded(destroy, None)?;
    }
    Ok(present)
}

/// kube-proxy's sets among the names `ipset list -n` printed, one a line.
pub fn kube_proxy_sets_in(listing: &str) -> Vec<String> {
    let ours = kube_proxy_set_names();
    listing
        .lines()
        .map(str::trim)
        .filter(|name| ours.iter().any(|o| o == name))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_names_are_derived_and_cut_as_kube_proxy_does() {
        let names = kube_proxy_set_names();
        assert!(names.contains(&"KUBE-6-CLUSTER-IP".to_string()));
        // "KUBE-6-LOAD-BALANCER-SOURCE-CIDR" is 32 characters: the last one goes.
        assert!(names.contains(&"KUBE-6-LOAD-BALANCER-SOURCE-CID".to_string()));
        assert!(names.iter().all(|n| n.len() <= MAX_NAME));
    }

    #[test]
    fn only_kube_proxys_sets_are_picked_from_the_listing() {
        let listing = "KUBE-CLUSTER-IP\nmy-set\nKUBE-6-LOOP-BACK\nKUBE-CLUSTER-IP-X\n";
        assert_eq!(
            kube_proxy_sets_in(listing),
            ["KUBE-CLUSTER-IP", "KUBE-6-LOOP-BACK"]
        );
    }
}
