//! What the packet-path logic needs from a hook, so [`crate::nodeport`] is written once for
//! tc and XDP: reading and writing packet bytes, checksum fix-ups, the FIB, and sending a
//! packet out of another device.

use core::{ffi::c_void, mem};

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK, TC_ACT_SHOT, bpf_adj_room_mode,
        xdp_action,
    },
    helpers::{
        bpf_redirect, bpf_redirect_neigh, bpf_redirect_peer, bpf_skb_change_tail,
        bpf_skb_load_bytes,
    },
    programs::{TcContext, XdpContext},
};
use bytemuck::Pod;

pub const FIB_SUCCESS: i64 = 0;
pub const FIB_NOT_FWDED: i64 = 4;
pub const FIB_NO_NEIGH: i64 = 7;

/// The bit of the socket buffer's `tc_index` that says "settled on its way in": tc ingress
/// sets it on a packet it translated, or whose reply entry it looked up and did not find,
/// and the egress program of the device the packet leaves by (a pod's, a node's) then
/// skips its own lookup of that entry, which would find nothing. The host's routing between the two leaves the
/// field alone, but tc sets it when an ingress program passes a packet: to the class id
/// the program left (`tc_classid`; TCX and clsact alike), so the bit is written there as
/// well as in `tc_index` (which a redirected packet keeps), and ingress sets both to 0 for
/// every other packet.
const TC_INDEX_SETTLED: u32 = 1 << 9;

pub trait Packet {
    /// Whether this is the XDP hook (for the counters).
    const XDP: bool;
    /// Let the packet go on its way (to the stack, or on out of the device).
    const PASS: i32;
    const DROP: i32;

    /// `Pod`: packet bytes are whatever the sender made them.
    fn load<T: Pod>(&self, offset: usize) -> Option<T>;
    fn store<T: Pod>(&mut self, offset: usize, value: &T) -> Result<(), ()>;
    /// As [`Self::load`], into `dst` (map memory: no copy on the stack).
    fn load_into<T: Pod>(&self, offset: usize, dst: &mut T) -> Result<(), ()>;
    /// Fixes the IPv4 header checksum at `offset` for a 4-byte field changing `from` -> `to`.
    fn l3_csum_replace(&mut self, offset: usize, from: u32, to: u32) -> Result<(), ()>;
    /// Fixes the L4 checksum at `offset` for a `size`-byte field (2 or 4) changing; `pseudo`:
    /// the field is part of the pseudo header; `udp`: a zero checksum means "none".
    fn l4_csum_replace(
        &mut self,
        offset: usize,
        from: u32,
        to: u32,
        size: u8,
        pseudo: bool,
        udp: bool,
    ) -> Result<(), ()>;
    /// Adds `diff`, a one's-complement sum of (!old + new) over changed 16-bit words (as in
    /// memory), into the L4 checksum at `offset`; `pseudo` and `udp` as for
    /// [`Self::l4_csum_replace`].
    fn l4_csum_diff(&mut self, offset: usize, diff: u32, pseudo: bool, udp: bool)
    -> Result<(), ()>;
    fn ifindex(&self) -> u32;
    fn as_ctx(&self) -> *mut c_void;
    /// Whether a FIB answer lets this hook send the packet out itself.
    fn can_redirect(fib_ret: i64) -> bool;
    /// Sends the packet out of the FIB's device (MACs already set on success).
    fn redirect(&mut self, fib_ret: i64, ifindex: u32) -> i32;
    /// Cuts the packet to `len` bytes, then makes room for `grow` more right after the
    /// Ethernet header: the shape of an error that quotes the packet. Err where the hook
    /// cannot reshape packets (XDP here).
    fn reshape(&mut self, len: u32, grow: u32) -> Result<(), ()>;
    /// Sends the packet back out of the device it arrived on (to the sender).
    fn bounce(&mut self) -> i32;
    /// Sends the packet into the namespace of the peer of veth `ifindex`, to arrive there
    /// as if that peer had received it (tc only; XDP passes it on).
    fn redirect_peer(&mut self, ifindex: u32) -> i32;
    /// Makes room for `len` bytes right after the fixed IP header (where IPv4 options and
    /// IPv6 extension headers go). Err where the hook cannot (XDP here).
    fn grow_net(&mut self, len: u32) -> Result<(), ()>;
    /// Ingress: notes on the packet whether this program settled it (see
    /// [`TC_INDEX_SETTLED`]); a no-op where the hook has no such field (XDP, whose packets
    /// tc ingress sees next anyway).
    fn note_settled(&mut self, settled: bool);
    /// Egress: whether ingress settled the packet.
    fn was_settled(&self) -> bool;
}

impl Packet for TcContext {
    const XDP: bool = false;
    const PASS: i32 = TC_ACT_OK;
    const DROP: i32 = TC_ACT_SHOT;

    // Headers are in the linear part of almost every packet: read there directly, a
    // bounds check against data_end, where bpf_skb_load_bytes is a helper call per field
    // (seven for a tuple, on every packet). The helper remains for the rest.
    #[inline(always)]
    fn load<T: Pod>(&self, offset: usize) -> Option<T> {
        linear::<T>(self, offset).or_else(|| TcContext::load(self, offset).ok())
    }

    #[inline(always)]
    fn store<T: Pod>(&mut self, offset: usize, value: &T) -> Result<(), ()> {
        TcContext::store(self, offset, value, 0).map_err(drop)
    }

    #[inline(always)]
    fn load_into<T: Pod>(&self, offset: usize, dst: &mut T) -> Result<(), ()> {
        if let Some(src) = linear_ptr::<T>(self, offset) {
            // SAFETY: `src` is `size_of::<T>()` readable packet bytes (see `linear_ptr`),
            // `dst` a live, exclusive `T`; packet and map memory do not overlap, and any
            // bytes are a valid `T: Pod`.
            unsafe {
                core::ptr::copy_nonoverlapping(src, dst as *mut T as *mut u8, mem::size_of::<T>())
            };
            return Ok(());
        }
        let len = mem::size_of::<T>() as u32;
        // SAFETY: our own program's context, and `dst` a live, exclusive `T` of exactly
        // `len` bytes, which is all the helper writes; any bytes are a valid `T: Pod`.
        let ret = unsafe {
            bpf_skb_load_bytes(
                self.skb.skb as *const c_void,
                offset as u32,
                dst as *mut T as *mut c_void,
                len,
            )
        };
        if ret == 0 { Ok(()) } else { Err(()) }
    }

    #[inline(always)]
    fn l3_csum_replace(&mut self, offset: usize, from: u32, to: u32) -> Result<(), ()> {
        TcContext::l3_csum_replace(self, offset, u64::from(from), u64::from(to), 4).map_err(drop)
    }

    // The kernel helper also keeps CHECKSUM_PARTIAL packets (local senders over veth) right.
    #[inline(always)]
    fn l4_csum_replace(
        &mut self,
        offset: usize,
        from: u32,
        to: u32,
        size: u8,
        pseudo: bool,
        udp: bool,
    ) -> Result<(), ()> {
        let mut flags = u64::from(size);
        if pseudo {
            flags |= u64::from(BPF_F_PSEUDO_HDR);
        }
        if udp {
            flags |= u64::from(BPF_F_MARK_MANGLED_0);
        }
        TcContext::l4_csum_replace(self, offset, u64::from(from), u64::from(to), flags)
            .map_err(drop)
    }

    // Size 0: the helper takes `to` as the difference, and `from` must be 0.
    #[inline(always)]
    fn l4_csum_diff(
        &mut self,
        offset: usize,
        diff: u32,
        pseudo: bool,
        udp: bool,
    ) -> Result<(), ()> {
        let mut flags = 0;
        if pseudo {
            flags |= u64::from(BPF_F_PSEUDO_HDR);
        }
        if udp {
            flags |= u64::from(BPF_F_MARK_MANGLED_0);
        }
        TcContext::l4_csum_replace(self, offset, 0, u64::from(diff), flags).map_err(drop)
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: the __sk_buff context the kernel passed this program, valid for its whole
        // run; the verifier checks the field read against the context's layout.
        unsafe { (*self.skb.skb).ifindex }
    }

    #[inline(always)]
    fn as_ctx(&self) -> *mut c_void {
        EbpfContext::as_ptr(self)
    }

    #[inline(always)]
    fn can_redirect(fib_ret: i64) -> bool {
        fib_ret == FIB_SUCCESS || fib_ret == FIB_NO_NEIGH
    }

    #[inline(always)]
    fn redirect(&mut self, fib_ret: i64, ifindex: u32) -> i32 {
        if fib_ret == FIB_NO_NEIGH {
            // The next hop's MAC is not known yet: the kernel resolves it.
            // SAFETY: no neighbour parameters (a null pointer with length 0, which the helper
            // documents as "look the next hop up"); the rest are plain values.
            return unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) as i32 };
        }
        // SAFETY: plain values; the helper only records where the packet goes next.
        unsafe { bpf_redirect(ifindex, 0) as i32 }
    }

    #[inline(always)]
    fn reshape(&mut self, len: u32, grow: u32) -> Result<(), ()> {
        // SAFETY: our own __sk_buff context and plain values; the helper resizes the packet
        // and the verifier drops every packet pointer we hold (we hold none: loads and
        // stores go through helpers).
        if unsafe { bpf_skb_change_tail(self.skb.skb, len, 0) } != 0 {
            return Err(());
        }
        let grow = i32::try_from(grow).map_err(drop)?;
        TcContext::adjust_room(self, grow, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, 0).map_err(drop)
    }

    #[inline(always)]
    fn redirect_peer(&mut self, ifindex: u32) -> i32 {
        // SAFETY: plain values; the helper only records where the packet goes next.
        unsafe { bpf_redirect_peer(ifindex, 0) as i32 }
    }

    #[inline(always)]
    fn grow_net(&mut self, len: u32) -> Result<(), ()> {
        let len = i32::try_from(len).map_err(drop)?;
        TcContext::adjust_room(self, len, bpf_adj_room_mode::BPF_ADJ_ROOM_NET, 0).map_err(drop)
    }

    #[inline(always)]
    fn bounce(&mut self) -> i32 {
        let ifindex = Packet::ifindex(self);
        // SAFETY: plain values; the helper only records where the packet goes next.
        unsafe { bpf_redirect(ifindex, 0) as i32 }
    }

    #[inline(always)]
    fn note_settled(&mut self, settled: bool) {
        let class = if settled { TC_INDEX_SETTLED } else { 0 };
        // SAFETY: the __sk_buff context the kernel passed this program, valid for its whole
        // run; tc programs may write tc_classid and tc_index, which the verifier checks.
        let skb = unsafe { &mut *self.skb.skb };
        // tc copies the class id into tc_index for a packet passed on; a redirected one
        // keeps tc_index as written.
        skb.tc_classid = class;
        skb.tc_index = class;
    }

    #[inline(always)]
    fn was_settled(&self) -> bool {
        // SAFETY: as in `ifindex`.
        unsafe { (*self.skb.skb).tc_index & TC_INDEX_SETTLED != 0 }
    }
}

impl Packet for XdpContext {
    const XDP: bool = true;
    const PASS: i32 = xdp_action::XDP_PASS as i32;
    const DROP: i32 = xdp_action::XDP_DROP as i32;

    // Direct packet access: the bounds check against data_end is what the verifier needs,
    // and it is far cheaper than a helper call per field.
    #[inline(always)]
    fn load<T: Pod>(&self, offset: usize) -> Option<T> {
        let offset = bounded(offset)?;
        let ptr = self.data() + offset;
        if ptr + mem::size_of::<T>() > self.data_end() {
            return None;
        }
        // SAFETY: [ptr, ptr + size_of::<T>()) lies within the packet (checked against
        // data_end just above), which nothing moves or frees while the program runs; the
        // read is unaligned, and any bytes are a valid `T: Pod`.
        Some(unsafe { core::ptr::read_unaligned(ptr as *const T) })
    }

    #[inline(always)]
    fn store<T: Pod>(&mut self, offset: usize, value: &T) -> Result<(), ()> {
        let offset = bounded(offset).ok_or(())?;
        let ptr = self.data() + offset;
        if ptr + mem::size_of::<T>() > self.data_end() {
            return Err(());
        }
        // SAFETY: [ptr, ptr + size_of::<T>()) lies within the packet (checked against
        // data_end just above), which XDP may write and which nothing else references;
        // header fields are not aligned to their size, hence the unaligned write.
        unsafe { core::ptr::write_unaligned(ptr as *mut T, *value) };
        Ok(())
    }

    #[inline(always)]
    fn load_into<T: Pod>(&self, offset: usize, dst: &mut T) -> Result<(), ()> {
        let offset = bounded(offset).ok_or(())?;
        let ptr = self.data() + offset;
        if ptr + mem::size_of::<T>() > self.data_end() {
            return Err(());
        }
        // SAFETY: [ptr, ptr + size_of::<T>()) lies within the packet (checked against
        // data_end just above), `dst` is a live, exclusive `T` in map memory, which the
        // packet does not overlap, and any bytes are a valid `T: Pod`. Copied in place: a
        // copy through the stack compiles to a call to a byte-at-a-time memmove.
        unsafe {
            core::ptr::copy_nonoverlapping(
                ptr as *const u8,
                dst as *mut T as *mut u8,
                mem::size_of::<T>(),
            )
        };
        Ok(())
    }

    #[inline(always)]
    fn l3_csum_replace(&mut self, offset: usize, from: u32, to: u32) -> Result<(), ()> {
        let csum: u16 = Packet::load(self, offset).ok_or(())?;
        Packet::store(
            self,
            offset,
            &!fold(u32::from(!csum) + field_diff(from, to, 4)),
        )
    }

    // XDP sees the checksum on the wire, which NICs deliver complete. (A veth peer that
    // offloads checksums hands over partial ones: such senders need tx offload off.)
    #[inline(always)]
    fn l4_csum_replace(
        &mut self,
        offset: usize,
        from: u32,
        to: u32,
        size: u8,
        pseudo: bool,
        udp: bool,
    ) -> Result<(), ()> {
        Packet::l4_csum_diff(self, offset, field_diff(from, to, size), pseudo, udp)
    }

    #[inline(always)]
    fn l4_csum_diff(
        &mut self,
        offset: usize,
        diff: u32,
        _pseudo: bool,
        udp: bool,
    ) -> Result<(), ()> {
        let csum: u16 = Packet::load(self, offset).ok_or(())?;
        if udp && csum == 0 {
            return Ok(());
        }
        let mut new = !fold(u32::from(!csum) + diff);
        if udp && new == 0 {
            new = 0xffff;
        }
        Packet::store(self, offset, &new)
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: the xdp_md context the kernel passed this program, valid for its whole
        // run; the verifier checks the field read against the context's layout.
        unsafe { (*self.ctx).ingress_ifindex }
    }

    #[inline(always)]
    fn as_ctx(&self) -> *mut c_void {
        EbpfContext::as_ptr(self)
    }

    // An XDP redirect into a veth (or a driver without ndo_xdp_xmit) is dropped unless the
    // receiving side runs XDP too, which another node's device need not: flows that must
    // leave the node again are tc's, which redirects socket buffers anywhere.
    #[inline(always)]
    fn can_redirect(_fib_ret: i64) -> bool {
        false
    }

    #[inline(always)]
    fn redirect(&mut self, _fib_ret: i64, _ifindex: u32) -> i32 {
        Self::PASS
    }

    #[inline(always)]
    fn reshape(&mut self, _len: u32, _grow: u32) -> Result<(), ()> {
        Err(())
    }

    #[inline(always)]
    fn bounce(&mut self) -> i32 {
        Self::PASS
    }

    #[inline(always)]
    fn redirect_peer(&mut self, _ifindex: u32) -> i32 {
        Self::PASS
    }

    #[inline(always)]
    fn grow_net(&mut self, _len: u32) -> Result<(), ()> {
        Err(())
    }

    #[inline(always)]
    fn note_settled(&mut self, _settled: bool) {}

    #[inline(always)]
    fn was_settled(&self) -> bool {
        false
    }
}

/// `T` at `offset` in the linear data of a tc packet, if it lies there (with a byte to
/// spare for one-byte fields: LLVM turns `ptr + 1 > end` into `ptr >= end`, from which
/// the verifier learns no readable range).
#[inline(always)]
fn linear<T: Pod>(ctx: &TcContext, offset: usize) -> Option<T> {
    let ptr = linear_ptr::<T>(ctx, offset)?;
    // SAFETY: [ptr, ptr + size_of::<T>()) lies within the packet's linear data (see
    // `linear_ptr`), which nothing moves while the program runs between helper calls; the
    // read is unaligned, and any bytes are a valid `T: Pod`.
    Some(unsafe { core::ptr::read_unaligned(ptr as *const T) })
}

/// Where `T` at `offset` starts in the linear data of a tc packet, if all of it lies there.
#[inline(always)]
fn linear_ptr<T: Pod>(ctx: &TcContext, offset: usize) -> Option<*const u8> {
    let offset = bounded(offset)?;
    let ptr = ctx.data() + offset;
    let window = if mem::size_of::<T>() < 2 {
        2
    } else {
        mem::size_of::<T>()
    };
    if ptr + window > ctx.data_end() {
        return None;
    }
    Some(ptr as *const u8)
}

/// Headers lie in the first few hundred bytes. Offsets read back from a map (the flow in
/// `nodeport::Scratch`) carry no bounds the verifier knows, and it allows no packet pointer
/// arithmetic without them: this check gives them one.
#[inline(always)]
fn bounded(offset: usize) -> Option<usize> {
    (offset <= 0xfff).then_some(offset)
}

/// A 32-bit one's-complement sum folded to 16 bits.
#[inline(always)]
pub fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// What a field of `size` bytes (2 or 4) changing `from` -> `to` (both as in memory) adds
/// to a checksum (RFC 1624): !old + new over its 16-bit words, in memory order as
/// [`Packet::l4_csum_diff`] takes it.
#[inline(always)]
fn field_diff(from: u32, to: u32, size: u8) -> u32 {
    let half = |v: u32, i: u32| (v >> (16 * i)) as u16;
    let mut diff = u32::from(!half(from, 0)) + u32::from(half(to, 0));
    if size == 4 {
        diff += u32::from(!half(from, 1)) + u32::from(half(to, 1));
    }
    diff
}
