//! A pod's UDP datagram to an address of the service ranges that no Service holds,
//! answered at once with ICMP "port unreachable", as the socket hooks refuse a node
//! process's connect() and the rule-based modes REJECT: the pod's connected socket gets
//! ECONNREFUSED instead of waiting for an answer that cannot come.
//!
//! The datagram itself becomes the error: cut to its IP header and 8 bytes of UDP (the
//! quote an ICMP error carries), grown by a new IP and ICMP header in front, and sent back
//! out of the device it came in by. A header with IPv4 options or IPv6 extension headers
//! passes as before.

use crate::{ip::ETH_HLEN, packet::Packet};

/// The IPv4 header we quote and write: no options.
const IP_HLEN: usize = 20;
const ICMP_HLEN: usize = 8;
/// What an ICMP error quotes of the packet: its IP header and 8 bytes of its payload.
const QUOTE: usize = IP_HLEN + 8;
const DEST_UNREACHABLE: u8 = 3;
const PORT_UNREACHABLE: u8 = 3;
const PROTO_ICMP: u8 = 1;

/// The Internet checksum of `words` (16-bit words as stored), folded, as stored.
#[inline(always)]
fn checksum<const N: usize>(words: &[u16; N], mut sum: u32) -> u16 {
    for w in words {
        sum += u32::from(u16::from_be(*w));
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    (!(sum as u16)).to_be()
}

/// Turns the IPv4 UDP datagram in `pkt` into an ICMP port unreachable to its sender and
/// returns the verdict that sends it; PASS where that cannot be done (IP options, XDP).
#[inline(never)]
pub fn port_unreachable4<P: Packet>(pkt: &mut P) -> i32 {
    build4(pkt).unwrap_or(P::PASS)
}

#[inline(always)]
fn build4<P: Packet>(pkt: &mut P) -> Option<i32> {
    let version_ihl: u8 = pkt.load(ETH_HLEN)?;
    if version_ihl != 0x45 {
        return None;
    }
    let macs: [u8; 12] = pkt.load(0)?;
    let saddr: u32 = pkt.load(ETH_HLEN + 12)?;
    let daddr: u32 = pkt.load(ETH_HLEN + 16)?;
    pkt.reshape((ETH_HLEN + QUOTE) as u32, (IP_HLEN + ICMP_HLEN) as u32)
        .ok()?;
    // Back to where it came from.
    let mut eth = [0u8; 12];
    eth[..6].copy_from_slice(&macs[6..]);
    eth[6..].copy_from_slice(&macs[..6]);
    pkt.store(0, &eth).ok()?;

    let total = (IP_HLEN + ICMP_HLEN + QUOTE) as u16;
    let mut ip = [0u16; IP_HLEN / 2];
    ip[0] = u16::from_be_bytes([0x45, 0]).to_be();
    ip[1] = total.to_be();
    ip[4] = u16::from_be_bytes([64, PROTO_ICMP]).to_be();
    // From the address the datagram was sent to, as a REJECT answers.
    let (d, s) = (daddr.to_ne_bytes(), saddr.to_ne_bytes());
    ip[6] = u16::from_ne_bytes([d[0], d[1]]);
    ip[7] = u16::from_ne_bytes([d[2], d[3]]);
    ip[8] = u16::from_ne_bytes([s[0], s[1]]);
    ip[9] = u16::from_ne_bytes([s[2], s[3]]);
    ip[5] = checksum(&ip, 0);
    pkt.store(ETH_HLEN, &ip).ok()?;

    let quote: [u16; QUOTE / 2] = pkt.load(ETH_HLEN + IP_HLEN + ICMP_HLEN)?;
    let mut icmp = [0u16; ICMP_HLEN / 2];
    icmp[0] = u16::from_be_bytes([DEST_UNREACHABLE, PORT_UNREACHABLE]).to_be();
    let quoted: u32 = quote.iter().map(|w| u32::from(u16::from_be(*w))).sum();
    icmp[1] = checksum(&icmp, quoted);
    pkt.store(ETH_HLEN + IP_HLEN, &icmp).ok()?;
    Some(pkt.bounce())
}

const IP6_HLEN: usize = 40;
const QUOTE6: usize = IP6_HLEN + 8;
const ICMP6_DEST_UNREACHABLE: u8 = 1;
const ICMP6_PORT_UNREACHABLE: u8 = 4;
const NEXT_ICMP6: u8 = 58;
const NEXT_UDP: u8 = 17;

/// The IPv6 form: ICMPv6 destination unreachable, port unreachable.
#[inline(never)]
pub fn port_unreachable6<P: Packet>(pkt: &mut P) -> i32 {
    build6(pkt).unwrap_or(P::PASS)
}

#[inline(always)]
fn build6<P: Packet>(pkt: &mut P) -> Option<i32> {
    // The UDP header right after the fixed header: no extension headers to quote.
    let next: u8 = pkt.load(ETH_HLEN + 6)?;
    if next != NEXT_UDP {
        return None;
    }
    let macs: [u8; 12] = pkt.load(0)?;
    let saddr: [u16; 8] = pkt.load(ETH_HLEN + 8)?;
    let daddr: [u16; 8] = pkt.load(ETH_HLEN + 24)?;
    pkt.reshape((ETH_HLEN + QUOTE6) as u32, (IP6_HLEN + ICMP_HLEN) as u32)
        .ok()?;
    let mut eth = [0u8; 12];
    eth[..6].copy_from_slice(&macs[6..]);
    eth[6..].copy_from_slice(&macs[..6]);
    pkt.store(0, &eth).ok()?;

    let payload = (ICMP_HLEN + QUOTE6) as u16;
    let mut ip = [0u16; IP6_HLEN / 2];
    ip[0] = 0x6000u16.to_be();
    ip[2] = payload.to_be();
    ip[3] = u16::from_be_bytes([NEXT_ICMP6, 64]).to_be();
    // From the address the datagram was sent to.
    ip[4..12].copy_from_slice(&daddr);
    ip[12..20].copy_from_slice(&saddr);
    pkt.store(ETH_HLEN, &ip).ok()?;

    let quote: [u16; QUOTE6 / 2] = pkt.load(ETH_HLEN + IP6_HLEN + ICMP_HLEN)?;
    let mut icmp = [0u16; ICMP_HLEN / 2];
    icmp[0] = u16::from_be_bytes([ICMP6_DEST_UNREACHABLE, ICMP6_PORT_UNREACHABLE]).to_be();
    // The pseudo header: both addresses, the length and the next header.
    let mut sum: u32 = ip[4..20].iter().map(|w| u32::from(u16::from_be(*w))).sum();
    sum += u32::from(payload) + u32::from(NEXT_ICMP6);
    sum += quote
        .iter()
        .map(|w| u32::from(u16::from_be(*w)))
        .sum::<u32>();
    icmp[1] = checksum(&icmp, sum);
    pkt.store(ETH_HLEN + IP6_HLEN, &icmp).ok()?;
    Some(pkt.bounce())
}
