//! How a completed RDMA write proves its bytes are in the target's memory, per provider.

/// How the server knows a GET's bytes are in the client's memory before it replies (on the TCP
/// connection, which may overtake the fabric): docs/rdma.md, "Completion semantics".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteCompletion {
    /// The provider completes a write only once its bytes are in the target's memory
    /// (`FI_DELIVERY_COMPLETE`, asked for and honoured).
    Delivery,
    /// A completed write was acknowledged by the target's NIC, which does not prove its bytes
    /// reached memory; a read of the written memory, ordered after the write
    /// (`FI_ORDER_RAW`) and issued once it completed, is answered only from memory that holds
    /// them. `Endpoint::run` ends every written group with such a one-byte read.
    ReadFence,
}

impl WriteCompletion {
    /// How `memkv net selftest` and the logs say it.
    pub fn describe(self) -> &'static str {
        match self {
            WriteCompletion::Delivery => "delivery-complete writes",
            WriteCompletion::ReadFence => "writes fenced by a read",
        }
    }
}

/// Core providers that accept `FI_DELIVERY_COMPLETE` without honouring it for RDMA writes:
/// `ofi_rxm` advertises it and passes it down to verbs, whose write still completes on the
/// responder's acknowledgement (libfabric 1.17 to 2.x).
const DELIVERY_NOT_HONOURED: [&str; 1] = ["verbs"];

/// The write completion a provider (`tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`) gives, from what
/// fi_getinfo accepted for it: delivery-complete writes (`delivery`) and read-after-write
/// ordering (`read_after_write`). None: neither guarantee, so the provider cannot serve GETs.
pub fn write_completion(
    provider: &str,
    delivery: bool,
    read_after_write: bool,
) -> Option<WriteCompletion> {
    let core = provider.split(';').next().unwrap_or(provider);
    if delivery && !DELIVERY_NOT_HONOURED.contains(&core) {
        Some(WriteCompletion::Delivery)
    } else if read_after_write {
        Some(WriteCompletion::ReadFence)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_fenced_where_delivery_completion_is_missing_or_hollow() {
        use WriteCompletion::{Delivery, ReadFence};
        // Providers other than verbs are taken at their word (tcp and efa, read in their
        // sources, deliver before they complete).
        for p in ["tcp;ofi_rxm", "sockets", "shm", "efa"] {
            assert_eq!(write_completion(p, true, true), Some(Delivery), "{p}");
            assert_eq!(write_completion(p, true, false), Some(Delivery), "{p}");
        }
        // rxm accepts it over verbs, whose writes still complete on the acknowledgement.
        assert_eq!(
            write_completion("verbs;ofi_rxm", true, true),
            Some(ReadFence)
        );
        assert_eq!(
            write_completion("verbs;ofi_rxd", true, true),
            Some(ReadFence)
        );
        assert_eq!(write_completion("verbs;ofi_rxm", true, false), None);
        // A provider without it: the fence where reads are ordered after writes, else nothing.
        assert_eq!(write_completion("efa", false, true), Some(ReadFence));
        assert_eq!(write_completion("efa", false, false), None);
    }
}
