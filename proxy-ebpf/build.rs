//! Rebuild the programs when bpf-linker changes (e.g. after `cargo xtask setup` re-links it
//! against a new nightly's LLVM), as the aya template does.
fn main() {
    match which::which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(e) => println!("cargo:warning=bpf-linker not found ({e}); run `cargo xtask setup`"),
    }
}
