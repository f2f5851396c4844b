//! `memkv_vllm._native`: the Python face of the Rust client and CLI. It only converts types and
//! releases the GIL around I/O; behaviour lives in memkv-client and memkv-cli.
//!
//! Buffers cross as (address, length) pairs: torch tensors have no buffer protocol and abi3-py310
//! has no PyBuffer, so the Python wrapper extracts addresses and passes the owning objects along;
//! submitted operations keep those owners alive until the I/O threads are done with the memory.

use std::sync::Arc;
use std::time::Duration;

use memkv_client::{Buf, Client, ClientConfig, Op, OpResult, Status};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn bufs(keys: &[Vec<u8>], ptrs: &[usize], sizes: &[usize]) -> PyResult<Vec<Buf>> {
    if keys.len() != ptrs.len() || keys.len() != sizes.len() {
        return Err(PyValueError::new_err(format!(
            "keys, ptrs and sizes differ in length ({}, {}, {})",
            keys.len(),
            ptrs.len(),
            sizes.len()
        )));
    }
    ptrs.iter()
        .zip(sizes)
        .map(|(&ptr, &len)| {
            if ptr == 0 && len > 0 {
                Err(PyValueError::new_err("null buffer address"))
            } else {
                Ok(Buf { ptr, len })
            }
        })
        .collect()
}

fn codes(st: &[Status]) -> Vec<u8> {
    st.iter().map(|s| *s as u8).collect()
}

#[pyclass(frozen, name = "Client", module = "memkv_vllm._native")]
struct PyClient {
    inner: Arc<Client>,
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (servers, auth_key=None, connections_per_server=2, connect_timeout_s=1.0, op_timeout_s=10.0, io_threads=8))]
    fn new(
        servers: Vec<String>,
        auth_key: Option<Vec<u8>>,
        connections_per_server: usize,
        connect_timeout_s: f64,
        op_timeout_s: f64,
        io_threads: usize,
    ) -> PyResult<Self> {
        if !(connect_timeout_s > 0.0 && op_timeout_s > 0.0) {
            return Err(PyValueError::new_err("timeouts must be positive"));
        }
        let inner = Client::new(ClientConfig {
            servers,
            auth_key,
            connections_per_server,
            connect_timeout: Duration::from_secs_f64(connect_timeout_s),
            op_timeout: Duration::from_secs_f64(op_timeout_s),
            io_threads,
        })
        .map_err(PyValueError::new_err)?;
        Ok(PyClient { inner })
    }

    /// Status code per key (0 = found); with lease_ms > 0 found values are leased.
    #[pyo3(signature = (keys, lease_ms=0))]
    fn exists(&self, py: Python<'_>, keys: Vec<Vec<u8>>, lease_ms: u32) -> Vec<(u8, u64)> {
        let c = &self.inner;
        py.detach(|| c.exists(&keys, lease_ms))
            .into_iter()
            .map(|(s, n)| (s as u8, n))
            .collect()
    }

    fn delete(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> Vec<u8> {
        let c = &self.inner;
        codes(&py.detach(|| c.delete(&keys)))
    }

    /// Stores from caller memory. The caller keeps the memory alive for the call (it blocks).
    fn put(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<u8>> {
        self.transfer(py, keys, ptrs, sizes, true)
    }

    /// Reads into caller memory. A buffer is written only when its key's status is 0.
    fn get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<u8>> {
        self.transfer(py, keys, ptrs, sizes, false)
    }

    #[pyo3(signature = (keys, lease_ms=0))]
    fn submit_exists(&self, keys: Vec<Vec<u8>>, lease_ms: u32) -> PyOp {
        PyOp {
            op: self
                .inner
                .submit(move |c| OpResult::StatusLens(c.exists(&keys, lease_ms))),
        }
    }

    /// Like put, on the I/O threads. `owner` is kept alive until the transfer is over, even if
    /// the returned Op is dropped first.
    #[pyo3(signature = (keys, ptrs, sizes, owner=None))]
    fn submit_put(
        &self,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<PyOp> {
        self.submit_transfer(keys, ptrs, sizes, owner, true)
    }

    /// Like get_into, on the I/O threads; `owner` as for submit_put.
    #[pyo3(signature = (keys, ptrs, sizes, owner=None))]
    fn submit_get_into(
        &self,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<PyOp> {
        self.submit_transfer(keys, ptrs, sizes, owner, false)
    }

    /// [(address, seconds or None, error or None)] per server.
    fn ping(&self, py: Python<'_>) -> Vec<(String, Option<f64>, Option<String>)> {
        let c = &self.inner;
        py.detach(|| c.ping())
            .into_iter()
            .map(|(a, r)| match r {
                Ok(d) => (a, Some(d.as_secs_f64()), None),
                Err(e) => (a, None, Some(e)),
            })
            .collect()
    }

    /// [(address, stats JSON or None, error or None)] per server.
    fn stats(&self, py: Python<'_>) -> Vec<(String, Option<String>, Option<String>)> {
        let c = &self.inner;
        py.detach(|| c.stats())
            .into_iter()
            .map(|(a, r)| match r {
                Ok(s) => (a, Some(s), None),
                Err(e) => (a, None, Some(e)),
            })
            .collect()
    }

    /// Index (in the configured list) of the server owning `key`.
    fn server_of(&self, key: &[u8]) -> usize {
        self.inner.server_of(key)
    }
}

impl PyClient {
    /// Blocking put or get with the GIL released.
    fn transfer(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        put: bool,
    ) -> PyResult<Vec<u8>> {
        let b = bufs(&keys, &ptrs, &sizes)?;
        let c = &self.inner;
        // SAFETY: the Python caller holds the owning objects for the duration of this blocking
        // call; the wrapper checked writability for GET.
        Ok(codes(&py.detach(|| unsafe {
            if put {
                c.put(&keys, &b)
            } else {
                c.get(&keys, &b)
            }
        })))
    }

    fn submit_transfer(
        &self,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        owner: Option<Py<PyAny>>,
        put: bool,
    ) -> PyResult<PyOp> {
        let b = bufs(&keys, &ptrs, &sizes)?;
        Ok(PyOp {
            op: self.inner.submit(move |c| {
                // SAFETY: `owner` (moved in here) keeps the memory alive until the transfer is
                // over; the Python wrapper checked writability for GET.
                let st = unsafe {
                    if put {
                        c.put(&keys, &b)
                    } else {
                        c.get(&keys, &b)
                    }
                };
                drop(owner);
                OpResult::Statuses(st)
            }),
        })
    }
}

/// A submitted operation: poll with done(), collect with wait().
#[pyclass(frozen, name = "Op", module = "memkv_vllm._native")]
struct PyOp {
    op: Op,
}

#[pymethods]
impl PyOp {
    fn done(&self) -> bool {
        self.op.done()
    }

    /// Per-key results, or None if not finished within `timeout` seconds (None = no limit).
    /// EXISTS ops give (status, length) pairs, the others status codes.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        let t = timeout.map(|s| Duration::from_secs_f64(s.max(0.0)));
        let op = self.op.clone();
        let r = py.detach(move || op.wait(t));
        Ok(match r {
            None => None,
            Some(OpResult::Statuses(st)) => Some(codes(&st).into_pyobject(py)?.into_any().unbind()),
            Some(OpResult::StatusLens(v)) => {
                let v: Vec<(u8, u64)> = v.into_iter().map(|(s, n)| (s as u8, n)).collect();
                Some(v.into_pyobject(py)?.into_any().unbind())
            }
        })
    }
}

/// Index of the server owning `key` among `servers` (rendezvous hashing).
#[pyfunction]
fn rendezvous(key: &[u8], servers: Vec<String>) -> PyResult<usize> {
    if servers.is_empty() {
        return Err(PyValueError::new_err("no servers"));
    }
    Ok(memkv_client::placement::rendezvous(key, &servers))
}

/// Runs the `memkv` command line (argv[0] is the program name) with the GIL released.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| memkv_cli::run(argv))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyClient>()?;
    m.add_class::<PyOp>()?;
    m.add_function(wrap_pyfunction!(rendezvous, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add("MAX_KEY_LEN", memkv_proto::MAX_KEY_LEN)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
