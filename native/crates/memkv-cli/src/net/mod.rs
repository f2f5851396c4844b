//! `memkv net`: what an operator runs to see whether a host can move KV bytes over RDMA.
//! `topo` shows the PCIe topology and the NIC each GPU uses; `selftest` checks the host end to
//! end. The topology itself (reading sysfs, pairing, the GPU-scratch verdict) is memkv-topo's;
//! this module shows it and adds what needs libfabric.

mod selftest;
mod topo;

use std::path::PathBuf;

use clap::{Args, Subcommand};
use memkv_topo::{device_list, Nic, Topology};

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

/// Whether the RDMA transport can reach GPU memory through `nic` (Ok: how; Err: why not), for
/// `memkv net topo`: asks libfabric for a domain of that name that registers GPU memory, as a
/// client started with `gpu_memory` does.
fn device_memory(nic: &Nic) -> Result<String, String> {
    let fab = memkv_fabric::Fabric::open_for(None, std::slice::from_ref(&nic.name), true)
        .map_err(|e| format!("libfabric opens no domain {} ({e})", nic.name))?;
    fab.device_memory().map(String::from).map_err(String::from)
}
