//! `cargo xtask image`: fastpath's container image, built on this machine from Debian's
//! packages and the project's files; no registry is reached.
//!
//! 1. A root file system made by debootstrap (minbase, plus iptables, nftables, conntrack,
//!    iproute2 and kmod, the tools the fallback modes call), cached under `target/image/`
//!    (rebuilt when the package list changes), so only the first run downloads packages
//!    (about 45 s here).
//! 2. Imported once as [`BASE`].
//! 3. `deploy/Containerfile` on top: the binaries and the seccomp profile, staged in a
//!    build context under `target/image/context`.
//!
//! [`Podman`] finds a way to run containers here, or says why there is none: on a host with
//! hybrid cgroups crun refuses ("cgroups in hybrid mode not supported") and runc works, and
//! podman's default ulimits may exceed what an unprivileged-limits host allows.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::cmd;

/// The image the DaemonSet names.
pub const IMAGE: &str = "localhost/fastpath:0.1.0";
/// The debootstrapped base.
pub const BASE: &str = "localhost/fastpath-base:bookworm";
const SUITE: &str = "bookworm";
const MIRROR: &str = "http://deb.debian.org/debian";
/// iproute2: the iptables and nftables modes read the node's addresses with `ip -j addr`
/// (node ports on the primary addresses) and remove kube-proxy's IPVS device with `ip link`.
const PACKAGES: &str = "iptables,nftables,conntrack,iproute2,kmod,ca-certificates";

/// How to run podman on this machine.
#[derive(Clone, Debug)]
pub struct Podman {
    /// Global flags (e.g. `--runtime runc`).
    pub global: Vec<String>,
    /// `podman run` flags every container here needs (ulimits the host allows).
    pub run: Vec<String>,
}

fn rlimit(resource: libc::__rlimit_resource_t) -> u64 {
    // SAFETY: rlimit is two integers; all zeros is a valid value.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `r` is a live, writable rlimit (left zero if the call fails).
    unsafe { libc::getrlimit(resource, &mut r) };
    r.rlim_max
}

impl Podman {
    /// A podman that runs a container of [`BASE`] (build it first), or why not.
    pub fn find() -> Result<Self> {
        if cmd::which("podman").is_none() {
            bail!("podman is not installed (apt-get install podman buildah debootstrap runc)");
        }
        let run = vec![
            // podman's defaults (nofile 1048576, nproc) may be above what this host lets a
            // container set (here nproc 65536 is refused, 32768 accepted); fastpath needs
            // far fewer than either.
            format!(
                "--ulimit=nofile={0}:{0}",
                rlimit(libc::RLIMIT_NOFILE).min(1 << 16)
            ),
            format!(
                "--ulimit=nproc={0}:{0}",
                rlimit(libc::RLIMIT_NPROC).min(4096)
            ),
        ];
        let mut errors = Vec::new();
        for runtime in [None, Some("runc")] {
            let global: Vec<String> = runtime
                .map(|r| vec![format!("--runtime={r}")])
                .unwrap_or_default();
            let mut smoke = Command::new("podman");
            smoke
                .args(&global)
                .args(["run", "--rm", "--pull=never", "--network=none"]);
            smoke.args(&run).args([BASE, "true"]);
            match cmd::output(&mut smoke) {
                Ok(_) => return Ok(Self { global, run }),
                Err(e) => errors.push(format!("{}: {e:#}", runtime.unwrap_or("default runtime"))),
            }
        }
        bail!("podman cannot run a container here: {}", errors.join("; "))
    }

    pub fn command(&self) -> Command {
        let mut c = Command::new("podman");
        c.args(&self.global);
        c
    }
}

fn image_exists(name: &str) -> bool {
    cmd::succeeds(Command::new("podman").args(["image", "exists", name]))
}

/// The debootstrapped root file system, made once under `target/image/` and imported as
/// [`BASE`] once.
pub fn build_base(target: &Path) -> Result<()> {
    let dir = target.join("image");
    let rootfs = dir.join(format!("rootfs-{SUITE}"));
    let stamp = dir.join(format!("rootfs-{SUITE}.done"));
    // The stamp holds the package list the root file system was made with.
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(PACKAGES) {
        if cmd::which("debootstrap").is_none() {
            bail!("debootstrap is not installed (apt-get install debootstrap)");
        }
        let _ = std::fs::remove_dir_all(&rootfs);
        std::fs::create_dir_all(&dir)?;
        println!(
            "image: debootstrap {SUITE} (minbase + {PACKAGES}) into {}",
            rootfs.display()
        );
        cmd::run(
            Command::new("debootstrap")
                .arg("--variant=minbase")
                .arg(format!("--include={PACKAGES}"))
                .args([SUITE, rootfs.to_str().context("rootfs path")?, MIRROR]),
        )
        .context("debootstrap (needs Debian's mirror)")?;
        // What an image never uses: package caches, documentation.
        for junk in [
            "var/cache/apt/archives",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
        ] {
            let p = rootfs.join(junk);
            let _ = std::fs::remove_dir_all(&p);
            let _ = std::fs::create_dir_all(&p);
        }
        std::fs::write(&stamp, PACKAGES)?;
        let _ = Command::new("podman").args(["rmi", "-f", BASE]).output();
    }
    if !image_exists(BASE) {
        println!("image: importing {} as {BASE}", rootfs.display());
        let tar = dir.join(format!("rootfs-{SUITE}.tar"));
        cmd::run(
            Command::new("tar")
                .arg("-C")
                .arg(&rootfs)
                .arg("-cf")
                .arg(&tar)
                .arg("."),
        )?;
        let imported = cmd::run(Command::new("podman").arg("import").arg(&tar).arg(BASE));
        let _ = std::fs::remove_file(&tar);
        imported?;
    }
    Ok(())
}

/// `deploy/Containerfile` over [`BASE`] with the `fastpath` and `fastpath-probe` found in
/// `bin_dir`, tagged `tag`.
pub fn build_image(target: &Path, bin_dir: &Path, tag: &str) -> Result<()> {
    let context = target
        .join("image")
        .join(format!("context-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&context);
    std::fs::create_dir_all(&context)?;
    let staged = (|| -> Result<()> {
        for bin in ["fastpath", "fastpath-probe"] {
            std::fs::copy(bin_dir.join(bin), context.join(bin))
                .with_context(|| format!("{}", bin_dir.join(bin).display()))?;
        }
        let deploy = crate::workspace_root().join("deploy");
        std::fs::copy(
            deploy.join("seccomp/fastpath.json"),
            context.join("seccomp.json"),
        )?;
        cmd::run(
            Command::new("podman")
                .args([
                    "build",
                    "--pull=never",
                    "--build-arg",
                    &format!("BASE={BASE}"),
                    "-t",
                    tag,
                    "-f",
                ])
                .arg(deploy.join("Containerfile"))
                .arg(&context),
        )
    })();
    let _ = std::fs::remove_dir_all(&context);
    staged
}

/// `cargo xtask image`: release build, base (cached), image [`IMAGE`].
pub fn image() -> Result<()> {
    crate::setup::setup()?;
    let mut build = crate::cargo();
    build.args([
        "build",
        "--release",
        "-p",
        "proxy-userland",
        "--bin",
        "fastpath",
        "--bin",
        "fastpath-probe",
    ]);
    println!("image: running `{}`", cmd::describe(&build));
    cmd::run(&mut build)?;
    let target = crate::target_dir();
    build_base(&target)?;
    build_image(&target, &target.join("release"), IMAGE)?;
    println!("image: built {IMAGE}");
    Ok(())
}

/// Where the test binaries' image context comes from: the folder of a binary cargo built.
pub fn bin_dir(bin: &str) -> PathBuf {
    Path::new(bin)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}
