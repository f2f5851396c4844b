//! The keys of a batch call, taken from Python into one buffer.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The keys of one batch, copied out of any iterable of `bytes` (or of other objects PyO3 turns
/// into bytes: `bytearray`, sequences of ints) into one buffer: one allocation per batch instead
/// of the one per key that `Vec<Vec<u8>>` makes, which for a batched existence check of short
/// keys cost about as much as the server's lookups.
pub struct Keys {
    bytes: Vec<u8>,
    /// Where key i ends in `bytes`; it starts where key i - 1 ends.
    ends: Vec<usize>,
}

impl Keys {
    /// Each key as a slice of the buffer, in order.
    pub fn slices(&self) -> Vec<&[u8]> {
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let k = &self.bytes[start..end];
                start = end;
                k
            })
            .collect()
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Keys {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Keys> {
        let n = obj.len().unwrap_or(0);
        // Room for keys of up to 32 bytes; longer ones grow the buffer.
        let mut keys = Keys {
            bytes: Vec::with_capacity(n * 32),
            ends: Vec::with_capacity(n),
        };
        for item in obj.try_iter()? {
            let item = item?;
            match item.cast::<PyBytes>() {
                Ok(b) => keys.bytes.extend_from_slice(b.as_bytes()),
                Err(_) => keys.bytes.extend(item.extract::<Vec<u8>>()?),
            }
            keys.ends.push(keys.bytes.len());
        }
        Ok(keys)
    }
}
