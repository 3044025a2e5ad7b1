//! Running `nft`: one transaction per call (`nft -f -` applies its whole input atomically,
//! or none of it), optionally in another network namespace, behind the [`Nft`] interface
//! unit tests fake; and removing our tables.

use std::{
    net::IpAddr,
    sync::{Arc, Mutex},
};

use super::{
    elements,
    render::{ElementChange, TABLE, elements_text, family_name},
};
use crate::dataplane::{
    iptables::{
        Family,
        apply::{ApplyError, Runner, Tools, run_bounded},
        conntrack::{Deleted, Flow},
    },
    leftovers, netns,
};

/// Everything the nftables proxier runs on the node for one family.
pub trait Nft: Send {
    fn family(&self) -> Family;
    /// `nft -f -`: all of `transaction` or nothing.
    fn run(&self, transaction: &str) -> Result<(), ApplyError>;
    /// Element changes only, as one transaction: by default through [`Nft::run`].
    fn run_elements(&self, changes: &[ElementChange]) -> Result<(), ApplyError> {
        self.run(&elements_text(self.family(), changes))
    }
    /// The node's addresses of this family (loopback included).
    fn local_addresses(&self) -> Result<Vec<IpAddr>, ApplyError>;
    /// The UDP entries of this family's conntrack table.
    fn conntrack_udp(&self) -> Result<Vec<Flow>, ApplyError>;
    /// Deletes UDP conntrack entries in one batch.
    fn conntrack_delete(&self, flows: &[Flow]) -> Result<Deleted, ApplyError>;
}

/// The real tools. Addresses and conntrack go through the iptables mode's runner, which
/// reads them over netlink and `ip` without touching iptables.
pub struct NftRunner {
    family: Family,
    netns: Option<String>,
    other: Runner,
}

impl NftRunner {
    pub fn new(family: Family, netns: Option<String>) -> Self {
        NftRunner {
            family,
            other: Runner::new(family, netns.clone()),
            netns,
        }
    }
}

impl Nft for NftRunner {
    fn family(&self) -> Family {
        self.family
    }
    fn run(&self, transaction: &str) -> Result<(), ApplyError> {
        let mut cmd = netns::command(self.netns.as_deref(), "nft");
        cmd.args(["-f", "-"]);
        run_bounded(cmd, Some(transaction)).map(drop)
    }
    /// Over netlink, as one batch: an `nft` run would first dump every chain, which costs
    /// more than the change at 10,000 services (docs/modes.md).
    fn run_elements(&self, changes: &[ElementChange]) -> Result<(), ApplyError> {
        if changes.len() > elements::MAX_BATCH {
            return self.run(&elements_text(self.family, changes));
        }
        elements::apply(self.netns.as_deref(), self.family, changes).map_err(|source| {
            ApplyError::Netlink {
                what: "nf_tables element changes",
                source,
            }
        })
    }
    fn local_addresses(&self) -> Result<Vec<IpAddr>, ApplyError> {
        self.other.local_addresses()
    }
    fn conntrack_udp(&self) -> Result<Vec<Flow>, ApplyError> {
        self.other.conntrack_udp()
    }
    fn conntrack_delete(&self, flows: &[Flow]) -> Result<Deleted, ApplyError> {
        self.other.conntrack_delete(flows)
    }
}

/// A stand-in that records every transaction and fails when told to.
#[derive(Clone, Default)]
pub struct FakeNft {
    pub family: Option<Family>,
    pub transactions: Arc<Mutex<Vec<String>>>,
    pub fail: Arc<Mutex<bool>>,
    pub addresses: Vec<IpAddr>,
}

impl FakeNft {
    pub fn new(family: Family) -> Self {
        FakeNft {
            family: Some(family),
            ..FakeNft::default()
        }
    }

    /// The transactions run so far.
    pub fn recorded(&self) -> Vec<String> {
        self.transactions
            .lock()
            .map(|t| t.clone())
            .unwrap_or_default()
    }

    pub fn set_fail(&self, fail: bool) {
        if let Ok(mut f) = self.fail.lock() {
            *f = fail;
        }
    }
}

impl Nft for FakeNft {
    fn family(&self) -> Family {
        self.family.unwrap_or(Family::V4)
    }
    fn run(&self, transaction: &str) -> Result<(), ApplyError> {
        if self.fail.lock().is_ok_and(|f| *f) {
            return Err(ApplyError::Failed {
                command: "nft -f -".into(),
                status: "exit status: 1".into(),
                stderr: "told to fail".into(),
            });
        }
        if let Ok(mut t) = self.transactions.lock() {
            t.push(transaction.to_string());
        }
        Ok(())
    }
    fn local_addresses(&self) -> Result<Vec<IpAddr>, ApplyError> {
        Ok(self.addresses.clone())
    }
    fn conntrack_udp(&self) -> Result<Vec<Flow>, ApplyError> {
        Ok(Vec::new())
    }
    fn conntrack_delete(&self, _: &[Flow]) -> Result<Deleted, ApplyError> {
        Ok(Deleted::default())
    }
}

/// Deletes our tables (`ip fastpath`, `ip6 fastpath`) in `netns`: the nftables mode's
/// state, removed by every other mode and by `--cleanup`. Returns the families whose table
/// went.
pub fn remove_tables(netns: Option<&str>) -> Result<Vec<&'static str>, ApplyError> {
    leftovers::nftables::remove_tables_named(netns, TABLE)
}

/// The statement that deletes one family's table whether or not it exists.
pub fn delete_table_text(family: Family) -> String {
    let f = family_name(family);
    format!("add table {f} {TABLE}\ndelete table {f} {TABLE}\n")
}
