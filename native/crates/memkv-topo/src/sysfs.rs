//! Reading GPUs and NICs below a sysfs root. The kernel's layout: `bus/pci/devices/<addr>` and
//! `class/{infiniband,net}/<name>/device` are symlinks into `devices/pci<host bridge>/...`,
//! whose canonical path is the device's position in the PCIe tree.

use std::fs;
use std::path::Path;

use crate::pci::{PciAddr, PciPlace};
use crate::{Gpu, GpuVendor, Nic, NicKind, TopoError, Topology};

const VENDOR_NVIDIA: u32 = 0x10de;
const VENDOR_AMD: u32 = 0x1002;
/// PCI base classes of compute GPUs: display controllers (NVIDIA's 3D controller 0x0302, VGA
/// 0x0300, AMD Instinct MI200's 0x0380) and processing accelerators (AMD MI300's 0x1200).
const GPU_BASE_CLASSES: [u32; 2] = [0x03, 0x12];

pub(crate) fn read(root: &Path) -> Result<Topology, TopoError> {
    let root = fs::canonicalize(root).map_err(|source| TopoError::Sysfs {
        path: root.to_path_buf(),
        source,
    })?;
    let mut gpus: Vec<Gpu> = entries(&root.join("bus/pci/devices"))
        .into_iter()
        .filter_map(|(name, path)| {
            let addr: PciAddr = name.parse().ok()?;
            let vendor = match read_hex(&path.join("vendor"))? {
                VENDOR_NVIDIA => GpuVendor::Nvidia,
                VENDOR_AMD => GpuVendor::Amd,
                _ => return None,
            };
            let class = read_hex(&path.join("class"))?;
            if !GPU_BASE_CLASSES.contains(&(class >> 16)) {
                return None;
            }
            let place = place(&root, &path)?;
            (place.addr == addr).then_some(Gpu {
                index: 0,
                vendor,
                place,
            })
        })
        .collect();
    gpus.sort_by_key(|g| g.place.addr);
    for (i, g) in gpus.iter_mut().enumerate() {
        g.index = i;
    }

    let mut nics: Vec<Nic> = entries(&root.join("class/infiniband"))
        .into_iter()
        .filter_map(|(name, path)| {
            let place = place(&root, &path.join("device"))?;
            let ports = entries(&path.join("ports"));
            let states: Vec<String> = ports
                .iter()
                .filter_map(|(_, p)| read_trimmed(&p.join("state")))
                .collect();
            Some(Nic {
                netdevs: entries(&path.join("device/net"))
                    .into_iter()
                    .map(|(n, _)| n)
                    .collect(),
                link_layers: ports
                    .iter()
                    .filter_map(|(_, p)| read_trimmed(&p.join("link_layer")))
                    .collect(),
                // The kernel writes e.g. "4: ACTIVE".
                active: (!states.is_empty()).then(|| states.iter().any(|s| s.ends_with("ACTIVE"))),
                name,
                kind: NicKind::Rdma,
                place,
            })
        })
        .collect();
    let rdma_functions: Vec<PciAddr> = nics.iter().map(|n| n.place.addr).collect();
    let mut virtual_interfaces = Vec::new();
    for (name, path) in entries(&root.join("class/net")) {
        match place(&root, &path.join("device")) {
            None => virtual_interfaces.push(name),
            // An RDMA device's own interface (RoCE, IPoIB) is listed with that device.
            Some(place) if rdma_functions.contains(&place.addr) => {}
            Some(place) => nics.push(Nic {
                name,
                kind: NicKind::Net,
                place,
                netdevs: Vec::new(),
                link_layers: Vec::new(),
                active: None,
            }),
        }
    }
    Ok(Topology {
        gpus,
        nics,
        virtual_interfaces,
    })
}

/// The directory's entries as (name, path), sorted by name; none when it does not exist (a
/// host without RDMA drivers has no `class/infiniband`).
fn entries(dir: &Path) -> Vec<(String, std::path::PathBuf)> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
        .collect();
    v.sort();
    v
}

/// Where the device behind `link` sits; None for a link that does not resolve below `root` to
/// a PCI device (a virtual interface, a dangling link).
fn place(root: &Path, link: &Path) -> Option<PciPlace> {
    let real = fs::canonicalize(link).ok()?;
    let rel = real.strip_prefix(root).ok()?.to_str()?;
    let mut place = PciPlace::from_path(rel, None)?;
    // A net device's link may end below its PCI function (virtio); the function holds numa_node.
    let numa = read_trimmed(
        &root
            .join("bus/pci/devices")
            .join(place.addr.to_string())
            .join("numa_node"),
    );
    place.numa_node = numa.and_then(|n| n.parse().ok());
    Some(place)
}

fn read_trimmed(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

fn read_hex(path: &Path) -> Option<u32> {
    let s = read_trimmed(path)?;
    u32::from_str_radix(s.strip_prefix("0x").unwrap_or(&s), 16).ok()
}
