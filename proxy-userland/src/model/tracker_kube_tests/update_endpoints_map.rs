//! TestUpdateEndpointsMap.

use super::*;

fn empty_endpoint() -> Fixture {
    (vec![], vec![])
}
fn unnamed_port() -> Fixture {
    (vec![at("198.18.1.1")], vec![("", 11)])
}
fn unnamed_port_ready() -> Fixture {
    (
        vec![cond(at("198.18.1.1"), true, true, false)],
        vec![("", 11)],
    )
}
fn unnamed_port_terminating() -> Fixture {
    (
        vec![cond(at("198.18.1.1"), false, true, true)],
        vec![("", 11)],
    )
}
fn unnamed_port_local() -> Fixture {
    (vec![here("198.18.1.1")], vec![("", 11)])
}
fn named_port_local() -> Fixture {
    (vec![here("198.18.1.1")], vec![("p11", 11)])
}
/// Also upstream's multipleSubsets_s1, multipleSubsetsWithLocal_s1 and complexBefore1.
fn named_port() -> Fixture {
    (vec![at("198.18.1.1")], vec![("p11", 11)])
}
fn named_port_renamed() -> Fixture {
    (vec![at("198.18.1.1")], vec![("p11-2", 11)])
}
fn named_port_renumbered() -> Fixture {
    (vec![at("198.18.1.1")], vec![("p11", 22)])
}
/// Also upstream's multipleSubsetsIPsPorts1_s1.
fn named_ports_local_no_local() -> Fixture {
    (
        vec![at("198.18.1.1"), here("198.18.1.2")],
        vec![("p11", 11), ("p12", 12)],
    )
}
fn multiple_subsets_s2() -> Fixture {
    (vec![at("198.18.1.2")], vec![("p12", 12)])
}
fn multiple_subsets_with_local_s2() -> Fixture {
    (vec![here("198.18.1.2")], vec![("p12", 12)])
}
fn multiple_subsets_multiple_ports_local_s1() -> Fixture {
    (vec![here("198.18.1.1")], vec![("p11", 11), ("p12", 12)])
}
fn multiple_subsets_multiple_ports_local_s2() -> Fixture {
    (vec![at("198.18.1.3")], vec![("p13", 13)])
}
fn multiple_subsets_ips_ports1_s2() -> Fixture {
    (
        vec![at("198.18.1.3"), here("198.18.1.4")],
        vec![("p13", 13), ("p14", 14)],
    )
}
fn multiple_subsets_ips_ports2() -> Fixture {
    (
        vec![at("198.18.2.1"), here("198.18.2.2")],
        vec![("p21", 21), ("p22", 22)],
    )
}
fn complex_before2_s1() -> Fixture {
    (
        vec![here("198.18.2.2"), here("198.18.2.22")],
        vec![("p22", 22)],
    )
}
fn complex_before2_s2() -> Fixture {
    (vec![here("198.18.2.3")], vec![("p23", 23)])
}
fn complex_before4_s1() -> Fixture {
    (
        vec![here("198.18.4.4"), here("198.18.4.5")],
        vec![("p44", 44)],
    )
}
fn complex_before4_s2() -> Fixture {
    (vec![here("198.18.4.6")], vec![("p45", 45)])
}
fn complex_after1_s1() -> Fixture {
    (vec![at("198.18.1.1"), at("198.18.1.11")], vec![("p11", 11)])
}
fn complex_after1_s2() -> Fixture {
    (vec![at("198.18.1.2")], vec![("p12", 12), ("p122", 122)])
}
fn complex_after3() -> Fixture {
    (vec![at("198.18.3.3")], vec![("p33", 33)])
}
fn complex_after4() -> Fixture {
    (vec![here("198.18.4.4")], vec![("p44", 44)])
}

struct Case {
    name: &'static str,
    previous: Vec<Option<discovery::EndpointSlice>>,
    current: Vec<Option<discovery::EndpointSlice>>,
    previous_map: Map,
    expected: Map,
    local: &'static [(&'static str, usize)],
    changed: &'static [&'static str],
}

fn run(case: Case) {
    let name = case.name;
    let mut t = tracker_with_services(&[
        ("ns1", "ep1"),
        ("ns2", "ep2"),
        ("ns3", "ep3"),
        ("ns4", "ep4"),
    ]);
    for slice in case.previous.iter().flatten() {
        apply(&mut t, slice, false);
    }
    t.take_changes();
    assert_eq!(
        endpoints_map(&t, TEST_HOSTNAME),
        case.previous_map,
        "{name}: previous"
    );
    assert_eq!(case.previous.len(), case.current.len(), "{name}: table");
    for (prev, curr) in case.previous.iter().zip(&case.current) {
        match (prev, curr) {
            (None, None) => {}
            (_, Some(curr)) => _ = apply(&mut t, curr, false),
            (Some(prev), None) => _ = apply(&mut t, prev, true),
        }
    }
    let changed: Vec<String> = t
        .take_changes()
        .changed
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        endpoints_map(&t, TEST_HOSTNAME),
        case.expected,
        "{name}: result"
    );
    assert_eq!(changed, case.changed, "{name}: changed services");
    let local: BTreeMap<String, usize> = case
        .local
        .iter()
        .map(|(k, n)| (k.to_string(), *n))
        .collect();
    assert_eq!(local_ready(&t), local, "{name}: local ready endpoints");
}

#[test]
fn test_update_endpoints_map() {
    let one = |f| vec![mk("ns1", "ep1", 1, f)];
    let unnamed = map(&[("ns1/ep1:", &["198.18.1.1:11 rs--"])]);
    let unnamed_local = map(&[("ns1/ep1:", &["198.18.1.1:11 rs-l"])]);
    let p11 = map(&[("ns1/ep1:p11", &["198.18.1.1:11 rs--"])]);
    let p11_p12_local = map(&[
        ("ns1/ep1:p11", &["198.18.1.1:11 rs--", "198.18.1.2:11 rs-l"]),
        ("ns1/ep1:p12", &["198.18.1.1:12 rs--", "198.18.1.2:12 rs-l"]),
    ]);
    let two_slices = map(&[
        ("ns1/ep1:p11", &["198.18.1.1:11 rs--"]),
        ("ns1/ep1:p12", &["198.18.1.2:12 rs--"]),
    ]);
    let many = map(&[
        ("ns1/ep1:p11", &["198.18.1.1:11 rs--", "198.18.1.2:11 rs-l"]),
        ("ns1/ep1:p12", &["198.18.1.1:12 rs--", "198.18.1.2:12 rs-l"]),
        ("ns1/ep1:p13", &["198.18.1.3:13 rs--", "198.18.1.4:13 rs-l"]),
        ("ns1/ep1:p14", &["198.18.1.3:14 rs--", "198.18.1.4:14 rs-l"]),
        ("ns2/ep2:p21", &["198.18.2.1:21 rs--", "198.18.2.2:21 rs-l"]),
        ("ns2/ep2:p22", &["198.18.2.1:22 rs--", "198.18.2.2:22 rs-l"]),
    ]);
    let cases = vec![
        Case {
            name: "empty",
            previous: vec![],
            current: vec![],
            previous_map: Map::new(),
            expected: Map::new(),
            local: &[],
            changed: &[],
        },
        Case {
            name: "no change, unnamed port",
            previous: one(unnamed_port),
            current: one(unnamed_port),
            previous_map: unnamed.clone(),
            expected: unnamed.clone(),
            local: &[],
            changed: &[],
        },
        Case {
            name: "no change, named port, local",
            previous: one(named_port_local),
            current: one(named_port_local),
            previous_map: map(&[("ns1/ep1:p11", &["198.18.1.1:11 rs-l"])]),
            expected: map(&[("ns1/ep1:p11", &["198.18.1.1:11 rs-l"])]),
            local: &[("ns1/ep1", 1)],
            changed: &[],
        },
        Case {
            name: "no change, multiple slices",
            previous: vec![
                mk("ns1", "ep1", 1, named_port),
                mk("ns1", "ep1", 2, multiple_subsets_s2),
            ],
            current: vec![
                mk("ns1", "ep1", 1, named_port),
                mk("ns1", "ep1", 2, multiple_subsets_s2),
            ],
            previous_map: two_slices.clone(),
            expected: two_slices.clone(),
            local: &[],
            changed: &[],
        },
        Case {
            name: "no change, multiple slices, multiple ports, local",
            previous: vec![
                mk("ns1", "ep1", 1, multiple_subsets_multiple_ports_local_s1),
                mk("ns1", "ep1", 2, multiple_subsets_multiple_ports_local_s2),
            ],
            current: vec![
                mk("ns1", "ep1", 1, multiple_subsets_multiple_ports_local_s1),
                mk("ns1", "ep1", 2, multiple_subsets_multiple_ports_local_s2),
            ],
            previous_map: map(&[
                ("ns1/ep1:p11", &["198.18.1.1:11 rs-l"]),
                ("ns1/ep1:p12", &["198.18.1.1:12 rs-l"]),
                ("ns1/ep1:p13", &["198.18.1.3:13 rs--"]),
            ]),
            expected: map(&[
                ("ns1/ep1:p11", &["198.18.1.1:11 rs-l"]),
                ("ns1/ep1:p12", &["198.18.1.1:12 rs-l"]),
                ("ns1/ep1:p13", &["198.18.1.3:13 rs--"]),
            ]),
            local: &[("ns1/ep1", 1)],
            changed: &[],
        },
        Case {
            name: "no change, multiple services, slices, IPs, and ports",
            previous: vec![
                mk("ns1", "ep1", 1, named_ports_local_no_local),
                mk("ns1", "ep1", 2, multiple_subsets_ips_ports1_s2),
                mk("ns2", "ep2", 1, multiple_subsets_ips_ports2),
            ],
            current: vec![
                mk("ns1", "ep1", 1, named_ports_local_no_local),
                mk("ns1", "ep1", 2, multiple_subsets_ips_ports1_s2),
                mk("ns2", "ep2", 1, multiple_subsets_ips_ports2),
            ],
            previous_map: many.clone(),
            expected: many.clone(),
            local: &[("ns1/ep1", 2), ("ns2/ep2", 1)],
            changed: &[],
        },
        Case {
            name: "add an EndpointSlice",
            previous: vec![None],
            current: one(unnamed_port_local),
            previous_map: Map::new(),
            expected: unnamed_local.clone(),
            local: &[("ns1/ep1", 1)],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "remove an EndpointSlice",
            previous: one(unnamed_port_local),
            current: vec![None],
            previous_map: unnamed_local.clone(),
            expected: Map::new(),
            local: &[],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "add an IP and port",
            previous: one(named_port),
            current: one(named_ports_local_no_local),
            previous_map: p11.clone(),
            expected: p11_p12_local.clone(),
            local: &[("ns1/ep1", 1)],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "remove an IP and port",
            previous: one(named_ports_local_no_local),
            current: one(named_port),
            previous_map: p11_p12_local.clone(),
            expected: p11.clone(),
            local: &[],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "add a slice to an endpoint",
            previous: vec![mk("ns1", "ep1", 1, named_port), None],
            current: vec![
                mk("ns1", "ep1", 1, named_port),
                mk("ns1", "ep1", 2, multiple_subsets_with_local_s2),
            ],
            previous_map: p11.clone(),
            expected: map(&[
                ("ns1/ep1:p11", &["198.18.1.1:11 rs--"]),
                ("ns1/ep1:p12", &["198.18.1.2:12 rs-l"]),
            ]),
            local: &[("ns1/ep1", 1)],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "remove a slice from an endpoint",
            previous: vec![
                mk("ns1", "ep1", 1, named_port),
                mk("ns1", "ep1", 2, multiple_subsets_s2),
            ],
            current: vec![mk("ns1", "ep1", 1, named_port), None],
            previous_map: two_slices.clone(),
            expected: p11.clone(),
            local: &[],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "rename a port",
            previous: one(named_port),
            current: one(named_port_renamed),
            previous_map: p11.clone(),
            expected: map(&[("ns1/ep1:p11-2", &["198.18.1.1:11 rs--"])]),
            local: &[],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "renumber a port",
            previous: one(named_port),
            current: one(named_port_renumbered),
            previous_map: p11.clone(),
            expected: map(&[("ns1/ep1:p11", &["198.18.1.1:22 rs--"])]),
            local: &[],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "complex add and remove",
            previous: vec![
                mk("ns1", "ep1", 1, named_port),
                None,
                mk("ns2", "ep2", 1, complex_before2_s1),
                mk("ns2", "ep2", 2, complex_before2_s2),
                None,
                None,
                mk("ns4", "ep4", 1, complex_before4_s1),
                mk("ns4", "ep4", 2, complex_before4_s2),
            ],
            current: vec![
                mk("ns1", "ep1", 1, complex_after1_s1),
                mk("ns1", "ep1", 2, complex_after1_s2),
                None,
                None,
                mk("ns3", "ep3", 1, complex_after3),
                None,
                mk("ns4", "ep4", 1, complex_after4),
                None,
            ],
            previous_map: map(&[
                ("ns1/ep1:p11", &["198.18.1.1:11 rs--"]),
                (
                    "ns2/ep2:p22",
                    &["198.18.2.22:22 rs-l", "198.18.2.2:22 rs-l"],
                ),
                ("ns2/ep2:p23", &["198.18.2.3:23 rs-l"]),
                ("ns4/ep4:p44", &["198.18.4.4:44 rs-l", "198.18.4.5:44 rs-l"]),
                ("ns4/ep4:p45", &["198.18.4.6:45 rs-l"]),
            ]),
            expected: map(&[
                (
                    "ns1/ep1:p11",
                    &["198.18.1.11:11 rs--", "198.18.1.1:11 rs--"],
                ),
                ("ns1/ep1:p12", &["198.18.1.2:12 rs--"]),
                ("ns1/ep1:p122", &["198.18.1.2:122 rs--"]),
                ("ns3/ep3:p33", &["198.18.3.3:33 rs--"]),
                ("ns4/ep4:p44", &["198.18.4.4:44 rs-l"]),
            ]),
            local: &[("ns4/ep4", 1)],
            changed: &["ns1/ep1", "ns2/ep2", "ns3/ep3", "ns4/ep4"],
        },
        Case {
            name: "change from 0 endpoint address to 1 unnamed port",
            previous: one(empty_endpoint),
            current: one(unnamed_port),
            previous_map: Map::new(),
            expected: unnamed.clone(),
            local: &[],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "change from ready to terminating pod",
            previous: one(unnamed_port_ready),
            current: one(unnamed_port_terminating),
            previous_map: unnamed.clone(),
            expected: map(&[("ns1/ep1:", &["198.18.1.1:11 -st-"])]),
            local: &[],
            changed: &["ns1/ep1"],
        },
        Case {
            name: "change from terminating to empty pod",
            previous: one(unnamed_port_terminating),
            current: one(empty_endpoint),
            previous_map: map(&[("ns1/ep1:", &["198.18.1.1:11 -st-"])]),
            expected: Map::new(),
            local: &[],
            changed: &["ns1/ep1"],
        },
    ];
    for case in cases {
        run(case);
    }
}
