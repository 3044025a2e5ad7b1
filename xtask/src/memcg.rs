//! A memory-limited cgroup for a test, as a container runtime makes one for a container with
//! `resources.limits.memory`: cgroup v2 where its memory controller is (`memory.max`,
//! `memory.events`, `memory.peak`), else the v1 memory hierarchy of a hybrid host
//! (`memory.limit_in_bytes`, `memory.oom_control`, `memory.max_usage_in_bytes`), which is
//! what the kubelet uses on such a host too.

use std::{
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow};

use crate::cgroup;

/// Which hierarchy the group lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hierarchy {
    V2,
    V1,
}

/// A cgroup with a memory limit; its processes are killed and the group removed on drop.
pub struct MemoryCgroup {
    path: PathBuf,
    hierarchy: Hierarchy,
}

impl MemoryCgroup {
    /// Makes group `name` limited to `limit` bytes: under the cgroup2 root when the memory
    /// controller is there (enabled for the root's children), else under this process's own
    /// group of the v1 memory hierarchy.
    pub fn create(name: &str, limit: u64) -> Result<MemoryCgroup> {
        crate::require_root("a memory cgroup")?;
        let (path, hierarchy) = match v2_root_with_memory()? {
            Some(root) => {
                fs::write(root.join("cgroup.subtree_control"), "+memory").with_context(|| {
                    format!(
                        "enabling the memory controller for {}'s children",
                        root.display()
                    )
                })?;
                (root.join(name), Hierarchy::V2)
            }
            None => (v1_own_group()?.join(name), Hierarchy::V1),
        };
        cgroup::create(&path)?;
        let group = MemoryCgroup { path, hierarchy };
        // From here on, a failure drops `group`, which removes it.
        let limit_file = match hierarchy {
            Hierarchy::V2 => "memory.max",
            Hierarchy::V1 => "memory.limit_in_bytes",
        };
        fs::write(group.path.join(limit_file), limit.to_string())
            .with_context(|| format!("limiting {} to {limit} bytes", group.path.display()))?;
        if hierarchy == Hierarchy::V2 {
            // No swap to spill into, as the kubelet runs containers by default.
            let _ = fs::write(group.path.join("memory.swap.max"), "0");
        }
        Ok(group)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn hierarchy(&self) -> Hierarchy {
        self.hierarchy
    }

    /// The file a process writes its pid to, to join (`cgroup.procs` in both hierarchies).
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// Processes the kernel's OOM killer killed in this group so far.
    pub fn oom_kills(&self) -> Result<u64> {
        let (file, key) = match self.hierarchy {
            Hierarchy::V2 => ("memory.events", "oom_kill"),
            Hierarchy::V1 => ("memory.oom_control", "oom_kill"),
        };
        let text = self.read(file)?;
        keyed(&text, key).ok_or_else(|| anyhow!("{file} has no {key} line: {text:?}"))
    }

    /// Bytes charged to the group now (process memory, page cache, kernel memory such as
    /// BPF maps).
    pub fn current(&self) -> Result<u64> {
        let file = match self.hierarchy {
            Hierarchy::V2 => "memory.current",
            Hierarchy::V1 => "memory.usage_in_bytes",
        };
        parse_bytes(&self.read(file)?)
    }

    /// The most bytes ever charged to the group, if the kernel keeps that (v2: memory.peak,
    /// since Linux 5.19).
    pub fn peak(&self) -> Result<Option<u64>> {
        let file = match self.hierarchy {
            Hierarchy::V2 => "memory.peak",
            Hierarchy::V1 => "memory.max_usage_in_bytes",
        };
        match fs::read_to_string(self.path.join(file)) {
            Ok(text) => parse_bytes(&text).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {file}")),
        }
    }

    fn read(&self, file: &str) -> Result<String> {
        let path = self.path.join(file);
        fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // Only processes a test put here; cgroup::remove_tree kills them by pid first.
        if let Err(e) = cgroup::remove_tree(&self.path, Duration::from_secs(10)) {
            eprintln!("memcg: {e:#}");
        }
    }
}

/// The value of line `key N` in a flat keyed file.
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

fn parse_bytes(text: &str) -> Result<u64> {
    text.trim()
        .parse()
        .with_context(|| format!("not a byte count: {text:?}"))
}

/// The cgroup2 root, if its memory controller is available there.
fn v2_root_with_memory() -> Result<Option<PathBuf>> {
    let Some(root) = cgroup::find_cgroup2_mount()? else {
        return Ok(None);
    };
    let controllers = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
    Ok(controllers
        .split_whitespace()
        .any(|c| c == "memory")
        .then_some(root))
}

/// This process's group in the v1 memory hierarchy (its mount plus the path
/// /proc/self/cgroup names).
fn v1_own_group() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    let own = fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    v1_memory_group(&mounts, &own).ok_or_else(|| {
        anyhow!(
            "no memory controller: neither the cgroup2 root lists it in cgroup.controllers nor \
             is a v1 memory hierarchy mounted"
        )
    })
}

/// The v1 memory hierarchy's mount and this process's path in it, from the text of
/// /proc/self/mounts and /proc/self/cgroup.
fn v1_memory_group(mounts: &str, own: &str) -> Option<PathBuf> {
    let mount = mounts.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (dir, fstype, options) = (fields.get(1)?, fields.get(2)?, fields.get(3)?);
        (*fstype == "cgroup" && options.split(',').any(|o| o == "memory")).then_some(*dir)
    })?;
    let path = own.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    })?;
    Some(Path::new(mount).join(path.trim_start_matches('/')))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_flat_keyed_files() {
        let events = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(keyed(events, "oom_kill"), Some(1));
        assert_eq!(keyed(events, "oom"), Some(1));
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(keyed(v1, "oom_kill"), Some(3));
        assert_eq!(keyed(v1, "missing"), None);
    }

    #[test]
    fn finds_own_v1_memory_group() {
        let mounts = "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n\
                      cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        let own = "5:devices:/\n4:memory:/process_api/abc\n0::/\n";
        assert_eq!(
            v1_memory_group(mounts, own),
            Some(PathBuf::from("/sys/fs/cgroup/memory/process_api/abc"))
        );
        assert_eq!(v1_memory_group("cgroup2 /x cgroup2 rw 0 0\n", own), None);
    }
}
