//! What kube-proxy's modes leave on a node, removed when fastpath takes it over, as
//! kube-proxy's own CleanupLeftovers removes its other modes' state:
//!
//! - its iptables mode: chains we remove as our iptables mode's (same names, see
//!   [`crate::dataplane::iptables::render::is_our_chain`]);
//! - its nftables mode: the tables `ip kube-proxy` and `ip6 kube-proxy` ([`nftables`]);
//! - its IPVS mode: the IPVS virtual servers and the `kube-ipvs0` dummy device ([`ipvs`]),
//!   its iptables chains ([`is_ipvs_chain`]) and then its ipsets ([`ipset`]), which the
//!   kernel refuses to destroy while a rule still references them.
//!
//! Everything here blocks (tools, netlink) and runs where the proxier runs (`netns`). A
//! missing tool means that mode's state cannot exist here: it is skipped, not an error.

pub mod ipset;
pub mod ipvs;
pub mod nftables;

use std::path::Path;

use super::iptables::{
    Table,
    apply::{ApplyError, Saved, Tools},
    render,
};

/// kube-proxy's IPVS-mode chains (pkg/proxy/ipvs: iptablesCleanupChains, plus the nat
/// KUBE-FIREWALL of releases before 1.23). The filter table's KUBE-FIREWALL is the
/// kubelet's and stays.
const IPVS_NAT_CHAINS: [&str; 6] = [
    "KUBE-SERVICES",
    "KUBE-POSTROUTING",
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
    "KUBE-MARK-MASQ",
    "KUBE-FIREWALL",
];
const IPVS_FILTER_CHAINS: [&str; 6] = [
    "KUBE-FORWARD",
    "KUBE-NODE-PORT",
    "KUBE-PROXY-FIREWALL",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

/// True for a chain kube-proxy's IPVS mode makes in `table`.
pub fn is_ipvs_chain(table: Table, chain: &str) -> bool {
    match table {
        Table::Nat => IPVS_NAT_CHAINS.contains(&chain),
        Table::Filter => IPVS_FILTER_CHAINS.contains(&chain),
    }
}

/// An IPVS-mode chain whose name our iptables mode does not use: what that mode removes.
/// The shared ones (KUBE-SERVICES, ...) it rewrites at its first sync; their rules that
/// match kube-proxy's ipsets go first ([`remove_set_rules`]).
pub fn is_ipvs_only_chain(table: Table, chain: &str) -> bool {
    is_ipvs_chain(table, chain) && !render::is_our_chain(table, chain)
}

/// Deletes every rule in the nat and filter tables that matches one of kube-proxy's ipsets
/// (`-m set --match-set KUBE-...`): only kube-proxy's IPVS mode writes them, and while one
/// stays the set cannot be destroyed. Returns how many went.
pub fn remove_set_rules(runner: &dyn Tools) -> Result<usize, ApplyError> {
    let saved = runner.save()?;
    let (text, count) = set_rules_removal(&saved);
    if count > 0 {
        runner.restore(&text)?;
    }
    Ok(count)
}

/// The restore input deleting the rules [`remove_set_rules`] removes, and their count.
pub fn set_rules_removal(saved: &Saved) -> (String, usize) {
    let names = ipset::kube_proxy_set_names();
    let mut out = String::new();
    let mut count = 0;
    for table in [Table::Filter, Table::Nat] {
        let Some(t) = saved.table(table) else {
            continue;
        };
        let lines: Vec<&String> = t
            .rules
            .iter()
            .map(|(_, line)| line)
            .filter(|line| matches_kube_proxy_set(line, &names))
            .collect();
        if lines.is_empty() {
            continue;
        }
        out.push_str(&format!("*{}\n", table.name()));
        for line in &lines {
            // "-A CHAIN ..." -> "-D CHAIN ...": the rule exactly as saved.
            out.push_str(&format!("-D {}\n", &line[3..]));
        }
        out.push_str("COMMIT\n");
        count += lines.len();
    }
    (out, count)
}

fn matches_kube_proxy_set(line: &str, names: &[String]) -> bool {
    let mut words = line.split_whitespace();
    while let Some(w) = words.next() {
        if w == "--match-set"
            && words
                .next()
                .is_some_and(|set| names.iter().any(|n| n == set))
        {
            return true;
        }
    }
    false
}

/// Whether `program` is an executable file on our PATH (the same file system in every
/// network namespace, so `ip netns exec` would find it too).
pub fn tool_exists(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path).any(|dir| {
        let p: &Path = &dir.join(program);
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipvs_chains_are_kube_proxys_and_the_kubelets_firewall_is_not() {
        assert!(is_ipvs_chain(Table::Nat, "KUBE-LOAD-BALANCER"));
        assert!(is_ipvs_chain(Table::Nat, "KUBE-FIREWALL"));
        assert!(is_ipvs_chain(Table::Filter, "KUBE-IPVS-FILTER"));
        assert!(!is_ipvs_chain(Table::Filter, "KUBE-FIREWALL"));
        assert!(!is_ipvs_chain(Table::Filter, "KUBE-KUBELET-CANARY"));
        // Our iptables mode keeps the names it shares, and removes the rest.
        assert!(!is_ipvs_only_chain(Table::Nat, "KUBE-SERVICES"));
        assert!(is_ipvs_only_chain(Table::Nat, "KUBE-NODE-PORT"));
        assert!(is_ipvs_only_chain(
            Table::Filter,
            "KUBE-SOURCE-RANGES-FIREWALL"
        ));
    }

    #[test]
    fn only_rules_matching_kube_proxys_sets_are_deleted() {
        let saved = Saved::parse(
            "*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-SERVICES -m set --match-set KUBE-6-CLUSTER-IP dst,dst -j ACCEPT
-A PREROUTING -m set --match-set my-own-set src -j ACCEPT
-A PREROUTING -m set --match-set KUBE-CLUSTER-IPX src -j ACCEPT
COMMIT
*filter
:INPUT ACCEPT [0:0]
COMMIT
",
        );
        let (text, count) = set_rules_removal(&saved);
        assert_eq!(count, 2, "{text}");
        assert!(
            text.starts_with("*nat\n-D KUBE-SERVICES -m comment"),
            "{text}"
        );
        assert!(
            !text.contains("my-own-set") && !text.contains("IPX"),
            "{text}"
        );
        assert_eq!(set_rules_removal(&Saved::default()), (String::new(), 0));
    }

    #[test]
    fn tools_are_found_on_the_path_and_made_up_ones_are_not() {
        assert!(tool_exists("sh"));
        assert!(!tool_exists("fastpath-no-such-tool"));
    }
}
