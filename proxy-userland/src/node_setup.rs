//! Node set-up, as kube-proxy's `cmd/kube-proxy/app/conntrack.go` and its OOM adjustment do:
//! size the conntrack table for the node, shorten the TCP conntrack timeouts, and make the
//! kernel's OOM killer spare the proxy (a node without its proxy loses every Service).
//!
//! Each step is best effort: a read-only /proc/sys (a container without the privilege), a
//! conntrack module that is not loaded, or a read-only /sys is reported as a warning naming
//! the file and what to do, and the proxy runs on. Paths are taken below a root directory so
//! tests can point it at a fake tree; the daemon uses `/`.
//!
//! Off unless asked for (`--node-setup` or `fastpath.nodeSetup: true`): a developer running
//! the daemon or the tests must not find their workstation's sysctls changed.

use std::{
    io,
    path::{Path, PathBuf},
    time::Duration,
};

use tracing::{info, warn};

/// What to set. Zeroes mean "leave alone", as in kube-proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSetup {
    pub conntrack_max_per_core: u32,
    pub conntrack_min: u32,
    pub tcp_timeout_established: Duration,
    pub tcp_timeout_close_wait: Duration,
    /// Set nf_conntrack_tcp_be_liberal to 1 (kube-proxy's conntrack.tcpBeLiberal); false
    /// leaves it alone, as kube-proxy does.
    pub tcp_be_liberal: bool,
    pub oom_score_adj: Option<i32>,
}

const CONNTRACK_MAX: &str = "proc/sys/net/netfilter/nf_conntrack_max";
const TCP_ESTABLISHED: &str = "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established";
const TCP_CLOSE_WAIT: &str = "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait";
const TCP_BE_LIBERAL: &str = "proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal";
const HASHSIZE: &str = "sys/module/nf_conntrack/parameters/hashsize";
const OOM_SCORE_ADJ: &str = "proc/self/oom_score_adj";

/// Why one setting could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{path} does not exist: is the nf_conntrack module loaded (modprobe nf_conntrack)?")]
    NoConntrack { path: PathBuf },
    #[error(
        "{path} is read-only ({source}); run privileged with a writable /proc/sys and /sys, \
         or set it on the node and turn node set-up off"
    )]
    ReadOnly { path: PathBuf, source: io::Error },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// One setting that was changed (or already right).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    pub path: PathBuf,
    pub value: i64,
    /// The value before; equal to `value` when nothing was written.
    pub previous: Option<i64>,
}

#[derive(Debug, Default)]
pub struct Report {
    pub applied: Vec<Applied>,
    pub failed: Vec<SetupError>,
}

impl NodeSetup {
    /// kube-proxy's getConntrackMax: max(maxPerCore x CPUs, min), or `None` to leave it.
    pub fn conntrack_max(&self, cpus: usize) -> Option<i64> {
        (self.conntrack_max_per_core > 0).then(|| {
            let scaled = i64::from(self.conntrack_max_per_core) * cpus as i64;
            scaled.max(i64::from(self.conntrack_min))
        })
    }

    /// Applies every step under `root` (normally `/`) for a node with `cpus` CPUs.
    pub fn apply(&self, root: &Path, cpus: usize) -> Report {
        let mut report = Report::default();
        if let Some(max) = self.conntrack_max(cpus) {
            let ok = report.record(set_int(root, CONNTRACK_MAX, max, true));
            // The hash table only grows to a quarter of the new maximum if told to; skip the
            // write when it is big enough already, since writing needs the initial network
            // namespace and a writable /sys, which a well-sized node should not require.
            if ok {
                let quarter = max / 4;
                match read_int(&root.join(HASHSIZE)) {
                    Ok(size) if size >= quarter => {}
                    Ok(_) => {
                        report.record(set_int(root, HASHSIZE, quarter, false));
                    }
                    Err(e) => report.failed.push(e),
                }
            }
        }
        for (rel, timeout) in [
            (TCP_ESTABLISHED, self.tcp_timeout_established),
            (TCP_CLOSE_WAIT, self.tcp_timeout_close_wait),
        ] {
            if !timeout.is_zero() {
                report.record(set_int(root, rel, timeout.as_secs() as i64, true));
            }
        }
        if self.tcp_be_liberal {
            report.record(set_int(root, TCP_BE_LIBERAL, 1, true));
        }
        if let Some(adj) = self.oom_score_adj {
            report.record(set_int(root, OOM_SCORE_ADJ, i64::from(adj), false));
        }
        report
    }
}

impl Report {
    fn record(&mut self, r: Result<Applied, SetupError>) -> bool {
        match r {
            Ok(a) => {
                self.applied.push(a);
                true
            }
            Err(e) => {
                self.failed.push(e);
                false
            }
        }
    }
}

/// Applies `setup` to this node and logs each change and each failure.
pub fn apply_to_node(setup: &NodeSetup) {
    // Online CPUs, as Go's runtime.NumCPU counts them for kube-proxy; not the cgroup quota,
    // which says nothing about how many connections the node carries.
    // SAFETY: sysconf only reads its integer argument.
    let cpus = match unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) } {
        n if n > 0 => n as usize,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let report = setup.apply(Path::new("/"), cpus);
    for a in &report.applied {
        if a.previous != Some(a.value) {
            info!(path = %a.path.display(), value = a.value, previous = ?a.previous, "node set-up: changed");
        }
    }
    for e in &report.failed {
        warn!("node set-up: {e}");
    }
}

fn read_int(path: &Path) -> Result<i64, SetupError> {
    let text = std::fs::read_to_string(path).map_err(|e| classify(path, e))?;
    text.trim().parse().map_err(|_| SetupError::Io {
        path: path.to_path_buf(),
        source: io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a number: {:?}", text.trim()),
        ),
    })
}

/// Writes `value` unless the file holds it already (kube-proxy's setIntSysCtl), so a node
/// that is set up right needs no write permission at all.
fn set_int(root: &Path, rel: &str, value: i64, conntrack: bool) -> Result<Applied, SetupError> {
    let path = root.join(rel);
    let previous = match read_int(&path) {
        Ok(v) => Some(v),
        Err(SetupError::NoConntrack { .. }) if !conntrack => {
            return Err(SetupError::Io {
                path: path.clone(),
                source: io::Error::from(io::ErrorKind::NotFound),
            });
        }
        Err(e @ SetupError::NoConntrack { .. }) => return Err(e),
        Err(_) => None,
    };
    if previous != Some(value) {
        std::fs::write(&path, format!("{value}\n")).map_err(|e| classify(&path, e))?;
    }
    Ok(Applied {
        path,
        value,
        previous,
    })
}

fn classify(path: &Path, e: io::Error) -> SetupError {
    let path = path.to_path_buf();
    match e.raw_os_error() {
        Some(libc::ENOENT) => SetupError::NoConntrack { path },
        Some(libc::EROFS | libc::EACCES | libc::EPERM) => SetupError::ReadOnly { path, source: e },
        _ if e.kind() == io::ErrorKind::NotFound => SetupError::NoConntrack { path },
        _ => SetupError::Io { path, source: e },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct FakeRoot(PathBuf);
    impl FakeRoot {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("fastpath-nodesetup-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            FakeRoot(dir)
        }
        fn put(&self, rel: &str, value: &str) {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, value).unwrap();
        }
        fn get(&self, rel: &str) -> String {
            std::fs::read_to_string(self.0.join(rel))
                .unwrap()
                .trim()
                .to_string()
        }
    }
    impl Drop for FakeRoot {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn kube_proxy_defaults() -> NodeSetup {
        NodeSetup {
            conntrack_max_per_core: 32768,
            conntrack_min: 131072,
            tcp_timeout_established: Duration::from_secs(86400),
            tcp_timeout_close_wait: Duration::from_secs(3600),
            tcp_be_liberal: false,
            oom_score_adj: Some(-999),
        }
    }

    #[test]
    fn conntrack_max_is_per_core_with_a_floor() {
        let s = kube_proxy_defaults();
        assert_eq!(
            s.conntrack_max(2),
            Some(131072),
            "the floor wins on small nodes"
        );
        assert_eq!(s.conntrack_max(8), Some(262144));
        let off = NodeSetup {
            conntrack_max_per_core: 0,
            ..s
        };
        assert_eq!(off.conntrack_max(64), None);
    }

    #[test]
    fn writes_sysctls_hashsize_and_oom_score_under_the_root() {
        let root = FakeRoot::new("write");
        root.put(CONNTRACK_MAX, "65536\n");
        root.put(HASHSIZE, "16384\n");
        root.put(TCP_ESTABLISHED, "432000\n");
        root.put(TCP_CLOSE_WAIT, "3600\n");
        root.put(OOM_SCORE_ADJ, "0\n");
        let report = kube_proxy_defaults().apply(&root.0, 8);
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        assert_eq!(root.get(CONNTRACK_MAX), "262144");
        assert_eq!(root.get(HASHSIZE), "65536");
        assert_eq!(root.get(TCP_ESTABLISHED), "86400");
        assert_eq!(root.get(OOM_SCORE_ADJ), "-999");
        let close_wait = report
            .applied
            .iter()
            .find(|a| a.path.ends_with("nf_conntrack_tcp_timeout_close_wait"))
            .unwrap();
        assert_eq!(
            close_wait.previous,
            Some(3600),
            "already right: not rewritten"
        );
    }

    /// kube-proxy's conntrack.tcpBeLiberal: set to 1 when asked, untouched otherwise.
    #[test]
    fn tcp_be_liberal_is_set_only_when_asked() {
        let root = FakeRoot::new("liberal");
        root.put(TCP_BE_LIBERAL, "0\n");
        let quiet = NodeSetup {
            conntrack_max_per_core: 0,
            tcp_timeout_established: Duration::ZERO,
            tcp_timeout_close_wait: Duration::ZERO,
            oom_score_adj: None,
            ..kube_proxy_defaults()
        };
        let report = quiet.apply(&root.0, 1);
        assert!(report.failed.is_empty() && report.applied.is_empty());
        assert_eq!(root.get(TCP_BE_LIBERAL), "0");
        let report = NodeSetup {
            tcp_be_liberal: true,
            ..quiet
        }
        .apply(&root.0, 1);
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        assert_eq!(root.get(TCP_BE_LIBERAL), "1");
    }

    #[test]
    fn a_big_enough_hash_table_is_left_alone() {
        let root = FakeRoot::new("hash");
        root.put(CONNTRACK_MAX, "1\n");
        root.put(HASHSIZE, "1000000\n");
        let s = NodeSetup {
            tcp_timeout_established: Duration::ZERO,
            tcp_timeout_close_wait: Duration::ZERO,
            oom_score_adj: None,
            ..kube_proxy_defaults()
        };
        let report = s.apply(&root.0, 1);
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        assert_eq!(root.get(HASHSIZE), "1000000");
        assert_eq!(report.applied.len(), 1);
    }

    #[test]
    fn a_missing_conntrack_module_is_a_warning_not_a_failure_of_the_rest() {
        let root = FakeRoot::new("nomodule");
        root.put(OOM_SCORE_ADJ, "0\n");
        let report = kube_proxy_defaults().apply(&root.0, 4);
        assert_eq!(root.get(OOM_SCORE_ADJ), "-999", "the OOM step still ran");
        assert_eq!(report.failed.len(), 3, "{:?}", report.failed);
        let msg = report.failed[0].to_string();
        assert!(
            msg.contains("nf_conntrack_max") && msg.contains("modprobe nf_conntrack"),
            "{msg}"
        );
    }

    #[test]
    fn read_only_files_are_explained() {
        let e = classify(
            Path::new("/proc/sys/net/netfilter/nf_conntrack_max"),
            io::Error::from_raw_os_error(libc::EROFS),
        );
        let msg = e.to_string();
        assert!(
            matches!(e, SetupError::ReadOnly { .. })
                && msg.contains("read-only")
                && msg.contains("privileged"),
            "{msg}"
        );
        assert!(matches!(
            classify(Path::new("x"), io::Error::from_raw_os_error(libc::EACCES)),
            SetupError::ReadOnly { .. }
        ));
    }

    #[test]
    fn garbage_in_a_file_is_an_error_naming_it() {
        let root = FakeRoot::new("garbage");
        root.put(OOM_SCORE_ADJ, "zero\n");
        // Unreadable current value: written anyway.
        let s = NodeSetup {
            conntrack_max_per_core: 0,
            tcp_timeout_established: Duration::ZERO,
            tcp_timeout_close_wait: Duration::ZERO,
            ..kube_proxy_defaults()
        };
        let report = s.apply(&root.0, 1);
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        assert_eq!(root.get(OOM_SCORE_ADJ), "-999");
        root.put(HASHSIZE, "lots");
        let e = read_int(&root.0.join(HASHSIZE)).unwrap_err().to_string();
        assert!(e.contains("hashsize") && e.contains("not a number"), "{e}");
    }
}
