//! `--pod-interfaces auto`: the pods' devices found without a CNI-specific name prefix.
//!
//! Whatever the CNI (bridge, ptp, Calico, Cilium, kindnet), a pod's network reaches the
//! node through a veth pair whose other end is in the pod's network namespace: in the
//! node's namespace, such a device carries `IFLA_LINK_NETNSID` (the peer's namespace as
//! this one numbers it). So does a node's own uplink when the node is itself a container
//! (kind, a test bed's fabric): the uplink is told apart by what a node's uplink has and a
//! pod's device has not, the node's address (pods' devices hold none, or a gateway address
//! such as Calico's 169.254.1.1), or a default route.

use std::{collections::BTreeSet, io, mem::size_of, net::IpAddr};

use bytemuck::{Pod, Zeroable};

use crate::dataplane::netlink::{NetlinkSocket, NlMsgHdr, attributes};

const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_LINK_NETNSID: u16 = 37;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
struct IfInfoMsg {
    family: u8,
    pad: u8,
    ty: u16,
    index: i32,
    flags: u32,
    change: u32,
}

const _: () = assert!(size_of::<NlMsgHdr>() == 16 && size_of::<IfInfoMsg>() == 16);

/// A device as the auto rule sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub veth: bool,
    /// Its peer lives in another network namespace (IFLA_LINK_NETNSID is present).
    pub peer_elsewhere: bool,
}

/// The rule, apart from how the facts are read: veths whose peer is in another namespace,
/// but for any that carries a default route (`uplinks`) or holds one of `node_addresses`
/// (`addresses`: (device name, address) of every address here).
pub fn pod_devices(
    links: &[Link],
    uplinks: &[String],
    addresses: &[(String, IpAddr)],
    node_addresses: &BTreeSet<IpAddr>,
) -> BTreeSet<u32> {
    let holds_node_address = |name: &str| {
        addresses
            .iter()
            .any(|(n, a)| n == name && node_addresses.contains(a))
    };
    links
        .iter()
        .filter(|l| l.veth && l.peer_elsewhere)
        .filter(|l| !uplinks.contains(&l.name) && !holds_node_address(&l.name))
        .map(|l| l.index)
        .collect()
}

/// Every device of this thread's network namespace, through one RTM_GETLINK dump (no
/// capability needed).
pub fn links_here() -> io::Result<Vec<Link>> {
    let socket = NetlinkSocket::route_dump(RTM_GETLINK, bytemuck::bytes_of(&IfInfoMsg::default()))?;
    let mut out = Vec::new();
    socket.read_dump("rtnetlink link", |ty, body| {
        if ty == RTM_NEWLINK {
            out.extend(parse_link(body));
        }
    })?;
    Ok(out)
}

/// One RTM_NEWLINK body; None if it is too short to be one.
fn parse_link(body: &[u8]) -> Option<Link> {
    let info: IfInfoMsg = bytemuck::pod_read_unaligned(body.get(..size_of::<IfInfoMsg>())?);
    let mut link = Link {
        index: u32::try_from(info.index).ok()?,
        ..Link::default()
    };
    for (ty, payload) in attributes(&body[size_of::<IfInfoMsg>()..]) {
        match ty {
            IFLA_IFNAME => {
                let name = payload.split(|&b| b == 0).next().unwrap_or_default();
                link.name = String::from_utf8_lossy(name).into_owned();
            }
            IFLA_LINK_NETNSID => link.peer_elsewhere = true,
            IFLA_LINKINFO => {
                link.veth = attributes(payload)
                    .any(|(t, kind)| t == IFLA_INFO_KIND && kind.starts_with(b"veth"));
            }
            _ => {}
        }
    }
    Some(link)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, veth: bool, peer_elsewhere: bool) -> Link {
        Link {
            index,
            name: name.into(),
            veth,
            peer_elsewhere,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// A kind node: its uplink `eth0` is a veth to the host's namespace holding the node IP
    /// and the default route; Calico's, Cilium's and a bridge CNI's pod devices hold no
    /// address (or a gateway that is not the node's); a veth with both ends here, a bridge
    /// and a dummy are not pods'.
    #[test]
    fn pods_veths_are_found_and_the_uplink_is_not() {
        let links = [
            link(1, "lo", false, false),
            link(2, "eth0", true, true),
            link(3, "cali1234", true, true),
            link(4, "lxc5678", true, true),
            link(5, "veth9abc", true, true),
            link(6, "vethpair-a", true, false),
            link(7, "cni0", false, false),
            link(8, "dummy0", false, true),
            link(9, "eth1", true, true),
        ];
        let addresses = vec![
            ("eth0".to_string(), ip("198.18.0.2")),
            ("cni0".to_string(), ip("198.18.5.1")),
            ("veth9abc".to_string(), ip("198.19.255.1")),
            ("eth1".to_string(), ip("2001:db8::2")),
        ];
        let node: BTreeSet<IpAddr> = [ip("198.18.0.2"), ip("2001:db8::2")].into();
        assert_eq!(
            pod_devices(&links, &["eth0".into()], &addresses, &node),
            [3, 4, 5].into(),
            "eth0 by its default route and address, eth1 by its address"
        );
        // Without a default route, the address alone still tells the uplink.
        assert_eq!(
            pod_devices(&links, &[], &addresses, &node),
            [3, 4, 5].into()
        );
        // A test bed's node namespace: the same gateway address on every pod's device, no
        // default route, and the node's address nowhere here: every pod's veth.
        let bed = [link(10, "fpv0", true, true), link(11, "fpv1", true, true)];
        let gw = vec![
            ("fpv0".to_string(), ip("198.18.0.1")),
            ("fpv1".to_string(), ip("198.18.0.1")),
        ];
        assert_eq!(
            pod_devices(&bed, &[], &gw, &BTreeSet::new()),
            [10, 11].into()
        );
    }

    #[test]
    fn link_messages_are_parsed_and_bad_ones_are_not_trusted() {
        let mut body = bytemuck::bytes_of(&IfInfoMsg {
            index: 7,
            ..IfInfoMsg::default()
        })
        .to_vec();
        let attr = crate::dataplane::netlink::attribute;
        body.extend(attr(IFLA_IFNAME, b"cali1\0"));
        body.extend(attr(IFLA_LINK_NETNSID, &3i32.to_ne_bytes()));
        body.extend(attr(
            IFLA_LINKINFO | 0x8000,
            &attr(IFLA_INFO_KIND, b"veth\0"),
        ));
        assert_eq!(parse_link(&body), Some(link(7, "cali1", true, true)));
        // Truncated: no panic, and an attribute cut short is ignored.
        assert_eq!(parse_link(&body[..10]), None);
        let cut = parse_link(&body[..body.len() - 3]).unwrap();
        assert!(!cut.veth && cut.peer_elsewhere && cut.name == "cali1");
        // A length pointing past the end.
        let mut bad = body[..size_of::<IfInfoMsg>()].to_vec();
        bad.extend([0xff, 0x00, 0x03, 0x00, b'x']);
        assert_eq!(parse_link(&bad), Some(link(7, "", false, false)));
    }

    #[test]
    fn this_namespace_lists_its_loopback() {
        let links = links_here().expect("rtnetlink dump");
        assert!(links.iter().any(|l| l.name == "lo" && !l.veth), "{links:?}");
    }
}
