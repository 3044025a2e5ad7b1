//! kube-proxy's nftables mode keeps everything in two tables of its own, `ip kube-proxy`
//! and `ip6 kube-proxy` (pkg/proxy/nftables); its CleanupLeftovers deletes both, and so do
//! we. Other tables (the node's firewall, iptables-nft's `ip nat`, a CNI's) stay.

use crate::dataplane::{
    iptables::apply::{ApplyError, run_bounded},
    netns,
};

/// The name of kube-proxy's table in each family.
pub const TABLE: &str = "kube-proxy";

/// Deletes kube-proxy's tables in `netns`; returns the families whose table went (e.g.
/// `["ip", "ip6"]`). Without `nft` there is nothing to do (nor could kube-proxy have made
/// them through it).
pub fn remove_tables(netns: Option<&str>) -> Result<Vec<&'static str>, ApplyError> {
    remove_tables_named(netns, TABLE)
}

/// Deletes the tables `table` of the families `ip` and `ip6` in `netns` (kube-proxy's, or
/// our own nftables mode's); returns the families whose table went.
pub fn remove_tables_named(
    netns: Option<&str>,
    table: &str,
) -> Result<Vec<&'static str>, ApplyError> {
    if !super::tool_exists("nft") {
        return Ok(Vec::new());
    }
    let mut list = netns::command(netns, "nft");
    list.args(["list", "tables"]);
    let families = families_holding(&run_bounded(list, None)?, table);
    for family in &families {
        let mut delete = netns::command(netns, "nft");
        delete.args(["delete", "table", family, table]);
        run_bounded(delete, None)?;
    }
    Ok(families)
}

/// The families that hold a `kube-proxy` table in `nft list tables` output
/// (`table ip kube-proxy` lines).
pub fn kube_proxy_families(listing: &str) -> Vec<&'static str> {
    families_holding(listing, TABLE)
}

/// The families (`ip`, `ip6` only) that hold a table `table` in `nft list tables` output.
pub fn families_holding(listing: &str, table: &str) -> Vec<&'static str> {
    let mut found = Vec::new();
    for line in listing.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let ["table", family, name] = words.as_slice()
            && *name == table
        {
            // Only the families kube-proxy uses: an `inet kube-proxy` is someone else's.
            for known in ["ip", "ip6"] {
                if *family == known && !found.contains(&known) {
                    found.push(known);
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_kube_proxys_own_tables_are_picked() {
        let listing = "table ip filter\ntable ip kube-proxy\ntable inet kube-proxy\n\
                       table ip6 kube-proxy\ntable ip kube-proxy-extra\ntable ip6 nat\n";
        assert_eq!(kube_proxy_families(listing), ["ip", "ip6"]);
        assert!(kube_proxy_families("table ip nat\n").is_empty());
        assert!(kube_proxy_families("").is_empty());
    }
}
