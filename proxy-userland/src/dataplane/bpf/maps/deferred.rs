//! A first sync's service and backend map writes, issued by a thread of their own while the
//! sync goes on deriving and recording the next services.
//!
//! At 50,000 services the first sync spent ~0.15 s deriving frontends, ~0.2 s in its own
//! bookkeeping and ~0.45 s in the kernel writing about a million entries, one after the
//! other on one CPU. Into maps that hold nothing of ours there is nothing to roll back to
//! and no reader to keep consistent but the programs, so the writes can trail behind: they
//! are queued in chunks, in the order the sync made them, and a writer thread issues each
//! chunk as backends, then slots and master entries, in order (a frontend's master still
//! comes after its slots, and every backend before the slots that name it). The sync waits
//! for the writer before it reports. If the kernel refuses any write (a full map), the
//! caller removes everything and programs service by service, so that a service that does
//! not fit fails alone, as it does on the usual path.

use std::{
    io,
    os::fd::{AsFd as _, AsRawFd as _, RawFd},
    sync::mpsc::{Receiver, SyncSender, sync_channel},
};

use std::net::IpAddr;

use aya::maps::IterableMap as _;
use proxy_common::{Backend4, Backend6, BackendId, Service4Key, Service6Key, ServiceValue};

use super::{ServiceMaps, batch};
use crate::dataplane::frontends::{BackendAddr, Frontend};

/// Service map entries a chunk collects before it goes to the writer: large enough that a
/// bpf() call's fixed cost is spread thin, small enough that the writer starts early.
const CHUNK: usize = 8192;
/// Chunks queued ahead of the writer.
const QUEUED: usize = 4;

/// Entries of the four maps, each in the order they were recorded.
#[derive(Default)]
pub struct Chunk {
    backends4: (Vec<BackendId>, Vec<Backend4>),
    backends6: (Vec<BackendId>, Vec<Backend6>),
    services4: (Vec<Service4Key>, Vec<ServiceValue>),
    services6: (Vec<Service6Key>, Vec<ServiceValue>),
}

impl Chunk {
    fn len(&self) -> usize {
        self.services4.0.len() + self.services6.0.len()
    }
}

/// Where [`ServiceMaps`] records writes while a writer runs.
pub struct Queue {
    chunk: Chunk,
    to_writer: SyncSender<Chunk>,
}

impl Queue {
    /// Backend entries, as [`ServiceMaps::put_backends`] would write them.
    pub fn backends(&mut self, entries: &[(BackendId, BackendAddr)]) {
        let c = &mut self.chunk;
        for (id, b) in entries {
            match b.ip {
                IpAddr::V4(ip) => {
                    c.backends4.0.push(*id);
                    c.backends4.1.push(super::backend4(ip, b));
                }
                IpAddr::V6(ip) => {
                    c.backends6.0.push(*id);
                    c.backends6.1.push(super::backend6(ip, b));
                }
            }
        }
    }

    /// One service map entry of `fe`. A master entry (slot 0) is a frontend's last: the
    /// chunk goes to the writer once it is full, so that a frontend's entries and its new
    /// backends stay in one chunk.
    pub fn service(&mut self, fe: &Frontend, slot: u16, value: ServiceValue) {
        let c = &mut self.chunk;
        match fe.ip {
            IpAddr::V4(ip) => {
                c.services4.0.push(super::key4(fe, ip, slot));
                c.services4.1.push(value);
            }
            IpAddr::V6(ip) => {
                c.services6.0.push(super::key6(fe, ip, slot));
                c.services6.1.push(value);
            }
        }
        if slot == 0 && self.chunk.len() >= CHUNK {
            self.send();
        }
    }

    fn send(&mut self) {
        let chunk = std::mem::take(&mut self.chunk);
        // The writer only stops early after an error, which it reports when joined.
        let _ = self.to_writer.send(chunk);
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.send();
    }
}

/// The four maps' descriptors, for the writer thread.
#[derive(Clone, Copy)]
pub struct Fds {
    backends4: RawFd,
    backends6: RawFd,
    services4: RawFd,
    services6: RawFd,
}

impl ServiceMaps {
    /// Starts recording service and backend writes instead of making them; `writer` must
    /// then run (on another thread) until the queue is handed back with
    /// [`ServiceMaps::stop_deferring`]. None if the kernel lacks batch updates.
    pub fn defer_writes(&mut self) -> Option<Writer> {
        if !batch::supported() {
            return None;
        }
        let fd = |m: &aya::maps::MapData| m.fd().as_fd().as_raw_fd();
        let fds = Fds {
            backends4: fd(self.backends4.map()),
            backends6: fd(self.backends6.map()),
            services4: fd(self.services4.map()),
            services6: fd(self.services6.map()),
        };
        let (to_writer, chunks) = sync_channel(QUEUED);
        self.front_filter.defer();
        self.deferred = Some(Queue {
            chunk: Chunk::default(),
            to_writer,
        });
        Some(Writer { fds, chunks })
    }

    /// Sends what is left to the writer and goes back to writing at once.
    pub fn stop_deferring(&mut self) {
        if let Err(e) = self.front_filter.flush() {
            // An array element the kernel will not write: nothing a retry would change.
            tracing::error!(
                error = %e,
                "cannot write the frontends' filter: pods' traffic to new Services may go \
                 untranslated on the packet path"
            );
        }
        self.deferred = None;
    }
}

/// The writer's half: run [`Writer::run`] on a thread while the maps record.
pub struct Writer {
    fds: Fds,
    chunks: Receiver<Chunk>,
}

impl Writer {
    /// Issues every chunk until the queue is dropped. After the first error it only drains
    /// the queue, and returns that error.
    ///
    /// The descriptors must stay open until this returns: the caller keeps the maps and
    /// joins this thread before they can go.
    pub fn run(self) -> io::Result<()> {
        let mut result = Ok(());
        for chunk in self.chunks {
            if result.is_err() {
                continue;
            }
            result = write_chunk(self.fds, &chunk);
        }
        result
    }
}

fn write_chunk(fds: Fds, c: &Chunk) -> io::Result<()> {
    batch::update_batch_fd(fds.backends4, &c.backends4.0, &c.backends4.1)?;
    batch::update_batch_fd(fds.backends6, &c.backends6.0, &c.backends6.1)?;
    batch::update_batch_fd(fds.services4, &c.services4.0, &c.services4.1)?;
    batch::update_batch_fd(fds.services6, &c.services6.0, &c.services6.1)
}
