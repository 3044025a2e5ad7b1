//! The renderer's unit tests: statements checked as text, and (where `nft` runs) the whole
//! transaction checked by `nft -c`, which parses and validates without committing.

use std::sync::Arc;

use super::*;
use crate::model::{
    Protocol, ServiceKey, ServicePort,
    testing::{ep, eps, node, state},
};

fn svc(ns: &str, name: &str, ip: &str) -> Service {
    Service::cluster_ip(
        ServiceKey::new(ns, name),
        vec![ip.parse().unwrap()],
        vec![ServicePort {
            name: "p80".into(),
            port: 80,
            protocol: Protocol::Tcp,
            node_port: None,
        }],
    )
}

fn cfg() -> RenderConfig {
    RenderConfig {
        local_traffic: LocalTraffic::Cidrs(vec![("198.18.0.0".parse().unwrap(), 16)]),
        service_ranges: vec![("198.19.0.0".parse().unwrap(), 17)],
        ..RenderConfig::default()
    }
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

/// `nft -c -f -` of `text`: None where nft cannot run here (not installed, not root).
fn nft_check(text: &str) -> Option<Result<(), String>> {
    use std::{io::Write as _, process::Stdio};
    let mut child = std::process::Command::new("nft")
        .args(["-c", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(text.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if stderr.contains("Operation not permitted") {
        return None;
    }
    Some(if out.status.success() {
        Ok(())
    } else {
        Err(stderr)
    })
}

#[test]
fn names_are_kube_proxys() {
    // From kube-proxy's TestOverallNFTablesRules. Endpoint names hash the address too: the
    // expected ones are kube-proxy's formula (base32 of SHA-256, 8 characters) worked out
    // independently for our test addresses; the same working gives upstream's
    // endpoint-5OJB2KTY-ns1/svc1/tcp/p80__<its 10.180.0.1>/80.
    let s1 = svc("ns1", "svc1", "198.19.0.41");
    let p = &s1.ports[0];
    assert_eq!(
        PortNames::new(&s1, p).cluster,
        "service-ULMVA6XW-ns1/svc1/tcp/p80"
    );
    assert_eq!(
        endpoint_names(&s1, p, "198.18.180.1:80".parse().unwrap()).0,
        "endpoint-H6C3XLIP-ns1/svc1/tcp/p80__198.18.180.1/80"
    );
    let s5 = svc("ns5", "svc5", "198.19.0.45");
    assert_eq!(
        PortNames::new(&s5, &s5.ports[0]).firewall,
        "firewall-HVFWP5L3-ns5/svc5/tcp/p80"
    );
    assert_eq!(
        endpoint_names(&s5, &s5.ports[0], "198.18.180.3:80".parse().unwrap()).1,
        "affinity-FQ27PTLC-ns5/svc5/tcp/p80__198.18.180.3/80"
    );
}

#[test]
fn a_cluster_ip_service_is_kube_proxys_svc1() {
    let st = state(vec![(
        svc("ns1", "svc1", "198.19.0.41"),
        Some(eps(vec![ep("198.18.180.1", "node-a")])),
    )]);
    let text = render_full(&st, &node(), Family::V4, &cfg());
    let got = lines(&text);
    let sc = "service-ULMVA6XW-ns1/svc1/tcp/p80";
    let ec = endpoint_names(
        st.services.values().next().unwrap(),
        &st.services.values().next().unwrap().ports[0],
        "198.18.180.1:80".parse().unwrap(),
    )
    .0;
    for want in [
        "add table ip fastpath { comment \"rules for kube-proxy\" ; }".to_string(),
        "add rule ip fastpath services ip daddr . meta l4proto . th dport vmap @service-ips"
            .to_string(),
        format!("add chain ip fastpath {sc}"),
        format!(
            "add rule ip fastpath {sc} ip daddr 198.19.0.41 ip saddr != 198.18.0.0/16 jump mark-for-masquerade"
        ),
        format!("add rule ip fastpath {sc} meta l4proto tcp dnat ip addr . port to numgen random mod 1 offset 65536 map @endpoints-tcp-00"),
        "add element ip fastpath endpoints-tcp-00 { 65536 : 198.18.180.1 . 80 }".to_string(),
        "add element ip fastpath hairpin-endpoints { 198.18.180.1 . 198.18.180.1 }".to_string(),
        "add rule ip fastpath nat-postrouting ct status dnat ip saddr . ip daddr @hairpin-endpoints jump mark-for-masquerade".to_string(),
        "add element ip fastpath cluster-ips { 198.19.0.41 }".to_string(),
        format!("add element ip fastpath service-ips {{ 198.19.0.41 . tcp . 80 : goto {sc} }}"),
        "add rule ip fastpath cluster-ips-check ip daddr { 198.19.0.0/17 } reject comment \"Reject traffic to unallocated ClusterIPs\"".to_string(),
        "add rule ip fastpath services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports".to_string(),
    ] {
        assert!(got.contains(&want.as_str()), "missing {want}\n{text}");
    }
    // Without affinity an endpoint has no chain of its own (docs/modes.md).
    assert!(!text.contains(&ec), "{text}");
}

#[test]
fn no_endpoints_reject_and_local_policy_drops() {
    let mut lb = svc("ns2", "svc2", "198.19.0.42");
    lb.ports[0].node_port = Some(3001);
    lb.load_balancer_ips = vec!["198.19.250.4".parse().unwrap()];
    lb.external_ips = vec!["198.19.227.22".parse().unwrap()];
    lb.external_policy_local = true;
    let st = state(vec![
        (svc("ns6", "svc6", "198.19.0.46"), None),
        (lb, Some(eps(vec![ep("198.18.180.2", "node-b")]))),
    ]);
    let text = render_full(&st, &node(), Family::V4, &cfg());
    let got = lines(&text);
    for want in [
        "add element ip fastpath no-endpoint-services { 198.19.0.46 . tcp . 80 comment \"ns6/svc6:p80\" : goto reject-chain }",
        "add element ip fastpath no-endpoint-nodeports { tcp . 3001 comment \"ns2/svc2:p80\" : drop }",
        "add element ip fastpath no-endpoint-services { 198.19.250.4 . tcp . 80 comment \"ns2/svc2:p80\" : drop }",
        "add element ip fastpath no-endpoint-services { 198.19.227.22 . tcp . 80 comment \"ns2/svc2:p80\" : drop }",
        "add rule ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80 ip saddr 198.18.0.0/16 goto service-42NFTM6N-ns2/svc2/tcp/p80 comment \"short-circuit pod traffic\"",
        "add rule ip fastpath external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local jump mark-for-masquerade comment \"masquerade local traffic\"",
        "add element ip fastpath service-nodeports { tcp . 3001 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }",
    ] {
        assert!(got.contains(&want), "missing {want}\n{text}");
    }
    // No local endpoint: nothing falls through to the (absent) local chain.
    assert!(!text.contains("goto local-"), "{text}");
}

/// A service with everything: node port, LB IP with source ranges, affinity, two
/// endpoints; in both families.
fn everything(family: Family) -> (ProxyState, RenderConfig) {
    let (cip, lbip, e1, e2, range, pods, svcs) = if family.is_v4() {
        (
            "198.19.0.45",
            "198.19.250.8",
            "198.18.180.3",
            "198.18.180.4",
            ("198.19.113.0", 25),
            ("198.18.0.0", 16),
            ("198.19.0.0", 17),
        )
    } else {
        (
            "2001:db8:96::45",
            "2001:db8:250::8",
            "2001:db8:180::3",
            "2001:db8:180::4",
            ("2001:db8:113::", 64),
            ("2001:db8:10::", 64),
            ("2001:db8:96::", 112),
        )
    };
    let mut s = svc("ns5", "svc5", cip);
    s.ports[0].node_port = Some(3002);
    s.load_balancer_ips = vec![lbip.parse().unwrap()];
    s.load_balancer_source_ranges = vec![(range.0.parse().unwrap(), range.1)];
    s.affinity_timeout = Some(10800);
    let st = state(vec![(
        s,
        Some(eps(vec![ep(e1, "node-a"), ep(e2, "node-b")])),
    )]);
    let cfg = RenderConfig {
        local_traffic: LocalTraffic::Cidrs(vec![(pods.0.parse().unwrap(), pods.1)]),
        service_ranges: vec![(svcs.0.parse().unwrap(), svcs.1)],
        nodeport_addresses: vec![(range.0.parse().unwrap(), range.1)],
        node_ips: vec![if family.is_v4() {
            "198.19.113.2".parse().unwrap()
        } else {
            "2001:db8:113::2".parse().unwrap()
        }],
        ..RenderConfig::default()
    };
    (st, cfg)
}

#[test]
fn affinity_firewall_and_node_addresses_are_written() {
    let (st, cfg) = everything(Family::V4);
    let text = render_full(&st, &node(), Family::V4, &cfg);
    let got = lines(&text);
    let aff = "affinity-";
    assert!(
        got.iter()
            .any(|l| l.starts_with(&format!("add set ip fastpath {aff}"))
                && l.ends_with("{ type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }")),
        "{text}"
    );
    for want in [
        "add rule ip fastpath firewall-HVFWP5L3-ns5/svc5/tcp/p80 ip saddr != { 198.19.113.0/25 , 198.19.250.8 } drop",
        "add element ip fastpath firewall-ips { 198.19.250.8 . tcp . 80 : goto firewall-HVFWP5L3-ns5/svc5/tcp/p80 }",
        "add element ip fastpath nodeport-ips { 198.19.113.2 }",
        "add rule ip fastpath services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
    ] {
        assert!(got.contains(&want), "missing {want}\n{text}");
    }
    assert!(
        got.iter()
            .any(|l| l.contains(" ip saddr @affinity-") && l.contains(" goto endpoint-")),
        "{text}"
    );
    assert!(
        got.iter().any(|l| l.contains("update @affinity-")),
        "{text}"
    );
}

#[test]
fn nft_accepts_full_and_partial_transactions_in_both_families() {
    for family in [Family::V4, Family::V6] {
        let (st, cfg) = everything(family);
        let mut rendered = Rendered::new(&st, &node(), family, &cfg);
        let full = rendered.full_transaction();
        // Change: one endpoint goes, the service loses its affinity; then it goes away.
        let key = st.services.keys().next().unwrap().clone();
        let mut st2 = st.clone();
        let mut s = (*st2.services[&key]).clone();
        s.affinity_timeout = None;
        st2.services.insert(key.clone(), Arc::new(s));
        let (e1, _) = if family.is_v4() {
            ("198.18.180.3", "")
        } else {
            ("2001:db8:180::3", "")
        };
        st2.endpoints
            .insert(key.clone(), Arc::new(eps(vec![ep(e1, "node-a")])));
        let (changed, stale, _) = rendered
            .rerender(&st2, &node(), &cfg, [&key])
            .expect("a change");
        let changed = changed.text(family);
        assert_eq!(
            stale.len(),
            2,
            "both affinity endpoint chains go: {changed}"
        );
        assert!(changed.contains("delete set"), "{changed}");
        assert!(
            rendered.rerender(&st2, &node(), &cfg, [&key]).is_none(),
            "nothing changed the second time"
        );
        let gone = ProxyState::default();
        let (removed, stale2, _) = rendered.rerender(&gone, &node(), &cfg, [&key]).unwrap();
        let removed = removed.text(family);
        assert!(removed.contains("delete element"), "{removed}");
        assert!(!stale2.is_empty());
        let f = family_name(family);
        let deletes: String = stale
            .iter()
            .chain(&stale2)
            .map(|c| format!("delete chain {f} fastpath {c}\n"))
            .collect();
        match nft_check(&format!("{full}{changed}{removed}{deletes}")) {
            None => eprintln!("nft cannot run here: transactions not checked"),
            Some(r) => r.unwrap_or_else(|e| panic!("{family:?}: {e}\n{full}{changed}{removed}")),
        }
    }
}

/// Writes the full transaction at `FASTPATH_NFT_DUMP_SIZES` services (10 endpoints each) to
/// `$FASTPATH_NFT_DUMP_DIR/full-N.nft`, and a one-service change's partial to
/// `partial-N.nft`: the renderer's real output, for timing `nft -f` by hand
/// (docs/modes.md, "nft at scale"). Ignored: it only writes files.
#[test]
#[ignore]
fn dump_for_timing() {
    let dir = std::env::var("FASTPATH_NFT_DUMP_DIR").unwrap_or_else(|_| "/tmp".into());
    let sizes = std::env::var("FASTPATH_NFT_DUMP_SIZES").unwrap_or_else(|_| "1000".into());
    for n in sizes
        .split(',')
        .filter_map(|s| s.trim().parse::<u32>().ok())
    {
        let entries = (0..n)
            .map(|i| {
                let ip = format!("198.19.{}.{}", i / 250, i % 250 + 1);
                let list = (0..10u32)
                    .map(|e| {
                        // Past 6,250 services the endpoints outgrow 198.18/16: reuse them.
                        let k = (i * 10 + e) % 62_500;
                        ep(&format!("198.18.{}.{}", k / 250, k % 250 + 1), "node-b")
                    })
                    .collect();
                (svc("ns", &format!("s{i}"), &ip), Some(eps(list)))
            })
            .collect();
        let mut st = state(entries);
        let mut r = Rendered::new(&st, &node(), Family::V4, &cfg());
        std::fs::write(format!("{dir}/full-{n}.nft"), r.full_transaction()).unwrap();
        let key = ServiceKey::new("ns", "s0");
        let changed = eps(vec![ep("198.18.255.250", "node-b")]);
        st.endpoints.insert(key.clone(), Arc::new(changed));
        let (text, _, _) = r.rerender(&st, &node(), &cfg(), [&key]).unwrap();
        std::fs::write(format!("{dir}/partial-{n}.nft"), text.text(Family::V4)).unwrap();
    }
}

/// Each endpoint's chance, read back from the rules: a `numgen random mod k 0` rule takes
/// 1/k of the packets that reach it, the last rule all that are left.
#[test]
fn the_endpoint_spread_gives_each_endpoint_an_even_share() {
    for n in [1usize, 2, 3, 7, 10, 100] {
        let names: Vec<String> = (0..n).map(|i| format!("goto endpoint-{i}")).collect();
        let rules = super::service::spread(names.iter().map(String::as_str));
        assert_eq!(rules.len(), n, "{rules:?}");
        let mut left = 1.0f64;
        for (i, rule) in rules.iter().enumerate() {
            let (taken, target) = match rule.strip_prefix("numgen random mod ") {
                Some(rest) => {
                    let (k, target) = rest.split_once(" 0 ").expect("a share rule");
                    (1.0 / k.parse::<f64>().expect("a modulus"), target)
                }
                None => (1.0, rule.as_str()),
            };
            assert_eq!(target, names[i], "{rules:?}");
            let share = left * taken;
            assert!(
                (share - 1.0 / n as f64).abs() < 1e-9,
                "endpoint {i} of {n} gets {share}: {rules:?}"
            );
            left -= share;
        }
        assert!(
            left.abs() < 1e-9,
            "{left} of the packets go nowhere: {rules:?}"
        );
    }
}

/// A partial sync whose transaction failed leaves the table as it was, and the renderer
/// goes back to it too: its services, hairpin counts and endpoint map slots, so the full
/// sync after it can rewrite the table in place.
#[test]
fn a_failed_partial_is_undone_to_what_the_table_still_holds() {
    let entries = (0..6u32)
        .map(|i| {
            let list = (0..3u32)
                .map(|e| ep(&format!("198.18.7.{}", i * 3 + e + 1), "node-b"))
                .collect();
            (
                svc("ns", &format!("s{i}"), &format!("198.19.7.{}", i + 1)),
                Some(eps(list)),
            )
        })
        .collect();
    let st = state(entries);
    let mut rendered = Rendered::new(&st, &node(), Family::V4, &cfg());
    let before = rendered.clone();
    // One service gone, one with new endpoints (one shared with another service), one new.
    let mut st2 = st.clone();
    let gone = ServiceKey::new("ns", "s0");
    st2.services.remove(&gone);
    st2.endpoints.remove(&gone);
    let moved = ServiceKey::new("ns", "s1");
    let shared = vec![ep("198.18.7.5", "node-b"), ep("198.18.7.9", "node-b")];
    st2.endpoints.insert(moved.clone(), Arc::new(eps(shared)));
    let (new_svc, new_eps) = (
        svc("ns", "s9", "198.19.7.99"),
        eps(vec![ep("198.18.7.99", "node-b")]),
    );
    let added = new_svc.key.clone();
    st2.services.insert(added.clone(), Arc::new(new_svc));
    st2.endpoints.insert(added.clone(), Arc::new(new_eps));
    let (_, _, undo) = rendered
        .rerender(&st2, &node(), &cfg(), [&gone, &moved, &added])
        .expect("a change");
    assert_ne!(rendered, before);
    rendered.undo(undo);
    assert_eq!(rendered, before);
}
