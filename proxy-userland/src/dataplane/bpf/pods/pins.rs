//! The pods' devices' links pinned under the pin directory (`--bpf-pin-dir`), so that they
//! outlive the daemon as the socket hooks' and node-port links do: with the pod path on,
//! the socket hooks leave pods' UDP to it, and between one daemon's exit and the next one's
//! first scan nothing else would translate it (an upgrade would black-hole pods' UDP).
//!
//! One pin per link, named `<ifindex>-<device>-<in|out>@<generation>`. A daemon notes the
//! pins it finds at start ("inherited"); once its own links for a device are attached and
//! pinned, or once the device is gone, it removes that device's inherited pins, which
//! detaches the previous daemon's programs there. Until then they keep translating: two
//! generations on one device is harmless, the first program (the older) answers for the
//! packet and the chain stops there.

use std::{
    collections::BTreeMap,
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
};

const BPF_OBJ_PIN: libc::c_long = 6;

/// `bpf_attr` for BPF_OBJ_PIN (linux/bpf.h), without the later `path_fd`.
#[repr(C)]
struct ObjPin {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}
const _: () = assert!(std::mem::size_of::<ObjPin>() == 16);

/// Pins the BPF object `fd` (a link) at `path`, on a bpffs.
fn pin_fd(fd: &OwnedFd, path: &Path) -> io::Result<()> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let attr = ObjPin {
        pathname: c_path.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    // SAFETY: `attr` is a valid, fully initialised bpf_attr prefix of the size we pass, and
    // `c_path`, which it points to, is a NUL-terminated string that outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_PIN,
            &attr as *const ObjPin,
            std::mem::size_of::<ObjPin>() as u32,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The part of a pin's name that says which device it is for.
pub(super) fn device_key(ifindex: u32, name: &str) -> String {
    format!("{ifindex}-{name}")
}

/// The device key of a pin file's name; None for a name that is not one of ours.
fn key_of(file_name: &str) -> Option<&str> {
    let (link, _generation) = file_name.rsplit_once('@')?;
    let (key, _direction) = link.rsplit_once('-')?;
    Some(key)
}

/// Unpins `paths`; a pin already gone is no error. The links go with their last reference.
pub(super) fn remove(paths: &[PathBuf]) {
    for p in paths {
        if let Err(e) = std::fs::remove_file(p)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(pin = %p.display(), "cannot unpin a pod device's link: {e}");
        }
    }
}

/// This daemon's pin folder for the pods' devices' links.
pub(super) struct Pins {
    dir: PathBuf,
    generation: String,
    /// Pins a previous daemon left, by device key.
    inherited: BTreeMap<String, Vec<PathBuf>>,
}

impl Pins {
    /// Makes the folder if needed and notes the pins already in it.
    pub(super) fn open(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
        let mut inherited: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
        for entry in std::fs::read_dir(dir)?.flatten() {
            let name = entry.file_name();
            // Whatever else is in our folder is left over: it goes with the "gone" devices.
            let key = key_of(&name.to_string_lossy())
                .unwrap_or_default()
                .to_string();
            inherited.entry(key).or_default().push(entry.path());
        }
        let generation = format!(
            "{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        );
        Ok(Self {
            dir: dir.to_path_buf(),
            generation,
            inherited,
        })
    }

    /// Pins one device's (ingress, egress) links; on an error, none of them stays pinned.
    pub(super) fn pin(
        &self,
        ifindex: u32,
        name: &str,
        links: &[OwnedFd; 2],
    ) -> io::Result<Vec<PathBuf>> {
        let key = device_key(ifindex, name);
        let mut pinned = Vec::new();
        for (link, direction) in links.iter().zip(["in", "out"]) {
            let path = self
                .dir
                .join(format!("{key}-{direction}@{}", self.generation));
            if let Err(e) = pin_fd(link, &path) {
                remove(&pinned);
                return Err(io::Error::new(
                    e.kind(),
                    format!("pinning at {}: {e}", path.display()),
                ));
            }
            pinned.push(path);
        }
        Ok(pinned)
    }

    /// Removes the inherited pins of every device but those `keep` names (by key): the
    /// devices still there that this daemon could not attach to yet.
    pub(super) fn release_inherited(&mut self, keep: impl Fn(&str) -> bool) {
        self.inherited.retain(|key, paths| {
            if keep(key) {
                return true;
            }
            remove(paths);
            false
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pins_name_says_its_device_whatever_the_device_is_called() {
        let name = format!("{}-in@123-456", device_key(7, "veth-a@b"));
        assert_eq!(key_of(&name), Some("7-veth-a@b"));
        assert_eq!(key_of("12-lxc1-out@99-1"), Some("12-lxc1"));
        assert_eq!(key_of("stray"), None);
        assert_eq!(key_of("@gen"), None);
    }
}
