//! A frontend's Maglev table, kept in step with its backends (see `bpf::maglev`).

use proxy_common::BackendId;

use super::{ProgramError, Programmer};
use crate::dataplane::{
    bpf::maglev,
    frontends::{BackendAddr, Frontend, frontend_name},
};

impl Programmer {
    /// Writes frontend `rev`'s table for `backends`, whose ids are `ids` (in the same
    /// order). With no backend the table goes: the master's count of 0 drops new flows.
    pub(super) fn write_maglev(
        &mut self,
        fe: &Frontend,
        rev: u16,
        backends: &[BackendAddr],
        ids: &[BackendId],
    ) -> Result<(), ProgramError> {
        let map_err = |source| ProgramError::Map {
            what: "the Maglev table",
            frontend: frontend_name(fe),
            source,
        };
        if backends.is_empty() {
            self.maps.del_maglev(rev).map_err(map_err)?;
        } else {
            let table = maglev::table(backends, self.lb.maglev_table_size, self.lb.maglev_seed);
            let entries: Vec<BackendId> = table.iter().map(|&i| ids[i as usize]).collect();
            self.maps.put_maglev(rev, &entries).map_err(map_err)?;
        }
        self.maglev_written.insert(rev);
        Ok(())
    }

    /// Puts back the table frontend `rev` had before a failed write: its old backends'
    /// (still held, so their ids are valid), or none.
    pub(super) fn restore_maglev(&mut self, fe: &Frontend, rev: u16, old: Option<&[BackendId]>) {
        let restored = match old {
            Some(ids) => {
                let backends = self.addrs_of(ids);
                self.write_maglev(fe, rev, &backends, ids)
            }
            None => self.drop_maglev(fe, rev),
        };
        if let Err(e) = restored {
            tracing::error!(frontend = %fe, "restoring the Maglev table failed: {e}");
        }
    }

    /// Removes frontend `rev`'s table, if it has one.
    pub(super) fn drop_maglev(&mut self, fe: &Frontend, rev: u16) -> Result<(), ProgramError> {
        self.maglev_written.remove(&rev);
        self.maps
            .del_maglev(rev)
            .map_err(|source| ProgramError::Map {
                what: "removing the Maglev table",
                frontend: frontend_name(fe),
                source,
            })
    }
}
