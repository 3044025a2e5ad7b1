//! kube-proxy's Test_servicePortChainNameBase and Test_servicePortEndpointChainNameBase.
//! The service names hash no address, so upstream's expected names hold as they are; the
//! endpoint cases hash upstream's addresses, which this project may not use, so their
//! properties are checked instead: the full length kept, and truncation with `...` that
//! leaves the hashes apart.

use crate::{
    dataplane::nftables::render::{PortNames, endpoint_names},
    model::{Protocol, Service, ServiceKey, ServicePort},
};

const LONG_NS: &str = "very-long-namespace-name-abcdefghijklmnopqrstuvwxyz0123456789xx";
const LONG_NAME: &str = "very-long-service-name-why-would-you-even-do-this-i-mean-really";
const LONG_PORT: &str = "port-443-providing-the-hypertext-transmission-protocol-with-tls";

fn service(ns: &str, name: &str, port: &str, protocol: Protocol) -> (Service, ServicePort) {
    let p = ServicePort {
        name: port.into(),
        port: 443,
        protocol,
        node_port: None,
    };
    let svc = Service::cluster_ip(
        ServiceKey::new(ns, name),
        vec!["198.19.0.1".parse().unwrap()],
        vec![p.clone()],
    );
    (svc, p)
}

/// The base of a chain name: without the `service-` / `endpoint-` prefix.
fn base(name: &str) -> &str {
    name.split_once('-').map_or(name, |(_, b)| b)
}

#[test]
fn test_service_port_chain_name_base() {
    for (name, (ns, svc, port, proto), want) in [
        (
            "simple",
            ("testing", "service", "http", Protocol::Tcp),
            "P4ZYZVCF-testing/service/tcp/http",
        ),
        (
            "different port, different hash",
            ("testing", "service", "https", Protocol::Tcp),
            "LZBRENCP-testing/service/tcp/https",
        ),
        (
            "max length",
            (LONG_NS, LONG_NAME, LONG_PORT, Protocol::Sctp),
            "KR6NACJP-very-long-namespace-name-abcdefghijklmnopqrstuvwxyz0123456789xx/very-long-service-name-why-would-you-even-do-this-i-mean-really/sctp/port-443-providing-the-hypertext-transmission-protocol-with-tls",
        ),
    ] {
        let (s, p) = service(ns, svc, port, proto);
        assert_eq!(base(&PortNames::new(&s, &p).cluster), want, "{name}");
    }
}

#[test]
fn test_service_port_endpoint_chain_name_base() {
    let (s, p) = service("testing", "service", "http", Protocol::Tcp);
    let ep = |a: &str| endpoint_names(&s, &p, a.parse().unwrap()).0;
    // "simple", "different endpoint, different hash", "ipv6".
    let (a, b) = (ep("198.18.180.1:80"), ep("198.18.180.2:80"));
    assert!(
        a.ends_with("-testing/service/tcp/http__198.18.180.1/80"),
        "{a}"
    );
    assert!(
        b.ends_with("-testing/service/tcp/http__198.18.180.2/80"),
        "{b}"
    );
    assert_ne!(
        &base(&a)[..8],
        &base(&b)[..8],
        "different endpoint, different hash"
    );
    let v6 = ep("[2001:db8:12::c3d4:e5f6:9999]:80");
    assert!(
        v6.ends_with("-testing/service/tcp/http__2001.db8.12..c3d4.e5f6.9999/80"),
        "{v6}"
    );

    let (s, p) = service(LONG_NS, LONG_NAME, LONG_PORT, Protocol::Sctp);
    let ep = |a: &str| base(&endpoint_names(&s, &p, a.parse().unwrap()).0).to_string();
    // "max length without truncation": as long as a name may be, and whole.
    let whole = ep("[2001:db8:9abc:def0::abcd:1234]:443");
    assert_eq!(whole.len(), 240, "{whole}");
    assert!(
        whole.ends_with("__2001.db8.9abc.def0..abcd.1234/443"),
        "{whole}"
    );
    // "truncated, 1" and "truncated, 2 (different IP, which is not visible in the result)".
    let (t1, t2) = (
        ep("[2001:db8:9abc:def0::abcd:1234:5678]:443"),
        ep("[2001:db8:9abc:def0::abcd:1234:8765]:443"),
    );
    for t in [&t1, &t2] {
        assert_eq!(t.len(), 240, "{t}");
        assert!(t.ends_with("__2001.db8.9abc.def0.0.abcd.1234..."), "{t}");
    }
    assert_eq!(t1[8..], t2[8..]);
    assert_ne!(t1[..8], t2[..8], "the hash still tells them apart");
}
