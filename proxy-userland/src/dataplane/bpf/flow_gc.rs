//! The flow table's collector.
//!
//! The packet programs' flow tables (`FP_CT4`, `FP_CT6`) are plain preallocated hash maps,
//! not LRU ones, whose inserts now and then cost far more (see proxy-ebpf's `maps::CT4`).
//! Nothing in the kernel removes their entries, so this thread does, as Cilium's
//! conntrack GC does for its tables:
//!
//! - every `interval`, entries idle past their timeout (`nat::ct_timeout_ns`: 10 s once a
//!   TCP flow closes, 60 s unanswered, 120 s UDP, 6 h established TCP) are deleted;
//! - within a second of a new flow finding a table full (the programs count it), at once;
//! - a table still over [`HIGH_WATER`] after that sheds entries down to [`LOW_WATER`]:
//!   first closing and unanswered flows (those conntrack's early drop would take), then
//!   the longest idle, as an LRU map would have; and it is swept again every second until
//!   a sweep need not evict.
//!
//! Until then a new flow that finds no room is dropped and counted
//! (`dropped_flow_table_full`); a TCP client's retried SYN comes a second later, when
//! there is room again.

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use aya::{
    Pod,
    maps::{HashMap, IterableMap as _, MapData},
};
use proxy_common::{CtKey, CtValue, nat};

pub use super::maps::FlowTables;
use super::maps::batch;
use crate::dataplane::watcher::Watcher;

/// How often idle entries are looked for by default (`--conntrack-gc-interval`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);
/// How often the drop counter is read for a table that filled up.
const TICK: Duration = Duration::from_secs(1);
/// Fill (of the table's size, in percent) above which a sweep also evicts live entries...
pub const HIGH_WATER: usize = 90;
/// ... down to this.
pub const LOW_WATER: usize = 80;

/// Set once a batch read failed: later sweeps may say so less loudly.
static BATCH_REFUSED: AtomicBool = AtomicBool::new(false);

/// What one sweep of one table did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Flows deleted because they were idle past their timeout.
    pub expired: usize,
    /// Live flows deleted to bring a nearly full table down.
    pub evicted: usize,
    /// Entries left.
    pub left: usize,
}

impl std::ops::Add for Sweep {
    type Output = Sweep;
    fn add(self, o: Sweep) -> Sweep {
        Sweep {
            expired: self.expired + o.expired,
            evicted: self.evicted + o.evicted,
            left: self.left + o.left,
        }
    }
}

impl FlowTables {
    /// New flows dropped so far for want of room, summed over CPUs.
    fn full_drops(&self) -> u64 {
        self.stats
            .get(&nat::stat::DROP_FLOW_TABLE_FULL, 0)
            .map(|per_cpu| per_cpu.iter().sum())
            .unwrap_or(0)
    }

    /// Whether the tables are LRU maps a daemon before this one pinned, which the programs
    /// keep using (with their LRU's eviction and its cost) until the pins go.
    pub fn inherited_lru(&self) -> bool {
        let kind = self.ct4.map().info().ok().and_then(|i| i.map_type().ok());
        kind == Some(aya::maps::MapType::LruHash)
    }

    /// Sweeps both tables once.
    pub fn sweep(&mut self, stop: &AtomicBool) -> Sweep {
        let now = monotonic_ns();
        sweep(&mut self.ct4, now, stop) + sweep(&mut self.ct6, now, stop)
    }

    /// Sweeps every `interval`, and within a [`TICK`] of a full table's drop, until the
    /// returned watcher is dropped.
    pub fn spawn(mut self, interval: Duration) -> std::io::Result<Watcher> {
        Watcher::spawn("flow-gc", move |stop| {
            // A flood that keeps the table full has it sweep every second: after traffic
            // and syncs, not before.
            crate::dataplane::watcher::lower_priority();
            let mut drops = self.full_drops();
            let mut last = Instant::now();
            // The last sweep had to evict: new flows may fill the room it made before
            // the next one finds out, so it looks again every tick until it need not.
            let mut pressed = false;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                if last.elapsed() < TICK {
                    continue;
                }
                let now_drops = self.full_drops();
                let full = now_drops != drops;
                if !full && !pressed && last.elapsed() < interval {
                    continue;
                }
                let dropped = now_drops.wrapping_sub(drops);
                drops = now_drops;
                let started = Instant::now();
                let done = self.sweep(stop);
                last = Instant::now();
                let took_ms = (last - started).as_millis() as u64;
                pressed = done.evicted > 0;
                if full {
                    tracing::warn!(
                        dropped,
                        expired = done.expired,
                        evicted = done.evicted,
                        left = done.left,
                        took_ms,
                        "the flow table was full: new flows were dropped (see \
                         fastpath_packets_total{{result=\"dropped_flow_table_full\"}})"
                    );
                } else if pressed {
                    tracing::warn!(
                        expired = done.expired,
                        evicted = done.evicted,
                        left = done.left,
                        took_ms,
                        "the flow table was nearly full: the longest idle flows were evicted"
                    );
                } else {
                    tracing::debug!(
                        expired = done.expired,
                        left = done.left,
                        took_ms,
                        "flow table swept"
                    );
                }
            }
        })
    }
}

/// One table's sweep: the table read in batches (or key by key where the kernel cannot),
/// then the dead entries deleted. Not during the walk: a walk by keys starts over from the
/// first key when its key is deleted (a program may delete one too: that walk is bounded
/// by the table's size).
fn sweep<A: Copy + Default + PartialEq>(
    table: &mut HashMap<MapData, CtKey<A>, CtValue<A>>,
    now: u64,
    stop: &AtomicBool,
) -> Sweep
where
    CtKey<A>: Pod,
    CtValue<A>: Pod,
{
    let Ok(capacity) = table.map().info().map(|i| i.max_entries() as usize) else {
        return Sweep::default();
    };
    let read = |walk: &mut Walk<A>| {
        batch::read_all(table.map(), |key, value| {
            walk.note(table, key, value, now, stop)
        })
    };
    let mut walk = Walk::new(capacity);
    if let Err(e) = read(&mut walk) {
        if !BATCH_REFUSED.swap(true, Ordering::Relaxed) {
            tracing::info!("the flow table cannot be read in batches ({e}): read by keys");
        }
        // Walked by keys from the start: what the batches noted would be noted twice.
        walk = Walk::new(capacity);
        for entry in table.iter() {
            let Ok((key, value)) = entry else { break };
            if !walk.note(table, key, value, now, stop) {
                break;
            }
        }
    }
    let Walk {
        dead,
        mut live,
        mut used,
        ..
    } = walk;
    let mut done = Sweep::default();
    for key in &dead {
        // Judged again: a program may have given the key to a new flow since.
        if let Some((Flow::Dead, value)) = state(table, key, now)
            && remove_flow(table, key, &value) > 0
        {
            done.expired += 1;
        }
    }
    if used * 100 > capacity * HIGH_WATER {
        live.sort_unstable_by_key(|(keep, seen, _, _)| (*keep, *seen));
        for (_, _, key, value) in &live {
            if used * 100 <= capacity * LOW_WATER {
                break;
            }
            let gone = remove_flow(table, key, value);
            if gone > 0 {
                used = used.saturating_sub(gone);
                done.evicted += 1;
            }
        }
    }
    done.left = used;
    done
}

/// What a sweep's walk found.
struct Walk<A> {
    /// Keys of entries past their time.
    dead: Vec<CtKey<A>>,
    /// Every flow has one reply entry (a DSR flow on its backend's node has nothing else):
    /// the live flows by theirs, (evict first, last packet, key, entry).
    live: Vec<(bool, u64, CtKey<A>, CtValue<A>)>,
    /// Live entries.
    used: usize,
    walked: usize,
    /// The table's size: a walk never reads more entries than it holds.
    capacity: usize,
}

impl<A: Copy + Default + PartialEq> Walk<A>
where
    CtKey<A>: Pod,
    CtValue<A>: Pod,
{
    fn new(capacity: usize) -> Self {
        Self {
            dead: Vec::new(),
            live: Vec::new(),
            used: 0,
            walked: 0,
            capacity,
        }
    }

    /// Judges one entry read; false: the walk is to stop.
    fn note(
        &mut self,
        table: &HashMap<MapData, CtKey<A>, CtValue<A>>,
        key: CtKey<A>,
        value: CtValue<A>,
        now: u64,
        stop: &AtomicBool,
    ) -> bool {
        self.walked += 1;
        if self.walked > self.capacity || stop.load(Ordering::Relaxed) {
            return false;
        }
        match state_of(table, &key, value, now) {
            (Flow::Dead, _) => self.dead.push(key),
            (
                Flow::Live {
                    early_drop,
                    last_seen,
                },
                value,
            ) => {
                self.used += 1;
                if key.dir == nat::dir::REPLY {
                    self.live.push((!early_drop, last_seen, key, value));
                }
            }
        }
        true
    }
}

/// The reply entry a forward entry names (as the programs' `known_flow` builds it).
fn reply_key<A: Copy + Default + PartialEq>(k: &CtKey<A>, v: &CtValue<A>) -> CtKey<A>
where
    CtValue<A>: Pod,
{
    v.reply_key(v.snat_addr != A::default(), k.saddr, k.sport, k.proto)
}

#[derive(Debug, PartialEq, Eq)]
enum Flow {
    /// Past its timeout, or a forward entry whose reply entry is gone: the programs would
    /// start the flow over.
    Dead,
    Live {
        early_drop: bool,
        last_seen: u64,
    },
}

/// A flow's state as the programs judge it, and the entry, read now (not from the walk: a
/// program may have given the key to a new flow since). None: the entry is gone.
fn state<A: Copy + Default + PartialEq>(
    table: &HashMap<MapData, CtKey<A>, CtValue<A>>,
    key: &CtKey<A>,
    now: u64,
) -> Option<(Flow, CtValue<A>)>
where
    CtKey<A>: Pod,
    CtValue<A>: Pod,
{
    let value = table.get(key, 0).ok()?;
    Some(state_of(table, key, value, now))
}

/// As [`state`], for an entry just read: only a forward entry's reply entry is looked up.
fn state_of<A: Copy + Default + PartialEq>(
    table: &HashMap<MapData, CtKey<A>, CtValue<A>>,
    key: &CtKey<A>,
    value: CtValue<A>,
    now: u64,
) -> (Flow, CtValue<A>)
where
    CtKey<A>: Pod,
    CtValue<A>: Pod,
{
    let reply = (key.dir == nat::dir::FORWARD)
        .then(|| table.get(&reply_key(key, &value), 0).ok())
        .flatten();
    (judge(key, &value, reply.as_ref(), now), value)
}

/// The programs' rule (`known_flow`, `reply_nat`): a forward entry holds while the reply
/// entry it names does, and a flow's timeout follows its reply entry's flags (only that
/// entry learns that the backend answered) from the later of the two entries' last packets.
fn judge<A>(key: &CtKey<A>, value: &CtValue<A>, reply: Option<&CtValue<A>>, now: u64) -> Flow {
    let (flags, last_seen) = if key.dir == nat::dir::FORWARD {
        let Some(reply) = reply else {
            return Flow::Dead;
        };
        (reply.flags, value.last_seen_ns.max(reply.last_seen_ns))
    } else {
        (value.flags, value.last_seen_ns)
    };
    if now.saturating_sub(last_seen) > nat::ct_timeout_ns(key.proto, flags) {
        return Flow::Dead;
    }
    let early_drop = flags & nat::ct_flags::CLOSING != 0
        || flags & (nat::ct_flags::SEEN_REPLY | nat::ct_flags::DSR) == 0;
    Flow::Live {
        early_drop,
        last_seen,
    }
}

/// Deletes a flow's entry, and with a reply entry the forward entry that names it (its
/// client and frontend are in the reply entry): how many entries went.
fn remove_flow<A: Copy + Default + PartialEq>(
    table: &mut HashMap<MapData, CtKey<A>, CtValue<A>>,
    key: &CtKey<A>,
    value: &CtValue<A>,
) -> usize
where
    CtKey<A>: Pod,
    CtValue<A>: Pod,
{
    let mut gone = usize::from(table.remove(key).is_ok());
    if key.dir == nat::dir::REPLY {
        gone += usize::from(table.remove(&forward_key(key, value)).is_ok());
    }
    gone
}

/// The forward entry whose reply entry is `k` (as the programs' `new_flow` writes both):
/// the client is the reply's destination, or with SNAT in the entry; the frontend is in
/// the entry.
fn forward_key<A: Copy + Default + PartialEq>(k: &CtKey<A>, v: &CtValue<A>) -> CtKey<A>
where
    CtValue<A>: Pod,
{
    let snat = v.snat_addr != A::default();
    CtKey {
        saddr: if snat { v.snat_addr } else { k.daddr },
        daddr: v.addr,
        sport: if snat { v.snat_port } else { k.dport },
        dport: v.port,
        proto: k.proto,
        dir: nat::dir::FORWARD,
        _pad: [0; 2],
    }
}

/// The programs' clock (bpf_ktime_get_ns, CLOCK_MONOTONIC; the coarse variant lags it by a
/// tick at most).
pub fn monotonic_ns() -> u64 {
    // SAFETY: timespec is two integers; all zeros is a valid value.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: `ts` is a live, writable timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use proxy_common::proto;

    use super::*;

    const S: u64 = 1_000_000_000;

    fn key(dir: u8, proto: u8) -> CtKey<u32> {
        CtKey {
            saddr: 1,
            daddr: 2,
            sport: 3,
            dport: 4,
            proto,
            dir,
            _pad: [0; 2],
        }
    }

    fn entry(flags: u16, last_seen_ns: u64) -> CtValue<u32> {
        CtValue {
            flags,
            last_seen_ns,
            ..Default::default()
        }
    }

    const ANSWERED: u16 = nat::ct_flags::SEEN_REPLY;
    const CLOSING: u16 = nat::ct_flags::CLOSING | nat::ct_flags::SEEN_REPLY;

    #[test]
    fn a_forward_entry_lives_by_its_reply_entrys_flags() {
        let now = 100_000 * S;
        let fwd = key(nat::dir::FORWARD, proto::TCP);
        // The forward entry never learns of the answer: 2 minutes idle is no unanswered
        // flow's end while its reply entry says it was answered.
        let quiet = entry(0, now - 120 * S);
        let answered = entry(ANSWERED, now - 120 * S);
        assert_eq!(
            judge(&fwd, &quiet, Some(&answered), now),
            Flow::Live {
                early_drop: false,
                last_seen: now - 120 * S
            }
        );
        // The later of the two entries' packets counts.
        let stale_reply = entry(ANSWERED, now - 7 * 3600 * S);
        assert!(matches!(
            judge(&fwd, &entry(0, now - S), Some(&stale_reply), now),
            Flow::Live { last_seen, .. } if last_seen == now - S
        ));
        assert_eq!(
            judge(&fwd, &entry(0, now - 7 * 3600 * S), Some(&stale_reply), now),
            Flow::Dead
        );
        // Without its reply entry the programs start the flow over.
        assert_eq!(judge(&fwd, &quiet, None, now), Flow::Dead);
    }

    #[test]
    fn timeouts_follow_the_programs() {
        let now = 100_000 * S;
        let reply = |p| key(nat::dir::REPLY, p);
        let cases = [
            (proto::TCP, CLOSING, 9, true),
            (proto::TCP, CLOSING, 11, false),
            (proto::UDP, 0, 59, true),
            (proto::UDP, 0, 61, false),
            (proto::UDP, ANSWERED, 119, true),
            (proto::UDP, ANSWERED, 121, false),
            (proto::TCP, ANSWERED, 5 * 3600, true),
            (proto::TCP, ANSWERED, 7 * 3600, false),
            (proto::UDP, nat::ct_flags::DSR, 119, true),
        ];
        for (p, flags, idle, live) in cases {
            let got = judge(&reply(p), &entry(flags, now - idle * S), None, now);
            assert_eq!(
                got != Flow::Dead,
                live,
                "proto {p} flags {flags:#x} idle {idle} s"
            );
        }
    }

    /// A flow's two keys lead to each other as the programs' `new_flow` writes them, with
    /// and without SNAT, so the collector takes a flow whole.
    #[test]
    fn a_flows_entries_name_each_other() {
        let (client, frontend, backend, snat) = (1u32, 2u32, 3u32, 4u32);
        let fields = |k: CtKey<u32>| (k.saddr, k.daddr, k.sport, k.dport, k.proto, k.dir);
        for with_snat in [false, true] {
            let fwd = CtKey {
                saddr: client,
                daddr: frontend,
                sport: 40000,
                dport: 30080,
                proto: proto::TCP,
                dir: nat::dir::FORWARD,
                _pad: [0; 2],
            };
            let (src, sport) = if with_snat {
                (snat, 61000)
            } else {
                (client, 40000)
            };
            let fwd_entry = CtValue {
                addr: backend,
                port: 8080,
                snat_addr: if with_snat { snat } else { 0 },
                snat_port: if with_snat { 61000 } else { 0 },
                ..Default::default()
            };
            let reply = CtKey {
                saddr: backend,
                daddr: src,
                sport: 8080,
                dport: sport,
                proto: proto::TCP,
                dir: nat::dir::REPLY,
                _pad: [0; 2],
            };
            let reply_entry = CtValue {
                addr: frontend,
                port: 30080,
                snat_addr: if with_snat { client } else { 0 },
                snat_port: if with_snat { 40000 } else { 0 },
                ..Default::default()
            };
            assert_eq!(fields(reply_key(&fwd, &fwd_entry)), fields(reply));
            assert_eq!(fields(forward_key(&reply, &reply_entry)), fields(fwd));
        }
    }

    #[test]
    fn closing_and_unanswered_flows_are_evicted_first() {
        let now = 100_000 * S;
        let r = key(nat::dir::REPLY, proto::TCP);
        for (flags, early) in [(CLOSING, true), (0, true), (ANSWERED, false)] {
            assert!(matches!(
                judge(&r, &entry(flags, now), None, now),
                Flow::Live { early_drop, .. } if early_drop == early
            ));
        }
    }
}
