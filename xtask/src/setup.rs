//! `cargo xtask setup`: bring a fresh machine to the point where the workspace builds and its
//! tests run. Idempotent; when everything is in place it only checks, in a second or two.
//!
//! 1. the nightly toolchain with rust-src (the eBPF crate builds with `-Z build-std`);
//! 2. bpf-linker, built against nightly's own LLVM (its libLLVM lives in nightly's sysroot;
//!    we expose it under `~/.local/share/fastpath/llvm/lib` for `LLVM_PREFIX`);
//! 3. cargo-fuzz (pinned), which `cargo xtask fuzz` drives with nightly's libFuzzer support;
//! 4. the Debian packages whose tools the tests and the daemon call.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use crate::cmd::{self, output, succeeds, which};

/// Tools we need on PATH, and the Debian package that ships each.
pub const SYSTEM_TOOLS: &[(&str, &str)] = &[
    ("iptables", "iptables"),
    ("nft", "nftables"),
    ("ipset", "ipset"),
    ("conntrack", "conntrack"),
    ("ip", "iproute2"),
    // promtool: the admin tests check /metrics with `promtool check metrics`.
    ("promtool", "prometheus"),
    // The container image test builds a debootstrap root and runs it with podman; crun
    // refuses this kind of host's mixed cgroup set-up, so runc too.
    ("podman", "podman"),
    ("runc", "runc"),
    ("debootstrap", "debootstrap"),
    // Tests turn checksum offload off on a veth, so that receivers verify what our
    // programs rewrote.
    ("ethtool", "ethtool"),
    // `cargo xtask seccomp-trace` counts the daemon's system calls with it.
    ("strace", "strace"),
];

const STAMP: &str = "bpf-linker.stamp";

/// Runs every step; prints one short line per check or action.
pub fn setup() -> Result<()> {
    let started = Instant::now();
    ensure_nightly()?;
    ensure_rust_src()?;
    ensure_bpf_linker()?;
    ensure_cargo_fuzz()?;
    ensure_system_tools()?;
    println!("setup: done in {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

fn rustup() -> Result<PathBuf> {
    which("rustup").context("rustup is not on PATH; install rustup (with a stable toolchain) first")
}

fn ensure_nightly() -> Result<()> {
    let list = output(Command::new(rustup()?).args(["toolchain", "list"]))?;
    if has_plain_nightly(&list) {
        println!("setup: nightly toolchain present");
        return Ok(());
    }
    println!("setup: installing the nightly toolchain (minimal profile)");
    cmd::run(Command::new(rustup()?).args([
        "toolchain",
        "install",
        "nightly",
        "--profile",
        "minimal",
    ]))
}

/// True if `rustup toolchain list` shows an undated nightly (`nightly-<triple>`).
pub fn has_plain_nightly(list: &str) -> bool {
    list.lines()
        .filter_map(|line| line.split_whitespace().next())
        .any(|name| {
            name.strip_prefix("nightly-")
                .is_some_and(|rest| rest.chars().next().is_some_and(|c| !c.is_ascii_digit()))
        })
}

fn ensure_rust_src() -> Result<()> {
    let installed = output(Command::new(rustup()?).args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))?;
    // rust-src for `-Z build-std`; clippy because the code-health gate lints the eBPF crate,
    // which only nightly builds.
    for component in ["rust-src", "clippy"] {
        let present = installed.lines().any(|l| {
            let l = l.trim();
            l == component
                || l.strip_prefix(component)
                    .is_some_and(|rest| rest.starts_with('-'))
        });
        if present {
            println!("setup: {component} (nightly) present");
            continue;
        }
        println!("setup: adding {component} to nightly");
        cmd::run(Command::new(rustup()?).args([
            "component",
            "add",
            component,
            "--toolchain",
            "nightly",
        ]))?;
    }
    Ok(())
}

/// `$HOME/.local/share/fastpath/llvm`: the LLVM_PREFIX bpf-linker is built against.
pub fn llvm_prefix() -> Result<PathBuf> {
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .context("HOME is not set")?;
    Ok(Path::new(&home).join(".local/share/fastpath/llvm"))
}

fn nightly_version() -> Result<String> {
    Ok(
        output(Command::new("rustc").arg("+nightly").arg("--version"))?
            .trim()
            .to_string(),
    )
}

/// The cargo-fuzz `cargo xtask fuzz` runs; pinned so that CI and developers build the
/// targets alike.
pub const CARGO_FUZZ_VERSION: &str = "0.13.1";

/// Installs cargo-fuzz with the stable toolchain (it is an ordinary binary); only the fuzz
/// targets need nightly.
fn ensure_cargo_fuzz() -> Result<()> {
    let installed = which("cargo-fuzz")
        .and_then(|bin| output(Command::new(bin).arg("--version")).ok())
        .unwrap_or_default();
    if installed.split_whitespace().nth(1) == Some(CARGO_FUZZ_VERSION) {
        println!("setup: cargo-fuzz {CARGO_FUZZ_VERSION} present");
        return Ok(());
    }
    let mut install = crate::cargo();
    install.args([
        "install",
        "cargo-fuzz",
        "--version",
        CARGO_FUZZ_VERSION,
        "--locked",
    ]);
    println!("setup: running `{}`", cmd::describe(&install));
    cmd::run(&mut install)
}

fn ensure_bpf_linker() -> Result<()> {
    let prefix = llvm_prefix()?;
    let stamp = prefix.join(STAMP);
    let nightly = nightly_version()?;
    let recorded = fs::read_to_string(&stamp)
        .ok()
        .map(|s| s.trim().to_string());
    let runs =
        which("bpf-linker").is_some() && succeeds(Command::new("bpf-linker").arg("--version"));

    match (runs, recorded.as_deref()) {
        (true, Some(r)) if r == nightly => {
            println!("setup: bpf-linker present, built for {nightly}");
            return Ok(());
        }
        (true, None) => {
            // Installed by hand (or before stamps existed): trust it, and remember.
            fs::create_dir_all(&prefix)
                .with_context(|| format!("creating {}", prefix.display()))?;
            fs::write(&stamp, format!("{nightly}\n"))
                .with_context(|| format!("writing {}", stamp.display()))?;
            println!("setup: bpf-linker present; recorded it as built for {nightly}");
            return Ok(());
        }
        (true, Some(r)) => {
            println!("setup: bpf-linker was built for {r}; rebuilding for {nightly}")
        }
        (false, _) => println!("setup: bpf-linker missing; building it against nightly's LLVM"),
    }

    let major = link_nightly_llvm(&prefix)?;
    let mut install = crate::cargo();
    install
        .current_dir(&prefix)
        .env("LLVM_PREFIX", &prefix)
        .args([
            "install",
            "bpf-linker",
            "--no-default-features",
            "--features",
        ])
        .arg(format!("llvm-{major}"));
    println!(
        "setup: running `LLVM_PREFIX={} {}`",
        prefix.display(),
        cmd::describe(&install)
    );
    cmd::run(&mut install)?;
    if !succeeds(Command::new("bpf-linker").arg("--version")) {
        bail!(
            "bpf-linker was installed but `bpf-linker --version` fails; is ~/.cargo/bin on PATH?"
        );
    }
    fs::write(&stamp, format!("{nightly}\n"))
        .with_context(|| format!("writing {}", stamp.display()))?;
    println!("setup: bpf-linker built for {nightly}");
    Ok(())
}

/// Makes `prefix/lib/{libLLVM.so, libLLVM.so.<ver>-rust-<x>-nightly}` point at nightly's
/// libLLVM; returns LLVM's major version (for bpf-linker's `llvm-N` feature).
fn link_nightly_llvm(prefix: &Path) -> Result<u32> {
    let sysroot = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let libdir = Path::new(sysroot.trim()).join("lib");
    let mut found = Vec::new();
    for entry in fs::read_dir(&libdir).with_context(|| format!("reading {}", libdir.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(major) = nightly_llvm_major(&name) {
            found.push((name, major));
        }
    }
    found.sort();
    let Some((name, major)) = found.pop() else {
        bail!(
            "no libLLVM.so.<version>-rust-*-nightly in {}",
            libdir.display()
        );
    };
    let target = libdir.join(&name);
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    for link in ["libLLVM.so", name.as_str()] {
        let link = lib.join(link);
        if fs::read_link(&link).is_ok_and(|t| t == target) {
            continue;
        }
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link)
            .with_context(|| format!("linking {} -> {}", link.display(), target.display()))?;
    }
    println!(
        "setup: {} -> {}",
        lib.join("libLLVM.so").display(),
        target.display()
    );
    Ok(major)
}

/// `libLLVM.so.22.1-rust-1.97.0-nightly` -> Some(22).
pub fn nightly_llvm_major(file_name: &str) -> Option<u32> {
    let version = file_name.strip_prefix("libLLVM.so.")?;
    let (llvm, rust) = version.split_once("-rust-")?;
    if !rust.ends_with("-nightly") {
        return None;
    }
    llvm.split('.').next()?.parse().ok()
}

fn ensure_system_tools() -> Result<()> {
    let missing: Vec<&str> = SYSTEM_TOOLS
        .iter()
        .filter(|(bin, _)| which(bin).is_none())
        .map(|(_, pkg)| *pkg)
        .collect();
    let names: Vec<&str> = SYSTEM_TOOLS.iter().map(|(bin, _)| *bin).collect();
    if missing.is_empty() {
        println!("setup: {} present", names.join(", "));
        return Ok(());
    }
    let apt = which("apt-get").with_context(|| {
        format!(
            "missing packages {} and no apt-get; install them by hand",
            missing.join(" ")
        )
    })?;
    println!("setup: installing {}", missing.join(" "));
    cmd::run(
        Command::new(&apt)
            .arg("update")
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    cmd::run(
        Command::new(&apt)
            .args(["install", "-y"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    let still: Vec<&str> = names
        .iter()
        .copied()
        .filter(|bin| which(bin).is_none())
        .collect();
    if !still.is_empty() {
        bail!("still missing after apt-get install: {}", still.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_undated_nightly() {
        let list = "stable-x86_64-unknown-linux-gnu (active, default)\n\
                    nightly-2024-01-01-x86_64-unknown-linux-gnu\n";
        assert!(!has_plain_nightly(list));
        assert!(has_plain_nightly("nightly-x86_64-unknown-linux-gnu\n"));
        assert!(has_plain_nightly(
            "stable-x\nnightly-aarch64-unknown-linux-gnu (active)\n"
        ));
        assert!(!has_plain_nightly(""));
    }

    #[test]
    fn parses_the_llvm_file_name() {
        assert_eq!(
            nightly_llvm_major("libLLVM.so.22.1-rust-1.97.0-nightly"),
            Some(22)
        );
        assert_eq!(
            nightly_llvm_major("libLLVM.so.23.0-rust-1.99.0-nightly"),
            Some(23)
        );
        assert_eq!(
            nightly_llvm_major("libLLVM-22-rust-1.97.0-nightly.so"),
            None
        );
        assert_eq!(
            nightly_llvm_major("libLLVM.so.22.1-rust-1.97.0-stable"),
            None
        );
        assert_eq!(nightly_llvm_major("librustc_driver-b5a9.so"), None);
    }

    /// Needs the nightly toolchain (which `setup` installs before the tests run).
    #[test]
    fn links_nightly_llvm_into_a_prefix() {
        let prefix = std::env::temp_dir().join(format!("fp-llvm-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&prefix);
        let major = link_nightly_llvm(&prefix).unwrap();
        assert!(major >= 20);
        // Twice: the second run finds the links in place.
        assert_eq!(link_nightly_llvm(&prefix).unwrap(), major);
        let generic = fs::read_link(prefix.join("lib/libLLVM.so")).unwrap();
        let names: Vec<String> = fs::read_dir(prefix.join("lib"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        let exact = names.iter().find(|n| n.as_str() != "libLLVM.so").unwrap();
        assert_eq!(nightly_llvm_major(exact), Some(major));
        assert_eq!(
            fs::read_link(prefix.join("lib").join(exact)).unwrap(),
            generic
        );
        assert!(generic.is_file() && generic.ends_with(exact));
        fs::remove_dir_all(&prefix).unwrap();
    }
}
