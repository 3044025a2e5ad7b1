//! Loading the embedded object and attaching its programs.

use std::{fs::File, path::Path};

use aya::{
    Ebpf, EbpfError,
    programs::{CgroupAttachMode, CgroupSockAddr, ProgramError},
};

/// The socket programs, v4 and v6, by their function names in `proxy-ebpf`.
pub const SOCK_PROGRAMS: [&str; 8] = [
    "fp_connect4",
    "fp_sendmsg4",
    "fp_recvmsg4",
    "fp_getpeer4",
    "fp_connect6",
    "fp_sendmsg6",
    "fp_recvmsg6",
    "fp_getpeer6",
];

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot open cgroup {path}: {source} (is cgroup v2 mounted there?)")]
    Cgroup { path: String, source: std::io::Error },
    #[error("loading the eBPF object failed: {0}")]
    Object(#[from] EbpfError),
    #[error("program {name} is missing from the eBPF object")]
    MissingProgram { name: &'static str },
    #[error("program {name} is not a cgroup sock_addr program")]
    WrongType { name: &'static str },
    #[error("the kernel refused program {name}: {source}")]
    Program { name: &'static str, source: ProgramError },
    #[error("map {name} is missing from the eBPF object")]
    MissingMap { name: &'static str },
    #[error("map {name} has an unexpected type: {source}")]
    Map { name: &'static str, source: aya::maps::MapError },
}

/// The loaded object with its programs attached. Dropping it detaches them (aya attaches
/// through BPF links, which go when their fd closes) and frees the maps.
pub struct Attached {
    ebpf: Ebpf,
}

impl Attached {
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}

/// The object built by `build.rs` from `proxy-ebpf`.
pub fn object() -> &'static [u8] {
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"))
}

pub fn load_and_attach(cgroup: &Path) -> Result<Attached, LoadError> {
    let cgroup_file = File::open(cgroup)
        .map_err(|source| LoadError::Cgroup { path: cgroup.display().to_string(), source })?;
    let mut ebpf = Ebpf::load(object())?;
    for name in SOCK_PROGRAMS {
        let program: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .ok_or(LoadError::MissingProgram { name })?
            .try_into()
            .map_err(|_| LoadError::WrongType { name })?;
        program.load().map_err(|source| LoadError::Program { name, source })?;
        // Through a BPF link (kernel >= 5.7) the kernel wants flags 0 and always allows other
        // programs beside ours; `Single` is what passes 0.
        program
            .attach(&cgroup_file, CgroupAttachMode::Single)
            .map_err(|source| LoadError::Program { name, source })?;
    }
    Ok(Attached { ebpf })
}
