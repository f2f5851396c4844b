//! `memkv bench`: put/get throughput against a memkv server, printed next to ceilings measured in
//! the same run on the same machine: memcpy, raw loopback TCP between two threads (one socket,
//! the same value size), the same with a socket per client thread, and optionally a local Redis
//! through the `redis` crate. GB/s = 1e9 B/s.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use memkv_client::{Buf, Client, ClientConfig, Status, TransportChoice};
use memkv_server::arena::Region;
use memkv_server::{parse_size, Server, ServerConfig};

use crate::{Conn, RdmaArgs};

#[derive(Args)]
pub struct BenchArgs {
    /// Servers to measure; without it an in-process server on loopback is started.
    #[arg(long, env = "MEMKV_SERVERS", hide_env_values = true)]
    servers: Option<String>,
    #[arg(long, env = "MEMKV_AUTH_KEY", hide_env_values = true)]
    auth_key: Option<String>,
    /// Value sizes (binary units).
    #[arg(long, value_delimiter = ',', default_value = "1M,4M,16M,64M")]
    sizes: Vec<String>,
    /// Client thread counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    threads: Vec<usize>,
    /// Bytes moved per measurement point (per direction); more is steadier.
    #[arg(long, default_value = "1G")]
    volume: String,
    /// Memory of the in-process server.
    #[arg(long, default_value = "2G")]
    memory: String,
    /// Keys each client thread overwrites round-robin; the TCP ceiling's receiver writes into as
    /// many buffers, so both move the same bytes into the same amount of memory.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    keys: u64,
    /// Values per memkv request (the tier sends `blocks_per_op` blocks per request). Each thread
    /// uses at least this many keys.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Rounds per point, each measuring the TCP ceiling and every system once; the best round of
    /// each is reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Also measure a local Redis (starts `redis-server` from PATH on a free port).
    #[arg(long)]
    vs_redis: bool,
    /// After each row, print every round's measurements (GB/s): the TCP ceilings with the
    /// receiver reading whole values / 256 KiB pieces, then memkv put and get.
    #[arg(long)]
    show_rounds: bool,
    /// Also write every row's measurements (GB/s) to FILE as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<std::path::PathBuf>,
    /// Draw throughput by value size and threads, with the same run's ceilings as lines, to
    /// FILE.png. Drawn by the `memkv` command of the Python package (matplotlib: pip install
    /// 'memkv-vllm[plot]'), which hands this binary a --json file to draw from.
    #[arg(long, value_name = "FILE.png")]
    plot: Option<std::path::PathBuf>,
    /// `rdma`: also measure memkv over the RDMA data path (the server's one-sided reads and
    /// writes of the bench's registered buffers), printed beside the TCP figures. The
    /// in-process server then serves RDMA; an external one needs --rdma. `shm`: also measure
    /// the same-host path (the server's copies into and out of the bench's memfd buffers over
    /// its unix socket), printed beside the TCP figures with its share of the row's memcpy.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma", "shm"])]
    transport: String,
    #[command(flatten)]
    rdma: crate::RdmaArgs,
    /// Also measure memkv over TLS 1.3: a second in-process server with a certificate made for
    /// the run, printed under each row with its share of the row's plaintext put and get.
    #[arg(long)]
    tls: bool,
    /// TLS to --servers (the bench's client then measures those servers over TLS).
    #[command(flatten)]
    tls_args: crate::TlsArgs,
}

/// The in-process TLS server of `--tls` and its client; the certificate's files live as long.
struct TlsBench {
    server: Server,
    client: Arc<Client>,
    _pki: memkv_tls::ephemeral::Pki,
}

impl TlsBench {
    fn start(memory: u64, auth_key: Option<String>, conns: usize) -> Result<TlsBench, String> {
        let pki = memkv_tls::ephemeral::Pki::new();
        let cert = pki.server("bench");
        let server = Server::start(ServerConfig {
            listen: "127.0.0.1:0".into(),
            memory,
            lanes: 2,
            tls: Some(memkv_tls::ServerTlsFiles {
                cert: cert.cert,
                key: cert.key,
                client_ca: None,
            }),
            ..ServerConfig::default()
        })
        .map_err(|e| format!("in-process TLS server: {e}"))?;
        let conn = Conn {
            servers: server.addr.to_string(),
            auth_key,
            timeout: 30.0,
            tls: crate::TlsArgs {
                tls_ca: Some(pki.ca()),
                ..crate::TlsArgs::default()
            },
        };
        let client = conn.client(1, conns)?;
        Ok(TlsBench {
            server,
            client,
            _pki: pki,
        })
    }
}

/// Best of `n` runs of a throughput measurement.
fn best(n: usize, mut f: impl FnMut() -> Result<f64, String>) -> Result<f64, String> {
    let mut b = 0f64;
    for _ in 0..n {
        b = b.max(f()?);
    }
    Ok(b)
}

/// A point's TCP ceiling from its rounds, each measured with both receiver strategies (whole
/// values, pieces): the strategy with the higher median over the rounds, and its best round.
/// Taking the best of both strategies in every round would make the ceiling the best of twice as
/// many measurements as each system gets, which on a noisy machine raises it by luck alone.
fn ceiling(rounds: &[[f64; 2]]) -> f64 {
    let median = |s: usize| {
        let mut v: Vec<f64> = rounds.iter().map(|r| r[s]).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => 0.0,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    };
    let s = if median(1) > median(0) { 1 } else { 0 };
    rounds.iter().map(|r| r[s]).fold(0.0, f64::max)
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// `64K`, `4M`, `1536K`: binary units, as `--sizes` takes them.
fn size_label(size: usize) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{}M", s >> 20),
        s if s % 1024 == 0 => format!("{}K", s >> 10),
        s => s.to_string(),
    }
}

/// A buffer whose pages are all written, so no measurement pays first-touch page faults (or reads
/// the kernel's shared zero page, which a zero-filled `vec!` would leave mapped).
fn touched(size: usize, byte: u8) -> Vec<u8> {
    vec![byte | 0x80; size]
}

/// memcpy ceiling: copies between two warm buffers of `size` bytes until `volume` moved.
fn memcpy_ceiling(size: usize, volume: u64) -> f64 {
    let src = vec![7u8; size];
    let mut dst = vec![0u8; size];
    dst.copy_from_slice(&src);
    let n = (volume / size as u64).max(2);
    let t = Instant::now();
    for _ in 0..n {
        dst.copy_from_slice(std::hint::black_box(&src));
    }
    std::hint::black_box(&dst);
    gbps(n * size as u64, t.elapsed())
}

/// Raw loopback TCP ceiling with `streams` sender/receiver thread pairs, one socket each, over
/// the same memory as a memkv point: the sender writes an 8-byte length and a value with writev
/// from the next of `batch` ordinary buffers (as a client thread does), the receiver reads it into
/// the next of `keys` buffers carved from memory prepared as the store's arena is (pre-faulted,
/// huge pages), as the store writes each of a thread's keys into memory of its own. This is the
/// data path memkv uses, with no store, protocol, checksum or request/reply round trip. The
/// receiver reads each value whole, or in `READ_PIECE` pieces as memkv does (`pieces`): each
/// is faster in some cells of this 2-vCPU box, and a ceiling is the better of them (`ceiling`).
fn tcp_ceiling(
    size: usize,
    volume: u64,
    streams: usize,
    w: &Workload,
    pieces: bool,
) -> std::io::Result<f64> {
    let n = ((volume / size as u64) as usize / streams).max(2);
    let keys = w.keys;
    // Sockets and memory are set up before the clock starts.
    let mut pairs = Vec::with_capacity(streams);
    for _ in 0..streams {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let s = TcpStream::connect(l.local_addr()?)?;
        s.set_nodelay(true)?;
        let vals: Vec<Vec<u8>> = (0..w.batch).map(|_| touched(size, 3)).collect();
        pairs.push((l.accept()?.0, s, Region::new(size * keys)?, vals));
    }
    let t = Instant::now();
    std::thread::scope(|sc| -> std::io::Result<()> {
        let mut hs = Vec::new();
        for (mut rx, mut tx, mut mem, vals) in pairs {
            hs.push(sc.spawn(move || -> std::io::Result<()> {
                let mut bufs: Vec<&mut [u8]> = mem.as_mut_slice().chunks_mut(size).collect();
                let mut hdr = [0u8; 8];
                for i in 0..n {
                    rx.read_exact(&mut hdr)?;
                    let buf = &mut *bufs[i % keys];
                    if pieces {
                        memkv_proto::io::read_exact_in_pieces(&mut rx, buf)?;
                    } else {
                        rx.read_exact(buf)?;
                    }
                }
                rx.write_all(b"k")
            }));
            hs.push(sc.spawn(move || -> std::io::Result<()> {
                let hdr = (size as u64).to_le_bytes();
                for i in 0..n {
                    let v: &[u8] = &vals[i % vals.len()];
                    memkv_proto::io::write_all_vectored(&mut tx, &[&hdr, v])?;
                }
                let mut ack = [0u8; 1];
                tx.read_exact(&mut ack)
            }));
        }
        hs.into_iter().try_for_each(|h| h.join().unwrap())
    })?;
    Ok(gbps((n * streams * size) as u64, t.elapsed()))
}

/// What each thread of a memkv or Redis point does.
struct Workload {
    /// Distinct keys per thread, overwritten round-robin.
    keys: usize,
    /// Values per memkv request.
    batch: usize,
}

/// XXH3-64 checksum rate of one core over warm checksum chunks: the work memkv adds per byte moved
/// (once at PUT, once at GET) on top of the copies the TCP ceiling does.
fn checksum_rate() -> f64 {
    let chunk = touched(memkv_proto::CHECKSUM_CHUNK, 5);
    let n = 2048;
    let mut x = memkv_proto::checksum(&chunk);
    let t = Instant::now();
    for _ in 0..n {
        x ^= memkv_proto::checksum(std::hint::black_box(&chunk));
    }
    std::hint::black_box(x);
    gbps((n * chunk.len()) as u64, t.elapsed())
}

/// Median round trip of a 32-byte ping-pong over loopback TCP: the floor under any request/reply
/// exchange, so a one-value-per-request client can reach at most `t / (t + rtt)` of a stream that
/// needs `t` per value.
fn tcp_rtt() -> std::io::Result<Duration> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let mut c = TcpStream::connect(l.local_addr()?)?;
    let mut s = l.accept()?.0;
    c.set_nodelay(true)?;
    s.set_nodelay(true)?;
    let echo = std::thread::spawn(move || {
        let mut b = [0u8; 32];
        while s.read_exact(&mut b).is_ok() && s.write_all(&b).is_ok() {}
    });
    let mut b = [0u8; 32];
    let mut lat = Vec::with_capacity(2001);
    for _ in 0..2001 {
        let t = Instant::now();
        c.write_all(&b)?;
        c.read_exact(&mut b)?;
        lat.push(t.elapsed());
    }
    drop(c);
    let _ = echo.join();
    lat.sort();
    Ok(lat[lat.len() / 2])
}

/// memkv put or get throughput for `threads` threads, each with its own keys and buffers, sending
/// `batch` values per request (keys `batch` apart in the thread's round-robin of `keys`).
fn memkv_point(
    client: &Arc<Client>,
    size: usize,
    threads: usize,
    w: &Workload,
    volume: u64,
    put: bool,
) -> Result<f64, String> {
    let per_request = w.batch * size;
    let requests = ((volume / per_request as u64) as usize / threads).max(1);
    let mem = PointMemory::new(client, threads * w.batch * size)?;
    // Built once: the same buffers serve every request of a thread.
    let bufs: Vec<Vec<Buf>> = (0..threads)
        .map(|th| {
            (0..w.batch)
                .map(|j| mem.buf((th * w.batch + j) * size, size))
                .collect()
        })
        .collect();
    let t = Instant::now();
    let failed: Vec<Vec<Status>> = std::thread::scope(|sc| {
        let hs: Vec<_> = bufs
            .into_iter()
            .enumerate()
            .map(|(th, b)| {
                sc.spawn(move || -> Option<Vec<Status>> {
                    for i in 0..requests {
                        let keys: Vec<Vec<u8>> = (0..w.batch)
                            .map(|j| {
                                let k = (i * w.batch + j) % w.keys;
                                format!("bench/m/{size}/{th}/{k}").into_bytes()
                            })
                            .collect();
                        // SAFETY: the buffers outlive the call, are distinct and this thread's alone.
                        let st = unsafe {
                            if put {
                                client.put(&keys, &b)
                            } else {
                                client.get(&keys, &b)
                            }
                        };
                        if st.iter().any(|s| *s != Status::Ok) {
                            return Some(st);
                        }
                    }
                    None
                })
            })
            .collect();
        hs.into_iter()
            .filter_map(|h| h.join().expect("bench thread panicked"))
            .collect()
    });
    let elapsed = t.elapsed();
    drop(mem);
    if let Some(st) = failed.first() {
        return Err(point_failed(size, threads, w, put, st));
    }
    Ok(gbps((requests * threads * per_request) as u64, elapsed))
}

/// The buffers of a memkv point, every page written (no first-touch faults in the timing): a
/// memfd mapping registered with the client when it uses the shared-memory transport (the
/// server copies into and out of it), else heap memory.
struct PointMemory<'a> {
    client: &'a Client,
    heap: Vec<u8>,
    shared: Option<memkv_client::shm_regions::SharedMemory>,
}

impl<'a> PointMemory<'a> {
    fn new(client: &'a Client, len: usize) -> Result<PointMemory<'a>, String> {
        if client.config().transport != TransportChoice::Shm {
            return Ok(PointMemory {
                client,
                heap: touched(len, 0x5a),
                shared: None,
            });
        }
        let m = memkv_client::shm_regions::SharedMemory::new("memkv-bench", len)
            .map_err(|e| format!("memfd for the shm bench: {e}"))?;
        // SAFETY: the mapping is ours and `len` bytes long.
        unsafe { std::ptr::write_bytes(m.ptr() as *mut u8, 0x5a, len) };
        // SAFETY: the mapping stays until this PointMemory drops, after unregistering it.
        unsafe { client.register_memory(m.ptr(), len)? };
        Ok(PointMemory {
            client,
            heap: Vec::new(),
            shared: Some(m),
        })
    }

    fn buf(&self, off: usize, len: usize) -> Buf {
        let base = match &self.shared {
            Some(m) => m.ptr(),
            None => self.heap.as_ptr() as usize,
        };
        Buf {
            ptr: base + off,
            len,
        }
    }
}

impl Drop for PointMemory<'_> {
    fn drop(&mut self) {
        if let Some(m) = &self.shared {
            // Unmapped when `shared` drops, right after.
            self.client.unregister_memory(m.ptr());
        }
    }
}

/// Why a memkv measurement could not complete, with what to change.
fn point_failed(size: usize, threads: usize, w: &Workload, put: bool, st: &[Status]) -> String {
    let bad = st.iter().find(|s| **s != Status::Ok).copied();
    let set = working_set(size, threads, w);
    let hint = match bad {
        Some(Status::NotFound) => format!(
            "values were evicted before they were read back: the server holds less than this \
             point's working set of {threads} thread(s) x {} keys x {} = {}",
            w.keys,
            size_label(size),
            size_label(set as usize)
        ),
        Some(Status::TooLarge) => format!(
            "the server accepts no value of {} (a value must fit in one of its lanes)",
            size_label(size)
        ),
        Some(Status::NoSpace) => "the server has no unpinned memory to store into".into(),
        _ => "the server did not answer as expected; see `memkv stats`".into(),
    };
    format!(
        "memkv {} of {} values failed ({}): {hint}. Give the server more memory (--memory for \
         the in-process one) or use fewer --threads, fewer --keys or smaller --sizes",
        if put { "put" } else { "get" },
        size_label(size),
        bad.map_or("no status", |s| s.name())
    )
}

/// Bytes one point keeps stored: every thread's keys at this size.
fn working_set(size: usize, threads: usize, w: &Workload) -> u64 {
    (threads * w.keys) as u64 * size as u64
}

/// Total value memory of the servers, from their stats (None if one does not say).
fn servers_capacity(client: &Client) -> Option<u64> {
    client
        .stats()
        .into_iter()
        .map(|(_, r)| {
            let v: serde_json::Value = serde_json::from_str(&r.ok()?).ok()?;
            v.get("memory_capacity_bytes")?.as_u64()
        })
        .sum()
}

/// Values from this size on are held to the target of 90% of the TCP ceiling.
const TARGET_FROM: usize = 4 << 20;

/// The put and get ratios of the target's sizes, against both ceilings.
#[derive(Default)]
struct Summary {
    one: Vec<f64>,
    per_thread: Vec<f64>,
}

impl Summary {
    fn add(&mut self, one: f64, per_thread: f64) {
        self.one.push(one);
        self.per_thread.push(per_thread);
    }

    fn line(&self) -> Option<String> {
        let span = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let under = v.iter().filter(|&&x| x < 90.0).count();
            format!("lowest {lo:.0}%, {under} of {} under 90%", v.len())
        };
        (!self.one.is_empty()).then(|| {
            format!(
                "values >= {}: vs tcp (one stream) {}; vs tcp*thr (a stream per client thread) {}",
                size_label(TARGET_FROM),
                span(&self.one),
                span(&self.per_thread)
            )
        })
    }
}

/// Median latency of a batched EXISTS of 1,000 keys.
fn exists_latency(client: &Arc<Client>) -> Result<Duration, String> {
    let keys: Vec<Vec<u8>> = (0..1000)
        .map(|i| format!("bench/exists/{i:06}").into_bytes())
        .collect();
    let small = [0u8; 64];
    let bufs = vec![Buf::of(&small); keys.len()];
    // SAFETY: `small` lives until the end of this function.
    unsafe { client.put(&keys, &bufs) };
    let mut lat: Vec<Duration> = (0..51)
        .map(|_| {
            let t = Instant::now();
            let r = client.exists(&keys, 0);
            let d = t.elapsed();
            match r.iter().find(|(s, _)| *s != Status::Ok) {
                Some((s, _)) => Err(format!(
                    "batched EXISTS of the 1,000 keys just stored answered {s}; the server \
                     may be too small to keep them"
                )),
                None => Ok(d),
            }
        })
        .collect::<Result<_, _>>()?;
    lat.sort();
    Ok(lat[lat.len() / 2])
}

struct Redis {
    child: std::process::Child,
    url: String,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis() -> Result<Redis, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let child = std::process::Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args([
            "--proto-max-bulk-len",
            "1gb",
            "--client-query-buffer-limit",
            "1gb",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start redis-server (apt-get install redis-server): {e}"))?;
    let r = Redis {
        child,
        url: format!("redis://127.0.0.1:{port}/"),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err("redis-server did not start".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(r)
}

fn redis_point(
    url: &str,
    size: usize,
    threads: usize,
    keys: usize,
    volume: u64,
    put: bool,
) -> Result<f64, String> {
    let per_thread = ((volume / size as u64) as usize / threads).max(1);
    // Connections and buffers are set up before the clock starts, as memkv's pool is.
    let setup = (0..threads)
        .map(|th| {
            let c = redis::Client::open(url)
                .and_then(|c| c.get_connection())
                .map_err(|e| e.to_string())?;
            Ok((c, touched(size, th as u8)))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let t = Instant::now();
    std::thread::scope(|sc| {
        let hs: Vec<_> = setup
            .into_iter()
            .enumerate()
            .map(|(th, (mut c, val))| {
                sc.spawn(move || -> Result<(), String> {
                    for i in 0..per_thread {
                        let key = format!("bench/{size}/{th}/{}", i % keys);
                        if put {
                            redis::cmd("SET")
                                .arg(&key)
                                .arg(&val[..])
                                .query::<()>(&mut c)
                                .map_err(|e| e.to_string())?;
                        } else {
                            let v: Vec<u8> = redis::cmd("GET")
                                .arg(&key)
                                .query(&mut c)
                                .map_err(|e| e.to_string())?;
                            if v.len() != size {
                                return Err("redis returned a wrong length".into());
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().unwrap())
    })?;
    Ok(gbps((per_thread * threads * size) as u64, t.elapsed()))
}

pub fn run(a: BenchArgs) -> Result<i32, String> {
    if a.plot.is_some() {
        return Err(
            "--plot is drawn by the memkv command of the Python package (python -m \
                    memkv_vllm.cli bench --plot ...); this binary writes the data with --json FILE"
                .into(),
        );
    }
    let volume = parse_size(&a.volume)?;
    let sizes: Vec<usize> = a
        .sizes
        .iter()
        .map(|s| parse_size(s).map(|v| v as usize))
        .collect::<Result<_, _>>()?;
    let max_threads = a.threads.iter().copied().max().unwrap_or(1);
    let with_rdma = a.transport == "rdma";
    let with_shm = a.transport == "shm";
    let mut _server = None;
    let servers = match &a.servers {
        Some(s) => s.clone(),
        None => {
            let memory = parse_size(&a.memory)?;
            let rdma = RdmaArgs {
                rdma: with_rdma,
                ..a.rdma.clone()
            };
            let s = Server::start(ServerConfig {
                listen: "127.0.0.1:0".into(),
                memory,
                lanes: 2,
                rdma: rdma.server_config(),
                ..ServerConfig::default()
            })
            .map_err(|e| format!("in-process server: {e}"))?;
            let addr = s.addr.to_string();
            _server = Some(s);
            addr
        }
    };
    let conn = Conn {
        servers: servers.clone(),
        auth_key: a.auth_key.clone(),
        timeout: 30.0,
        tls: a.tls_args.clone(),
    };
    if a.tls && a.servers.is_some() {
        return Err(
            "--tls compares an in-process TLS server with the in-process plaintext one; \
             leave out --servers (to measure servers of your own over TLS, give --tls-ca)"
                .into(),
        );
    }
    let tls_bench = a
        .tls
        .then(|| TlsBench::start(parse_size(&a.memory)?, a.auth_key.clone(), max_threads))
        .transpose()?;
    let client = conn.client(1, max_threads)?;
    let rdma_client = with_rdma
        .then(|| {
            conn.client_over(
                1,
                max_threads,
                ClientConfig {
                    transport: TransportChoice::Rdma,
                    rdma_provider: a.rdma.rdma_provider.clone(),
                    rdma_devices: a.rdma.rdma_devices.clone(),
                    ..ClientConfig::default()
                },
            )
        })
        .transpose()?;
    let shm_client = with_shm
        .then(|| {
            conn.client_over(
                1,
                max_threads,
                ClientConfig {
                    transport: TransportChoice::Shm,
                    ..ClientConfig::default()
                },
            )
        })
        .transpose()?;
    let redis = if a.vs_redis {
        Some(start_redis()?)
    } else {
        None
    };
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let rep = a.repeat.max(1);
    let w = Workload {
        keys: a.keys.max(a.batch) as usize,
        batch: a.batch as usize,
    };
    // Refuse up front what cannot be measured: a working set the servers cannot hold.
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let set = working_set(largest, max_threads, &w);
    if let Some(cap) = servers_capacity(&client).filter(|&cap| set > cap) {
        return Err(format!(
            "the bench's largest working set ({max_threads} thread(s) x {} keys x {} = {}) \
             exceeds the servers' memory ({}): values would be evicted before they are read \
             back. Give the server more memory (--memory for the in-process one) or use fewer \
             --threads, fewer --keys or smaller --sizes",
            w.keys,
            size_label(largest),
            size_label(set as usize),
            size_label(cap as usize)
        ));
    }
    println!(
        "memkv bench: servers {servers}, {cpus} CPUs, {} per point, {} keys per thread, {} \
         value(s) per memkv request, best of {rep} rounds, GB/s = 1e9 B/s",
        a.volume, w.keys, w.batch
    );
    println!(
        "XXH3-64 checksum, one core, warm {} chunks: {:.1} GB/s",
        size_label(memkv_proto::CHECKSUM_CHUNK),
        checksum_rate()
    );
    // What TLS adds per byte on each end, for the bound printed under each TLS row.
    let record = a
        .tls
        .then(|| memkv_tls::record_rate::record_layer_rate(256 << 20))
        .transpose()?;
    if let Some(r) = &record {
        println!(
            "rustls record layer, one core, in memory, {}: seal {:.1} GB/s, open {:.1} GB/s \
             (a TLS stream reaches at most 1 / (1 + P / {:.1}) of a plaintext stream of P GB/s)",
            r.suite,
            r.seal_gbps,
            r.open_gbps,
            r.seal_gbps.min(r.open_gbps)
        );
        let (seal, open) = memkv_tls::record_rate::cipher_rate(256 << 20)?;
        println!(
            "AES-128-GCM alone (ring), one core, in place, 16 KiB records: seal {seal:.1} GB/s, \
             open {open:.1} GB/s (the bound of a record layer that never copies: 1 / (1 + P / \
             {:.1}))",
            seal.min(open)
        );
    }
    let rtt = tcp_rtt().map_err(|e| format!("tcp round trip: {e}"))?;
    println!(
        "loopback TCP round trip (32-byte ping-pong, median of 2001): {:.1} us",
        rtt.as_secs_f64() * 1e6
    );
    println!(
        "{:>8} {:>3} | {:>7} {:>7} {:>7} | {:>7} {:>7} | {:>7} {:>7} | {:>8} {:>8} |{}{}",
        "value",
        "thr",
        "memcpy",
        "tcp",
        "tcp*thr",
        "put",
        "get",
        "put/tcp",
        "get/tcp",
        "put/tcp*",
        "get/tcp*",
        if redis.is_some() {
            " redis-set redis-get  put/redis get/redis"
        } else {
            ""
        },
        if with_rdma { " rdma-put rdma-get" } else { "" },
    );
    if with_shm {
        println!("{:>61}shm-put shm-get  put/memcpy get/memcpy", "");
    }
    if tls_bench.is_some() {
        println!(
            "{:>61}tls-put tls-get  put/plain  get/plain  best put/get (record layer)",
            ""
        );
    }
    let mut summary = Summary::default();
    let mut tls_ratios: Vec<f64> = Vec::new();
    let mut rows = Vec::new();
    for &size in &sizes {
        let mc = best(rep, || Ok(memcpy_ceiling(size, volume)))?;
        for &th in &a.threads {
            // Rounds interleave the ceilings and every system, so a noisy neighbour slows all of
            // them alike instead of the one measured at that moment; the best round counts.
            // Each round measures a ceiling with both of the receiver's read strategies.
            let tcp = |streams| -> Result<[f64; 2], String> {
                let mut r = [0f64; 2];
                for (r, pieces) in r.iter_mut().zip([false, true]) {
                    *r = tcp_ceiling(size, volume, streams, &w, pieces)
                        .map_err(|e| format!("tcp ceiling: {e}"))?;
                }
                Ok(r)
            };
            // Per round: the one-stream and per-thread ceilings ([whole, pieces] each), then
            // memkv put, get, Redis set, get, memkv over RDMA put, get, over shm put, get, over
            // TLS put, get.
            let mut rounds: Vec<([f64; 2], [f64; 2], [f64; 10])> = Vec::with_capacity(rep);
            for _ in 0..rep {
                let one = tcp(1)?;
                let many = if th == 1 { one } else { tcp(th)? };
                let systems = [
                    memkv_point(&client, size, th, &w, volume, true)?,
                    memkv_point(&client, size, th, &w, volume, false)?,
                    match &redis {
                        Some(r) => redis_point(&r.url, size, th, w.keys, volume, true)?,
                        None => 0.0,
                    },
                    match &redis {
                        Some(r) => redis_point(&r.url, size, th, w.keys, volume, false)?,
                        None => 0.0,
                    },
                    match &rdma_client {
                        Some(c) => memkv_point(c, size, th, &w, volume, true)?,
                        None => 0.0,
                    },
                    match &rdma_client {
                        Some(c) => memkv_point(c, size, th, &w, volume, false)?,
                        None => 0.0,
                    },
                    match &shm_client {
                        Some(c) => memkv_point(c, size, th, &w, volume, true)?,
                        None => 0.0,
                    },
                    match &shm_client {
                        Some(c) => memkv_point(c, size, th, &w, volume, false)?,
                        None => 0.0,
                    },
                    match &tls_bench {
                        Some(t) => memkv_point(&t.client, size, th, &w, volume, true)?,
                        None => 0.0,
                    },
                    match &tls_bench {
                        Some(t) => memkv_point(&t.client, size, th, &w, volume, false)?,
                        None => 0.0,
                    },
                ];
                rounds.push((one, many, systems));
            }
            let best_of = |k: usize| rounds.iter().map(|r| r.2[k]).fold(0.0, f64::max);
            let [p, g, rp, rg, dp, dg, sp, sg, tp, tg] =
                [0, 1, 2, 3, 4, 5, 6, 7, 8, 9].map(best_of);
            let one: Vec<[f64; 2]> = rounds.iter().map(|r| r.0).collect();
            let many: Vec<[f64; 2]> = rounds.iter().map(|r| r.1).collect();
            let (tcp, tcp_n) = (ceiling(&one), ceiling(&many));
            let pct = |x: f64, c: f64| 100.0 * x / c;
            let mut line = format!(
                "{:>8} {:>3} | {:>7.2} {:>7.2} {:>7.2} | {:>7.2} {:>7.2} | {:>6.0}% {:>6.0}% | {:>7.0}% {:>7.0}% |",
                size_label(size),
                th,
                mc,
                tcp,
                tcp_n,
                p,
                g,
                pct(p, tcp),
                pct(g, tcp),
                pct(p, tcp_n),
                pct(g, tcp_n),
            );
            if redis.is_some() {
                line += &format!(" {:>9.2} {:>9.2} {:>9.2}x {:>8.2}x", rp, rg, p / rp, g / rg);
            }
            if with_rdma {
                line += &format!(" {dp:>8.2} {dg:>8.2}");
            }
            println!("{line}");
            if with_shm {
                println!(
                    "{:>61}{sp:>7.2} {sg:>7.2} {:>10.0}% {:>9.0}%",
                    "",
                    pct(sp, mc),
                    pct(sg, mc)
                );
            }
            if let Some(r) = &record {
                // Each thread's stream: plaintext's per-thread rate, plus the record layer.
                let best = |x: f64| 100.0 * r.best_share(x / th as f64);
                println!(
                    "{:>61}{tp:>7.2} {tg:>7.2} {:>10.0}% {:>9.0}% {:>9.0}% {:>4.0}%",
                    "",
                    pct(tp, p),
                    pct(tg, g),
                    best(p),
                    best(g)
                );
                if size >= TARGET_FROM {
                    tls_ratios.extend([pct(tp, p), pct(tg, g)]);
                }
            }
            let tls_gbps = |x: f64| tls_bench.as_ref().map(|_| x);
            let redis_gbps = |x: f64| redis.as_ref().map(|_| x);
            let rdma_gbps = |x: f64| with_rdma.then_some(x);
            let shm_gbps = |x: f64| with_shm.then_some(x);
            rows.push(serde_json::json!({
                "size": size, "label": size_label(size), "threads": th, "memcpy": mc,
                "tcp": tcp, "tcp_per_thread": tcp_n, "put": p, "get": g,
                "redis_set": redis_gbps(rp), "redis_get": redis_gbps(rg),
                "rdma_put": rdma_gbps(dp), "rdma_get": rdma_gbps(dg),
                "shm_put": shm_gbps(sp), "shm_get": shm_gbps(sg),
                "tls_put": tls_gbps(tp), "tls_get": tls_gbps(tg),
            }));
            if a.show_rounds {
                let each: Vec<String> = rounds
                    .iter()
                    .map(|(o, m, x)| {
                        let mut r = format!(
                            "tcp {:.2}/{:.2} tcp*thr {:.2}/{:.2} put {:.2} get {:.2}",
                            o[0], o[1], m[0], m[1], x[0], x[1]
                        );
                        if with_rdma {
                            r += &format!(" rdma-put {:.2} rdma-get {:.2}", x[4], x[5]);
                        }
                        if with_shm {
                            r += &format!(" shm-put {:.2} shm-get {:.2}", x[6], x[7]);
                        }
                        if tls_bench.is_some() {
                            r += &format!(" tls-put {:.2} tls-get {:.2}", x[8], x[9]);
                        }
                        r
                    })
                    .collect();
                println!("    rounds: {}", each.join("; "));
            }
            if size >= TARGET_FROM {
                summary.add(pct(p, tcp), pct(p, tcp_n));
                summary.add(pct(g, tcp), pct(g, tcp_n));
            }
        }
    }
    if let Some(s) = summary.line() {
        println!("{s}");
    }
    if !tls_ratios.is_empty() {
        let lo = tls_ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let under = tls_ratios.iter().filter(|&&x| x < 80.0).count();
        println!(
            "values >= {}: TLS vs plaintext (same run) lowest {lo:.0}%, {under} of {} under 80%",
            size_label(TARGET_FROM),
            tls_ratios.len()
        );
    }
    let lat = exists_latency(&client)?;
    println!(
        "batched EXISTS of 1,000 keys: median {:.3} ms",
        lat.as_secs_f64() * 1e3
    );
    if let Some(path) = &a.json {
        let doc = serde_json::json!({
            "servers": servers, "cpus": cpus, "volume": a.volume, "keys": w.keys,
            "batch": w.batch, "repeat": rep, "gbps": "1e9 B/s", "rows": rows,
            "exists_1000_keys_ms": lat.as_secs_f64() * 1e3,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap())
            .map_err(|e| format!("--json {}: {e}", path.display()))?;
    }
    for s in _server.into_iter().chain(tls_bench.map(|t| t.server)) {
        s.shutdown();
        s.wait();
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::ceiling;

    #[test]
    fn a_ceiling_is_the_best_round_of_the_strategy_with_the_higher_median() {
        // Pieces are faster in most rounds; whole values had one lucky round.
        let rounds = [[4.0, 5.0], [6.5, 5.2], [4.1, 5.1]];
        assert_eq!(ceiling(&rounds), 5.2);
        let rounds = [[5.0, 4.0], [5.2, 6.5], [5.1, 4.1]];
        assert_eq!(ceiling(&rounds), 5.2);
        assert_eq!(ceiling(&[[3.0, 2.0]]), 3.0);
        assert_eq!(
            ceiling(&[[3.0, 2.0], [1.0, 4.0]]),
            4.0,
            "even count: mean of the middle two"
        );
    }
}
