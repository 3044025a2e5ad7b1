//! How the packet path balances traffic from other hosts: the backend choice
//! (`--bpf-lb-algorithm`, Maglev's table size and seed) and how a flow reaches a backend
//! on another node (`--bpf-lb-mode`), with Cilium's names and defaults.

use proxy_common::maglev::DEFAULT_TABLE_SIZE;

use crate::model::LbAlgorithm;
pub use crate::model::LbMode;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbConfig {
    /// The default for services without the algorithm annotation.
    pub algorithm: LbAlgorithm,
    pub mode: LbMode,
    /// `M`, one of `proxy_common::maglev::TABLE_SIZES`.
    pub maglev_table_size: u32,
    /// The same on every node, or flows moved between nodes change backend.
    pub maglev_seed: u32,
}

impl Default for LbConfig {
    fn default() -> Self {
        Self {
            algorithm: LbAlgorithm::Random,
            mode: LbMode::Snat,
            maglev_table_size: DEFAULT_TABLE_SIZE,
            maglev_seed: 0,
        }
    }
}
