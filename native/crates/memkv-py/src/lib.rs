//! `memkv_vllm._native`: the Python face of the Rust client and of memkv-topo's answers for one
//! GPU. It only converts types and releases the GIL around I/O; behaviour lives in memkv-client
//! and memkv-topo. It also carries the `memkv` command line (memkv-cli's `run`), because the
//! wheel's `memkv` console script has no other compiled code to run (see Cargo.toml).
//!
//! Buffers cross as (address, length) pairs: torch tensors have no buffer protocol and abi3-py310
//! has no PyBuffer, so the Python wrapper extracts addresses and passes the owning objects along;
//! submitted operations keep those owners alive until the I/O threads are done with the memory.
//!
//! Per-key outcomes cross as ONE `bytes` of status codes per batch (byte i: key i's status
//! number), never as a Python object per key: a batched check of thousands of keys then costs
//! what the I/O costs. The Python wrapper makes enums only for callers that ask for them.
//!
//! No Rust panic crosses into Python: every entry point runs under `catch_unwind` and turns a
//! panic (a bug) into a `RuntimeError` with a clear message instead of pyo3's `PanicException`.

mod keys;
#[cfg(feature = "test-peer")]
mod testing;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use memkv_client::{exec::panic_message, Buf, Client, ClientConfig, Op, OpResult, Status};
use memkv_client::{placement, TransportChoice};
use memkv_client::{CompletionQueue, Lane};
use memkv_tls::ClientTlsFiles;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use keys::Keys;

/// Runs `f`, turning a panic into a Python RuntimeError.
fn no_panic<T>(f: impl FnOnce() -> T) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| internal_error(&panic_message(&*p)))
}

fn internal_error(msg: &str) -> PyErr {
    PyRuntimeError::new_err(format!(
        "memkv internal error (a bug; please report it): {msg}"
    ))
}

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

/// Per server: (address, answer or None, error or None).
type PerServer<T> = Vec<(String, Option<T>, Option<String>)>;
/// Per server: (address, up, last failure's status code, its reason, seconds since it).
type HealthRows = Vec<(String, bool, Option<u8>, Option<String>, Option<f64>)>;

/// The client's per-server results as Python rows, each answer converted by `f`.
fn per_server<T, U>(rows: memkv_client::PerServer<T>, f: impl Fn(T) -> U) -> PerServer<U> {
    rows.into_iter()
        .map(|(a, r)| match r {
            Ok(v) => (a, Some(f(v)), None),
            Err(e) => (a, None, Some(e)),
        })
        .collect()
}

/// One status code per key, as Python `bytes`.
fn codes<'py>(py: Python<'py>, st: &[Status]) -> Bound<'py, PyBytes> {
    let v: Vec<u8> = st.iter().map(|s| *s as u8).collect();
    PyBytes::new(py, &v)
}

/// The status codes of an EXISTS answer, as Python `bytes`.
fn exists_codes<'py>(py: Python<'py>, v: &[(Status, u64)]) -> Bound<'py, PyBytes> {
    let st: Vec<u8> = v.iter().map(|(s, _)| *s as u8).collect();
    PyBytes::new(py, &st)
}

/// (status codes as `bytes`, stored lengths) of an EXISTS answer.
fn codes_lens<'py>(py: Python<'py>, v: &[(Status, u64)]) -> (Bound<'py, PyBytes>, Vec<u64>) {
    (exists_codes(py, v), v.iter().map(|(_, n)| *n).collect())
}

/// A finite, non-negative number of seconds as a Duration: ValueError otherwise (including
/// values too large for a Duration), never a panic.
/// A mapped read's statuses, addresses and ticket.
type MappedRead<'py> = (Bound<'py, PyBytes>, Vec<usize>, u64);

fn mapped_codes<'py>(py: Python<'py>, v: &[(Status, usize)]) -> Bound<'py, PyBytes> {
    let b: Vec<u8> = v.iter().map(|(s, _)| *s as u8).collect();
    PyBytes::new(py, &b)
}

fn mapped_read<'py>(py: Python<'py>, v: &[(Status, usize)], ticket: u64) -> MappedRead<'py> {
    (
        mapped_codes(py, v),
        v.iter().map(|(_, a)| *a).collect(),
        ticket,
    )
}

/// The Python side of a `MapHook`: `register(ptr, nbytes)` when a server's memory is mapped
/// (raising keeps it unused), `unregister(ptr, nbytes)` before it is unmapped.
struct PyMapHook {
    register: Py<PyAny>,
    unregister: Py<PyAny>,
}

impl memkv_client::mapped::MapHook for PyMapHook {
    fn mapped(&self, ptr: usize, len: usize) -> Result<(), String> {
        Python::try_attach(|py| {
            self.register
                .call1(py, (ptr, len))
                .map(drop)
                .map_err(|e| e.to_string())
        })
        .unwrap_or_else(|| Err("the Python interpreter is shutting down".into()))
    }

    /// At interpreter shutdown nothing can be called: the registration goes with the process.
    fn unmapping(&self, ptr: usize, len: usize) {
        Python::try_attach(|py| {
            if let Err(e) = self.unregister.call1(py, (ptr, len)) {
                tracing::warn!(error = %e, "memkv: unregistering a server mapping failed");
            }
        });
    }
}

fn seconds(s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|e| PyValueError::new_err(format!("{s} is not a usable number of seconds: {e}")))
}

fn transport_choice(name: &str) -> PyResult<TransportChoice> {
    Ok(match name {
        "tcp" => TransportChoice::Tcp,
        "rdma" => TransportChoice::Rdma,
        "auto" => TransportChoice::Auto,
        "shm" => TransportChoice::Shm,
        other => {
            return Err(PyValueError::new_err(format!(
                "transport must be tcp, rdma, auto or shm, got {other:?}"
            )))
        }
    })
}

/// The client's TLS files: None without a CA; the rest needs one.
fn tls_files(
    ca: Option<PathBuf>,
    server_name: Option<String>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> PyResult<Option<ClientTlsFiles>> {
    match ca {
        Some(ca) => Ok(Some(ClientTlsFiles {
            ca,
            server_name,
            cert,
            key,
        })),
        None if server_name.is_none() && cert.is_none() && key.is_none() => Ok(None),
        None => Err(PyValueError::new_err(
            "tls_server_name, tls_cert and tls_key need tls_ca",
        )),
    }
}

#[pyclass(frozen, name = "Client", module = "memkv_vllm._native")]
struct PyClient {
    inner: Arc<Client>,
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (servers, auth_key=None, connections_per_server=2, connect_timeout_s=1.0, op_timeout_s=10.0, io_threads=8, transport="tcp", rdma_devices=Vec::new(), gpu_memory=false, *, tls_ca=None, tls_server_name=None, tls_cert=None, tls_key=None, tls_allow_rdma=false))]
    #[expect(
        clippy::too_many_arguments,
        reason = "Python's keyword arguments of memkv_vllm._native.Client(...)"
    )]
    fn new(
        servers: Vec<String>,
        auth_key: Option<Vec<u8>>,
        connections_per_server: usize,
        connect_timeout_s: f64,
        op_timeout_s: f64,
        io_threads: usize,
        transport: &str,
        rdma_devices: Vec<String>,
        gpu_memory: bool,
        tls_ca: Option<PathBuf>,
        tls_server_name: Option<String>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        tls_allow_rdma: bool,
    ) -> PyResult<Self> {
        let ok = |t: f64| t > 0.0 && t.is_finite();
        if !(ok(connect_timeout_s) && ok(op_timeout_s)) {
            return Err(PyValueError::new_err(
                "timeouts must be positive and finite",
            ));
        }
        let cfg = ClientConfig {
            servers,
            auth_key,
            connections_per_server,
            connect_timeout: seconds(connect_timeout_s)?,
            op_timeout: seconds(op_timeout_s)?,
            io_threads,
            transport: transport_choice(transport)?,
            rdma_devices,
            // The provider comes from MEMKV_RDMA_PROVIDER (else libfabric's first).
            rdma_provider: None,
            gpu_memory,
            tls: tls_files(tls_ca, tls_server_name, tls_cert, tls_key)?,
            tls_allow_rdma,
        };
        let inner = no_panic(|| Client::new(cfg))?.map_err(PyValueError::new_err)?;
        Ok(PyClient { inner })
    }

    /// Status codes (`bytes`, one per key); with lease_ms > 0 found values are leased.
    #[pyo3(signature = (keys, lease_ms=0))]
    fn exists<'py>(
        &self,
        py: Python<'py>,
        keys: Keys,
        lease_ms: u32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let c = &self.inner;
        let v = py.detach(|| no_panic(|| c.exists(&keys.slices(), lease_ms)))?;
        Ok(exists_codes(py, &v))
    }

    /// (status codes as `bytes`, stored length per key); leases as for exists.
    #[pyo3(signature = (keys, lease_ms=0))]
    fn exists_lengths<'py>(
        &self,
        py: Python<'py>,
        keys: Keys,
        lease_ms: u32,
    ) -> PyResult<(Bound<'py, PyBytes>, Vec<u64>)> {
        let c = &self.inner;
        let v = py.detach(|| no_panic(|| c.exists(&keys.slices(), lease_ms)))?;
        Ok(codes_lens(py, &v))
    }

    fn delete<'py>(&self, py: Python<'py>, keys: Keys) -> PyResult<Bound<'py, PyBytes>> {
        let c = &self.inner;
        Ok(codes(
            py,
            &py.detach(|| no_panic(|| c.delete(&keys.slices())))?,
        ))
    }

    /// Stores from raw addresses. Unsafe in Rust's sense: the caller guarantees every
    /// (address, size) is readable memory that stays valid until this blocking call returns.
    fn put<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.transfer(py, keys, ptrs, sizes, true)
    }

    /// Reads into raw addresses. Unsafe in Rust's sense: the caller guarantees every
    /// (address, size) is writable memory, distinct from the others, that nobody else touches
    /// until this blocking call returns. A buffer is written only when its key's status is 0,
    /// except that a transfer failing part-way may leave part of that key's value in it.
    fn get_into<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.transfer(py, keys, ptrs, sizes, false)
    }

    /// Like exists, on the I/O threads. Every submit_* takes an optional `queue` and `tag`: the
    /// tag is pushed onto the queue once the Op is complete. Its deadline (op_timeout_s) counts
    /// from submission. Lookups and loads start before stores and deletes waiting for a thread.
    #[pyo3(signature = (keys, lease_ms=0, queue=None, tag=0))]
    fn submit_exists(
        &self,
        keys: Keys,
        lease_ms: u32,
        queue: Option<&PyCompletionQueue>,
        tag: u64,
    ) -> PyOp {
        let by = self.inner.deadline();
        PyOp {
            op: self.inner.submit_to(
                move |c| OpResult::StatusLens(c.exists_by(&keys.slices(), lease_ms, by)),
                Lane::Urgent,
                notify(queue, tag),
            ),
        }
    }

    /// Like delete, on the I/O threads; `queue` and `tag` as for submit_exists.
    #[pyo3(signature = (keys, queue=None, tag=0))]
    fn submit_delete(&self, keys: Keys, queue: Option<&PyCompletionQueue>, tag: u64) -> PyOp {
        let by = self.inner.deadline();
        PyOp {
            op: self.inner.submit_to(
                move |c| OpResult::Statuses(c.delete_by(&keys.slices(), by)),
                Lane::Bulk,
                notify(queue, tag),
            ),
        }
    }

    /// Like put, on the I/O threads. `owner` is kept alive until the transfer is over, even if
    /// the returned Op is dropped first; the addresses must stay valid as long as `owner` lives.
    /// No memory is read once the Op is complete. `queue` and `tag` as for submit_exists.
    #[pyo3(signature = (keys, ptrs, sizes, owner=None, queue=None, tag=0))]
    fn submit_put(
        &self,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        owner: Option<Py<PyAny>>,
        queue: Option<&PyCompletionQueue>,
        tag: u64,
    ) -> PyResult<PyOp> {
        self.submit_transfer(keys, ptrs, sizes, owner, true, notify(queue, tag))
    }

    /// Like get_into, on the I/O threads; `owner`, `queue` and `tag` as for submit_put. No
    /// buffer is written once the Op is complete, whatever its statuses (TIMEOUT included).
    #[pyo3(signature = (keys, ptrs, sizes, owner=None, queue=None, tag=0))]
    fn submit_get_into(
        &self,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        owner: Option<Py<PyAny>>,
        queue: Option<&PyCompletionQueue>,
        tag: u64,
    ) -> PyResult<PyOp> {
        self.submit_transfer(keys, ptrs, sizes, owner, false, notify(queue, tag))
    }

    /// Mapped reads from same-host servers started with --shm-share-values: maps each
    /// server's memory now, calling `register(ptr, nbytes)` for each mapping (a GPU engine
    /// registers it with CUDA; raising leaves it unused) and later `unregister(ptr, nbytes)`
    /// before one goes. One entry per server: None when its memory is mapped, else why not.
    fn enable_mapped_reads(
        &self,
        py: Python<'_>,
        register: Py<PyAny>,
        unregister: Py<PyAny>,
    ) -> PyResult<Vec<Option<String>>> {
        let hook = Arc::new(PyMapHook {
            register,
            unregister,
        });
        let c = &self.inner;
        let r = py.detach(|| no_panic(|| c.enable_mapped_reads(hook)))?;
        Ok(r.into_iter().map(|r| r.err()).collect())
    }

    /// A mapped read on the I/O threads: where each key's value (of the expected length in
    /// `sizes`) lies in this process, pinned until `submit_release_mapped` of the op's ticket
    /// (`Op.wait_mapped`). `queue` and `tag` as for submit_exists.
    #[pyo3(signature = (keys, sizes, queue=None, tag=0))]
    fn submit_get_mapped(
        &self,
        keys: Vec<Vec<u8>>,
        sizes: Vec<u64>,
        queue: Option<&PyCompletionQueue>,
        tag: u64,
    ) -> PyResult<PyOp> {
        if keys.len() != sizes.len() {
            return Err(PyValueError::new_err("one size per key"));
        }
        let by = self.inner.deadline();
        Ok(PyOp {
            op: self.inner.submit_to(
                move |c| {
                    let (v, t) = c.get_mapped_by(&keys, &sizes, by);
                    OpResult::Mapped(v, t)
                },
                Lane::Urgent,
                notify(queue, tag),
            ),
        })
    }

    /// Ends a mapped read's pins on the I/O threads: the op's one status is OK when the
    /// servers held every value until now (what was copied out is what was stored),
    /// UNAVAILABLE when not (fail those keys).
    #[pyo3(signature = (ticket, queue=None, tag=0))]
    fn submit_release_mapped(
        &self,
        ticket: u64,
        queue: Option<&PyCompletionQueue>,
        tag: u64,
    ) -> PyOp {
        PyOp {
            op: self.inner.submit_to(
                move |c| {
                    let held = c.release_mapped(ticket);
                    OpResult::Statuses(vec![if held {
                        Status::Ok
                    } else {
                        Status::Unavailable
                    }])
                },
                Lane::Urgent,
                notify(queue, tag),
            ),
        }
    }

    /// [(address, seconds or None, error or None)] per server.
    fn ping(&self, py: Python<'_>) -> PyResult<PerServer<f64>> {
        let c = &self.inner;
        Ok(per_server(py.detach(|| no_panic(|| c.ping()))?, |d| {
            d.as_secs_f64()
        }))
    }

    /// [(address, stats JSON or None, error or None)] per server.
    fn stats(&self, py: Python<'_>) -> PyResult<PerServer<String>> {
        let c = &self.inner;
        Ok(per_server(py.detach(|| no_panic(|| c.stats()))?, |s| s))
    }

    /// [(address, (tenant name, key prefix, read-only) or None, error or None)] per server: the
    /// tenant our credential names there (None from a server without tenants).
    #[allow(
        clippy::type_complexity,
        reason = "the row is the Python tuple the stub spells out"
    )]
    fn tenants<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<
        Vec<(
            String,
            Option<(String, Bound<'py, PyBytes>, bool)>,
            Option<String>,
        )>,
    > {
        let c = &self.inner;
        let rows = py.detach(|| no_panic(|| c.tenants()))?;
        Ok(rows
            .into_iter()
            .map(|(a, r)| match r {
                Ok(t) => {
                    let t = t.map(|t| (t.name, PyBytes::new(py, &t.prefix), t.read_only));
                    (a, t, None)
                }
                Err(e) => (a, None, Some(e)),
            })
            .collect())
    }

    /// [(address, up, last failure's status code or None, its reason or None, seconds since it
    /// or None)] per server, as this client sees them; no request is sent.
    fn health(&self, py: Python<'_>) -> PyResult<HealthRows> {
        let c = &self.inner;
        Ok(py
            .detach(|| no_panic(|| c.health()))?
            .into_iter()
            .map(|h| {
                let f = h.last_failure;
                (
                    h.addr,
                    h.up,
                    f.as_ref().map(|f| f.status as u8),
                    f.as_ref().map(|f| f.reason.clone()),
                    f.as_ref().map(|f| f.at.elapsed().as_secs_f64()),
                )
            })
            .collect())
    }

    /// Index (in the configured list) of the server owning `key`.
    fn server_of(&self, key: &[u8]) -> usize {
        self.inner.server_of(key)
    }

    /// The servers in canonical form, in the configured order.
    fn servers(&self) -> Vec<String> {
        self.inner.config().servers.clone()
    }

    /// Registers [ptr, ptr + nbytes) with the RDMA transport as one region (a no-op over TCP).
    /// The memory must stay mapped until `unregister_buffer(ptr)`.
    fn register_buffer(&self, ptr: usize, nbytes: usize) -> PyResult<()> {
        // SAFETY: the caller keeps the memory mapped until unregister_buffer (documented).
        no_panic(|| unsafe { self.inner.register_memory(ptr, nbytes) })?
            .map_err(PyValueError::new_err)
    }

    /// Undoes `register_buffer(ptr, ...)`; no transfer touching the region may be running.
    fn unregister_buffer(&self, ptr: usize) -> PyResult<()> {
        no_panic(|| self.inner.unregister_memory(ptr))
    }

    /// `(True, how)` when transfers may name GPU memory (transport 'rdma' on a domain that
    /// registers it, asked for with `gpu_memory=True`), else `(False, why not)`.
    fn gpu_memory(&self) -> PyResult<(bool, String)> {
        Ok(match no_panic(|| self.inner.gpu_memory())? {
            Ok(how) => (true, how),
            Err(why) => (false, why),
        })
    }

    /// The libfabric provider values move through (`verbs`, `shm`, `tcp`, ...); None over TCP.
    fn rdma_provider(&self) -> Option<String> {
        self.inner.rdma_provider().map(String::from)
    }
}

impl PyClient {
    /// The buffers of a transfer, checked to be memory the transport can move (ValueError for
    /// GPU memory it cannot reach, before any byte moves).
    fn movable(&self, keys: &[Vec<u8>], ptrs: &[usize], sizes: &[usize]) -> PyResult<Vec<Buf>> {
        let b = bufs(keys, ptrs, sizes)?;
        no_panic(|| self.inner.check_buffers(&b))?.map_err(PyValueError::new_err)?;
        Ok(b)
    }

    /// Blocking put or get with the GIL released.
    fn transfer<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        put: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.movable(&keys, &ptrs, &sizes)?;
        let c = &self.inner;
        // SAFETY: the Python caller guarantees the memory stays valid (and, for GET, writable
        // and untouched) for the duration of this blocking call.
        let st = py.detach(|| {
            no_panic(|| unsafe {
                if put {
                    c.put(&keys, &b)
                } else {
                    c.get(&keys, &b)
                }
            })
        })?;
        Ok(codes(py, &st))
    }

    fn submit_transfer(
        &self,
        keys: Vec<Vec<u8>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        owner: Option<Py<PyAny>>,
        put: bool,
        notify: Option<(CompletionQueue, u64)>,
    ) -> PyResult<PyOp> {
        let b = self.movable(&keys, &ptrs, &sizes)?;
        let by = self.inner.deadline();
        Ok(PyOp {
            op: self.inner.submit_to(
                move |c| {
                    // SAFETY: `owner` (moved in here) keeps the memory alive until the transfer
                    // is over; the Python wrapper checked writability for GET.
                    let st = unsafe {
                        if put {
                            c.put_by(&keys, &b, by)
                        } else {
                            c.get_by(&keys, &b, by)
                        }
                    };
                    drop(owner);
                    OpResult::Statuses(st)
                },
                if put { Lane::Bulk } else { Lane::Urgent },
                notify,
            ),
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

    /// Status codes (`bytes`, one per key), or None if not finished within `timeout` seconds
    /// (None = no limit). Raises RuntimeError if the operation panicked (a bug).
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        Ok(match self.result(py, timeout)? {
            None => None,
            Some(OpResult::Statuses(st)) => Some(codes(py, &st)),
            Some(OpResult::StatusLens(v)) => Some(exists_codes(py, &v)),
            Some(OpResult::Mapped(v, _)) => Some(mapped_codes(py, &v)),
            Some(OpResult::Panicked(msg)) => return Err(internal_error(&msg)),
        })
    }

    /// For mapped reads (`Client.submit_get_mapped`): (status codes as `bytes`, the address of
    /// each Ok value, 0 for others, and the ticket to release), or None as for wait.
    /// ValueError for other ops.
    #[pyo3(signature = (timeout=None))]
    fn wait_mapped<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Option<MappedRead<'py>>> {
        Ok(match self.result(py, timeout)? {
            None => None,
            Some(OpResult::Mapped(v, t)) => Some(mapped_read(py, &v, t)),
            Some(OpResult::Panicked(msg)) => return Err(internal_error(&msg)),
            Some(_) => return Err(PyValueError::new_err("only mapped reads have addresses")),
        })
    }

    /// For EXISTS ops: (status codes as `bytes`, stored length per key), or None as for wait.
    /// ValueError for other ops.
    #[pyo3(signature = (timeout=None))]
    fn wait_lengths<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Vec<u64>)>> {
        Ok(match self.result(py, timeout)? {
            None => None,
            Some(OpResult::StatusLens(v)) => Some(codes_lens(py, &v)),
            Some(OpResult::Statuses(_) | OpResult::Mapped(..)) => {
                return Err(PyValueError::new_err("only EXISTS ops have lengths"))
            }
            Some(OpResult::Panicked(msg)) => return Err(internal_error(&msg)),
        })
    }
}

impl PyOp {
    /// The finished result, or None after `timeout` seconds (see `wait_limit`).
    fn result(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<OpResult>> {
        let t = wait_limit(timeout)?;
        let op = self.op.clone();
        Ok(py.detach(move || op.wait(t)))
    }
}

/// A wait's limit from Python seconds: None or inf = no limit; a negative wait is a poll.
fn wait_limit(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    Ok(match timeout {
        Some(s) if s.is_nan() => return Err(PyValueError::new_err("timeout is NaN")),
        Some(s) if s == f64::INFINITY => None,
        Some(s) => Some(seconds(s.max(0.0))?),
        None => None,
    })
}

/// The announcement a submit_* asked for.
fn notify(queue: Option<&PyCompletionQueue>, tag: u64) -> Option<(CompletionQueue, u64)> {
    queue.map(|q| (q.queue.clone(), tag))
}

/// Where Ops submitted with it announce their completion: each pushes its integer tag once,
/// when its result is ready (a panicked Op too), so one thread can wait for many Ops and then
/// collect each with `wait(0)` without blocking.
#[pyclass(frozen, name = "CompletionQueue", module = "memkv_vllm._native")]
struct PyCompletionQueue {
    queue: CompletionQueue,
}

#[pymethods]
impl PyCompletionQueue {
    #[new]
    fn new() -> Self {
        PyCompletionQueue {
            queue: CompletionQueue::new(),
        }
    }

    /// The tags of the Ops completed since the last call, in completion order. Waits (GIL
    /// released) up to `timeout` seconds (None = no limit) for the first; an empty list when
    /// the timeout passed or `wake()` was called first.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Vec<u64>> {
        let t = wait_limit(timeout)?;
        let q = self.queue.clone();
        py.detach(move || no_panic(|| q.wait(t)))
    }

    /// Ends the current wait, or else the next one, even without a tag.
    fn wake(&self) {
        self.queue.wake();
    }
}

/// Index of the server owning `key` among `servers` (rendezvous hashing over the strings as
/// given; `Client` canonicalises its list first).
#[pyfunction]
fn rendezvous(key: &[u8], servers: Vec<String>) -> PyResult<usize> {
    if servers.is_empty() {
        return Err(PyValueError::new_err("no servers"));
    }
    no_panic(|| placement::rendezvous(key, &servers))
}

/// The canonical spelling of one `host:port`; ValueError says what is wrong with a bad one.
#[pyfunction]
fn canonical_server(text: &str) -> PyResult<String> {
    no_panic(|| placement::canonical_server(text))?.map_err(PyValueError::new_err)
}

/// A malformed address, an unknown device name or an unreadable sysfs, as a ValueError.
fn topo_error(e: memkv_topo::TopoError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Runs the `memkv` command line (argv[0] is the program name) with the GIL released.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    py.detach(|| no_panic(|| memkv_cli::run(argv)))
}

/// Direct mode's `memkv_scratch_medium: auto` for the GPU at PCI address `gpu` (`0000:1b:00.0`,
/// or nvidia-smi's `00000000:1B:00.0`): `(True, reason)` when a NIC (narrowed to `rdma_devices`,
/// empty = all) shares the GPU's PCIe switch and the transport reaches GPU memory, else
/// `(False, reason)`. `device_memory` is the client's `gpu_memory()` answer (default: not
/// reached). ValueError for a malformed address or an unknown device name; a host whose sysfs
/// cannot be read gets `(False, reason)`.
#[pyfunction]
#[pyo3(signature = (gpu, rdma_devices=Vec::new(), sysfs="/sys", device_memory=(false, String::from("no transport that registers GPU memory was opened"))))]
fn gpu_scratch_verdict(
    py: Python<'_>,
    gpu: &str,
    rdma_devices: Vec<String>,
    sysfs: &str,
    device_memory: (bool, String),
) -> PyResult<(bool, String)> {
    let reach = match device_memory {
        (true, how) => Ok(how),
        (false, why) => Err(why),
    };
    let v = py.detach(|| {
        no_panic(|| {
            memkv_topo::host::gpu_scratch_verdict(Path::new(sysfs), gpu, &rdma_devices, reach)
        })
    })?;
    v.map(|v| (v.gpu, v.reason)).map_err(topo_error)
}

/// The NIC the rank of the GPU at PCI address `gpu` uses (nearest by PCIe topology among the
/// NICs narrowed to `rdma_devices`, empty = all) as `(name, proximity)`, e.g.
/// `("mlx5_2", "same PCIe switch")`; None when sysfs lists no GPU there or no NIC. ValueError for
/// a malformed address, an unknown device name or an unreadable sysfs.
#[pyfunction]
#[pyo3(signature = (gpu, rdma_devices=Vec::new(), sysfs="/sys"))]
fn nic_for_gpu(
    py: Python<'_>,
    gpu: &str,
    rdma_devices: Vec<String>,
    sysfs: &str,
) -> PyResult<Option<(String, &'static str)>> {
    py.detach(|| no_panic(|| memkv_topo::host::nic_for_gpu(Path::new(sysfs), gpu, &rdma_devices)))?
        .map_err(topo_error)
}

/// Where the byte at address `ptr` lives: `("host", None)` or `("cuda", device ordinal)`, as the
/// CUDA driver this process loaded says (no driver loaded: host).
#[pyfunction]
fn memory_kind(ptr: usize) -> PyResult<(&'static str, Option<i32>)> {
    Ok(match no_panic(|| memkv_client::memory::locate(ptr))? {
        memkv_client::Memory::Host => ("host", None),
        memkv_client::Memory::Cuda(d) => ("cuda", Some(d)),
    })
}

/// (name, number) of every client outcome, so the Python enum can be checked against them.
#[pyfunction]
fn statuses() -> Vec<(&'static str, u8)> {
    Status::ALL.iter().map(|s| (s.name(), *s as u8)).collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Forward the client's log records to Python's logging. No caching: records are rare (server
    // state changes) and a level set later with logging.setLevel must apply. Another extension
    // may have installed a `log` logger first; then ours stays out of its way.
    let _ = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::Nothing)?.install();
    m.add_class::<PyClient>()?;
    m.add_class::<PyOp>()?;
    m.add_class::<PyCompletionQueue>()?;
    #[cfg(feature = "test-peer")]
    m.add_class::<testing::RdmaTestPeer>()?;
    m.add_function(wrap_pyfunction!(rendezvous, m)?)?;
    m.add_function(wrap_pyfunction!(canonical_server, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(statuses, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_scratch_verdict, m)?)?;
    m.add_function(wrap_pyfunction!(nic_for_gpu, m)?)?;
    m.add_function(wrap_pyfunction!(memory_kind, m)?)?;
    m.add("MAX_KEY_LEN", memkv_proto::MAX_KEY_LEN)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
