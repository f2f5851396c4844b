//! `memkv_vllm._native.RdmaTestPeer`, for tests only: a bare libfabric endpoint with registered
//! memory, so a test can speak memkv's protocol by hand over RDMA (hostile descriptors, a
//! client that stops driving its endpoint, one that vanishes mid-transfer) against a real
//! server. It is memkv-fabric's real path, not a model of it; nothing in memkv_vllm uses it.
//! Built only with the `test-peer` feature, which `bash scripts/test.sh` enables and a wheel
//! does not.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use memkv_fabric::{Endpoint, Fabric, Mr};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// An endpoint on `provider`'s `domain` with `size` bytes registered for the server's remote
/// reads and writes, its progress driven by a thread (or, with `progress=False`, by nobody: a
/// client that stopped, whose transfers never complete). `close()` ends it.
#[pyclass(name = "RdmaTestPeer", module = "memkv_vllm._native")]
pub struct RdmaTestPeer {
    peer: Option<Peer>,
}

struct Peer {
    name: Vec<u8>,
    provider: String,
    stop: Arc<AtomicBool>,
    progress: Option<JoinHandle<()>>,
    /// Dropped before `mem`, which the provider writes through raw pointers only.
    mr: Mr,
    mem: Box<[u8]>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.progress.take() {
            let _ = t.join();
        }
    }
}

impl RdmaTestPeer {
    fn open(&self) -> PyResult<&Peer> {
        self.peer
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the peer is closed"))
    }

    /// The address of `[offset, offset + len)` in the registered memory, bounds checked.
    fn span(&self, offset: usize, len: usize) -> PyResult<usize> {
        let p = self.open()?;
        match offset.checked_add(len) {
            Some(end) if end <= p.mem.len() => Ok(p.mem.as_ptr() as usize + offset),
            _ => Err(PyValueError::new_err(format!(
                "[{offset}, +{len}) is outside the {} registered bytes",
                p.mem.len()
            ))),
        }
    }
}

#[pymethods]
impl RdmaTestPeer {
    #[new]
    #[pyo3(signature = (provider, domain, size, progress=true))]
    fn new(provider: &str, domain: &str, size: usize, progress: bool) -> PyResult<Self> {
        let err = |e: memkv_fabric::FabricError| PyValueError::new_err(e.to_string());
        let fab = Fabric::open(Some(provider), &[domain.to_string()]).map_err(err)?;
        let mut ep = Endpoint::open(&fab).map_err(err)?;
        let name = ep.name().map_err(err)?;
        let mem = vec![0u8; size.max(1)].into_boxed_slice();
        // SAFETY: `mem` lives in the Peer, which drops the registration first.
        let mr = unsafe { fab.register(mem.as_ptr() as usize, mem.len(), true) }.map_err(err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let t = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if progress && ep.progress().is_err() {
                    return;
                }
                ep.wait(Duration::from_millis(2));
            }
        });
        Ok(RdmaTestPeer {
            peer: Some(Peer {
                name,
                provider: fab.hello_name.clone(),
                stop,
                progress: Some(t),
                mr,
                mem,
            }),
        })
    }

    /// The endpoint's address, as RDMA_HELLO carries it.
    fn address<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.open()?.name))
    }

    /// The provider's name as RDMA_HELLO carries it (`tcp;ofi_rxm with 256-byte rxm buffers`).
    fn provider(&self) -> PyResult<String> {
        Ok(self.open()?.provider.clone())
    }

    /// `(addr, rkey)` naming the registered byte at `offset` in a descriptor. The offset is
    /// not checked against the registration: hostile descriptors are what this is for.
    fn descriptor(&self, offset: u64) -> PyResult<(u64, u64)> {
        let p = self.open()?;
        let ptr = (p.mem.as_ptr() as u64)
            .checked_add(offset)
            .ok_or_else(|| PyValueError::new_err("offset overflows the address space"))?;
        Ok((p.mr.remote_addr(ptr as usize), p.mr.key))
    }

    /// A copy of `len` registered bytes at `offset`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        len: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let at = self.span(offset, len)?;
        let mut out = vec![0u8; len];
        // SAFETY: `[at, at + len)` is inside the registered memory, alive while `self` is.
        unsafe { std::ptr::copy_nonoverlapping(at as *const u8, out.as_mut_ptr(), len) };
        Ok(PyBytes::new(py, &out))
    }

    /// Writes `data` into the registered memory at `offset`.
    fn write(&self, offset: usize, data: &[u8]) -> PyResult<()> {
        let at = self.span(offset, data.len())?;
        // SAFETY: as in `read`; the caller does not write while a transfer runs.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at as *mut u8, data.len()) };
        Ok(())
    }

    /// Stops the progress thread and closes the endpoint and the registration (a client that
    /// vanished): the server's later operations on them fail.
    fn close(&mut self) {
        self.peer = None;
    }
}
