//! The renderer's unit tests: rules checked as text.

use super::*;
use crate::model::{
    Endpoint, Protocol, ServiceKey, ServicePort,
    testing::{ep, eps, node, state},
};

fn svc(name: &str, ip: &str) -> Service {
    Service::cluster_ip(
        ServiceKey::new("ns1", name),
        vec![ip.parse().unwrap()],
        vec![ServicePort {
            name: "p80".into(),
            port: 80,
            protocol: Protocol::Tcp,
            node_port: None,
        }],
    )
}

fn v4(st: &ProxyState) -> Ruleset {
    render(st, &node(), Family::V4, &RenderConfig::default())
}

fn has(rules: &[String], want: &str) -> bool {
    rules.iter().any(|r| r == want)
}

#[test]
fn a_cluster_ip_is_spread_over_its_endpoints_like_kube_proxy() {
    let s = svc("svc1", "198.19.0.41");
    let st = state(vec![(
        s,
        Some(eps(vec![
            ep("198.18.180.1", "node-a"),
            ep("198.18.180.2", "node-b"),
        ])),
    )]);
    let rs = v4(&st);
    let svc_chain = "KUBE-SVC-XPGD46QRK7WJZT7O";
    let sep1 = "KUBE-SEP-IADAUZRQTTAIDYFJ";
    assert!(rs.nat_chains.iter().any(|c| c == svc_chain));
    assert!(
        has(
            &rs.nat_rules,
            &format!(
                "-A KUBE-SERVICES -m comment --comment \"ns1/svc1:p80 cluster IP\" -m tcp -p tcp -d 198.19.0.41 --dport 80 -j {svc_chain}"
            )
        ),
        "{:#?}",
        rs.nat_rules
    );
    assert!(
        has(
            &rs.nat_rules,
            &format!(
                "-A {svc_chain} -m comment --comment \"ns1/svc1:p80 -> 198.18.180.1:80\" -m statistic --mode random --probability 0.5000000000 -j {sep1}"
            )
        ),
        "{:#?}",
        rs.nat_rules
    );
    assert!(has(
        &rs.nat_rules,
        &format!(
            "-A {sep1} -m comment --comment \"ns1/svc1:p80\" -s 198.18.180.1 -j KUBE-MARK-MASQ"
        )
    ));
    assert!(has(
        &rs.nat_rules,
        &format!(
            "-A {sep1} -m comment --comment \"ns1/svc1:p80\" -m tcp -p tcp -j DNAT --to-destination 198.18.180.1:80"
        )
    ));
    // The last endpoint's rule always matches.
    let last = rs
        .nat_rules
        .iter()
        .rfind(|r| r.starts_with(&format!("-A {svc_chain} ")))
        .unwrap();
    assert!(!last.contains("statistic"), "{last}");
    // The node port catch-all is the very last rule of KUBE-SERVICES.
    let last_services = rs
        .nat_rules
        .iter()
        .rfind(|r| r.starts_with("-A KUBE-SERVICES "))
        .unwrap();
    assert!(
        last_services.ends_with("-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"),
        "{last_services}"
    );
    assert!(rs.filter_rules.iter().all(|r| !r.contains("REJECT")));
}

#[test]
fn probabilities_give_every_endpoint_an_equal_share() {
    assert_eq!(probability(4), "0.2500000000");
    assert_eq!(probability(3), "0.3333333333");
    assert_eq!(probability(2), "0.5000000000");
    // Endpoint i is chosen when rules 0..i miss and rule i hits: 1/n for every i.
    for n in 2..=7usize {
        let mut miss = 1.0;
        for i in 0..n {
            let p = if i + 1 < n { 1.0 / (n - i) as f64 } else { 1.0 };
            let share = miss * p;
            assert!(
                (share - 1.0 / n as f64).abs() < 1e-9,
                "n={n} i={i} share={share}"
            );
            miss *= 1.0 - p;
        }
    }
    let four: Vec<Endpoint> = (1..=4)
        .map(|i| ep(&format!("198.18.180.{i}"), "node-a"))
        .collect();
    let rs = v4(&state(vec![(svc("svc1", "198.19.0.41"), Some(eps(four)))]));
    let probs: Vec<&str> = rs
        .nat_rules
        .iter()
        .filter_map(|r| r.split("--probability ").nth(1))
        .map(|r| r.split(' ').next().unwrap())
        .collect();
    assert_eq!(probs, ["0.2500000000", "0.3333333333", "0.5000000000"]);
}

#[test]
fn no_endpoints_is_a_reject_in_the_filter_table_and_nothing_in_nat() {
    let mut s = svc("svc1", "198.19.0.41");
    s.ports[0].node_port = Some(3001);
    s.external_ips = vec!["198.19.227.11".parse().unwrap()];
    let rs = v4(&state(vec![(s, None)]));
    assert!(has(
        &rs.filter_rules,
        "-A KUBE-SERVICES -m comment --comment \"ns1/svc1:p80 has no endpoints\" -m tcp -p tcp -d 198.19.0.41 --dport 80 -j REJECT"
    ));
    assert!(has(
        &rs.filter_rules,
        "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"ns1/svc1:p80 has no endpoints\" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3001 -j REJECT"
    ));
    assert!(has(
        &rs.filter_rules,
        "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"ns1/svc1:p80 has no endpoints\" -m tcp -p tcp -d 198.19.227.11 --dport 80 -j REJECT"
    ));
    assert!(
        rs.nat_chains
            .iter()
            .all(|c| !c.starts_with("KUBE-SVC-") && !c.starts_with("KUBE-EXT-"))
    );
}

#[test]
fn client_ip_affinity_checks_recent_lists_before_the_random_spread() {
    let mut s = svc("svc1", "198.19.0.41");
    s.affinity_timeout = Some(10800);
    let rs = v4(&state(vec![(
        s,
        Some(eps(vec![
            ep("198.18.180.1", "node-a"),
            ep("198.18.180.2", "node-a"),
        ])),
    )]));
    let in_svc: Vec<&String> = rs
        .nat_rules
        .iter()
        .filter(|r| r.starts_with("-A KUBE-SVC-XPGD46QRK7WJZT7O "))
        .collect();
    assert_eq!(in_svc.len(), 4);
    assert!(in_svc[0].contains("-m recent --name KUBE-SEP-IADAUZRQTTAIDYFJ --rcheck --seconds 10800 --reap -j KUBE-SEP-IADAUZRQTTAIDYFJ"), "{}", in_svc[0]);
    assert!(in_svc[1].contains("--rcheck"));
    assert!(in_svc[2].contains("statistic"));
    assert!(has(
        &rs.nat_rules,
        "-A KUBE-SEP-IADAUZRQTTAIDYFJ -m comment --comment \"ns1/svc1:p80\" -m recent --name KUBE-SEP-IADAUZRQTTAIDYFJ --set -m tcp -p tcp -j DNAT --to-destination 198.18.180.1:80"
    ));
}

#[test]
fn external_traffic_policy_local_uses_svl_and_ext_chains() {
    let mut s = svc("svc1", "198.19.0.41");
    s.ports[0].node_port = Some(3001);
    s.external_policy_local = true;
    let st = state(vec![(
        s,
        Some(eps(vec![
            ep("198.18.180.1", "node-a"),
            ep("198.18.180.2", "node-b"),
        ])),
    )]);
    let rs = v4(&st);
    let h = "XPGD46QRK7WJZT7O";
    let (svc_c, svl, ext) = (
        format!("KUBE-SVC-{h}"),
        format!("KUBE-SVL-{h}"),
        format!("KUBE-EXT-{h}"),
    );
    for c in [&svc_c, &svl, &ext] {
        assert!(
            rs.nat_chains.contains(c),
            "{c} missing from {:?}",
            rs.nat_chains
        );
    }
    assert!(has(
        &rs.nat_rules,
        &format!(
            "-A KUBE-NODEPORTS -m comment --comment \"ns1/svc1:p80\" -m tcp -p tcp --dport 3001 -j {ext}"
        )
    ));
    assert!(has(
        &rs.nat_rules,
        &format!(
            "-A {ext} -m comment --comment \"masquerade LOCAL traffic for ns1/svc1:p80 external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"
        )
    ));
    assert!(has(
        &rs.nat_rules,
        &format!(
            "-A {ext} -m comment --comment \"route LOCAL traffic for ns1/svc1:p80 external destinations\" -m addrtype --src-type LOCAL -j {svc_c}"
        )
    ));
    assert_eq!(
        rs.nat_rules
            .iter()
            .rfind(|r| r.starts_with(&format!("-A {ext} ")))
            .unwrap(),
        &format!("-A {ext} -j {svl}")
    );
    // The local chain only has this node's endpoint; the cluster chain has both.
    assert_eq!(
        rs.nat_rules
            .iter()
            .filter(|r| r.starts_with(&format!("-A {svl} ")))
            .count(),
        1
    );
    assert_eq!(
        rs.nat_rules
            .iter()
            .filter(|r| r.starts_with(&format!("-A {svc_c} ")))
            .count(),
        2
    );
    // No endpoint may be masqueraded for external traffic under Local policy.
    assert!(!has(
        &rs.nat_rules,
        &format!(
            "-A {ext} -m comment --comment \"masquerade traffic for ns1/svc1:p80 external destinations\" -j KUBE-MARK-MASQ"
        )
    ));

    // With no local endpoint, external traffic is dropped (not rejected: other nodes have
    // endpoints, a load balancer should try them).
    let st = state(vec![(
        st.services.values().next().unwrap().as_ref().clone(),
        Some(eps(vec![ep("198.18.180.2", "node-b")])),
    )]);
    let rs = v4(&st);
    assert!(
        rs.filter_rules
            .iter()
            .any(|r| r.contains("has no local endpoints") && r.contains("--dport 3001 -j DROP")),
        "{:#?}",
        rs.filter_rules
    );
}

#[test]
fn internal_traffic_policy_local_sends_the_cluster_ip_to_svl() {
    let mut s = svc("svc1", "198.19.0.41");
    s.internal_policy_local = true;
    let rs = v4(&state(vec![(
        s.clone(),
        Some(eps(vec![
            ep("198.18.180.1", "node-a"),
            ep("198.18.180.2", "node-b"),
        ])),
    )]));
    assert!(
        rs.nat_rules
            .iter()
            .any(|r| r.starts_with("-A KUBE-SERVICES ")
                && r.ends_with("-j KUBE-SVL-XPGD46QRK7WJZT7O"))
    );
    assert!(!rs.nat_chains.iter().any(|c| c.starts_with("KUBE-SVC-")));
    // Only remote endpoints: DROP at the cluster IP.
    let rs = v4(&state(vec![(
        s,
        Some(eps(vec![ep("198.18.180.2", "node-b")])),
    )]));
    assert!(
        rs.filter_rules
            .iter()
            .any(|r| r.contains("has no local endpoints")
                && r.contains("-d 198.19.0.41")
                && r.ends_with("-j DROP"))
    );
}

#[test]
fn masquerading_follows_the_cluster_cidr_or_masquerade_all() {
    let s = svc("svc1", "198.19.0.41");
    let st = state(vec![(s, Some(eps(vec![ep("198.18.180.1", "node-a")])))]);
    let cfg = RenderConfig {
        local_traffic: LocalTraffic::Cidrs(vec![("198.18.0.0".parse().unwrap(), 16)]),
        ..Default::default()
    };
    let rs = render(&st, &node(), Family::V4, &cfg);
    assert!(
        rs.nat_rules.iter().any(|r| r.starts_with("-A KUBE-SVC-")
            && r.ends_with("! -s 198.18.0.0/16 -j KUBE-MARK-MASQ"))
    );
    let all = render(
        &st,
        &node(),
        Family::V4,
        &RenderConfig {
            masquerade_all: true,
            random_fully: true,
            ..Default::default()
        },
    );
    assert!(
        all.nat_rules
            .iter()
            .any(|r| r.starts_with("-A KUBE-SVC-") && r.ends_with("--dport 80 -j KUBE-MARK-MASQ"))
    );
    assert!(has(
        &all.nat_rules,
        "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000"
    ));
    assert!(has(
        &all.nat_rules,
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
    ));
}

/// --detect-local-mode: what marks pods' traffic is kube-proxy's detector's match, in both
/// rules that tell it apart (masquerade for the rest; pods skip the Local policy).
#[test]
fn local_traffic_is_told_apart_as_detect_local_mode_says() {
    let mut s = svc("svc1", "198.19.0.41");
    s.ports[0].node_port = Some(3001);
    s.external_policy_local = true;
    let st = state(vec![(s, Some(eps(vec![ep("198.18.180.1", "node-a")])))]);
    let rules = |local_traffic: LocalTraffic, family: Family| {
        let cfg = RenderConfig {
            local_traffic,
            ..Default::default()
        };
        render(&st, &node(), family, &cfg).nat_rules
    };
    for (detector, local, not_local) in [
        (
            LocalTraffic::Interface("cbr0".into()),
            "-i cbr0",
            "! -i cbr0",
        ),
        (
            LocalTraffic::Interface("veth+".into()),
            "-i veth+",
            "! -i veth+",
        ),
        (
            LocalTraffic::Cidrs(vec![("198.18.0.0".parse().unwrap(), 24)]),
            "-s 198.18.0.0/24",
            "! -s 198.18.0.0/24",
        ),
    ] {
        let nat = rules(detector.clone(), Family::V4);
        assert!(
            nat.iter().any(|r| r.starts_with("-A KUBE-SVC-")
                && r.ends_with(&format!("{not_local} -j KUBE-MARK-MASQ"))),
            "{detector:?}: {nat:#?}"
        );
        assert!(
            nat.iter().any(|r| r.starts_with("-A KUBE-EXT-")
                && r.contains("pod traffic for")
                && r.contains(&format!("{local} -j KUBE-SVC-"))),
            "{detector:?}: {nat:#?}"
        );
    }
    // Nothing to tell apart by (ClusterCIDR without a CIDR of the family): neither rule.
    for nat in [
        rules(LocalTraffic::Cidrs(vec![]), Family::V4),
        rules(
            LocalTraffic::Cidrs(vec![("2001:db8::".parse().unwrap(), 64)]),
            Family::V4,
        ),
    ] {
        assert!(!nat.iter().any(|r| r.contains("pod traffic for")
            || (r.starts_with("-A KUBE-SVC-") && r.ends_with("-j KUBE-MARK-MASQ"))));
    }
}

#[test]
fn load_balancer_source_ranges_use_a_firewall_chain() {
    let mut s = svc("svc1", "198.19.0.41");
    s.load_balancer_ips = vec!["198.19.250.4".parse().unwrap()];
    s.load_balancer_source_ranges = vec![("198.19.240.0".parse().unwrap(), 25)];
    let rs = v4(&state(vec![(
        s,
        Some(eps(vec![ep("198.18.180.1", "node-a")])),
    )]));
    let fw = "KUBE-FW-XPGD46QRK7WJZT7O";
    assert!(
        rs.nat_rules
            .iter()
            .any(|r| r.contains("-d 198.19.250.4") && r.ends_with(&format!("-j {fw}")))
    );
    assert!(has(
        &rs.nat_rules,
        &format!(
            "-A {fw} -m comment --comment \"ns1/svc1:p80 loadbalancer IP\" -s 198.19.240.0/25 -j KUBE-EXT-XPGD46QRK7WJZT7O"
        )
    ));
    assert!(
        rs.filter_rules
            .iter()
            .any(|r| r.starts_with("-A KUBE-PROXY-FIREWALL ")
                && r.contains("-d 198.19.250.4")
                && r.ends_with("-j DROP"))
    );
}

#[test]
fn each_family_gets_its_own_addresses_and_output_is_deterministic() {
    let mut s = svc("svc1", "198.19.0.41");
    s.cluster_ips.push("2001:db8::41".parse().unwrap());
    let st = state(vec![
        (
            s,
            Some(eps(vec![
                ep("198.18.180.1", "node-a"),
                ep("2001:db8::1", "node-a"),
            ])),
        ),
        (svc("v4only", "198.19.0.42"), None),
    ]);
    let v6 = render(&st, &node(), Family::V6, &RenderConfig::default());
    assert!(v6.nat_rules.iter().any(|r| r.contains("-d 2001:db8::41")));
    assert!(
        v6.nat_rules
            .iter()
            .any(|r| r.ends_with("DNAT --to-destination [2001:db8::1]:80"))
    );
    assert!(
        v6.nat_rules
            .iter()
            .chain(&v6.filter_rules)
            .all(|r| !r.contains("198.19.") && !r.contains("198.18."))
    );
    assert!(
        v6.filter_rules.iter().all(|r| !r.contains("v4only")),
        "a v4-only service is not in ip6tables"
    );
    assert_eq!(v4(&st), v4(&st));
    let text = v4(&st).restore_text(&BTreeSet::new());
    assert!(text.starts_with("*filter\n:KUBE-SERVICES - [0:0]\n"));
    assert_eq!(text.matches("COMMIT\n").count(), 2);
}

#[test]
fn a_partial_restore_rewrites_only_the_chains_that_changed() {
    let two = |second: &str| {
        state(vec![
            (
                svc("a", "198.19.0.1"),
                Some(eps(vec![ep("198.18.1.1", "node-a")])),
            ),
            (
                svc("b", "198.19.0.2"),
                Some(eps(vec![ep("198.18.1.1", "node-a"), ep(second, "node-a")])),
            ),
        ])
    };
    let before = v4(&two("198.18.1.2"));
    assert_eq!(
        before.partial_restore_text(&before, &BTreeSet::new()),
        None,
        "nothing differs"
    );

    // b's second endpoint moves: b's service chain and the two endpoint chains change.
    let after = v4(&two("198.18.1.3"));
    let text = after
        .partial_restore_text(&before, &BTreeSet::new())
        .expect("b changed");
    let declared: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix(':')).collect();
    let rules_of = |c: &str| {
        text.lines()
            .filter(|l| l.starts_with(&format!("-A {c} ")))
            .count()
    };
    let b_svc = after.nat_chains.iter().find(|c| {
        c.starts_with("KUBE-SVC-")
            && after
                .nat_rules
                .iter()
                .any(|r| r.starts_with(&format!("-A {c} ")) && r.contains("198.18.1.3"))
    });
    let b_svc = b_svc.expect("b's service chain");
    assert!(
        declared.iter().any(|d| d.starts_with(b_svc.as_str())),
        "{text}"
    );
    assert_eq!(rules_of(b_svc), 2, "{text}");
    assert!(
        !declared.iter().any(|d| d.starts_with("KUBE-SERVICES")),
        "the service jumps did not change: {text}"
    );
    // One SVC chain and one new SEP chain; the old SEP chain is for the caller's `stale`.
    assert_eq!(
        declared
            .iter()
            .filter(|d| d.starts_with("KUBE-SVC-"))
            .count(),
        1,
        "{text}"
    );
    assert_eq!(
        declared
            .iter()
            .filter(|d| d.starts_with("KUBE-SEP-"))
            .count(),
        1,
        "{text}"
    );
}

#[test]
fn stale_chains_are_flushed_and_deleted() {
    let rs = v4(&state(vec![]));
    let stale = BTreeSet::from([(Table::Nat, "KUBE-SVC-GONE".to_string())]);
    let text = rs.restore_text(&stale);
    let nat = &text[text.find("*nat").unwrap()..];
    assert!(nat.contains(":KUBE-SVC-GONE - [0:0]\n"));
    assert!(
        nat.trim_end().ends_with("-X KUBE-SVC-GONE\nCOMMIT"),
        "{nat}"
    );
    assert!(
        is_our_chain(Table::Nat, "KUBE-SEP-X") && !is_our_chain(Table::Nat, "KUBE-PORTALS-HOST")
    );
    assert!(
        !is_our_chain(Table::Filter, "KUBE-FIREWALL"),
        "kubelet's chain is not ours"
    );
}

#[test]
fn rendering_again_only_the_changed_services_gives_what_a_full_render_gives() {
    let cfg = RenderConfig::default();
    let two = |second: &str| {
        state(vec![
            (
                svc("a", "198.19.0.1"),
                Some(eps(vec![ep("198.18.1.1", "node-a")])),
            ),
            (
                svc("b", "198.19.0.2"),
                Some(eps(vec![ep("198.18.1.1", "node-a"), ep(second, "node-a")])),
            ),
        ])
    };
    let before = two("198.18.1.2");
    let mut rendered = Rendered::new(&before, &node(), Family::V4, &cfg);
    assert_eq!(rendered.ruleset(), v4(&before));
    let b = ServiceKey::new("ns1", "b");
    let a = ServiceKey::new("ns1", "a");

    // Nothing changed: nothing replaced, nothing to restore.
    let replaced = rendered.rerender(&before, [&a, &b], &node(), Family::V4, &cfg);
    assert!(replaced.is_empty());
    assert_eq!(
        rendered.partial_restore_text(&replaced, &BTreeSet::new(), false),
        None
    );

    // b's second endpoint moves: b's service chain and its new endpoint chain only.
    let after = two("198.18.1.3");
    let replaced = rendered.rerender(&after, [&b], &node(), Family::V4, &cfg);
    assert_eq!(replaced.len(), 1);
    assert_eq!(rendered.ruleset(), v4(&after));
    let text = rendered
        .partial_restore_text(&replaced, &BTreeSet::new(), false)
        .unwrap();
    let declared: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix(':')).collect();
    assert_eq!(declared.len(), 2, "{text}");
    assert_eq!(
        declared
            .iter()
            .filter(|d| d.starts_with("KUBE-SVC-"))
            .count(),
        1,
        "{text}"
    );
    assert_eq!(
        declared
            .iter()
            .filter(|d| d.starts_with("KUBE-SEP-"))
            .count(),
        1,
        "{text}"
    );
    assert!(text.contains("198.18.1.3:80"), "{text}");
    assert!(!text.contains("198.19.0.1"), "a is untouched: {text}");

    // Undone (the restore failed): as before.
    rendered.undo(replaced);
    assert_eq!(rendered.ruleset(), v4(&before));

    // a goes: KUBE-SERVICES is written whole (without a's jump, with b's), and the old
    // chains the caller names stale are deleted after it.
    let without_a = state(vec![(
        svc("b", "198.19.0.2"),
        Some(eps(vec![
            ep("198.18.1.1", "node-a"),
            ep("198.18.1.2", "node-a"),
        ])),
    )]);
    let replaced = rendered.rerender(&without_a, [&a], &node(), Family::V4, &cfg);
    let old_a: Vec<String> = replaced[0].1.as_ref().unwrap().rules.nat_chains.clone();
    assert_eq!(old_a.len(), 2, "a's SVC and SEP chains");
    let stale: BTreeSet<(Table, String)> = old_a.iter().map(|c| (Table::Nat, c.clone())).collect();
    let text = rendered
        .partial_restore_text(&replaced, &stale, true)
        .unwrap();
    let nat = &text[text.find("*nat").unwrap()..];
    assert!(nat.starts_with(&format!("*nat\n{LIST_FIRST}")), "{nat}");
    assert!(nat.contains(":KUBE-SERVICES - [0:0]\n"), "{nat}");
    let services: Vec<&str> = nat
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SERVICES "))
        .collect();
    assert_eq!(services.len(), 2, "b's jump and the node-port rule: {nat}");
    assert!(
        services[0].contains("198.19.0.2") && services[1].contains("KUBE-NODEPORTS"),
        "{nat}"
    );
    for c in &old_a {
        assert!(nat.contains(&format!("-X {c}\n")), "{nat}");
    }
    assert_eq!(rendered.ruleset(), v4(&without_a));
    assert!(
        !text[..text.find("*nat").unwrap()].contains(LIST_FIRST),
        "the filter table is not listed"
    );
}
