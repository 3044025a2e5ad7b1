//! The nf_tables ruleset generation of a network namespace (`NFT_MSG_GETGEN`).
//!
//! The kernel bumps it on every nf_tables commit, whoever makes it. The periodic sync uses
//! it to skip reading the tables back when nobody but us has committed since it last knew
//! them to hold exactly our rules: `iptables-nft-save` takes ~5 s at 10,000 services, and
//! every change arriving meanwhile waits behind it. Legacy iptables does not go through
//! nf_tables, so this is only asked with the nft tools.

use std::{io, time::Duration};

use crate::dataplane::{netlink::NetlinkSocket, netns::in_netns};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
const NFTA_GEN_ID: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_HDRLEN: usize = 16;
/// struct nfgenmsg: family, version, resource id.
const NFGENMSG_LEN: usize = 4;
const TIMEOUT: Duration = Duration::from_secs(1);

/// The generation in `netns` (None: ours).
pub fn read(netns: Option<&str>) -> io::Result<u32> {
    in_netns(netns, ask).map_err(|e| io::Error::other(e.to_string()))?
}

fn ask() -> io::Result<u32> {
    let socket =
        NetlinkSocket::open(libc::SOCK_RAW, libc::NETLINK_NETFILTER)?.with_recv_timeout(TIMEOUT)?;
    socket.send(&request())?;
    let mut buf = [0u8; 512];
    let got = socket.recv(&mut buf)?;
    parse(&buf[..got])
}

fn request() -> Vec<u8> {
    let len = (NLMSG_HDRLEN + NFGENMSG_LEN) as u32;
    let mut msg = Vec::with_capacity(len as usize);
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN).to_ne_bytes());
    msg.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
    msg.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    msg
}

/// The generation from the kernel's answer (one message: NEWGEN, or an error).
fn parse(reply: &[u8]) -> io::Result<u32> {
    let bad =
        |why: &str| io::Error::new(io::ErrorKind::InvalidData, format!("NFT_MSG_GETGEN: {why}"));
    let u16_at = |b: &[u8], i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
    if reply.len() < NLMSG_HDRLEN {
        return Err(bad("short reply"));
    }
    let len =
        (u32::from_ne_bytes([reply[0], reply[1], reply[2], reply[3]]) as usize).min(reply.len());
    let kind = u16_at(reply, 4);
    if kind == NLMSG_ERROR && len >= NLMSG_HDRLEN + 4 {
        let code = i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]);
        return Err(io::Error::from_raw_os_error(-code));
    }
    if kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN {
        return Err(bad("unexpected message type"));
    }
    let mut at = NLMSG_HDRLEN + NFGENMSG_LEN;
    while at + 4 <= len {
        let attr_len = u16_at(reply, at) as usize;
        let attr_type = u16_at(reply, at + 2) & 0x3fff;
        if attr_len < 4 || at + attr_len > len {
            break;
        }
        if attr_type == NFTA_GEN_ID && attr_len >= 8 {
            let v = &reply[at + 4..at + 8];
            return Ok(u32::from_be_bytes([v[0], v[1], v[2], v[3]]));
        }
        at += (attr_len + 3) & !3;
    }
    Err(bad("no generation id in the reply"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut body = vec![libc::AF_UNSPEC as u8, 0, 0, 0];
        for (t, v) in attrs {
            body.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
            body.extend_from_slice(&t.to_ne_bytes());
            body.extend_from_slice(v);
            while body.len() % 4 != 0 {
                body.push(0);
            }
        }
        let mut msg = Vec::new();
        msg.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        msg.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN).to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend_from_slice(&body);
        msg
    }

    #[test]
    fn the_generation_is_read_past_other_attributes() {
        let r = reply(&[(3, b"iptables-nft\0"), (NFTA_GEN_ID, &7u32.to_be_bytes())]);
        assert_eq!(parse(&r).unwrap(), 7);
    }

    #[test]
    fn an_error_or_a_truncated_reply_is_an_error_not_a_panic() {
        let mut err = vec![0u8; 20];
        err[..4].copy_from_slice(&20u32.to_ne_bytes());
        err[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        err[16..20].copy_from_slice(&(-libc::EPERM).to_ne_bytes());
        assert_eq!(parse(&err).unwrap_err().raw_os_error(), Some(libc::EPERM));
        let r = reply(&[(NFTA_GEN_ID, &7u32.to_be_bytes())]);
        for cut in 0..r.len() - 1 {
            assert!(parse(&r[..cut]).is_err(), "cut at {cut}");
        }
        // An attribute claiming more than there is.
        let mut r = reply(&[(NFTA_GEN_ID, &7u32.to_be_bytes())]);
        let at = NLMSG_HDRLEN + NFGENMSG_LEN;
        r[at..at + 2].copy_from_slice(&200u16.to_ne_bytes());
        assert!(parse(&r).is_err());
    }
}
