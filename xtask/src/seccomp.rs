//! The daemon's seccomp allow-list, made from what it really calls.
//!
//! `cargo xtask seccomp-trace` runs the integration tests that start the real `fastpath`
//! (every mode, `--cleanup`, `inspect`/`explain`, probes, the kube source, SIGTERM) with
//! [`TRACE_ENV`] set. The tests' helpers then start each `fastpath` as
//! `strace -f -c -o FILE -- fastpath ...` ([`command`], [`prefix`]): `-f` follows the
//! threads and everything the daemon runs (iptables-restore, iptables-save, nft, conntrack,
//! ip, ...), which the container's filter confines as well; `-c` keeps only a count per
//! call, so a run writes a few lines, not gigabytes. The names found, plus the calls a
//! trace on one machine cannot show ([`SOMETIMES`], [`RUNTIME`], the aarch64 forms of
//! [`GENERIC`]), become `deploy/seccomp/fastpath.json` ([`profile`]).
//!
//! strace and not the kernel's SCMP_ACT_LOG: the log action reports through the audit
//! printk path, which is rate limited (calls go missing without a word), and needs the
//! daemon in a container already; strace sees every call of every process, here and in CI.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsStr,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::cmd;

/// Set to a folder, the tests' helpers run each `fastpath` under strace and leave a count
/// of its system calls there.
pub const TRACE_ENV: &str = "FASTPATH_SYSCALL_TRACE";

/// The integration tests whose `fastpath` processes make the trace: each mode through the
/// daemon (eBPF, iptables, userspace and the fallbacks), restarts with pins and
/// `--cleanup`, `inspect` and `explain` in both modes, the admin servers and probes, the
/// API server source (TLS, watches), UDP socket resets in client namespaces (setns), the
/// DaemonSet's capabilities, and SIGTERM shutdowns (the helpers stop daemons with it).
pub const WORKLOADS: &[&str] = &[
    "daemon",
    "mode_daemon",
    "pinning",
    "admin",
    "kube_source",
    "least_privilege",
    "inspect_explain",
    "inspect_iptables",
    "explain_iptables",
    "udp_backend_loss",
    "hostile_input",
];

/// Where the trace of this run goes, when one is asked for.
fn trace_dir() -> Option<PathBuf> {
    std::env::var_os(TRACE_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

/// `strace -f -c -o FILE --` when [`TRACE_ENV`] is set, else nothing: put it right before
/// the `fastpath` of a command line (after wrappers such as setpriv or nsenter, whose own
/// calls are not the daemon's).
pub fn prefix() -> Vec<String> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let Some(dir) = trace_dir() else {
        return Vec::new();
    };
    let file = dir.join(format!(
        "{}-{}.strace",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    vec![
        "strace".into(),
        "-f".into(),
        "-qq".into(),
        "-c".into(),
        "-o".into(),
        file.display().to_string(),
        "--".into(),
    ]
}

/// `program` (fastpath), under strace when a trace is asked for.
pub fn command(program: impl AsRef<OsStr>) -> Command {
    let prefix = prefix();
    match prefix.split_first() {
        Some((strace, rest)) => {
            let mut c = Command::new(strace);
            c.args(rest).arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// The process a signal for the daemon must go to: `pid` itself, or under a trace the
/// program strace started (strace holds fatal signals back while it writes to a file).
pub fn tracee(pid: u32) -> u32 {
    if trace_dir().is_none() {
        return pid;
    }
    let children = format!("/proc/{pid}/task/{pid}/children");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // strace gone (or going): there is nothing left to signal but itself.
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if matches!(
            state.rsplit(") ").next().and_then(|s| s.chars().next()),
            None | Some('Z' | 'X')
        ) {
            return pid;
        }
        let first = std::fs::read_to_string(&children)
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse().ok()));
        match first {
            Some(child) => return child,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            None => return pid,
        }
    }
}

/// The call names in an `strace -c` summary (the last column of each row but the total).
pub fn summary_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let first_is_number = cols.first()?.parse::<f64>().is_ok();
            let name = *cols.last()?;
            (first_is_number && cols.len() >= 5 && name != "total").then(|| name.to_string())
        })
        .collect()
}

/// The x86_64 calls that 64-bit Arm does not have, and what glibc calls there instead: a
/// trace made on x86_64 names the former, the profile allows both.
pub const GENERIC: &[(&str, &[&str])] = &[
    ("open", &["openat"]),
    ("creat", &["openat"]),
    ("stat", &["newfstatat"]),
    ("lstat", &["newfstatat"]),
    ("access", &["faccessat", "faccessat2"]),
    ("poll", &["ppoll"]),
    ("select", &["pselect6"]),
    ("pause", &["ppoll"]),
    ("epoll_wait", &["epoll_pwait"]),
    ("epoll_create", &["epoll_create1"]),
    ("pipe", &["pipe2"]),
    ("dup2", &["dup3"]),
    ("fork", &["clone"]),
    ("vfork", &["clone"]),
    ("unlink", &["unlinkat"]),
    ("rmdir", &["unlinkat"]),
    ("mkdir", &["mkdirat"]),
    ("mknod", &["mknodat"]),
    ("rename", &["renameat", "renameat2"]),
    ("readlink", &["readlinkat"]),
    ("chmod", &["fchmodat"]),
    ("chown", &["fchownat"]),
    ("lchown", &["fchownat"]),
    ("link", &["linkat"]),
    ("symlink", &["symlinkat"]),
    ("getdents", &["getdents64"]),
    ("eventfd", &["eventfd2"]),
    ("signalfd", &["signalfd4"]),
    ("inotify_init", &["inotify_init1"]),
    ("utime", &["utimensat"]),
    ("utimes", &["utimensat"]),
    ("alarm", &["setitimer"]),
    ("getpgrp", &["getpgid"]),
    ("time", &["clock_gettime"]),
];

/// Calls a real run can need that a trace may miss, each with why.
pub const SOMETIMES: &[(&str, &str)] = &[
    (
        "pidfd_open",
        "a connected UDP socket of a removed backend is connected to its Service again from a copy of its descriptor (dataplane/bpf/repoint.rs): only when a backend leaves while a client on the node holds one",
    ),
    (
        "pidfd_getfd",
        "as pidfd_open: the copy of the client's descriptor",
    ),
    (
        "clone3",
        "glibc 2.34+ starts threads and posix_spawn children with clone3 and falls back to clone only on ENOSYS, not on this profile's EPERM",
    ),
    (
        "clone",
        "glibc's fallback where the kernel has no clone3 (before 5.3), and what other libcs use",
    ),
    (
        "rseq",
        "glibc 2.35+ registers every new thread; a refusal is survived but costs its fast sched_getcpu",
    ),
    (
        "statx",
        "Rust's std reads file metadata with statx first (fs::metadata, File::metadata)",
    ),
    (
        "newfstatat",
        "Rust's std and glibc's stat where statx is not used; the only stat on aarch64",
    ),
    ("fstat", "glibc's fstat, and Rust's std fallback from statx"),
    (
        "getrandom",
        "Rust's std seeds HashMap keys with it and rustls/ring make TLS keys with it; before the first such use there is none to trace",
    ),
    (
        "restart_syscall",
        "the kernel resumes a sleeping call interrupted by a signal (SIGTERM's handler) through it; strace does not show it",
    ),
    (
        "rt_sigreturn",
        "the return from every signal handler (tokio's SIGTERM and SIGINT handlers)",
    ),
    (
        "mremap",
        "glibc's realloc of blocks above the mmap threshold (128 KiB): large List reads and rule sets at scale",
    ),
    (
        "madvise",
        "glibc's free gives memory back with it when large arenas shrink, after big syncs; jemalloc (the daemon's allocator) returns freed pages with it",
    ),
    (
        "open",
        "jemalloc reads /proc/sys/vm/overcommit_memory and the transparent huge page setting with open, not openat, once at start (x86_64; openat on aarch64)",
    ),
    (
        "readlink",
        "jemalloc looks for its optional configuration symlink /etc/_rjem_malloc.conf once at start",
    ),
    (
        "readlinkat",
        "the same lookup on aarch64, which has no readlink",
    ),
    (
        "sched_yield",
        "spin-then-yield in tokio's and std's locks under contention",
    ),
    (
        "exit",
        "a thread's end (tokio's blocking pool lets idle threads go after 10 s); it never returns, so strace -c does not count it",
    ),
    (
        "exit_group",
        "every process's end; it never returns, so strace -c does not count it",
    ),
    (
        "wait4",
        "reaping a child (iptables-restore, nft, conntrack) that glibc's waitpid waits for",
    ),
    (
        "tgkill",
        "abort() and raise(); also the Go runtime of runc preempts with it before the execve",
    ),
];

/// What the container runtime (runc, crun) still calls in the container's process after
/// it loaded the filter and before it executes fastpath: with no_new_privs the filter is
/// loaded last, right before the execve, but runc's Go runtime may still run.
pub const RUNTIME: &[&str] = &[
    "execve",
    // runc 1.1 checks what /proc is (statfs of its fd) between the filter and the execve.
    "fstatfs",
    "futex",
    "nanosleep",
    "getpid",
    "gettid",
    "rt_sigaction",
    "rt_sigprocmask",
    "sigaltstack",
    "mmap",
    "munmap",
    "close",
    "fcntl",
    "write",
    "read",
    "epoll_ctl",
    "epoll_pwait",
    "capget",
    "capset",
    "prctl",
    "setgroups",
    "setgid",
    "setuid",
    "close_range",
];

/// The calls of the old deny-list profile: none is ever allowed.
pub const NEVER: &[&str] = &[
    "acct",
    "add_key",
    "adjtimex",
    "clock_adjtime",
    "clock_settime",
    "delete_module",
    "finit_module",
    "init_module",
    "ioperm",
    "iopl",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "pivot_root",
    "process_vm_readv",
    "process_vm_writev",
    "ptrace",
    "quotactl",
    "reboot",
    "request_key",
    "settimeofday",
    "stime",
    "swapoff",
    "swapon",
    "syslog",
    "uselib",
    "userfaultfd",
    "vm86",
    "vm86old",
    // Whole kernels of their own, which the filter cannot look into.
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
];

/// The allow-list profile: `traced` (x86_64 names), their aarch64 forms, [`SOMETIMES`] and
/// [`RUNTIME`]; everything else fails with EPERM.
pub fn profile(traced: &BTreeSet<String>) -> Result<Value> {
    let never: BTreeSet<&str> = NEVER.iter().copied().collect();
    if let Some(bad) = traced.iter().find(|n| never.contains(n.as_str())) {
        bail!("the trace has {bad}, which the profile never allows: find out who calls it");
    }
    let mut allowed: BTreeSet<String> = traced.clone();
    let mut rules = vec![json!({
        "names": traced,
        "action": "SCMP_ACT_ALLOW",
        "comment": "Traced: every call fastpath and the tools it runs (iptables-restore, iptables-save, nft, conntrack, ip) made over `cargo xtask seccomp-trace` on x86_64 (glibc 2.36)",
    })];
    let generic: BTreeSet<&str> = GENERIC
        .iter()
        .filter(|(legacy, _)| traced.contains(*legacy))
        .flat_map(|(_, now)| now.iter().copied())
        .filter(|n| allowed.insert(n.to_string()))
        .collect();
    if !generic.is_empty() {
        rules.push(json!({
            "names": generic,
            "action": "SCMP_ACT_ALLOW",
            "comment": "aarch64 (and other new architectures) have no open, stat, poll, epoll_wait, pipe, dup2, fork, ...: glibc calls these there for the traced legacy calls",
        }));
    }
    for (name, why) in SOMETIMES {
        if allowed.insert(name.to_string()) {
            rules.push(json!({"names": [name], "action": "SCMP_ACT_ALLOW", "comment": why}));
        }
    }
    let runtime: BTreeSet<&str> = RUNTIME
        .iter()
        .copied()
        .filter(|n| allowed.insert(n.to_string()))
        .collect();
    if !runtime.is_empty() {
        rules.push(json!({
            "names": runtime,
            "action": "SCMP_ACT_ALLOW",
            "comment": "The container runtime's last calls in the container's process, between loading this filter and executing fastpath",
        }));
    }
    Ok(json!({
        "comment": "Generated by `cargo xtask seccomp-trace` (docs/deploying.md): edit xtask/src/seccomp.rs, not this file",
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"],
        "syscalls": rules,
    }))
}

/// The names a profile allows.
pub fn allowed(profile: &Value) -> BTreeSet<String> {
    profile["syscalls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["action"] == "SCMP_ACT_ALLOW")
        .flat_map(|r| r["names"].as_array().into_iter().flatten())
        .filter_map(|n| n.as_str().map(String::from))
        .collect()
}

/// The names of every summary under `dir`, and how many summaries there were.
pub fn collect(dir: &Path) -> Result<(BTreeSet<String>, usize)> {
    let mut names = BTreeSet::new();
    let mut files = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let path = entry?.path();
        if path.extension() == Some(OsStr::new("strace")) {
            names.extend(summary_names(&std::fs::read_to_string(&path)?));
            files += 1;
        }
    }
    Ok((names, files))
}

/// `cargo xtask seccomp-trace [TEST...]`: the [`WORKLOADS`] (or the tests named) under
/// strace, and deploy/seccomp/fastpath.json rewritten from what they called; with `rerun`
/// false, only rewritten from the last trace (after a change to this file's lists).
pub fn trace(tests: &[String], rerun: bool) -> Result<()> {
    let dir = crate::target_dir().join("seccomp-trace");
    if rerun {
        crate::require_root("seccomp-trace")?;
        // Installs strace too.
        crate::setup::setup()?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let tests: Vec<&str> = if tests.is_empty() {
            WORKLOADS.to_vec()
        } else {
            tests.iter().map(String::as_str).collect()
        };
        let mut run = crate::cargo();
        run.args(["test", "-p", "proxy-userland"]);
        for t in &tests {
            run.args(["--test", t]);
        }
        run.env(TRACE_ENV, &dir);
        println!("seccomp-trace: running `{}`", cmd::describe(&run));
        cmd::run(&mut run)
            .context("the traced tests failed: the trace would miss what they did not reach")?;
    }
    let (traced, files) = collect(&dir)?;
    if files == 0 {
        bail!("no trace was written: do the tests start fastpath through xtask::seccomp?");
    }
    let path = crate::workspace_root().join("deploy/seccomp/fastpath.json");
    let before = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .map(|p| allowed(&p))
        .unwrap_or_default();
    let profile = profile(&traced)?;
    let after = allowed(&profile);
    std::fs::write(
        &path,
        format!("{}\n", serde_json::to_string_pretty(&profile)?),
    )?;
    let diff = |a: &BTreeSet<String>, b: &BTreeSet<String>| -> Vec<String> {
        a.difference(b).cloned().collect()
    };
    let counts: BTreeMap<&str, usize> = [("traced", traced.len()), ("allowed", after.len())]
        .into_iter()
        .collect();
    println!(
        "seccomp-trace: {files} traced runs, {counts:?}; newly allowed {:?}, no longer allowed {:?}; wrote {}",
        diff(&after, &before),
        diff(&before, &after),
        path.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUMMARY: &str = "\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 40.00    0.000040          13         3           bpf
 30.00    0.000030           1        30         2 openat
  0.00    0.000000           0         1           restart_syscall
------ ----------- ----------- --------- --------- ----------------
100.00    0.000070           2        34         2 total
";

    #[test]
    fn a_summary_gives_its_call_names_and_not_the_total() {
        let names = summary_names(SUMMARY);
        assert_eq!(
            names.iter().map(String::as_str).collect::<Vec<_>>(),
            ["bpf", "openat", "restart_syscall"]
        );
    }

    #[test]
    fn the_profile_adds_the_aarch64_forms_and_refuses_by_default() {
        let traced: BTreeSet<String> = ["open", "epoll_wait", "bpf"].map(String::from).into();
        let p = profile(&traced).unwrap();
        assert_eq!(p["defaultAction"], "SCMP_ACT_ERRNO");
        let allowed = allowed(&p);
        for n in ["openat", "epoll_pwait", "bpf", "clone3", "execve"] {
            assert!(allowed.contains(n), "{n}");
        }
        assert!(!allowed.contains("ptrace"));
    }

    #[test]
    fn a_trace_with_a_never_allowed_call_is_an_error() {
        let traced: BTreeSet<String> = ["bpf", "ptrace"].map(String::from).into();
        assert!(profile(&traced).is_err());
    }
}
