//! A full sync in bounded parts (`Rendered::full_transactions`): played in order, over an
//! empty table or over the table a previous state left, the parts must add up to what one
//! full render of the new state holds, in the model and in the kernel.

use std::{
    io::Write as _,
    process::{Command, Stdio},
};

use super::{
    fake::FakeProxier,
    proxier_test::{our_overall_flows, overall_state},
    *,
};
use crate::{
    dataplane::{
        iptables::kube_tests::{ep, make_test_service, node, port, slice, state},
        nftables::render::Rendered,
    },
    model::{Protocol::Tcp, ProxyState, ServiceKey},
};

/// `n` services of 3 endpoints each, the endpoints shifted by `shift` (a pod or two per
/// service replaced when it changes).
fn many(n: u8, shift: u8) -> ProxyState {
    state(
        (0..n)
            .map(|i| {
                let svc =
                    make_test_service("ns", &format!("s{i}"), &format!("198.19.1.{i}"), |s| {
                        s.ports = vec![port("p80", 80, Tcp, None)];
                    });
                let eps = (0..3)
                    .map(|e| ep(&format!("198.18.{i}.{}", e + shift + 1), None))
                    .collect();
                (svc, Some(slice(eps, &[("p80", 80, Tcp)])))
            })
            .collect(),
    )
}

fn rendered(fp: &FakeProxier, st: &ProxyState) -> Rendered {
    Rendered::new(st, &node(), fp.family, &fp.config())
}

/// As the sync builds a table written over `previous`: chains keep their map slots.
fn rendered_over(fp: &FakeProxier, st: &ProxyState, previous: &Rendered) -> Rendered {
    Rendered::new_over(st, &node(), fp.family, &fp.config(), Some(previous))
}

/// The part of the text one service adds: the budget may be passed by that much.
const LARGEST_SERVICE: usize = 2_000;

#[test]
fn a_table_over_the_budget_is_written_in_parts_that_add_up_to_it() {
    let fp = FakeProxier::v4();
    let st = many(60, 0);
    let mut full = rendered(&fp, &st);
    let budget = 4_000;
    let (txs, stale) = full.full_transactions(None, budget);
    assert!(stale.is_empty(), "{stale:?}");
    assert!(txs.len() > 5, "{} transactions", txs.len());
    for tx in &txs {
        assert!(
            tx.len() < budget + LARGEST_SERVICE,
            "{} bytes:\n{tx}",
            tx.len()
        );
    }
    assert!(txs[0].starts_with("add table ip fastpath\ndelete table ip fastpath\n"));
    // A service's objects are never split between two transactions.
    for (i, tx) in txs.iter().enumerate().skip(1) {
        let first_chain = tx.lines().find(|l| l.contains(" service-"));
        if let Some(line) = first_chain {
            let chain = line.split(' ').find(|w| w.starts_with("service-")).unwrap();
            for earlier in &txs[..i] {
                assert!(
                    !earlier.contains(chain),
                    "{chain} split over two transactions"
                );
            }
        }
    }
    let played = Dump::parse(&txs.concat()).expect("the parts parse");
    let want = Dump::parse(&full.text()).unwrap();
    assert_transaction_equal(&want.to_statements(), &played.to_statements());
    // Under the budget: one transaction, atomic as before.
    let mut small = rendered(&fp, &many(2, 0));
    let whole = small.full_transaction().len();
    assert_eq!(small.full_transactions(None, 2 * whole).0.len(), 1);
}

#[test]
fn a_full_sync_over_a_known_table_rewrites_it_in_place() {
    let fp = FakeProxier::v4();
    let old_state = many(40, 0);
    let old = rendered(&fp, &old_state);
    // Services gone, endpoints replaced, one service's affinity on.
    let mut st = many(30, 1);
    let key = ServiceKey::new("ns", "s3");
    let mut s3 = (*st.services[&key]).clone();
    s3.affinity_timeout = Some(10_800);
    st.services.insert(key, std::sync::Arc::new(s3));
    let mut old = old;
    let mut new = rendered_over(&fp, &st, &old);
    let (txs, stale) = new.full_transactions(Some(&old), 4_000);
    assert!(txs.len() > 3, "{} transactions", txs.len());
    assert!(!txs[0].contains("delete table"), "{}", txs[0]);
    assert_eq!(stale.len(), 10, "the 10 services gone: {stale:?}");

    let mut played = old.full_transactions(None, usize::MAX).0.concat();
    played.push_str(&txs.concat());
    let mut want = fp.text(&st);
    for c in &stale {
        want.push_str(&format!("add chain ip fastpath {c}\n"));
    }
    assert_transaction_equal(
        &Dump::parse(&want).unwrap().to_statements(),
        &Dump::parse(&played).unwrap().to_statements(),
    );
}

/// Runs each of `runs` (`nft -f` texts) in order in one new network namespace, then lists
/// the table. None where that cannot run here (not root, no nft).
fn play_in_kernel(runs: &[String]) -> Option<String> {
    let dir = std::env::temp_dir().join(format!("fastpath-nft-parts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let mut script = String::from("set -e\n");
    for (i, text) in runs.iter().enumerate() {
        let path = dir.join(format!("{i}.nft"));
        std::fs::write(&path, text).ok()?;
        script.push_str(&format!("nft -f {}\n", path.display()));
    }
    script.push_str("nft list table ip fastpath\n");
    let mut child = Command::new("unshare")
        .args(["--net", "--", "sh", "-s"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(script.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let cannot = ["unshare failed", "Operation not permitted", "not found"];
        assert!(
            cannot.iter().any(|c| stderr.contains(c)),
            "nft refused a part: {stderr}"
        );
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The kernel takes every part: a first sync in parts, a full sync over it with services
/// changed and gone, and the hourly one that changes nothing. Upstream's packet
/// expectations for TestOverallNFTablesRules' services hold on what it then holds.
#[test]
fn the_kernel_takes_a_full_sync_in_parts_over_its_own_table() {
    let fp = FakeProxier::v4();
    let mut first_state = overall_state();
    let mut last_state = overall_state();
    for (k, v) in many(30, 0).services {
        first_state.services.insert(k, v);
    }
    for (k, v) in many(30, 0).endpoints {
        first_state.endpoints.insert(k, v);
    }
    for (k, v) in many(20, 1).services {
        last_state.services.insert(k, v);
    }
    for (k, v) in many(20, 1).endpoints {
        last_state.endpoints.insert(k, v);
    }
    let mut first = rendered(&fp, &first_state);
    let mut runs = first.full_transactions(None, 4_000).0;
    let mut last = rendered_over(&fp, &last_state, &first);
    let over = last.full_transactions(Some(&first), 4_000).0;
    let again = rendered_over(&fp, &last_state, &last)
        .full_transactions(Some(&last), 4_000)
        .0;
    assert!(
        over.len() > 2 && again.len() > 2,
        "{} and {}",
        over.len(),
        again.len()
    );
    runs.extend(over);
    runs.extend(again);
    let Some(listing) = play_in_kernel(&runs) else {
        eprintln!("nft cannot run here: the parts were not played in the kernel");
        return;
    };
    let dump = Dump::from_listing(&listing)
        .unwrap_or_else(|e| panic!("nft's listing does not parse: {e}\n{listing}"));
    let want = fp.sync(&last_state);
    for chain in want.chains.keys() {
        assert!(
            dump.chains.contains_key(chain),
            "{chain} missing\n{listing}"
        );
    }
    run_packet_flow_tests(
        "TestOverallNFTablesRules, after a full sync in parts",
        &dump,
        TEST_NODE_IPS,
        &our_overall_flows(),
    );
}
