//! The UDP conntrack entries over ctnetlink (NETLINK_NETFILTER, NFNL_SUBSYS_CTNETLINK), as
//! kube-proxy reaches them (vishvananda/netlink's ConntrackDeleteFilters): one dump of the
//! family's table, then every deletion of a sync in one batch on one socket, the acks read
//! back. Running the `conntrack` tool once per entry cost a process each: 109 entries made
//! one sync take 2.5 s, and 2,000 would have held it for about 30 s.
//!
//! The messages are encoded and parsed with netlink-packet-netfilter's typed attributes;
//! the socket is ours ([`NetlinkSocket`]), opened inside the proxier's network namespace,
//! where it stays bound.

use std::{
    io,
    net::IpAddr,
    time::{Duration, Instant},
};

use netlink_packet_core::{
    DefaultNla, NLA_TYPE_MASK, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload, Nla as _,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
    conntrack::{ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol, Tuple},
};

use super::{
    conntrack::{Deleted, Flow},
    render::Family,
};
use crate::dataplane::{netlink::NetlinkSocket, netns::in_netns};

/// CTA_ID: the entry's id, a big-endian u32 (the crate has no variant for it). A delete
/// that carries it fails with ENOENT unless the entry found by the tuple is that one.
const CTA_ID: u16 = 12;
/// How long one receive waits: the kernel answers a delete within our send, and a dump
/// datagram as soon as we read the previous one, so this only bounds a lost answer.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);
/// A whole dump, however large the table.
const DUMP_DEADLINE: Duration = Duration::from_secs(30);
/// The socket buffers we ask for: the acks of a whole batch must fit in the receive
/// buffer, or the kernel drops them (ENOBUFS). Root may go beyond net.core.rmem_max.
const WANTED_BUFFER: libc::c_int = 4 << 20;
/// What one ack costs at most in the receive buffer: the kernel counts the buffer's true
/// size (about 768 bytes), not the 36 bytes of the message.
const ACK_COST: usize = 1024;
/// An encoded delete request at most (IPv6: 108 bytes).
const DELETE_MAX_LEN: usize = 128;
/// Requests in one send at most.
const MAX_PER_SEND: usize = 4096;
/// Dump datagrams are at most 32 KiB; acks are far smaller.
const RECV_LEN: usize = 64 * 1024;
const NLMSG_HDRLEN: usize = 16;

/// The UDP entries of `family`'s conntrack table in `netns` (None: ours).
pub fn list_udp(netns: Option<&str>, family: Family) -> io::Result<Vec<Flow>> {
    in_netns(netns, || Socket::open()?.list_udp(family))
        .map_err(|e| io::Error::other(e.to_string()))?
}

/// Deletes `flows` from `family`'s conntrack table in `netns` (None: ours).
pub fn delete(netns: Option<&str>, family: Family, flows: &[Flow]) -> io::Result<Deleted> {
    if flows.is_empty() {
        return Ok(Deleted::default());
    }
    in_netns(netns, || Socket::open()?.delete(family, flows))
        .map_err(|e| io::Error::other(e.to_string()))?
}

struct Socket {
    socket: NetlinkSocket,
    /// Delete requests per send, so that their acks fit in the receive buffer.
    per_send: usize,
    seq: u32,
}

impl Socket {
    fn open() -> io::Result<Self> {
        let socket = NetlinkSocket::open(libc::SOCK_RAW, libc::NETLINK_NETFILTER)?
            .with_recv_timeout(RECV_TIMEOUT)?;
        // The FORCE options need CAP_NET_ADMIN, which the proxier has; without it, take
        // what net.core.[rw]mem_max allow and send smaller batches.
        for (force, plain) in [
            (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
            (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
        ] {
            if socket
                .set_option(libc::SOL_SOCKET, force, WANTED_BUFFER)
                .is_err()
            {
                let _ = socket.set_option(libc::SOL_SOCKET, plain, WANTED_BUFFER);
            }
        }
        // An error then echoes the request's header only, not the whole request. Older
        // kernels without the option just send bigger errors.
        let _ = socket.set_option(libc::SOL_NETLINK, libc::NETLINK_CAP_ACK, 1);
        let rcvbuf = socket.option(libc::SOL_SOCKET, libc::SO_RCVBUF)?;
        let sndbuf = socket.option(libc::SOL_SOCKET, libc::SO_SNDBUF)?;
        Ok(Socket {
            socket,
            per_send: per_send(rcvbuf.max(0) as usize, sndbuf.max(0) as usize),
            seq: 0,
        })
    }

    fn list_udp(&mut self, family: Family) -> io::Result<Vec<Flow>> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let mut request = Vec::new();
        encode(
            &mut request,
            ConntrackMessage::Get(Vec::new()),
            family,
            seq,
            NLM_F_REQUEST | NLM_F_DUMP,
        );
        self.socket.send(&request)?;
        let deadline = Instant::now() + DUMP_DEADLINE;
        let mut buf = vec![0u8; RECV_LEN];
        let mut flows = Vec::new();
        loop {
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("conntrack dump unfinished after {DUMP_DEADLINE:?}"),
                ));
            }
            let got = self.socket.recv(&mut buf)?;
            for bytes in messages(&buf[..got]) {
                // A message we cannot parse (another protocol's entry with attributes
                // the crate does not know) is not one of ours to delete.
                let Ok(msg) = NetlinkMessage::<NetfilterMessage>::deserialize(bytes) else {
                    continue;
                };
                if msg.header.sequence_number != seq {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::Done(_) => return Ok(flows),
                    NetlinkPayload::Error(e) => {
                        return Err(match e.code {
                            Some(code) => io::Error::from_raw_os_error(code.get().saturating_neg()),
                            None => io::Error::other("conntrack dump acked without an end"),
                        });
                    }
                    NetlinkPayload::InnerMessage(m) => flows.extend(flow_of(family, &m)),
                    _ => {}
                }
            }
        }
    }

    fn delete(&mut self, family: Family, flows: &[Flow]) -> io::Result<Deleted> {
        let mut done = Deleted::default();
        let mut buf = vec![0u8; RECV_LEN];
        for chunk in flows.chunks(self.per_send) {
            let first = self.seq.wrapping_add(1);
            let mut batch = Vec::with_capacity(chunk.len() * DELETE_MAX_LEN);
            for (i, flow) in chunk.iter().enumerate() {
                encode(
                    &mut batch,
                    delete_request(flow),
                    family,
                    first.wrapping_add(i as u32),
                    NLM_F_REQUEST | NLM_F_ACK,
                );
            }
            self.seq = first.wrapping_add(chunk.len() as u32 - 1);
            // One sendmsg: the kernel handles the requests one after the other within it
            // and queues an answer for each, an ack or an error.
            self.socket.send(&batch)?;
            let mut answered = vec![false; chunk.len()];
            let mut left = chunk.len();
            while left > 0 {
                let got = self.socket.recv(&mut buf)?;
                for (seq, errno) in messages(&buf[..got]).into_iter().filter_map(answer) {
                    let i = seq.wrapping_sub(first) as usize;
                    let Some(flow) = chunk.get(i) else { continue };
                    if std::mem::replace(&mut answered[i], true) {
                        continue;
                    }
                    left -= 1;
                    match errno {
                        None => done.deleted += 1,
                        Some(libc::ENOENT) => done.already_gone += 1,
                        Some(errno) => done
                            .failed
                            .push((*flow, io::Error::from_raw_os_error(errno).to_string())),
                    }
                }
            }
        }
        Ok(done)
    }
}

/// Delete requests per send for socket buffers of these sizes (as the kernel reports
/// them): the acks must fit in the receive buffer, the requests in the send buffer.
fn per_send(rcvbuf: usize, sndbuf: usize) -> usize {
    (rcvbuf / ACK_COST)
        .min(sndbuf.saturating_sub(32) / DELETE_MAX_LEN)
        .clamp(1, MAX_PER_SEND)
}

/// Appends `msg` as one ctnetlink message of `family`.
fn encode(out: &mut Vec<u8>, msg: ConntrackMessage, family: Family, seq: u32, flags: u16) {
    let family = match family {
        Family::V4 => NetfilterProtoFamily::IPv4,
        Family::V6 => NetfilterProtoFamily::IPv6,
    };
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut packet = NetlinkMessage::new(
        header,
        NetlinkPayload::from(NetfilterMessage::new(
            NetfilterHeader::new(family, 0, 0),
            msg,
        )),
    );
    packet.finalize();
    let at = out.len();
    out.resize(at + packet.buffer_len(), 0);
    packet.serialize(&mut out[at..]);
}

/// The request that deletes exactly `flow`. The kernel finds the entry by its original
/// tuple (it looks at CTA_TUPLE_REPLY only without one); the id, when we have it, keeps a
/// newer entry with the same tuple from being deleted instead.
fn delete_request(flow: &Flow) -> ConntrackMessage {
    let mut attrs = vec![ConntrackAttribute::CtaTupleOrig(vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(flow.orig_src),
            IPTuple::DestinationAddress(flow.orig_dst),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(Protocol::Udp),
            ProtoTuple::SourcePort(flow.orig_sport),
            ProtoTuple::DestinationPort(flow.orig_dport),
        ]),
    ])];
    if let Some(id) = flow.id {
        attrs.push(ConntrackAttribute::Other(DefaultNla::new(
            CTA_ID,
            id.to_be_bytes().to_vec(),
        )));
    }
    ConntrackMessage::Delete(attrs)
}

/// The messages of one datagram, each with its header; a length that does not fit ends it.
fn messages(mut buf: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while let Some(len) = buf.get(..4) {
        let len = u32::from_ne_bytes([len[0], len[1], len[2], len[3]]) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            break;
        }
        out.push(&buf[..len]);
        buf = buf.get((len + 3) & !3..).unwrap_or_default();
    }
    out
}

/// The answer one message gives to a request: its sequence number and, for an error, the
/// errno (None: acked). Anything else is no answer.
fn answer(bytes: &[u8]) -> Option<(u32, Option<i32>)> {
    let msg = NetlinkMessage::<NetfilterMessage>::deserialize(bytes).ok()?;
    match msg.payload {
        NetlinkPayload::Error(e) => Some((
            msg.header.sequence_number,
            e.code.map(|c| c.get().saturating_neg()),
        )),
        _ => None,
    }
}

/// One direction of an entry as the kernel reports it.
#[derive(Debug, Default)]
struct Ends {
    src: Option<IpAddr>,
    dst: Option<IpAddr>,
    proto: Option<u8>,
    sport: Option<u16>,
    dport: Option<u16>,
}

fn ends(tuple: &[Tuple]) -> Ends {
    let mut e = Ends::default();
    for part in tuple {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => e.src = Some(*a),
                        IPTuple::DestinationAddress(a) => e.dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(fields) => {
                for f in fields {
                    match f {
                        ProtoTuple::Protocol(p) => e.proto = Some(u8::from(*p)),
                        ProtoTuple::SourcePort(p) => e.sport = Some(*p),
                        ProtoTuple::DestinationPort(p) => e.dport = Some(*p),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    e
}

/// The UDP entry of `family` one dump message describes, if it is one.
fn flow_of(family: Family, msg: &NetfilterMessage) -> Option<Flow> {
    let NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) = &msg.inner else {
        return None;
    };
    let (mut orig, mut reply, mut id) = (None, None, None);
    for attr in attrs {
        match attr {
            ConntrackAttribute::CtaTupleOrig(t) => orig = Some(ends(t)),
            ConntrackAttribute::CtaTupleReply(t) => reply = Some(ends(t)),
            ConntrackAttribute::Other(nla)
                if nla.kind() & NLA_TYPE_MASK == CTA_ID && nla.value_len() == 4 =>
            {
                let mut v = [0u8; 4];
                nla.emit_value(&mut v);
                id = Some(u32::from_be_bytes(v));
            }
            _ => {}
        }
    }
    let (orig, reply) = (orig?, reply?);
    if orig.proto? != libc::IPPROTO_UDP as u8 {
        return None;
    }
    let flow = Flow {
        orig_src: orig.src?,
        orig_dst: orig.dst?,
        orig_sport: orig.sport?,
        orig_dport: orig.dport?,
        reply_src: reply.src?,
        reply_sport: reply.sport?,
        id,
    };
    let ours = [flow.orig_src, flow.orig_dst, flow.reply_src]
        .iter()
        .all(|ip| Family::of(ip) == family);
    ours.then_some(flow)
}

#[cfg(test)]
mod tests;
