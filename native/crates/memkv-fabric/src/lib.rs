//! libfabric for memkv's one-sided data path, loaded with dlopen at first use and never linked,
//! so a process that never asks for RDMA (and a host without libfabric) is unaffected.
//!
//! `Fabric` (`fabric`) is one provider's fabric and domain, found and opened by `discovery`;
//! `Mr` (`mr`) a memory registration (of host memory, or of GPU memory where the domain reaches
//! it: `memory::locate` says which a buffer is); `MrCache` the client's bounded cache of them;
//! `Endpoint` (`endpoint`) a reliable-datagram endpoint with its completion queue and address
//! vector, which runs batches of RDMA reads and writes (`Endpoint::run`, their completion as
//! `completion` and `fence` say) and drives the provider's progress for a passive side
//! (`Endpoint::progress`). Every failure is a `FabricError` (`error`).
//!
//! Which provider: `verbs` (InfiniBand/RoCE) and `efa` where the hardware is, `tcp` (and
//! `sockets`) anywhere, which is how the tests run the real path over loopback. Over the rxm
//! layer (`verbs;ofi_rxm`, `tcp;ofi_rxm`) the endpoints get small message buffers, which they do
//! not use (`tuning`).

mod completion;
mod discovery;
mod endpoint;
mod error;
mod fabric;
mod fence;
pub mod memory;
mod mr;
mod sys;
mod tuning;

pub use completion::{write_completion, WriteCompletion};
pub use endpoint::{Endpoint, Rma};
pub use error::FabricError;
pub use fabric::Fabric;
pub use memory::Memory;
pub use mr::{Mr, MrCache};
pub use tuning::Tuning;

use sys::Lib;

/// Whether libfabric can be loaded here, and its version ("1.17") or why not.
pub fn probe() -> std::result::Result<String, String> {
    let l = Lib::get()?;
    Ok(format!("{}.{}", l.version >> 16, l.version & 0xffff))
}

/// What memkv set of libfabric's rxm sizes in this process (docs/rdma.md, "Memory per
/// connection"), or why libfabric cannot be loaded.
pub fn tuning() -> std::result::Result<Tuning, String> {
    Lib::get().map(|l| l.tuning.clone())
}
