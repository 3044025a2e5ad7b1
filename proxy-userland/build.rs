//! Builds `proxy-ebpf` for the BPF target with the nightly toolchain and bpf-linker, and
//! leaves the object in OUT_DIR for `include_bytes_aligned!`, as the aya template does.
use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("MetadataCommand::exec")?;
    let ebpf = packages
        .into_iter()
        .find(|p| p.name.as_str() == "proxy-ebpf")
        .ok_or_else(|| anyhow!("proxy-ebpf package not found"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent"))?;
    aya_build::build_ebpf(
        [Package {
            name: "proxy-ebpf",
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        Toolchain::default(),
    )
    .context("building the eBPF programs failed; has `cargo xtask setup` run?")
}
