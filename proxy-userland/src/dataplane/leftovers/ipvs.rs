//! kube-proxy's IPVS mode: its virtual servers in the kernel's IPVS table and the dummy
//! device `kube-ipvs0` that holds the service addresses. Its CleanupLeftovers flushes the
//! one and deletes the other; so do we.
//!
//! The flush is one generic netlink request (`IPVS_CMD_FLUSH` to the "IPVS" family), sent
//! on the bare netlink socket the project already uses: crates.io has no maintained IPVS
//! client (the `ipvs` crate is a name reservation), and a flush needs none. When the kernel
//! has no IPVS (the module is not loaded, or the family is unknown) there is nothing to
//! flush; we do not load the module to find out.

use std::{io, path::Path, time::Duration};

use crate::dataplane::{
    iptables::apply::{ApplyError, run_bounded},
    netlink::NetlinkSocket,
    netns,
};

/// The dummy device kube-proxy's IPVS mode binds service addresses to.
pub const DUMMY_DEVICE: &str = "kube-ipvs0";

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const IPVS_GENL_NAME: &str = "IPVS";
const IPVS_GENL_VERSION: u8 = 1;
const IPVS_CMD_FLUSH: u8 = 17;
const NLMSG_ERROR: u16 = 2;
const NLMSG_HDRLEN: usize = 16;
/// struct genlmsghdr: cmd, version, reserved.
const GENL_HDRLEN: usize = 4;
const TIMEOUT: Duration = Duration::from_secs(2);

/// What became of the IPVS table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flush {
    /// Every virtual server (and its real servers) was deleted.
    Flushed,
    /// The kernel has no IPVS here: no table to clear.
    NoIpvs,
}

/// Flushes the IPVS table of `netns` (None: ours), if the kernel has one.
pub fn flush_virtual_servers(netns: Option<&str>) -> io::Result<Flush> {
    // A built-in or loaded ip_vs shows here; asking netlink for the family otherwise would
    // make the kernel load the module on a node that never used it.
    if !Path::new("/sys/module/ip_vs").exists() {
        return Ok(Flush::NoIpvs);
    }
    let flush = || -> io::Result<Flush> {
        let socket = NetlinkSocket::open(libc::SOCK_RAW, libc::NETLINK_GENERIC)?
            .with_recv_timeout(TIMEOUT)?;
        let Some(family) = family_id(&socket, IPVS_GENL_NAME)? else {
            return Ok(Flush::NoIpvs);
        };
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
        socket.send(&message(
            family,
            flags,
            2,
            IPVS_CMD_FLUSH,
            IPVS_GENL_VERSION,
            &[],
        ))?;
        let mut buf = [0u8; 1024];
        let got = socket.recv(&mut buf)?;
        match parse(&buf[..got])? {
            Reply::Ack => Ok(Flush::Flushed),
            Reply::Attributes(_) => Err(bad("IPVS_CMD_FLUSH: no acknowledgement")),
        }
    };
    netns::in_netns(netns, flush).map_err(|e| io::Error::other(e.to_string()))?
}

/// The id of generic netlink family `name`, or None if the kernel does not know it.
pub fn family_id(socket: &NetlinkSocket, name: &str) -> io::Result<Option<u16>> {
    let mut value = name.as_bytes().to_vec();
    value.push(0);
    let request = message(
        GENL_ID_CTRL,
        libc::NLM_F_REQUEST as u16,
        1,
        CTRL_CMD_GETFAMILY,
        1,
        &[(CTRL_ATTR_FAMILY_NAME, &value)],
    );
    socket.send(&request)?;
    let mut buf = vec![0u8; 8192];
    let got = socket.recv(&mut buf)?;
    match parse(&buf[..got]) {
        Ok(Reply::Attributes(attrs)) => attrs
            .iter()
            .find(|(t, v)| *t == CTRL_ATTR_FAMILY_ID && v.len() >= 2)
            .map(|(_, v)| Some(u16::from_ne_bytes([v[0], v[1]])))
            .ok_or_else(|| bad("CTRL_CMD_GETFAMILY: no family id in the reply")),
        Ok(Reply::Ack) => Err(bad("CTRL_CMD_GETFAMILY: an acknowledgement, no family")),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// One generic netlink request: header, genl header, attributes (each padded to 4 bytes).
fn message(
    kind: u16,
    flags: u16,
    seq: u32,
    cmd: u8,
    version: u8,
    attrs: &[(u16, &[u8])],
) -> Vec<u8> {
    let mut body = vec![cmd, version, 0, 0];
    for (t, v) in attrs {
        body.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
        body.extend_from_slice(&t.to_ne_bytes());
        body.extend_from_slice(v);
        while body.len() % 4 != 0 {
            body.push(0);
        }
    }
    let mut msg = Vec::with_capacity(NLMSG_HDRLEN + body.len());
    msg.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
    msg.extend_from_slice(&body);
    msg
}

#[derive(Debug, PartialEq, Eq)]
enum Reply {
    /// An NLMSG_ERROR carrying 0.
    Ack,
    /// A genl message's attributes, (type, value).
    Attributes(Vec<(u16, Vec<u8>)>),
}

fn bad(why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("generic netlink: {why}"),
    )
}

/// The first message of a reply: an error (as the errno), an acknowledgement, or a genl
/// message's attributes. Never panics on short or lying input.
fn parse(reply: &[u8]) -> io::Result<Reply> {
    let u16_at = |i: usize| u16::from_ne_bytes([reply[i], reply[i + 1]]);
    if reply.len() < NLMSG_HDRLEN {
        return Err(bad("short reply"));
    }
    let len =
        (u32::from_ne_bytes([reply[0], reply[1], reply[2], reply[3]]) as usize).min(reply.len());
    if u16_at(4) == NLMSG_ERROR {
        if len < NLMSG_HDRLEN + 4 {
            return Err(bad("short error message"));
        }
        let code = i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]);
        return match code {
            0 => Ok(Reply::Ack),
            // The kernel sends -errno; anything else is not an errno we can name.
            c if c < 0 => Err(io::Error::from_raw_os_error(c.saturating_neg())),
            _ => Err(bad("positive error code")),
        };
    }
    let mut attrs = Vec::new();
    let mut at = NLMSG_HDRLEN + GENL_HDRLEN;
    while at + 4 <= len {
        let attr_len = u16_at(at) as usize;
        let attr_type = u16_at(at + 2) & 0x3fff;
        if attr_len < 4 || at + attr_len > len {
            break;
        }
        attrs.push((attr_type, reply[at + 4..at + attr_len].to_vec()));
        at += (attr_len + 3) & !3;
    }
    Ok(Reply::Attributes(attrs))
}

/// What was found at `kube-ipvs0`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    /// No such device.
    Absent,
    /// kube-proxy's dummy device, deleted.
    Deleted,
    /// A device of that name that is not a dummy (its kind): not kube-proxy's, kept, as
    /// kube-proxy keeps it.
    NotDummy(String),
}

/// Deletes `kube-ipvs0` in `netns` if it is a dummy device.
pub fn remove_dummy_device(netns: Option<&str>) -> Result<Device, ApplyError> {
    let mut show = netns::command(netns, "ip");
    show.args(["-details", "-json", "link", "show", "dev", DUMMY_DEVICE]);
    let listing = match run_bounded(show, None) {
        Ok(out) => out,
        // `ip` says "Device ... does not exist" and fails: nothing to delete.
        Err(ApplyError::Failed { stderr, .. }) if stderr.contains("does not exist") => {
            return Ok(Device::Absent);
        }
        Err(e) => return Err(e),
    };
    match link_kind(&listing) {
        Some(kind) if kind == "dummy" => {
            let mut delete = netns::command(netns, "ip");
            delete.args(["link", "delete", DUMMY_DEVICE]);
            run_bounded(delete, None)?;
            Ok(Device::Deleted)
        }
        Some(kind) => Ok(Device::NotDummy(kind)),
        None => Ok(Device::NotDummy("unknown".into())),
    }
}

/// The `linkinfo.info_kind` of the first link in `ip -details -json link show` output.
pub fn link_kind(json: &str) -> Option<String> {
    let links: serde_json::Value = serde_json::from_str(json).ok()?;
    links
        .get(0)?
        .get("linkinfo")?
        .get("info_kind")?
        .as_str()
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_family_request_is_well_formed() {
        let m = message(GENL_ID_CTRL, 1, 1, CTRL_CMD_GETFAMILY, 1, &[(2, b"IPVS\0")]);
        // 16 header + 4 genl + 4 attribute header + 5 name, padded to 8.
        assert_eq!(m.len(), 32);
        assert_eq!(u32::from_ne_bytes([m[0], m[1], m[2], m[3]]), 32);
        assert_eq!(&m[24..29], b"IPVS\0");
        assert_eq!(&m[29..], [0, 0, 0]);
    }

    #[test]
    fn replies_parse_and_bad_ones_are_errors_not_panics() {
        let ack = {
            let mut m = message(NLMSG_ERROR, 0, 1, 0, 0, &[]);
            m[16..20].copy_from_slice(&0i32.to_ne_bytes());
            m
        };
        assert_eq!(parse(&ack).unwrap(), Reply::Ack);
        let mut err = ack.clone();
        err[16..20].copy_from_slice(&(-libc::ENOENT).to_ne_bytes());
        assert_eq!(parse(&err).unwrap_err().raw_os_error(), Some(libc::ENOENT));
        let family = message(
            GENL_ID_CTRL,
            0,
            1,
            1,
            2,
            &[(2, b"IPVS\0"), (1, &0x21u16.to_ne_bytes())],
        );
        assert_eq!(
            parse(&family).unwrap(),
            Reply::Attributes(vec![
                (2, b"IPVS\0".to_vec()),
                (1, 0x21u16.to_ne_bytes().to_vec())
            ])
        );
        for cut in 0..NLMSG_HDRLEN {
            assert!(parse(&family[..cut]).is_err());
        }
        for cut in NLMSG_HDRLEN..family.len() {
            let _ = parse(&family[..cut]);
        }
        let mut lying = family.clone();
        lying[20..22].copy_from_slice(&500u16.to_ne_bytes());
        assert_eq!(parse(&lying).unwrap(), Reply::Attributes(vec![]));
    }

    #[test]
    fn the_kernel_answers_for_a_known_family_and_not_for_a_made_up_one() {
        let socket = NetlinkSocket::open(libc::SOCK_RAW, libc::NETLINK_GENERIC)
            .unwrap()
            .with_recv_timeout(TIMEOUT)
            .unwrap();
        // nlctrl is the controller itself: always there, always id 0x10.
        assert_eq!(family_id(&socket, "nlctrl").unwrap(), Some(GENL_ID_CTRL));
        assert_eq!(family_id(&socket, "FP-NO-SUCH").unwrap(), None);
    }

    #[test]
    fn the_link_kind_is_read_from_ip_json() {
        let dummy = r#"[{"ifindex":5,"ifname":"kube-ipvs0","linkinfo":{"info_kind":"dummy"}}]"#;
        assert_eq!(link_kind(dummy).as_deref(), Some("dummy"));
        let veth = r#"[{"ifname":"kube-ipvs0","linkinfo":{"info_kind":"veth"}}]"#;
        assert_eq!(link_kind(veth).as_deref(), Some("veth"));
        assert_eq!(link_kind(r#"[{"ifname":"lo"}]"#), None);
        assert_eq!(link_kind("not json"), None);
        assert_eq!(link_kind("[]"), None);
    }
}
