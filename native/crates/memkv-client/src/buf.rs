//! A caller buffer, the unit every transfer names. A leaf: it depends on nothing in the crate,
//! so the connection, the transports and the one-sided sides (RDMA, shared memory) all use it
//! without depending on each other.

/// A caller buffer: raw address and length. Callers guarantee it stays valid (and, for GET,
/// unaliased) until the operation using it returns.
#[derive(Debug, Clone, Copy)]
pub struct Buf {
    pub ptr: usize,
    pub len: usize,
}

impl Buf {
    /// A buffer the client reads from (a PUT's value).
    pub fn of(v: &[u8]) -> Buf {
        Buf {
            ptr: v.as_ptr() as usize,
            len: v.len(),
        }
    }

    /// A buffer the client writes into (a GET's destination).
    pub fn of_mut(v: &mut [u8]) -> Buf {
        Buf {
            ptr: v.as_mut_ptr() as usize,
            len: v.len(),
        }
    }
}
