//! The `memkv` command line. Shared by the standalone binary and the Python wheel's `memkv`
//! console script (which calls `run` through the extension module).

pub mod bench;
mod disk_args;
mod net;
pub mod stats_table;

use std::sync::atomic::Ordering;
use std::time::Duration;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use memkv_client::{Client, ClientConfig};
use memkv_server::{parse_auth_key, parse_size, Server, ServerConfig};
use memkv_tls::{ClientTlsFiles, ServerTlsFiles};

#[derive(Parser)]
#[command(
    name = "memkv",
    version,
    about = "memkv: an in-memory KV-cache store for vLLM"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a server.
    Serve(ServeArgs),
    /// Show each server's items, memory, hit ratios and counters (a table; JSON with --json).
    Stats(StatsArgs),
    /// Check that each server answers; exit 1 if one does not.
    Ping(Conn),
    /// Measure put/get throughput against a server next to loopback-TCP and memcpy ceilings.
    Bench(bench::BenchArgs),
    /// Inspect and check this host's RDMA setup: PCIe topology, NICs, libfabric.
    Net(net::NetArgs),
}

/// `memkv serve`. The flags a deployment sets per host also come from MEMKV_* variables (a flag
/// wins over its variable), the names the client configuration already leaves to the server.
#[derive(Args)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(
        long,
        env = "MEMKV_LISTEN",
        hide_env_values = true,
        default_value = "127.0.0.1:7390"
    )]
    listen: String,
    /// Value memory, reserved and pre-faulted at start (e.g. 512M, 8G; binary units).
    #[arg(
        long,
        env = "MEMKV_MEMORY",
        hide_env_values = true,
        default_value = "1G"
    )]
    memory: String,
    /// Independent shards, each with its own index, memory share and eviction.
    #[arg(long, env = "MEMKV_LANES", hide_env_values = true, default_value_t = 4)]
    lanes: usize,
    /// 64 hex characters; clients must prove they hold it (HMAC-SHA256 challenge).
    #[arg(long, env = "MEMKV_AUTH_KEY", hide_env_values = true)]
    auth_key: Option<String>,
    /// YAML file of tenants, each with its own credential (auth key, or client-certificate
    /// subject under mutual TLS), key prefix, memory quota and optional read_only flag
    /// (docs/security.md); instead of --auth-key.
    #[arg(
        long,
        env = "MEMKV_TENANTS",
        hide_env_values = true,
        conflicts_with = "auth_key"
    )]
    tenants: Option<std::path::PathBuf>,
    /// Serve Prometheus metrics over HTTP at HOST:PORT/metrics, and the health probe at
    /// HOST:PORT/healthz. No credentials are asked there: bind it to loopback or a private network.
    #[arg(long, env = "MEMKV_METRICS", hide_env_values = true)]
    metrics: Option<String>,
    /// Open connections at most. When all are taken, a new one replaces the oldest that has not
    /// authenticated yet; it is refused only when every one has.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Share of each lane's memory that may be pinned: leased by EXISTS, or being sent or
    /// received (0..1); and of each --disk directory's capacity that segments held by leases
    /// may take.
    #[arg(long, default_value_t = 0.5)]
    max_leased_fraction: f64,
    /// Seconds a new connection has to finish its handshake (HELLO, and AUTH with a key).
    #[arg(long, default_value_t = 10.0)]
    handshake_timeout: f64,
    /// Seconds any request or reply may take on top of its bytes at --min-rate.
    #[arg(long, default_value_t = 30.0)]
    frame_timeout: f64,
    /// Slowest transfer accepted for a request or reply, bytes per second (e.g. 1M); a slower
    /// peer is cut off.
    #[arg(long, default_value = "1M")]
    min_rate: String,
    /// Memory for request bodies and reply tables over all connections [default: a quarter of
    /// --memory, within 64M..1G].
    #[arg(long)]
    max_buffer_memory: Option<String>,
    /// The same-host data path's unix socket: `auto` (the abstract name memkv/IP:PORT of
    /// --listen, which clients with transport shm/auto find by themselves), `@NAME` (an
    /// abstract name of one's own), a file PATH (removed at exit; clients name it with
    /// MEMKV_SHM_SOCKET), or `off`.
    #[arg(
        long,
        env = "MEMKV_SHM_SOCKET",
        hide_env_values = true,
        default_value = "auto"
    )]
    shm_socket: String,
    /// Client memory regions one same-host connection may have mapped at once.
    #[arg(long, default_value_t = 64)]
    max_shm_regions: usize,
    /// Largest client memory region mapped (e.g. 64G).
    #[arg(long, default_value = "1T")]
    max_shm_region: String,
    /// Client memory mapped at once over all same-host connections (address space only: the
    /// pages are the clients').
    #[arg(long, default_value = "16T")]
    max_shm_mapped: String,
    /// Threads that copy the same-host path's large transfers, shared by every connection
    /// (one thread copies 5-6 GB/s; 1: each transfer on its connection's thread) [default: the
    /// CPUs, at most 8].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=256))]
    shm_copy_threads: Option<u64>,
    /// Keep the values in shared memory (one sealed memfd per lane) that authenticated
    /// clients on the same-host socket may map read-only, so that a GPU copies a value
    /// straight out of the server's pages (direct mode's loads) instead of the server copying
    /// it into the client's buffer first. Every such client can then read every value in the
    /// server: for a host whose engines are one tenant. Refused with --tenants of more than one.
    #[arg(long, env = "MEMKV_SHM_SHARE_VALUES", hide_env_values = true)]
    shm_share_values: bool,
    #[command(flatten)]
    rdma: RdmaArgs,
    #[command(flatten)]
    disk: disk_args::DiskArgs,
    #[command(flatten)]
    tls: ServeTlsArgs,
}

/// TLS on `memkv serve`'s TCP listener.
#[derive(Args)]
struct ServeTlsArgs {
    /// Serve TLS 1.3 with this certificate chain (PEM, leaf first); SIGHUP reloads it and
    /// --tls-key without closing open connections.
    #[arg(long, env = "MEMKV_TLS_SERVER_CERT", hide_env_values = true)]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "MEMKV_TLS_SERVER_KEY", hide_env_values = true)]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA bundle (PEM): mutual TLS.
    #[arg(long, env = "MEMKV_TLS_CLIENT_CA", hide_env_values = true)]
    tls_client_ca: Option<PathBuf>,
    /// Serve --rdma beside TLS: RDMA's one-sided transfers move values outside TLS, in clear on
    /// the fabric (only the control connection is encrypted).
    #[arg(long, env = "MEMKV_TLS_ALLOW_RDMA", hide_env_values = true)]
    tls_allow_rdma: bool,
}

impl ServeTlsArgs {
    fn files(&self) -> Result<Option<ServerTlsFiles>, String> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(ServerTlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            })),
            (None, None) if self.tls_client_ca.is_none() => Ok(None),
            (None, None) => Err("--tls-client-ca needs --tls-cert and --tls-key".into()),
            _ => Err("--tls-cert and --tls-key go together".into()),
        }
    }
}

/// The client's TLS settings, shared by every command that connects to servers.
#[derive(Args, Clone, Default)]
pub struct TlsArgs {
    /// Connect with TLS 1.3, verifying the servers' certificates against this CA bundle (PEM).
    #[arg(long, env = "MEMKV_TLS_CA", hide_env_values = true)]
    pub tls_ca: Option<PathBuf>,
    /// Name the servers' certificates must carry [default: the host of each server address].
    #[arg(long, env = "MEMKV_TLS_SERVER_NAME", hide_env_values = true)]
    pub tls_server_name: Option<String>,
    /// Client certificate chain (PEM), for servers under mutual TLS.
    #[arg(long, env = "MEMKV_TLS_CERT", hide_env_values = true)]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "MEMKV_TLS_KEY", hide_env_values = true)]
    pub tls_key: Option<PathBuf>,
}

impl TlsArgs {
    pub fn files(&self) -> Result<Option<ClientTlsFiles>, String> {
        let Some(ca) = &self.tls_ca else {
            if self.tls_server_name.is_some() || self.tls_cert.is_some() || self.tls_key.is_some() {
                return Err("--tls-server-name, --tls-cert and --tls-key need --tls-ca".into());
            }
            return Ok(None);
        };
        Ok(Some(ClientTlsFiles {
            ca: ca.clone(),
            server_name: self.tls_server_name.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
        }))
    }
}

/// The same-host data path of `memkv serve`, from its flags.
fn shm_config(a: &ServeArgs) -> Result<Option<memkv_server::shm::ShmConfig>, String> {
    use memkv_server::shm::{ShmConfig, ShmSocket};
    let socket = match a.shm_socket.as_str() {
        "off" if a.shm_share_values => {
            return Err(
                "--shm-share-values needs the same-host socket (--shm-socket is off)".into(),
            )
        }
        "off" => return Ok(None),
        "auto" | "" => ShmSocket::Default,
        s => match s.strip_prefix('@') {
            Some(name) => ShmSocket::Abstract(name.to_string()),
            None => ShmSocket::Path(s.into()),
        },
    };
    let size = |flag: &str, v: &str| parse_size(v).map_err(|e| format!("{flag}: {e}"));
    Ok(Some(ShmConfig {
        socket,
        max_regions: a.max_shm_regions,
        max_region_bytes: size("--max-shm-region", &a.max_shm_region)?,
        max_mapped_bytes: size("--max-shm-mapped", &a.max_shm_mapped)?,
        copy_threads: a
            .shm_copy_threads
            .map_or_else(memkv_server::shm::default_copy_threads, |n| n as usize),
        share_values: a.shm_share_values,
    }))
}

/// The RDMA data path's settings, shared by `serve` and `bench`.
#[derive(Args, Clone)]
pub struct RdmaArgs {
    /// Serve the RDMA data path too: clients with transport rdma/auto send descriptors of their
    /// registered memory and the server reads and writes it (libfabric, loaded at start; the
    /// server refuses to start when it cannot be opened).
    #[arg(long, env = "MEMKV_RDMA", hide_env_values = true)]
    pub rdma: bool,
    /// libfabric provider: verbs, efa, tcp, ... [default: the first libfabric offers].
    #[arg(long, env = "MEMKV_RDMA_PROVIDER", hide_env_values = true)]
    pub rdma_provider: Option<String>,
    /// libfabric domains to use, comma-separated (NICs such as mlx5_0, efa's rdmap0s31 or its
    /// domain rdmap0s31-rdm; for the tcp provider, interfaces such as lo) [default: the first
    /// the provider offers].
    #[arg(
        long,
        env = "MEMKV_RDMA_DEVICES",
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub rdma_devices: Vec<String>,
    /// Connections that may use the RDMA data path at once; later ones are refused it (their
    /// values go over TCP, or they fail with transport rdma). Each costs the libfabric
    /// provider's own buffers outside --memory (about 2.5 MiB with tcp;ofi_rxm).
    #[arg(long, default_value_t = memkv_server::rdma::DEFAULT_MAX_ENDPOINTS)]
    pub max_rdma_connections: usize,
}

impl RdmaArgs {
    /// The server's RDMA configuration, when `--rdma` is on.
    pub fn server_config(&self) -> Option<memkv_server::rdma::RdmaConfig> {
        self.rdma.then(|| memkv_server::rdma::RdmaConfig {
            provider: self.rdma_provider.clone(),
            domains: self.rdma_devices.clone(),
            max_endpoints: self.max_rdma_connections,
        })
    }
}

#[derive(Args, Clone)]
pub struct Conn {
    /// Comma-separated host:port list.
    #[arg(
        long,
        env = "MEMKV_SERVERS",
        hide_env_values = true,
        default_value = "127.0.0.1:7390"
    )]
    pub servers: String,
    #[arg(long, env = "MEMKV_AUTH_KEY", hide_env_values = true)]
    pub auth_key: Option<String>,
    /// Seconds before a silent server counts as down.
    #[arg(long, default_value_t = 5.0)]
    pub timeout: f64,
    #[command(flatten)]
    pub tls: TlsArgs,
}

#[derive(Args)]
struct StatsArgs {
    #[command(flatten)]
    conn: Conn,
    /// Print the raw counters as JSON (one object per server) instead of the table.
    #[arg(long)]
    json: bool,
}

impl Conn {
    pub fn client(
        &self,
        io_threads: usize,
        conns: usize,
    ) -> Result<std::sync::Arc<Client>, String> {
        self.client_over(io_threads, conns, ClientConfig::default())
    }

    /// A client with the transport settings of `base` (its servers, key and timeouts are ours).
    pub fn client_over(
        &self,
        io_threads: usize,
        conns: usize,
        base: ClientConfig,
    ) -> Result<std::sync::Arc<Client>, String> {
        let servers: Vec<String> = self
            .servers
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        let auth_key = self.auth_key.as_deref().map(parse_auth_key).transpose()?;
        let timeout = Duration::try_from_secs_f64(self.timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| {
                format!(
                    "--timeout {} is not a positive number of seconds",
                    self.timeout
                )
            })?;
        let tls = self.tls.files()?.or(base.tls.clone());
        Client::new(ClientConfig {
            servers,
            auth_key,
            tls,
            connections_per_server: conns,
            connect_timeout: timeout.min(Duration::from_secs(5)),
            op_timeout: timeout,
            io_threads,
            ..base
        })
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("MEMKV_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Runs the command line `args` (args[0] is the program name); returns the exit code.
pub fn run(args: Vec<String>) -> i32 {
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    init_logging();
    let r = match cli.cmd {
        Cmd::Serve(a) => serve(a),
        Cmd::Stats(a) => stats(a),
        Cmd::Ping(c) => ping(c),
        Cmd::Bench(b) => bench::run(b),
        Cmd::Net(n) => net::run(n),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("memkv: error: {e}");
            1
        }
    }
}

fn serve(a: ServeArgs) -> Result<i32, String> {
    memkv_server::tune_allocator();
    let memory = parse_size(&a.memory).map_err(|e| format!("--memory: {e}"))?;
    if a.lanes == 0 || a.lanes > 1024 {
        return Err("--lanes must be between 1 and 1024".into());
    }
    if memory / (a.lanes as u64) < 4096 {
        return Err(format!(
            "--memory {} is too small for {} lanes",
            a.memory, a.lanes
        ));
    }
    if !(0.0..=1.0).contains(&a.max_leased_fraction) {
        return Err("--max-leased-fraction must be within 0..1".into());
    }
    let secs = |flag: &str, v: f64| {
        if v.is_finite() && v > 0.0 && v < 1e6 {
            Ok(Duration::from_secs_f64(v))
        } else {
            Err(format!("{flag} must be a number of seconds above 0"))
        }
    };
    let min_rate = parse_size(&a.min_rate).map_err(|e| format!("--min-rate: {e}"))?;
    if min_rate == 0 {
        return Err("--min-rate must be above 0".into());
    }
    let buffer_budget = a
        .max_buffer_memory
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(|e| format!("--max-buffer-memory: {e}"))?;
    if buffer_budget.is_some_and(|b| b < 2 * memkv_proto::MAX_BODY_LEN as u64) {
        return Err("--max-buffer-memory must be at least 32M (two largest request bodies)".into());
    }
    let auth_key = a
        .auth_key
        .as_deref()
        .map(parse_auth_key)
        .transpose()
        .map_err(|e| format!("--auth-key: {e}"))?;
    let shm = shm_config(&a)?;
    let tenants = match &a.tenants {
        Some(path) => {
            let (tenants, notes) = memkv_server::tenants::file::load(path, memory)?;
            for note in notes {
                tracing::warn!("{note}");
            }
            Some(tenants)
        }
        None => None,
    };
    let cfg = ServerConfig {
        listen: a.listen.clone(),
        memory,
        lanes: a.lanes,
        auth_key,
        tenants,
        metrics_listen: a.metrics,
        max_connections: a.max_connections,
        max_leased_fraction: a.max_leased_fraction,
        handshake_timeout: secs("--handshake-timeout", a.handshake_timeout)?,
        frame_timeout: secs("--frame-timeout", a.frame_timeout)?,
        min_rate,
        buffer_budget,
        rdma: a.rdma.server_config(),
        disk: a.disk.config(memory, a.max_leased_fraction)?,
        shm,
        tls: a.tls.files()?,
        tls_allow_rdma: a.tls.tls_allow_rdma,
        ..ServerConfig::default()
    };
    let server = Server::start(cfg).map_err(|e| format!("cannot start on {}: {e}", a.listen))?;
    let flag = server.shutdown_flag();
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, flag.clone()).map_err(|e| e.to_string())?;
    }
    let reload = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGHUP, reload.clone())
        .map_err(|e| e.to_string())?;
    // Tests and scripts read the bound address (useful with port 0) from this line.
    println!("memkv listening on {}", server.addr);
    use std::io::Write;
    let _ = std::io::stdout().flush();
    while !flag.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        if reload.swap(false, Ordering::Relaxed) {
            match server.reload_tls() {
                Ok(()) => tracing::info!("SIGHUP: TLS certificate and key reloaded"),
                Err(e) => {
                    tracing::warn!(error = %e, "SIGHUP: TLS reload failed; the certificate in use stays")
                }
            }
        }
    }
    tracing::info!("shutdown requested; draining connections");
    server.wait();
    Ok(0)
}

fn stats(a: StatsArgs) -> Result<i32, String> {
    let client = a.conn.client(1, 1)?;
    let mut code = 0;
    let rows: Vec<(String, Result<serde_json::Value, String>)> = client
        .stats()
        .into_iter()
        .map(|(addr, r)| {
            let v = r.and_then(|s| {
                serde_json::from_str(&s).map_err(|e| format!("unreadable stats: {e}"))
            });
            code |= i32::from(v.is_err());
            (addr, v)
        })
        .collect();
    let text = if a.json {
        let out: serde_json::Map<String, serde_json::Value> = rows
            .into_iter()
            .map(|(addr, v)| {
                (
                    addr,
                    v.unwrap_or_else(|e| serde_json::json!({ "error": e })),
                )
            })
            .collect();
        serde_json::to_string_pretty(&out).unwrap() + "\n"
    } else {
        stats_table::render(&rows)
    };
    // A closed pipe (`memkv stats | head`) is the reader's choice, not an error worth a panic.
    use std::io::Write;
    let _ = std::io::stdout().write_all(text.as_bytes());
    Ok(code)
}

fn ping(c: Conn) -> Result<i32, String> {
    let client = c.client(1, 1)?;
    let mut code = 0;
    for (addr, r) in client.ping() {
        match r {
            Ok(d) => println!("{addr}: ok {:.3} ms", d.as_secs_f64() * 1e3),
            Err(e) => {
                code = 1;
                println!("{addr}: DOWN ({e})");
            }
        }
    }
    Ok(code)
}
