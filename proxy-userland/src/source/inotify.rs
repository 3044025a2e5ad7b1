//! A wake-up for the manifest poll: inotify on the watched folder, so that a change is read
//! as soon as it is written instead of at the next poll (a 20 ms poll alone put 10 ms on
//! the median change). The poll stays: it is what notices changes inotify does not report
//! (network file systems, a folder created after start, a full event queue).

use std::{
    collections::BTreeSet,
    ffi::{CString, OsStr, OsString},
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use tokio::io::{Interest, unix::AsyncFd};

/// What can change a manifest: a file written and closed, renamed in or out (atomic
/// writers, ConfigMap volumes' `..data` swap), deleted, or the folder itself going away.
/// Not IN_MODIFY or IN_CREATE: they fire while a file is half written.
const MASK: u32 = libc::IN_CLOSE_WRITE
    | libc::IN_MOVED_TO
    | libc::IN_MOVED_FROM
    | libc::IN_DELETE
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF;

/// Reads per wake-up at most; what is left keeps the descriptor readable for the next one.
const MAX_READS: usize = 64;

pub struct DirWatch {
    fd: AsyncFd<OwnedFd>,
    dir: PathBuf,
    watching: bool,
    /// The one file watched, when the path is a file; else any manifest in the folder.
    file: Option<OsString>,
}

impl DirWatch {
    /// Watches the manifests at `path` (a file, or a folder of them): the folder they are
    /// in, waking only for names that can change what is read. A writer's temporary file
    /// (`a.json.tmp`, an editor's swap file) woke a look that found nothing, and that look
    /// took a CPU from the writer it was waiting for.
    pub fn for_manifests(path: &Path) -> io::Result<Self> {
        let file = match path.is_dir() {
            true => None,
            false => path.file_name().map(OsStr::to_owned),
        };
        let mut watch = Self::new(Self::dir_of(path))?;
        watch.file = file;
        Ok(watch)
    }

    /// Watches `dir`, or will once it exists (see [`DirWatch::arm`]).
    pub fn new(dir: PathBuf) -> io::Result<Self> {
        // SAFETY: no pointers; the result is checked below.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor inotify_init1 just opened; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: the OwnedFd moves into the AsyncFd, which owns it until dropped: the
        // descriptor stays open and the same for the AsyncFd's whole life.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
        let mut watch = Self {
            fd,
            dir,
            watching: false,
            file: None,
        };
        watch.arm();
        Ok(watch)
    }

    /// The folder a manifest path's changes show up in: the path if it is a folder, else
    /// the folder holding the file (which sees it replaced by rename).
    pub fn dir_of(path: &Path) -> PathBuf {
        match path.parent() {
            _ if path.is_dir() => path.to_owned(),
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
            _ => PathBuf::from("."),
        }
    }

    /// Adds the watch if it is not in place (the folder did not exist, or went away and
    /// came back). Cheap when it is: no system call.
    pub fn arm(&mut self) {
        if self.watching {
            return;
        }
        let Ok(dir) = CString::new(self.dir.as_os_str().as_bytes()) else {
            return;
        };
        // SAFETY: `dir` is a NUL-terminated string that outlives the call; the descriptor
        // is ours and open.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), dir.as_ptr(), MASK) };
        self.watching = wd >= 0;
    }

    /// Waits until something that matters happened in the folder, then takes every queued
    /// event: what changed.
    pub async fn changed(&mut self) -> io::Result<Woken> {
        loop {
            let mut ready = self.fd.readable().await?;
            let file = self.file.as_deref();
            let matters = |name: &[u8]| matters(file, OsStr::from_bytes(name));
            match ready.try_io(|fd| drain(fd.get_ref(), &matters)) {
                Ok(Ok(Drained { gone, all, names })) => {
                    // The watch was removed with its folder; `arm` adds it again.
                    if gone {
                        self.watching = false;
                        return Ok(Woken::All);
                    }
                    if all {
                        return Ok(Woken::All);
                    }
                    if !names.is_empty() {
                        return Ok(Woken::Names(names));
                    }
                }
                Ok(Err(e)) => return Err(e),
                // Spurious readiness: wait again.
                Err(_) => continue,
            }
        }
    }
}

/// What a wake-up says changed in the folder.
#[derive(Debug, PartialEq, Eq)]
pub enum Woken {
    /// These manifests (names in the folder) were written, renamed in or out, or deleted;
    /// nothing else that matters.
    Names(BTreeSet<OsString>),
    /// Anything may have: the folder itself, a ConfigMap volume's `..data` swap, or a
    /// queue that overflowed.
    All,
}

/// How an event for `name` in the folder bears on what is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Matters {
    No,
    /// The watched file, or a manifest of the folder.
    This,
    /// The folder itself (no name) or a ConfigMap volume's `..data` swap (names starting
    /// `..`), behind which every file may have changed.
    All,
}

fn matters(file: Option<&OsStr>, name: &OsStr) -> Matters {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.starts_with(b"..") {
        return Matters::All;
    }
    let this = match file {
        Some(file) => name == file,
        None => crate::source::file::is_manifest_name(Path::new(name)),
    };
    if this { Matters::This } else { Matters::No }
}

/// What a drain of the queue found.
#[derive(Default)]
struct Drained {
    /// The kernel dropped the watch (IN_IGNORED).
    gone: bool,
    /// An event that may concern every file: see [`Matters::All`], or an overflowed queue.
    all: bool,
    /// The manifests events named.
    names: BTreeSet<OsString>,
}

/// Reads the queued events. WouldBlock when nothing was queued.
fn drain(fd: &OwnedFd, matters: &impl Fn(&[u8]) -> Matters) -> io::Result<Drained> {
    // Aligned for the event headers read out of it.
    #[repr(C, align(8))]
    struct Buf([u8; 4096]);
    let mut buf = Buf([0; 4096]);
    let header = std::mem::size_of::<libc::inotify_event>();
    let (mut read_any, mut found) = (false, Drained::default());
    for _ in 0..MAX_READS {
        // SAFETY: the buffer is ours, writable and as long as we say; the descriptor is open.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.0.as_mut_ptr().cast(), buf.0.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock if read_any => Ok(found),
                _ => Err(e),
            };
        }
        read_any = true;
        let n = n as usize;
        let mut at = 0;
        while at + header <= n {
            // SAFETY: the kernel wrote a whole event header at `at` (checked against `n`);
            // read_unaligned makes no assumption about its alignment.
            let ev: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(buf.0.as_ptr().add(at).cast()) };
            found.gone |= ev.mask & libc::IN_IGNORED != 0;
            let name_at = at + header;
            let name = buf
                .0
                .get(name_at..(name_at + ev.len as usize).min(n))
                .unwrap_or(&[]);
            // The name is NUL-padded.
            let name = name.split(|&b| b == 0).next().unwrap_or(&[]);
            match matters(name) {
                _ if ev.mask & libc::IN_Q_OVERFLOW != 0 => found.all = true,
                Matters::All => found.all = true,
                Matters::This => {
                    found.names.insert(OsStr::from_bytes(name).to_owned());
                }
                Matters::No => {}
            }
            at += header + ev.len as usize;
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::source::file::testdata::TempDir;

    async fn woken(w: &mut DirWatch) -> bool {
        tokio::time::timeout(Duration::from_secs(2), w.changed())
            .await
            .is_ok_and(|r| r.is_ok())
    }

    async fn names(w: &mut DirWatch) -> Option<Woken> {
        let woken = tokio::time::timeout(Duration::from_secs(2), w.changed()).await;
        woken.ok().and_then(Result::ok)
    }

    async fn idle(w: &mut DirWatch) -> bool {
        (tokio::time::timeout(Duration::from_millis(100), w.changed()).await).is_err()
    }

    #[tokio::test]
    async fn wakes_on_writes_renames_and_deletes() {
        let dir = TempDir::new();
        let mut w = DirWatch::for_manifests(&dir.0).unwrap();
        assert!(w.watching);

        let only = |names: &[&str]| Some(Woken::Names(names.iter().map(OsString::from).collect()));
        dir.write("a.yaml", "a: 1\n");
        assert_eq!(names(&mut w).await, only(&["a.yaml"]), "a file written");
        // An atomic writer's temporary file is not a manifest: its rename is the change.
        dir.write("b.tmp", "b: 1\n");
        assert!(idle(&mut w).await, "a temporary file written");
        std::fs::rename(dir.0.join("b.tmp"), dir.0.join("b.yaml")).unwrap();
        assert_eq!(names(&mut w).await, only(&["b.yaml"]), "a file renamed in");
        // Renamed out and deleted, both in one drain.
        std::fs::rename(dir.0.join("b.yaml"), dir.0.join("b.old")).unwrap();
        std::fs::remove_file(dir.0.join("a.yaml")).unwrap();
        let mut seen = BTreeSet::new();
        while let Some(Woken::Names(n)) = names(&mut w).await {
            seen.extend(n);
            if seen.len() == 2 {
                break;
            }
        }
        assert_eq!(
            seen,
            ["a.yaml", "b.yaml"].map(OsString::from).into(),
            "renamed out, deleted"
        );
        dir.write(".b.yaml.swp", "x");
        assert!(idle(&mut w).await, "an editor's swap file");
        // A ConfigMap volume swaps its `..data` link: every file may have changed.
        std::os::unix::fs::symlink(".", dir.0.join("..data_tmp")).unwrap();
        std::fs::rename(dir.0.join("..data_tmp"), dir.0.join("..data")).unwrap();
        assert_eq!(names(&mut w).await, Some(Woken::All), "a ConfigMap update");

        // Nothing happened: no wake-up.
        assert!(idle(&mut w).await);
    }

    #[tokio::test]
    async fn a_file_path_wakes_for_that_file_only() {
        let dir = TempDir::new();
        let path = dir.write("a.yaml", "a: 1\n");
        let mut w = DirWatch::for_manifests(&path).unwrap();
        dir.write("other.yaml", "b: 1\n");
        assert!(idle(&mut w).await, "another manifest beside it");
        dir.write("a.yaml", "a: 2\n");
        assert!(woken(&mut w).await);
    }

    #[tokio::test]
    async fn a_folder_that_comes_back_is_watched_again() {
        let dir = TempDir::new();
        let sub = dir.0.join("manifests");
        let mut w = DirWatch::new(sub.clone()).unwrap();
        assert!(!w.watching, "not there yet");
        std::fs::create_dir(&sub).unwrap();
        w.arm();
        assert!(w.watching);

        std::fs::remove_dir(&sub).unwrap();
        assert!(woken(&mut w).await);
        // The IN_IGNORED may come with the delete or just after it.
        if w.watching {
            assert!(woken(&mut w).await);
        }
        assert!(!w.watching);
        std::fs::create_dir(&sub).unwrap();
        w.arm();
        std::fs::write(sub.join("a.yaml"), "a: 1\n").unwrap();
        assert!(woken(&mut w).await);
    }

    #[test]
    fn the_folder_of_a_file_path() {
        let dir = TempDir::new();
        assert_eq!(DirWatch::dir_of(&dir.0), dir.0);
        assert_eq!(DirWatch::dir_of(&dir.0.join("a.yaml")), dir.0);
        assert_eq!(DirWatch::dir_of(Path::new("a.yaml")), Path::new("."));
    }
}
