//! A thread that runs until its handle is dropped: the watchers of the pods' devices, the
//! routing rules and netfilter, each looking again and again at something the kernel
//! holds, and each stopped (and waited for) with the dataplane that started it.

use std::{
    io,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

pub struct Watcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Runs `body` on a thread named `name`; `body` returns soon after the flag it is given
    /// is set, which dropping the watcher does.
    pub fn spawn(name: &str, body: impl FnOnce(&AtomicBool) + Send + 'static) -> io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || body(&flag))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Nice 19 for the calling thread: bookkeeping (the map census, the flow table's
/// collector) comes after a busy node's syncs and traffic.
pub fn lower_priority() {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority on our own thread id with a valid `which`; it only reads its
    // arguments. Failure (no permission) leaves the priority as it was, which is fine.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
}
