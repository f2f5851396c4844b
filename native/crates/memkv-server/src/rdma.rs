//! The server's side of the RDMA data path (`--rdma`): one libfabric domain with every lane's
//! memory registered once at start, and per connection an endpoint that reads (PUT) and writes
//! (GET) the client's registered memory named by the descriptors of a request (`cmd::rdma_transfer`).
//!
//! The TCP connection stays the control path: handshake, auth, key tables, per-key statuses and
//! all limits are the same as without RDMA; only the values move by one-sided operations.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use memkv_fabric::{Endpoint, Fabric, Mr};

use crate::store::Store;

/// Which fabric to serve RDMA on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// libfabric provider (`verbs`, `efa`, `tcp`, ...); None: the first libfabric offers.
    pub provider: Option<String>,
    /// Domains (NICs; for tcp, interfaces) allowed; empty: any.
    pub domains: Vec<String>,
    /// Connections that may hold an RDMA endpoint at once; RDMA_HELLO beyond it is refused
    /// (the connection carries its values over TCP, or fails for a client that insists).
    pub max_endpoints: usize,
}

/// Default of `RdmaConfig::max_endpoints`. Every endpoint costs the provider's own buffers,
/// outside `--memory` and the buffer budget: about 2.5 MiB each with libfabric 1.17's
/// `tcp;ofi_rxm` and memkv's rxm sizes (memkv-fabric's `tuning`; 85 MiB with rxm's defaults),
/// so the default bound holds them to about 640 MiB.
pub const DEFAULT_MAX_ENDPOINTS: usize = 256;

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            provider: None,
            domains: Vec::new(),
            max_endpoints: DEFAULT_MAX_ENDPOINTS,
        }
    }
}

/// The domain and the lanes' registrations, shared by every connection.
pub struct ServerFabric {
    pub fab: Arc<Fabric>,
    regions: Vec<Mr>,
    /// Endpoints open now, and their bound.
    endpoints: Arc<AtomicUsize>,
    max_endpoints: usize,
    /// Keeps the registered memory mapped until the registrations (dropped first) are closed.
    _store: Arc<Store>,
}

impl ServerFabric {
    /// Opens the fabric and registers all of the store's memory for local reads and writes.
    pub fn open(cfg: &RdmaConfig, store: &Arc<Store>) -> io::Result<ServerFabric> {
        let fail = |e: memkv_fabric::FabricError| {
            io::Error::other(format!(
                "--rdma: cannot open libfabric (provider {}, domains {:?}): {e}",
                cfg.provider.as_deref().unwrap_or("any"),
                cfg.domains
            ))
        };
        let fab = Fabric::open(cfg.provider.as_deref(), &cfg.domains).map_err(fail)?;
        let regions = store
            .memory_ranges()
            .into_iter()
            .filter(|(_, len)| *len > 0)
            // SAFETY: the store's memory is mapped for as long as the store lives, and this
            // holds the store until the registrations are closed.
            .map(|(ptr, len)| unsafe { fab.register(ptr, len, false) })
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?;
        let rxm = memkv_fabric::tuning().map_or_else(|e| e, |t| t.to_string());
        tracing::info!(provider = %fab.provider, domain = %fab.domain_name,
            completion = fab.write_completion.describe(), rxm = %rxm,
            "RDMA data path on (one-sided reads and writes of client memory)");
        Ok(ServerFabric {
            fab,
            regions,
            endpoints: Arc::new(AtomicUsize::new(0)),
            max_endpoints: cfg.max_endpoints,
            _store: store.clone(),
        })
    }

    /// A slot for one more endpoint, held until the guard drops; None at the bound.
    pub(crate) fn endpoint_slot(&self) -> Option<EndpointSlot> {
        self.endpoints
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_endpoints).then_some(n + 1)
            })
            .ok()
            .map(|_| EndpointSlot(self.endpoints.clone()))
    }

    pub(crate) fn max_endpoints(&self) -> usize {
        self.max_endpoints
    }

    /// The local descriptor of store memory `[ptr, ptr + len)`.
    pub fn desc(&self, ptr: usize, len: usize) -> Option<usize> {
        self.regions
            .iter()
            .find(|m| m.covers(ptr, len))
            .map(Mr::desc)
    }
}

/// One of `RdmaConfig::max_endpoints`, given back on drop.
pub(crate) struct EndpointSlot(Arc<AtomicUsize>);

impl Drop for EndpointSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection's endpoint and its client's address in it.
pub(crate) struct RdmaPeer {
    pub ep: Endpoint,
    pub peer: u64,
    /// Dropped after the endpoint closed.
    pub _slot: EndpointSlot,
}
