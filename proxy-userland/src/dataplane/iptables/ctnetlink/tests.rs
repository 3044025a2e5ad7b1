//! The messages against the kernel's layout (include/uapi/linux/netfilter/nfnetlink_conntrack.h),
//! built here byte by byte.

use super::*;

const NESTED: u16 = 0x8000;

fn nla(kind: u16, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    while out.len() % 4 != 0 {
        out.push(0);
    }
    out
}

fn nested(kind: u16, parts: &[Vec<u8>]) -> Vec<u8> {
    nla(kind | NESTED, &parts.concat())
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// CTA_TUPLE_ORIG or _REPLY: CTA_TUPLE_IP { src, dst }, CTA_TUPLE_PROTO { num, ports }.
fn tuple(kind: u16, src: &str, dst: &str, proto: u8, sport: u16, dport: u16) -> Vec<u8> {
    let (src, dst) = (ip(src), ip(dst));
    let (s, d) = if src.is_ipv4() { (1, 2) } else { (3, 4) };
    nested(
        kind,
        &[
            nested(1, &[nla(s, &octets(src)), nla(d, &octets(dst))]),
            nested(
                2,
                &[
                    nla(1, &[proto]),
                    nla(2, &sport.to_be_bytes()),
                    nla(3, &dport.to_be_bytes()),
                ],
            ),
        ],
    )
}

fn message(kind: u16, flags: u16, seq: u32, family: u8, attrs: &[Vec<u8>]) -> Vec<u8> {
    let body = attrs.concat();
    let mut out = Vec::new();
    out.extend_from_slice(&((NLMSG_HDRLEN + 4 + body.len()) as u32).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&[family, 0, 0, 0]);
    out.extend_from_slice(&body);
    out
}

const AF_INET: u8 = libc::AF_INET as u8;
const CT_NEW: u16 = 1 << 8;
const CT_DELETE: u16 = (1 << 8) | 2;

/// An entry as a dump reports it: 198.18.0.2:12345 to the cluster IP 198.19.0.10:53,
/// translated to 198.18.1.11:5353, with the attributes around the tuples a kernel adds.
fn dumped(proto: u8, id: u32) -> Vec<u8> {
    message(
        CT_NEW,
        libc::NLM_F_MULTI as u16,
        1,
        AF_INET,
        &[
            tuple(1, "198.18.0.2", "198.19.0.10", proto, 12345, 53),
            tuple(2, "198.18.1.11", "198.18.0.2", proto, 5353, 12345),
            nla(3, &0x188u32.to_be_bytes()), // CTA_STATUS
            nla(7, &29u32.to_be_bytes()),    // CTA_TIMEOUT
            nla(8, &0u32.to_be_bytes()),     // CTA_MARK
            nla(11, &1u32.to_be_bytes()),    // CTA_USE
            nla(CTA_ID, &id.to_be_bytes()),
            nla(99, b"from a newer kernel"),
        ],
    )
}

fn parse(family: Family, bytes: &[u8]) -> Vec<Flow> {
    messages(bytes)
        .into_iter()
        .filter_map(|m| NetlinkMessage::<NetfilterMessage>::deserialize(m).ok())
        .filter_map(|m| match m.payload {
            NetlinkPayload::InnerMessage(m) => flow_of(family, &m),
            _ => None,
        })
        .collect()
}

fn flow() -> Flow {
    Flow {
        orig_src: ip("198.18.0.2"),
        orig_dst: ip("198.19.0.10"),
        orig_sport: 12345,
        orig_dport: 53,
        reply_src: ip("198.18.1.11"),
        reply_sport: 5353,
        id: Some(0xdead_beef),
    }
}

#[test]
fn a_delete_request_carries_the_original_tuple_and_the_id_in_the_kernels_layout() {
    let mut out = Vec::new();
    encode(
        &mut out,
        delete_request(&flow()),
        Family::V4,
        9,
        NLM_F_REQUEST | NLM_F_ACK,
    );
    let want = message(
        CT_DELETE,
        (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16,
        9,
        AF_INET,
        &[
            tuple(1, "198.18.0.2", "198.19.0.10", 17, 12345, 53),
            nla(CTA_ID, &0xdead_beefu32.to_be_bytes()),
        ],
    );
    assert_eq!(out, want);
    assert!(out.len() <= DELETE_MAX_LEN);

    // IPv6, no id (an entry not listed over netlink): the tuple alone.
    let v6 = Flow {
        orig_src: ip("2001:db8::2"),
        orig_dst: ip("2001:db8:5::10"),
        reply_src: ip("2001:db8:1::11"),
        id: None,
        ..flow()
    };
    let mut out = Vec::new();
    encode(&mut out, delete_request(&v6), Family::V6, 10, NLM_F_REQUEST);
    let want = message(
        CT_DELETE,
        libc::NLM_F_REQUEST as u16,
        10,
        libc::AF_INET6 as u8,
        &[tuple(1, "2001:db8::2", "2001:db8:5::10", 17, 12345, 53)],
    );
    assert_eq!(out, want);
    let mut with_id = Vec::new();
    let v6 = Flow { id: Some(1), ..v6 };
    encode(&mut with_id, delete_request(&v6), Family::V6, 10, 0);
    assert!(with_id.len() <= DELETE_MAX_LEN, "{}", with_id.len());
}

#[test]
fn a_dump_request_asks_for_the_familys_table() {
    let mut out = Vec::new();
    encode(
        &mut out,
        ConntrackMessage::Get(Vec::new()),
        Family::V6,
        3,
        NLM_F_REQUEST | NLM_F_DUMP,
    );
    let want = message(
        CT_NEW | 1,
        (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16,
        3,
        libc::AF_INET6 as u8,
        &[],
    );
    assert_eq!(out, want);
}

#[test]
fn dumped_udp_entries_parse_into_flows_and_others_are_skipped() {
    let mut datagram = dumped(17, 0xdead_beef);
    datagram.extend(dumped(6, 2)); // TCP: not ours
    datagram.extend(message(3, 2, 1, AF_INET, &[])); // NLMSG_DONE
    assert_eq!(parse(Family::V4, &datagram), [flow()]);
    assert_eq!(
        parse(Family::V6, &datagram),
        [],
        "an IPv4 entry is not an IPv6 flow"
    );

    // The kernel's answer to a delete: an ack (error 0) or an errno, with the request's
    // sequence number; NETLINK_CAP_ACK: the request's header only.
    let ack = |seq: u32, code: i32| {
        let mut m = Vec::new();
        m.extend_from_slice(&36u32.to_ne_bytes());
        m.extend_from_slice(&2u16.to_ne_bytes()); // NLMSG_ERROR
        m.extend_from_slice(&0x100u16.to_ne_bytes()); // NLM_F_CAPPED
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&code.to_ne_bytes());
        m.extend_from_slice(&message(CT_DELETE, 5, seq, AF_INET, &[])[..16]);
        m
    };
    assert_eq!(answer(&ack(7, 0)), Some((7, None)));
    assert_eq!(
        answer(&ack(8, -libc::ENOENT)),
        Some((8, Some(libc::ENOENT)))
    );
    assert_eq!(answer(&dumped(17, 1)), None, "not an answer");
}

#[test]
fn truncated_or_lying_datagrams_are_skipped_not_a_panic() {
    let mut datagram = dumped(17, 1);
    datagram.extend(dumped(17, 2));
    for cut in 0..datagram.len() {
        let flows = parse(Family::V4, &datagram[..cut]);
        assert!(flows.len() <= 1, "cut at {cut}: {flows:?}");
    }
    // A message claiming more than the datagram holds, or less than a header.
    let mut lying = dumped(17, 1);
    lying[..4].copy_from_slice(&10_000u32.to_ne_bytes());
    assert!(messages(&lying).is_empty());
    lying[..4].copy_from_slice(&3u32.to_ne_bytes());
    assert!(messages(&lying).is_empty());
    // An attribute claiming more than its message holds.
    let mut bad = dumped(17, 1);
    bad[20..22].copy_from_slice(&4000u16.to_ne_bytes());
    assert_eq!(parse(Family::V4, &bad), []);
    assert_eq!(answer(&bad), None);
}

#[test]
fn a_batch_is_as_large_as_the_socket_buffers_hold_acks_and_requests() {
    // 4 MiB asked, 8 MiB granted (the kernel doubles): the most per send.
    assert_eq!(per_send(8 << 20, 8 << 20), MAX_PER_SEND);
    // Without CAP_NET_ADMIN, the default 208 KiB: acks limit it.
    assert_eq!(per_send(212_992, 212_992), 208);
    assert_eq!(per_send(212_992, 4096), 31);
    assert_eq!(per_send(0, 0), 1);
}
