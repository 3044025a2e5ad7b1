//! TestEndpointSliceUpdate.

use super::*;

/// generateEndpointSliceWithOffset: slice `svc1-<n>` of ns1/svc1, endpoints 1..=count at
/// 198.18.<offset>.<i> on `hosts[i % len]`, not ready when `i % unready_mod == 0` (then not
/// serving either), terminating when `i % terminating_mod == 0`, TCP ports `port-<k>`.
fn generated(
    n: u32,
    offset: u32,
    count: u32,
    unready_mod: u32,
    terminating_mod: u32,
    hosts: &[&str],
    ports: &[i32],
) -> discovery::EndpointSlice {
    let endpoints = (1..=count)
        .map(|i| {
            let ready_condition = i % unready_mod != 0;
            let terminating = i % terminating_mod == 0;
            let mut e = cond(
                at(&format!("198.18.{offset}.{i}")),
                ready_condition && !terminating,
                ready_condition,
                terminating,
            );
            e.node_name = (!hosts.is_empty()).then(|| hosts[i as usize % hosts.len()].into());
            e
        })
        .collect();
    let names = ["port-0", "port-1"];
    let ports = ports
        .iter()
        .enumerate()
        .map(|(k, &p)| (names[k], p))
        .collect();
    k8s_slice("ns1", "svc1", n, "TCP", (endpoints, ports))
}

/// generateEndpointSlice: the offset is the slice number.
fn gen_slice(
    n: u32,
    count: u32,
    unready_mod: u32,
    terminating_mod: u32,
    hosts: &[&str],
    ports: &[i32],
) -> discovery::EndpointSlice {
    generated(n, n, count, unready_mod, terminating_mod, hosts, ports)
}

/// Lines for endpoints `ids` of group `g` on `port`, all with `flags`.
fn lines(g: u8, ids: &[u8], port: u16, flags: &str) -> Vec<String> {
    ids.iter()
        .map(|i| format!("198.18.{g}.{i}:{port} {flags}"))
        .collect()
}

fn both_ports(f: impl Fn(u16) -> Vec<Vec<String>>) -> Map {
    [("ns1/svc1:port-0", 80), ("ns1/svc1:port-1", 443)]
        .into_iter()
        .map(|(k, p)| (k.to_string(), f(p).concat().into_iter().collect()))
        .collect()
}

/// (name, starting slices, the slice, remove it, a change expected, the service's map after).
type Case = (
    &'static str,
    Vec<discovery::EndpointSlice>,
    discovery::EndpointSlice,
    bool,
    bool,
    Option<Map>,
);

#[test]
fn test_endpoint_slice_update() {
    const H12: &[&str] = &["host1", "host2"];
    const H1: &[&str] = &["host1"];
    let mut fqdn = gen_slice(2, 5, 999, 999, H1, &[80, 443]);
    fqdn.address_type = "FQDN".into();
    let overlap = || {
        vec![
            gen_slice(1, 3, 999, 999, H12, &[80, 443]),
            gen_slice(2, 2, 999, 999, H12, &[80, 443]),
        ]
    };
    let cases: Vec<Case> = vec![
        (
            "add a simple slice that doesn't already exist",
            vec![],
            gen_slice(1, 3, 999, 999, H12, &[80, 443]),
            false,
            true,
            Some(both_ports(|p| {
                vec![lines(1, &[1, 3], p, "rs--"), lines(1, &[2], p, "rs-l")]
            })),
        ),
        (
            "add the same slice that already exists",
            vec![gen_slice(1, 3, 999, 999, H12, &[80, 443])],
            gen_slice(1, 3, 999, 999, H12, &[80, 443]),
            false,
            false,
            None,
        ),
        (
            "add an FQDN slice (invalid address type)",
            vec![gen_slice(1, 3, 999, 999, H12, &[80, 443])],
            fqdn,
            false,
            false,
            None,
        ),
        (
            "add a slice that overlaps with existing state",
            overlap(),
            gen_slice(1, 5, 999, 999, H1, &[80, 443]),
            false,
            true,
            Some(both_ports(|p| {
                vec![
                    lines(1, &[1, 2, 3, 4, 5], p, "rs-l"),
                    lines(2, &[1], p, "rs--"),
                    lines(2, &[2], p, "rs-l"),
                ]
            })),
        ),
        // Upstream expects 198.18.1.1 and .3 on port-0 to be local: the new slice svc1-3
        // puts them on host1 while svc1-1 still says host2, and upstream lets the local copy
        // win. Ours keeps svc1-1's copy (equally healthy, first by name); see the module docs.
        (
            "add a slice that overlaps with existing state and partial ports",
            overlap(),
            generated(3, 1, 5, 999, 999, H1, &[80]),
            false,
            true,
            Some(map(&[
                (
                    "ns1/svc1:port-0",
                    &[
                        "198.18.1.1:80 rs--",
                        "198.18.1.2:80 rs-l",
                        "198.18.1.3:80 rs--",
                        "198.18.1.4:80 rs-l",
                        "198.18.1.5:80 rs-l",
                        "198.18.2.1:80 rs--",
                        "198.18.2.2:80 rs-l",
                    ],
                ),
                (
                    "ns1/svc1:port-1",
                    &[
                        "198.18.1.1:443 rs--",
                        "198.18.1.2:443 rs-l",
                        "198.18.1.3:443 rs--",
                        "198.18.2.1:443 rs--",
                        "198.18.2.2:443 rs-l",
                    ],
                ),
            ])),
        ),
        (
            "remove a slice that overlaps with existing state",
            overlap(),
            gen_slice(1, 5, 999, 999, H1, &[80, 443]),
            true,
            true,
            Some(both_ports(|p| {
                vec![lines(2, &[1], p, "rs--"), lines(2, &[2], p, "rs-l")]
            })),
        ),
        (
            "remove a slice that doesn't even exist in current state",
            vec![
                gen_slice(1, 5, 999, 999, H1, &[80, 443]),
                gen_slice(2, 2, 999, 999, H1, &[80, 443]),
            ],
            gen_slice(3, 5, 999, 999, H1, &[80, 443]),
            true,
            false,
            None,
        ),
        (
            "transition all endpoints to unready state",
            vec![gen_slice(1, 3, 999, 999, H12, &[80, 443])],
            gen_slice(1, 3, 1, 999, H1, &[80, 443]),
            false,
            true,
            Some(both_ports(|p| vec![lines(1, &[1, 2, 3], p, "---l")])),
        ),
        (
            "transition all endpoints to ready state",
            vec![gen_slice(1, 2, 1, 999, H12, &[80, 443])],
            gen_slice(1, 2, 999, 999, H1, &[80, 443]),
            false,
            true,
            Some(both_ports(|p| vec![lines(1, &[1, 2], p, "rs-l")])),
        ),
        (
            "transition some endpoints to ready state",
            vec![
                gen_slice(1, 3, 2, 999, H1, &[80, 443]),
                gen_slice(2, 2, 2, 999, H1, &[80, 443]),
            ],
            gen_slice(1, 3, 3, 999, H1, &[80, 443]),
            false,
            true,
            Some(both_ports(|p| {
                vec![
                    lines(1, &[1, 2], p, "rs-l"),
                    lines(1, &[3], p, "---l"),
                    lines(2, &[1], p, "rs-l"),
                    lines(2, &[2], p, "---l"),
                ]
            })),
        ),
        (
            "transition some endpoints to terminating state",
            vec![
                gen_slice(1, 3, 2, 2, H1, &[80, 443]),
                gen_slice(2, 2, 2, 2, H1, &[80, 443]),
            ],
            gen_slice(1, 3, 3, 2, H1, &[80, 443]),
            false,
            true,
            Some(both_ports(|p| {
                vec![
                    lines(1, &[1], p, "rs-l"),
                    lines(1, &[2], p, "-stl"),
                    lines(1, &[3], p, "---l"),
                    lines(2, &[1], p, "rs-l"),
                    lines(2, &[2], p, "--tl"),
                ]
            })),
        ),
    ];
    for (name, starting, slice, remove, want_change, want_map) in cases {
        let mut t = tracker_with_services(&[("ns1", "svc1")]);
        for s in &starting {
            apply(&mut t, s, false);
        }
        t.take_changes();
        apply(&mut t, &slice, remove);
        assert_eq!(t.has_changes(), want_change, "{name}: changed");
        if let Some(want) = want_map {
            assert_eq!(endpoints_map(&t, "host1"), want, "{name}: endpoints");
        }
    }
}
