//! Element changes over netlink: one nf_tables batch of NEWSETELEM and DELSETELEM
//! messages, all applied or none, as `nft -f` would send them, without nft's dump of every
//! chain first (20-40 ms at 10,000 services, most of a partial sync that moves endpoints).

use std::{io, net::IpAddr, time::Duration};

use super::render::{ElementChange, TABLE, endpoints::map_name};
use crate::dataplane::{
    iptables::Family,
    netlink::{NLMSG_ERROR, NetlinkSocket, NlMsgHdr, error_in},
    netns::in_netns,
};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFT_MSG_GETGEN: u16 = 16;
const NLM_F_REQUEST: u16 = libc::NLM_F_REQUEST as u16;
const NLM_F_ACK: u16 = libc::NLM_F_ACK as u16;
const NLM_F_CREATE: u16 = libc::NLM_F_CREATE as u16;
const NLA_F_NESTED: u16 = libc::NLA_F_NESTED as u16;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;

/// More changes than this go through `nft` instead: a batch must fit one datagram (about
/// 100 bytes a change).
pub const MAX_BATCH: usize = 1_000;
const ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// Applies `changes` to `family`'s table in `netns` (None: ours) in one batch.
pub fn apply(netns: Option<&str>, family: Family, changes: &[ElementChange]) -> io::Result<()> {
    if changes.is_empty() {
        return Ok(());
    }
    let batch = encode(family, changes, 1)?;
    // Asked after the batch, and answered after it: the batch is done when this is.
    let mut probe = Vec::new();
    let probe_seq = changes.len() as u32 + 3;
    message(
        &mut probe,
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
        NLM_F_REQUEST | NLM_F_ACK,
        probe_seq,
        0,
        |_| {},
    );
    in_netns(netns, || {
        let socket = NetlinkSocket::open(libc::SOCK_RAW, libc::NETLINK_NETFILTER)?
            .with_recv_timeout(ACK_TIMEOUT)?;
        socket.send(&batch)?;
        socket.send(&probe)?;
        read_answers(&socket, probe_seq)
    })
    .map_err(|e| io::Error::other(e.to_string()))?
}

/// Reads until the probe `probe_seq` is acknowledged. The batch's messages ask for no
/// acknowledgement (a thousand of them, each echoing its request, overflow the socket's
/// buffer: ENOBUFS), so Linux answers only those that failed, and any such error fails the
/// batch (Linux then applied none of it).
fn read_answers(socket: &NetlinkSocket, probe_seq: u32) -> io::Result<()> {
    const HDR: usize = size_of::<NlMsgHdr>();
    let mut buf = vec![0u8; 64 * 1024];
    let mut first_error = None;
    loop {
        let len = socket.recv(&mut buf)?;
        let mut off = 0;
        while off + HDR <= len {
            let hdr: NlMsgHdr = bytemuck::pod_read_unaligned(&buf[off..off + HDR]);
            let end = off + hdr.len as usize;
            if (hdr.len as usize) < HDR || end > len {
                return Err(io::Error::other("truncated nf_tables answer"));
            }
            if hdr.ty == NLMSG_ERROR {
                let err = error_in(&buf[off + HDR..end]);
                if hdr.seq == probe_seq {
                    return first_error.map_or(Ok(()), Err);
                }
                if err.raw_os_error() != Some(0) && first_error.is_none() {
                    first_error = Some(err);
                }
            }
            off += (hdr.len as usize + 3) & !3;
        }
    }
}

/// The batch: BEGIN, one message per change (in order, so a key deleted and added again
/// ends added), END. Sequence numbers start at `seq`.
pub fn encode(family: Family, changes: &[ElementChange], seq: u32) -> io::Result<Vec<u8>> {
    let nfproto = if family.is_v4() {
        NFPROTO_IPV4
    } else {
        NFPROTO_IPV6
    };
    let mut out = Vec::with_capacity(64 + changes.len() * 96);
    let mut seq = seq;
    message(&mut out, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, 0, |b| {
        // The batch's subsystem, in network order, where a message has its resource id.
        b.truncate(b.len() - 2);
        b.extend_from_slice(&NFNL_SUBSYS_NFTABLES.to_be_bytes());
    });
    for change in changes {
        seq += 1;
        let (set, key, data, add) = parts(family, change)?;
        let (ty, flags) = if add {
            (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_CREATE)
        } else {
            (NFT_MSG_DELSETELEM, NLM_F_REQUEST)
        };
        message(
            &mut out,
            (NFNL_SUBSYS_NFTABLES << 8) | ty,
            flags,
            seq,
            nfproto,
            |b| {
                attr(b, NFTA_SET_ELEM_LIST_TABLE, &c_string(TABLE));
                attr(b, NFTA_SET_ELEM_LIST_SET, &c_string(&set));
                nested(b, NFTA_SET_ELEM_LIST_ELEMENTS, |b| {
                    nested(b, NFTA_LIST_ELEM, |b| {
                        nested(b, NFTA_SET_ELEM_KEY, |b| attr(b, NFTA_DATA_VALUE, &key));
                        if let Some(data) = &data {
                            nested(b, NFTA_SET_ELEM_DATA, |b| attr(b, NFTA_DATA_VALUE, data));
                        }
                    });
                });
            },
        );
    }
    message(
        &mut out,
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        seq + 1,
        0,
        |b| {
            b.truncate(b.len() - 2);
            b.extend_from_slice(&NFNL_SUBSYS_NFTABLES.to_be_bytes());
        },
    );
    Ok(out)
}

/// The set, key, data (for an endpoint) and whether the element is added. Keys and data
/// are laid out as nf_tables registers hold them: each part of a concatenation padded to 4
/// bytes; the endpoint key (numgen's result) in host order, addresses and ports in network
/// order.
type Parts = (String, Vec<u8>, Option<Vec<u8>>, bool);

fn parts(family: Family, change: &ElementChange) -> io::Result<Parts> {
    let addr = |ip: IpAddr| -> io::Result<Vec<u8>> {
        match (ip, family.is_v4()) {
            (IpAddr::V4(v4), true) => Ok(v4.octets().to_vec()),
            (IpAddr::V6(v6), false) => Ok(v6.octets().to_vec()),
            _ => Err(io::Error::other(format!(
                "{ip} is not of the table's family"
            ))),
        }
    };
    Ok(match *change {
        ElementChange::Endpoint {
            proto,
            shard,
            key,
            to,
        } => {
            let data = match to {
                Some(to) => {
                    let mut d = addr(to.ip())?;
                    d.extend_from_slice(&to.port().to_be_bytes());
                    d.extend_from_slice(&[0, 0]);
                    Some(d)
                }
                None => None,
            };
            (
                map_name(proto, shard),
                key.to_ne_bytes().to_vec(),
                data,
                to.is_some(),
            )
        }
        ElementChange::Hairpin { ip, add } => {
            let mut key = addr(ip)?;
            key.extend(addr(ip)?);
            (super::render::HAIRPIN.to_string(), key, None, add)
        }
    })
}

fn c_string(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// One message: header, nfgenmsg (family, version 0, resource id 0), then `body`.
fn message(
    out: &mut Vec<u8>,
    ty: u16,
    flags: u16,
    seq: u32,
    nfproto: u8,
    body: impl FnOnce(&mut Vec<u8>),
) {
    let start = out.len();
    out.extend_from_slice(bytemuck::bytes_of(&NlMsgHdr {
        len: 0,
        ty,
        flags,
        seq,
        pid: 0,
    }));
    out.extend_from_slice(&[nfproto, 0, 0, 0]);
    body(out);
    let len = (out.len() - start) as u32;
    out[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    pad(out);
}

fn attr(out: &mut Vec<u8>, ty: u16, value: &[u8]) {
    let len = (4 + value.len()) as u16;
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(value);
    pad(out);
}

fn nested(out: &mut Vec<u8>, ty: u16, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
    body(out);
    let len = (out.len() - start) as u16;
    out[start..start + 2].copy_from_slice(&len.to_ne_bytes());
}

fn pad(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}
