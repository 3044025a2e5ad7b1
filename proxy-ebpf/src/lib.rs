//! Empty: lets the host build see this crate as a dependency, as in the aya template.
#![no_std]
