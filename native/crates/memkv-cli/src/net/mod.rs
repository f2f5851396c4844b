//! `memkv net`: what an operator runs to see whether a host can move KV bytes over RDMA.
//! `topo` shows the PCIe topology and the NIC each GPU uses; `selftest` checks the host end to
//! end.

mod selftest;
mod topo;

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use memkv_topo::{Nic, PciAddr, ScratchVerdict, Topology};

#[derive(Args)]
pub struct NetArgs {
    #[command(subcommand)]
    cmd: NetCmd,
}

#[derive(Subcommand)]
enum NetCmd {
    /// Print the GPUs, the NICs and the NIC each GPU uses (nearest by PCIe topology), and whether
    /// direct mode's `memkv_scratch_medium: auto` would put scratch in GPU memory.
    Topo(topo::TopoArgs),
    /// Check this host end to end: the topology, libfabric and its providers, and put/get round
    /// trips through a temporary server on loopback. Exit 1 if a check failed.
    Selftest(selftest::SelftestArgs),
}

/// Where to read the topology and which NICs to keep; shared by `topo` and `selftest`.
#[derive(Args)]
struct TopoSource {
    /// Read this sysfs tree instead of the host's (recorded trees, tests).
    #[arg(long, default_value = "/sys")]
    sysfs: PathBuf,
    /// Comma-separated NIC names to use (e.g. mlx5_0,mlx5_1); empty = all.
    #[arg(
        long,
        env = "MEMKV_RDMA_DEVICES",
        hide_env_values = true,
        default_value = ""
    )]
    rdma_devices: String,
}

impl TopoSource {
    fn read(&self) -> Result<Topology, String> {
        Topology::read(&self.sysfs)
            .and_then(|t| t.narrow(&device_list(&self.rdma_devices)))
            .map_err(|e| e.to_string())
    }
}

pub fn run(a: NetArgs) -> Result<i32, String> {
    match a.cmd {
        NetCmd::Topo(t) => topo::run(t),
        NetCmd::Selftest(s) => selftest::run(s),
    }
}

/// `MEMKV_RDMA_DEVICES`' comma list.
pub fn device_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(String::from)
        .collect()
}

/// Whether the RDMA transport can reach GPU memory through `nic` (Ok: how; Err: why not), for
/// `memkv net topo`: asks libfabric for a domain of that name that registers GPU memory, as a
/// client started with `gpu_memory` does.
fn device_memory(nic: &Nic) -> Result<String, String> {
    let fab = memkv_fabric::Fabric::open_for(None, std::slice::from_ref(&nic.name), true)
        .map_err(|e| format!("libfabric opens no domain {} ({e})", nic.name))?;
    fab.device_memory().map(String::from).map_err(String::from)
}

/// The NIC (name, and how near: "same PCIe switch", ...) the rank of the GPU at PCI address
/// `gpu` uses, among the NICs narrowed to `rdma_devices` (empty = all); None when sysfs lists no
/// GPU there or no NIC. A malformed address, an unknown device name or an unreadable sysfs is
/// an error.
pub fn nic_for_gpu(
    sysfs: &Path,
    gpu: &str,
    rdma_devices: &[String],
) -> Result<Option<(String, &'static str)>, String> {
    let addr: PciAddr = gpu.parse()?;
    let topo = Topology::read(sysfs)
        .and_then(|t| t.narrow(rdma_devices))
        .map_err(|e| e.to_string())?;
    Ok(topo
        .nic_for_gpu(addr)
        .map(|(n, p)| (n.name.clone(), p.describe())))
}

/// The answer to direct mode's `memkv_scratch_medium: auto` for the GPU at PCI address `gpu`,
/// with the NICs narrowed to `rdma_devices` (empty = all), given whether the client's transport
/// registers GPU memory (`reach`: Ok how, Err why not). A malformed address or an unknown device
/// name is an error; a host whose sysfs cannot be read gets a "no" with the reason.
pub fn gpu_scratch_verdict(
    sysfs: &Path,
    gpu: &str,
    rdma_devices: &[String],
    reach: Result<String, String>,
) -> Result<ScratchVerdict, String> {
    let addr: PciAddr = gpu.parse()?;
    let topo = match Topology::read(sysfs) {
        Ok(t) => t,
        Err(e) => {
            return Ok(ScratchVerdict {
                gpu: false,
                reason: e.to_string(),
            })
        }
    };
    let topo = topo.narrow(rdma_devices).map_err(|e| e.to_string())?;
    Ok(memkv_topo::gpu_scratch(&topo, addr, |_| reach))
}
