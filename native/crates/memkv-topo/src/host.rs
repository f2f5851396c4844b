//! What direct mode asks of a host about one of its GPUs, named by PCI address as the CUDA
//! driver gives it: the NIC that GPU's rank uses, and whether its scratch goes in GPU memory.
//! Each call reads the topology below the sysfs root it is given, with the NICs narrowed to the
//! configured `MEMKV_RDMA_DEVICES`.

use std::path::Path;

use crate::{gpu_scratch, PciAddr, ScratchVerdict, TopoError, Topology};

fn address(gpu: &str) -> Result<PciAddr, TopoError> {
    gpu.parse().map_err(TopoError::Address)
}

/// The NIC (name, and how near: "same PCIe switch", ...) the rank of the GPU at PCI address
/// `gpu` uses, among the NICs narrowed to `rdma_devices` (empty = all); None when sysfs lists no
/// GPU there or no NIC. A malformed address, an unknown device name or an unreadable sysfs is
/// an error.
pub fn nic_for_gpu(
    sysfs: &Path,
    gpu: &str,
    rdma_devices: &[String],
) -> Result<Option<(String, &'static str)>, TopoError> {
    let addr = address(gpu)?;
    let topo = Topology::read(sysfs)?.narrow(rdma_devices)?;
    Ok(topo
        .nic_for_gpu(addr)
        .map(|(n, p)| (n.name.clone(), p.describe())))
}

/// The answer to direct mode's `memkv_scratch_medium: auto` for the GPU at PCI address `gpu`,
/// with the NICs narrowed to `rdma_devices` (empty = all), given whether the client's transport
/// registers GPU memory (`reach`: Ok how, Err why not). A malformed address or an unknown device
/// name is an error; a host whose sysfs cannot be read gets a "no" with the reason, since
/// host-memory scratch works everywhere.
pub fn gpu_scratch_verdict(
    sysfs: &Path,
    gpu: &str,
    rdma_devices: &[String],
    reach: Result<String, String>,
) -> Result<ScratchVerdict, TopoError> {
    let addr = address(gpu)?;
    let topo = match Topology::read(sysfs) {
        Ok(t) => t,
        Err(e) => {
            return Ok(ScratchVerdict {
                gpu: false,
                reason: e.to_string(),
            })
        }
    };
    Ok(gpu_scratch(&topo.narrow(rdma_devices)?, addr, |_| reach))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOWHERE: &str = "/nonexistent/memkv-topo-sysfs";

    #[test]
    fn a_malformed_address_is_an_error_naming_it() {
        let e = nic_for_gpu(Path::new("/sys"), "cuda:0", &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "'cuda:0' is not a PCI address (like 0000:1b:00.0)"
        );
        let e = gpu_scratch_verdict(Path::new(NOWHERE), "cuda:0", &[], Ok("x".into()));
        assert!(matches!(e, Err(TopoError::Address(_))), "{e:?}");
    }

    #[test]
    fn an_unreadable_sysfs_is_an_error_for_the_nic_and_a_no_for_gpu_scratch() {
        let e = nic_for_gpu(Path::new(NOWHERE), "0000:18:00.0", &[]).unwrap_err();
        assert!(e.to_string().starts_with("cannot read sysfs at "), "{e}");
        let v = gpu_scratch_verdict(
            Path::new(NOWHERE),
            "00000000:18:00.0",
            &[],
            Ok("verbs registers CUDA memory".into()),
        )
        .unwrap();
        assert!(
            !v.gpu && v.reason.starts_with("cannot read sysfs at "),
            "{v:?}"
        );
    }

    #[test]
    fn on_a_host_without_devices_no_gpu_has_a_nic_and_a_named_nic_is_unknown() {
        // An empty sysfs tree is a readable host with no PCI device at all.
        let root = std::env::temp_dir().join(format!("memkv-topo-bare-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let found = nic_for_gpu(&root, "0000:18:00.0", &[]);
        let unknown =
            gpu_scratch_verdict(&root, "0000:18:00.0", &["mlx5_9".into()], Ok("x".into()));
        let none = gpu_scratch_verdict(&root, "0000:18:00.0", &[], Ok("x".into()));
        std::fs::remove_dir(&root).unwrap();
        assert_eq!(found.unwrap(), None);
        let e = unknown.unwrap_err().to_string();
        assert!(e.contains("names mlx5_9 but this host has no NIC"), "{e}");
        assert_eq!(none.unwrap().reason, "sysfs lists no GPU at 0000:18:00.0");
    }
}
