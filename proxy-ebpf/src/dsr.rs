//! Direct server return: the entry node sends a flow to another node's backend with the
//! client's source kept and the frontend (address and port) in an IPv4 option or an IPv6
//! destination option, as Cilium's `--bpf-lb-dsr-dispatch=opt` does; the backend's node
//! reads it into a reply entry, so the backend's answers leave from the frontend straight
//! to the client.
//!
//! An option rather than IPIP: it needs no tunnel device on any node (nor the `ipip`
//! module), the packet stays routable by any fabric that routes pod addresses, and it costs
//! 8 (IPv4) or 24 (IPv6) bytes on the packets that carry it. Only a flow's first packet at
//! a node, and TCP SYNs, carry it: the backend's node keeps what it read.

use proxy_common::nat::dsr::{EXT6_LEN, OPT4_LEN, OPT4_TYPE, OPT6_LEN, OPT6_TYPE};

use crate::{
    ip::{self, ETH_HLEN, IP6_HLEN, Ip, NEXTHDR_DEST, V4},
    packet::Packet,
};

/// IPv4's header without options.
const IP4_HLEN: usize = 20;

/// The frontend a DSR option in this packet names (address, port in network byte order).
#[inline(always)]
pub fn frontend<P: Packet, I: Ip>(pkt: &P) -> Option<(I::Addr, u16)> {
    if I::ETH_P == V4::ETH_P {
        let ver_ihl: u8 = pkt.load(ETH_HLEN)?;
        if ver_ihl & 0x0f < 7 {
            return None;
        }
        let head: [u8; 2] = pkt.load(ETH_HLEN + IP4_HLEN)?;
        if head != [OPT4_TYPE, OPT4_LEN] {
            return None;
        }
        let port: u16 = pkt.load(ETH_HLEN + IP4_HLEN + 2)?;
        let addr: I::Addr = pkt.load(ETH_HLEN + IP4_HLEN + 4)?;
        Some((addr, port))
    } else {
        let next: u8 = pkt.load(ETH_HLEN + 6)?;
        if next != NEXTHDR_DEST {
            return None;
        }
        ip::dsr_option6(pkt, ETH_HLEN)?;
        let addr: I::Addr = pkt.load(ETH_HLEN + IP6_HLEN + 4)?;
        let port: u16 = pkt.load(ETH_HLEN + IP6_HLEN + 20)?;
        Some((addr, port))
    }
}

/// Adds the option naming frontend (`addr`, `port`) to a packet whose IP header has
/// none yet. Err (packet unchanged or unusable) where it cannot: an IPv4 header that
/// already has options, an IPv6 packet with extension headers, XDP.
#[inline(always)]
pub fn push<P: Packet, I: Ip>(pkt: &mut P, addr: I::Addr, port: u16) -> Result<(), ()> {
    if I::ETH_P == V4::ETH_P {
        // Version and header length, TOS, total length: one word for the checksum.
        let old: [u8; 4] = pkt.load(ETH_HLEN).ok_or(())?;
        if old[0] != 0x45 {
            return Err(());
        }
        let total = u16::from_be_bytes([old[2], old[3]]).checked_add(u16::from(OPT4_LEN));
        let total = total.ok_or(())?.to_be_bytes();
        pkt.grow_net(u32::from(OPT4_LEN))?;
        let new = [0x45 + OPT4_LEN / 4, old[1], total[0], total[1]];
        let p = port.to_ne_bytes();
        let opt = [OPT4_TYPE, OPT4_LEN, p[0], p[1]];
        pkt.store(ETH_HLEN, &new)?;
        pkt.store(ETH_HLEN + IP4_HLEN, &opt)?;
        pkt.store(ETH_HLEN + IP4_HLEN + 4, &addr)?;
        let csum = I::L3_CSUM.ok_or(())?;
        pkt.l3_csum_replace(csum, u32::from_ne_bytes(old), u32::from_ne_bytes(new))?;
        pkt.l3_csum_replace(csum, 0, u32::from_ne_bytes(opt))?;
        pkt.l3_csum_replace(csum, 0, I::word(&addr, 0))
    } else {
        let next: u8 = pkt.load(ETH_HLEN + 6).ok_or(())?;
        let payload: u16 = pkt.load(ETH_HLEN + 4).ok_or(())?;
        let payload = u16::from_be(payload)
            .checked_add(EXT6_LEN as u16)
            .ok_or(())?;
        pkt.grow_net(EXT6_LEN as u32)?;
        pkt.store(ETH_HLEN + 4, &payload.to_be())?;
        pkt.store(ETH_HLEN + 6, &NEXTHDR_DEST)?;
        let head = [next, (EXT6_LEN / 8 - 1) as u8, OPT6_TYPE, OPT6_LEN];
        pkt.store(ETH_HLEN + IP6_HLEN, &head)?;
        pkt.store(ETH_HLEN + IP6_HLEN + 4, &addr)?;
        pkt.store(ETH_HLEN + IP6_HLEN + 20, &[port, 0u16])
    }
}
