//! Mapped reads (`--shm-share-values`): the values a same-host client reads straight out of the
//! server's memory stay pinned, per connection, until the client says its copy is done
//! (SHM_RELEASE) or the connection ends.
//!
//! A pinned value is neither freed nor reused while pinned: eviction and overwrites unlink it
//! from the index, but its span (and the bytes the client is copying) lives as long as a pin
//! holds it, and it counts against its lane's pinned-bytes bound like a value being sent over
//! TCP. A client that dies mid-copy releases its pins with its connection. The release answers
//! whether the pins were still held and the values matched their checksums (verified while the
//! client copied), so a client whose connection broke while it copied knows its bytes may have
//! been overwritten, and fails those keys, as it fails those of a corrupt value.

use std::collections::HashMap;
use std::sync::Arc;

use crate::lane::Pinned;
use crate::shm_copy::Verdict;

/// Pin sets one connection may hold at once: a client releases each as soon as its copy ends,
/// so this only bounds one that forgets to.
pub const MAX_PIN_SETS: usize = 256;

/// The values one GET_MAPPED pinned, their keys, and their checksums' verdict (computed
/// while the client copies; the release answers it).
pub(crate) struct PinSet<'a> {
    pub keys: Vec<Vec<u8>>,
    pub values: Vec<Pinned<'a>>,
    pub verdict: Arc<Verdict>,
}

/// One connection's pinned values, by the pin id its GET_MAPPED reply named.
#[derive(Default)]
pub(crate) struct MappedPins<'a> {
    sets: HashMap<u64, PinSet<'a>>,
    next: u64,
}

impl<'a> MappedPins<'a> {
    /// Whether another pin set fits.
    pub fn has_room(&self) -> bool {
        self.sets.len() < MAX_PIN_SETS
    }

    /// Holds `set` until `release` of the returned id (0 when there is nothing to hold).
    pub fn hold(&mut self, set: PinSet<'a>) -> u64 {
        if set.values.is_empty() {
            return 0;
        }
        self.next += 1;
        self.sets.insert(self.next, set);
        self.next
    }

    /// The set of `id`, taken out: its pins go when it drops. None when no such set was held.
    pub fn release(&mut self, id: u64) -> Option<PinSet<'a>> {
        self.sets.remove(&id)
    }
}
