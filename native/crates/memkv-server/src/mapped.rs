//! Mapped reads (`--shm-share-values`): the values a same-host client reads straight out of the
//! server's memory stay pinned, per connection, until the client says its copy is done
//! (SHM_RELEASE) or the connection ends.
//!
//! A pinned value is neither freed nor reused while pinned: eviction and overwrites unlink it
//! from the index, but its span (and the bytes the client is copying) lives as long as a pin
//! holds it, and it counts against its lane's pinned-bytes bound like a value being sent over
//! TCP. A client that dies mid-copy releases its pins with its connection. The release answers
//! whether the pins were still held, so a client whose connection broke while it copied knows
//! its bytes may have been overwritten, and fails those keys.

use std::collections::HashMap;

use crate::lane::Pinned;

/// Pin sets one connection may hold at once: a client releases each as soon as its copy ends,
/// so this only bounds one that forgets to.
pub const MAX_PIN_SETS: usize = 256;

/// One connection's pinned values, by the pin id its GET_MAPPED reply named.
#[derive(Default)]
pub(crate) struct MappedPins<'a> {
    sets: HashMap<u64, Vec<Pinned<'a>>>,
    next: u64,
}

impl<'a> MappedPins<'a> {
    /// Whether another pin set fits.
    pub fn has_room(&self) -> bool {
        self.sets.len() < MAX_PIN_SETS
    }

    /// Holds `values` until `release` of the returned id (0 when there is nothing to hold).
    pub fn hold(&mut self, values: Vec<Pinned<'a>>) -> u64 {
        if values.is_empty() {
            return 0;
        }
        self.next += 1;
        self.sets.insert(self.next, values);
        self.next
    }

    /// Lets the pins of `id` go; false when no such set was held.
    pub fn release(&mut self, id: u64) -> bool {
        self.sets.remove(&id).is_some()
    }
}
