//! The host's PCIe topology as the kernel shows it in sysfs: GPUs, RDMA NICs (and plain network
//! devices, which the tcp provider uses), where each sits, and which NIC each GPU should use.
//!
//! Everything reads below a sysfs root given by the caller (`/sys` on a host), so tests run the
//! same code over recorded trees. Nothing here touches a device or a fabric library.

pub mod host;
mod pci;
mod sysfs;

use std::path::PathBuf;

pub use pci::{PciAddr, PciPlace, Proximity};

/// The GPU vendors whose devices direct mode can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuVendor {
    Nvidia,
    Amd,
}

impl GpuVendor {
    pub fn name(self) -> &'static str {
        match self {
            GpuVendor::Nvidia => "NVIDIA",
            GpuVendor::Amd => "AMD",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Position in PCI address order: the numbering of `nvidia-smi`, and of CUDA with
    /// CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA's default order may differ: match GPUs by address).
    pub index: usize,
    pub vendor: GpuVendor,
    pub place: PciPlace,
}

/// How a NIC is reached through libfabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NicKind {
    /// An RDMA device (`/sys/class/infiniband`): InfiniBand, RoCE, AWS EFA; libfabric's verbs
    /// or efa provider.
    Rdma,
    /// A PCI network device with no RDMA device on it: only the tcp provider uses it.
    Net,
}

impl NicKind {
    pub fn name(self) -> &'static str {
        match self {
            NicKind::Rdma => "rdma",
            NicKind::Net => "net",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// The name `MEMKV_RDMA_DEVICES` uses: the RDMA device (`mlx5_0`, `efa_0`) or, for a plain
    /// network device, the interface (`eth0`).
    pub name: String,
    pub kind: NicKind,
    pub place: PciPlace,
    /// Network interfaces on the same PCI function (RoCE and IPoIB have one).
    pub netdevs: Vec<String>,
    /// Per port of an RDMA device, `InfiniBand` or `Ethernet`.
    pub link_layers: Vec<String>,
    /// Whether any port of an RDMA device is ACTIVE (a NIC with none is never paired); None for
    /// a plain network device or where sysfs shows no port.
    pub active: Option<bool>,
}

/// The NIC a GPU uses and how near it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    /// Index into `Topology::gpus`.
    pub gpu: usize,
    /// Index into `Topology::nics`, None when there is no NIC.
    pub nic: Option<usize>,
    pub proximity: Option<Proximity>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// In PCI address order.
    pub gpus: Vec<Gpu>,
    /// RDMA devices by name, then plain network devices by name.
    pub nics: Vec<Nic>,
    /// Network interfaces on no PCI device (`lo`): libfabric's tcp provider can use them, so
    /// `MEMKV_RDMA_DEVICES` may name them, but they are nobody's nearest NIC.
    pub virtual_interfaces: Vec<String>,
}

/// Suffixes libfabric adds to a device's name to name its domains: the efa provider's
/// reliable-datagram and datagram domains (`rdmap0s31-rdm`, `efa_0-dgrm`) and the verbs
/// provider's datagram domain (`mlx5_0-dgram`, which `ofi_rxd` layers reliable datagrams over).
const DOMAIN_SUFFIXES: [&str; 3] = ["-rdm", "-dgrm", "-dgram"];

/// The device a libfabric domain is on: the name without its provider's suffix
/// (`rdmap0s31-rdm` is on `rdmap0s31`); other domains (verbs' `mlx5_0`, tcp's `lo`) are named
/// after their device. So `MEMKV_RDMA_DEVICES` may name a device as sysfs does or as
/// `fi_info` does.
pub fn device_of_domain(domain: &str) -> &str {
    DOMAIN_SUFFIXES
        .iter()
        .find_map(|s| domain.strip_suffix(s))
        .filter(|d| !d.is_empty())
        .unwrap_or(domain)
}

/// `MEMKV_RDMA_DEVICES`' comma list of device names, blanks dropped.
pub fn device_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(String::from)
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum TopoError {
    /// A GPU named by a string that is no PCI address; the text says so.
    #[error("{0}")]
    Address(String),
    #[error("cannot read sysfs at {path}: {source}")]
    Sysfs {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "MEMKV_RDMA_DEVICES names {unknown} but this host has {known} \
         (see `memkv net topo`)"
    )]
    UnknownNics { unknown: String, known: String },
}

impl Topology {
    /// Reads the topology below `root` (`/sys` on a host). A host without GPUs, RDMA devices or
    /// even PCI is a valid, empty answer; only an unreadable root is an error.
    pub fn read(root: &std::path::Path) -> Result<Topology, TopoError> {
        sysfs::read(root)
    }

    /// Keeps only the NICs named in `names` (MEMKV_RDMA_DEVICES); an empty list keeps all. A
    /// name this host does not have is an error naming those it has, not a silent fallback.
    pub fn narrow(mut self, names: &[String]) -> Result<Topology, TopoError> {
        let names: Vec<&str> = names
            .iter()
            .map(|n| n.trim())
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            return Ok(self);
        }
        // A name is the device's own or one of its libfabric domains (`rdmap0s31-rdm`).
        let named = |dev: &str| {
            names
                .iter()
                .any(|n| *n == dev || device_of_domain(n) == dev)
        };
        let has = |dev: &str| {
            self.nics.iter().any(|nic| nic.name == dev)
                || self.virtual_interfaces.iter().any(|v| v == dev)
        };
        let unknown: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| !has(n) && !has(device_of_domain(n)))
            .collect();
        if !unknown.is_empty() {
            let known: Vec<&str> = self
                .nics
                .iter()
                .map(|n| n.name.as_str())
                .chain(self.virtual_interfaces.iter().map(String::as_str))
                .collect();
            return Err(TopoError::UnknownNics {
                unknown: unknown.join(", "),
                known: if known.is_empty() {
                    "no NIC".into()
                } else {
                    known.join(", ")
                },
            });
        }
        self.nics.retain(|n| named(&n.name));
        self.virtual_interfaces.retain(|v| named(v));
        Ok(self)
    }

    /// The NIC each GPU uses: the nearest (same switch, then root complex, then NUMA node, then
    /// any), among RDMA devices with an ACTIVE port where there is one, else among plain network
    /// devices. Ties go to the NIC fewer GPUs use so far, then to the name, so GPUs sharing a
    /// switch with as many NICs spread over them, and every rank computes the same pairing on
    /// its own.
    pub fn pairing(&self) -> Vec<Pair> {
        let usable = |n: &Nic| n.kind == NicKind::Rdma && n.active != Some(false);
        let candidate: &dyn Fn(&Nic) -> bool = if self.nics.iter().any(usable) {
            &usable
        } else {
            &|n: &Nic| n.kind == NicKind::Net
        };
        let mut load = vec![0usize; self.nics.len()];
        self.gpus
            .iter()
            .enumerate()
            .map(|(g, gpu)| {
                let best = self
                    .nics
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| candidate(n))
                    .min_by_key(|(i, n)| (Proximity::of(&gpu.place, &n.place), load[*i], &n.name));
                match best {
                    Some((i, n)) => {
                        load[i] += 1;
                        Pair {
                            gpu: g,
                            nic: Some(i),
                            proximity: Some(Proximity::of(&gpu.place, &n.place)),
                        }
                    }
                    None => Pair {
                        gpu: g,
                        nic: None,
                        proximity: None,
                    },
                }
            })
            .collect()
    }

    /// The GPU at `addr`, if sysfs lists one there.
    pub fn gpu(&self, addr: PciAddr) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.place.addr == addr)
    }

    /// The NIC the GPU at `addr` uses by `pairing`, and how near it is; None when sysfs lists
    /// no GPU there or no NIC can be paired.
    pub fn nic_for_gpu(&self, addr: PciAddr) -> Option<(&Nic, Proximity)> {
        let pair = self.pairing()[self.gpu(addr)?.index];
        Some((&self.nics[pair.nic?], pair.proximity?))
    }
}

/// Whether direct mode's `memkv_scratch_medium: auto` should put scratch in a GPU's memory, and
/// why (the reason is logged either way).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScratchVerdict {
    pub gpu: bool,
    pub reason: String,
}

/// GPU scratch pays only where the GPU's NIC (by `Topology::pairing`) shares its PCIe switch,
/// so the NIC's DMA into GPU memory stays below the switch, AND the fabric provider can reach
/// device memory through that NIC: `device_memory` answers the latter (Ok: a description of
/// how, Err: why not); it is asked only when the topology allows.
pub fn gpu_scratch(
    topo: &Topology,
    gpu: PciAddr,
    device_memory: impl FnOnce(&Nic) -> Result<String, String>,
) -> ScratchVerdict {
    let no = |reason: String| ScratchVerdict { gpu: false, reason };
    if topo.gpu(gpu).is_none() {
        return no(format!("sysfs lists no GPU at {gpu}"));
    }
    let Some((nic, prox)) = topo.nic_for_gpu(gpu) else {
        return no(format!("GPU {gpu} has no NIC to pair with"));
    };
    if nic.kind != NicKind::Rdma {
        return no(format!(
            "GPU {gpu}'s NIC {} is a plain network device (tcp provider), which reads host memory only",
            nic.name
        ));
    }
    if prox != Proximity::Switch {
        return no(format!(
            "GPU {gpu}'s nearest RDMA NIC {} is not below its PCIe switch ({})",
            nic.name,
            prox.describe()
        ));
    }
    match device_memory(nic) {
        Ok(how) => ScratchVerdict {
            gpu: true,
            reason: format!(
                "RDMA NIC {} shares GPU {gpu}'s PCIe switch and {how}",
                nic.name
            ),
        },
        Err(why) => no(format!(
            "RDMA NIC {} shares GPU {gpu}'s PCIe switch but {why}",
            nic.name
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(path: &str, numa: u32) -> PciPlace {
        PciPlace::from_path(path, Some(numa)).unwrap()
    }

    fn gpu(index: usize, path: &str, numa: u32) -> Gpu {
        Gpu {
            index,
            vendor: GpuVendor::Nvidia,
            place: place(path, numa),
        }
    }

    fn nic(name: &str, kind: NicKind, path: &str, numa: u32, active: Option<bool>) -> Nic {
        Nic {
            name: name.into(),
            kind,
            place: place(path, numa),
            netdevs: vec![],
            link_layers: vec![],
            active,
        }
    }

    const SW_A: &str = "devices/pci0000:00/0000:00:01.0/0000:01:00.0";
    const SW_B: &str = "devices/pci0000:80/0000:80:01.0/0000:81:00.0";

    /// Two GPUs and two NICs below switch A, one GPU below switch B on the other socket.
    fn host() -> Topology {
        Topology {
            gpus: vec![
                gpu(0, &format!("{SW_A}/0000:02:00.0/0000:03:00.0"), 0),
                gpu(1, &format!("{SW_A}/0000:02:01.0/0000:04:00.0"), 0),
                gpu(2, &format!("{SW_B}/0000:82:00.0/0000:83:00.0"), 1),
            ],
            nics: vec![
                nic(
                    "mlx5_0",
                    NicKind::Rdma,
                    &format!("{SW_A}/0000:02:02.0/0000:05:00.0"),
                    0,
                    Some(true),
                ),
                nic(
                    "mlx5_1",
                    NicKind::Rdma,
                    &format!("{SW_A}/0000:02:03.0/0000:06:00.0"),
                    0,
                    Some(true),
                ),
                nic(
                    "eth0",
                    NicKind::Net,
                    &format!("{SW_B}/0000:82:01.0/0000:84:00.0"),
                    1,
                    None,
                ),
            ],
            virtual_interfaces: vec!["lo".into()],
        }
    }

    fn names(t: &Topology) -> Vec<Option<&str>> {
        t.pairing()
            .iter()
            .map(|p| p.nic.map(|i| t.nics[i].name.as_str()))
            .collect()
    }

    #[test]
    fn gpus_on_one_switch_spread_over_its_nics_and_rdma_beats_a_nearer_plain_nic() {
        let t = host();
        assert_eq!(names(&t), [Some("mlx5_0"), Some("mlx5_1"), Some("mlx5_0")]);
        let prox: Vec<_> = t.pairing().iter().map(|p| p.proximity).collect();
        assert_eq!(
            prox,
            [
                Some(Proximity::Switch),
                Some(Proximity::Switch),
                Some(Proximity::Far)
            ]
        );
    }

    #[test]
    fn a_gpus_nic_is_its_entry_in_the_pairing() {
        let t = host();
        let at = |a: &str| a.parse::<PciAddr>().unwrap();
        let (n, p) = t.nic_for_gpu(at("0000:04:00.0")).unwrap();
        assert_eq!((n.name.as_str(), p), ("mlx5_1", Proximity::Switch));
        assert!(t.nic_for_gpu(at("0000:05:00.0")).is_none());
    }

    #[test]
    fn a_nic_without_an_active_port_is_not_paired() {
        let mut t = host();
        t.nics[1].active = Some(false);
        assert_eq!(names(&t), [Some("mlx5_0"), Some("mlx5_0"), Some("mlx5_0")]);
        t.nics[0].active = Some(false);
        // No usable RDMA NIC left: the tcp provider's plain network device.
        assert_eq!(names(&t), [Some("eth0"); 3]);
    }

    #[test]
    fn without_nics_no_gpu_is_paired() {
        let mut t = host();
        t.nics.clear();
        assert!(t
            .pairing()
            .iter()
            .all(|p| p.nic.is_none() && p.proximity.is_none()));
        let v = gpu_scratch(&t, "0000:03:00.0".parse().unwrap(), |_| unreachable!());
        assert!(!v.gpu && v.reason.contains("no NIC"), "{}", v.reason);
    }

    #[test]
    fn the_device_list_is_the_comma_separated_names_without_blanks() {
        assert_eq!(device_list(" mlx5_0, ,mlx5_1,"), ["mlx5_0", "mlx5_1"]);
        assert!(device_list("").is_empty());
    }

    #[test]
    fn a_domain_is_on_the_device_its_name_starts_with() {
        assert_eq!(device_of_domain("rdmap0s31-rdm"), "rdmap0s31");
        assert_eq!(device_of_domain("efa_0-dgrm"), "efa_0");
        assert_eq!(device_of_domain("mlx5_0-dgram"), "mlx5_0");
        assert_eq!(device_of_domain("mlx5_0"), "mlx5_0");
        assert_eq!(device_of_domain("lo"), "lo");
        assert_eq!(device_of_domain("-rdm"), "-rdm");
    }

    #[test]
    fn narrowing_keeps_the_named_nics_and_refuses_unknown_names() {
        let t = host().narrow(&["mlx5_1".into(), " ".into()]).unwrap();
        assert_eq!(names(&t), [Some("mlx5_1"); 3]);
        assert_eq!(host().narrow(&[]).unwrap(), host());
        let e = host()
            .narrow(&["mlx5_1".into(), "mlx5_9".into(), "ib7".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("names mlx5_9, ib7 but this host has mlx5_0, mlx5_1, eth0, lo"),
            "{e}"
        );
        // A device named as libfabric names its domain: efa's `<device>-rdm`.
        let t = host().narrow(&["mlx5_1-rdm".into()]).unwrap();
        assert_eq!(names(&t), [Some("mlx5_1"); 3]);
        let e = host()
            .narrow(&["mlx5_9-rdm".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("names mlx5_9-rdm but"), "{e}");
        // The tcp provider's loopback is a valid name, and nobody's NIC.
        let lo = host().narrow(&["lo".into()]).unwrap();
        assert!(lo.nics.is_empty() && lo.virtual_interfaces == ["lo"]);
        assert_eq!(names(&lo), [None; 3]);
        let mut bare = host();
        bare.nics.clear();
        bare.virtual_interfaces.clear();
        let e = bare.narrow(&["mlx5_0".into()]).unwrap_err().to_string();
        assert!(e.contains("this host has no NIC"), "{e}");
    }

    #[test]
    fn gpu_scratch_needs_a_switch_local_rdma_nic_and_a_provider_that_reaches_gpu_memory() {
        let t = host();
        let at = |a: &str| a.parse::<PciAddr>().unwrap();
        let yes = gpu_scratch(&t, at("0000:04:00.0"), |n| {
            assert_eq!(n.name, "mlx5_1");
            Ok("verbs registers CUDA memory".into())
        });
        assert!(yes.gpu, "{}", yes.reason);
        assert!(yes
            .reason
            .contains("mlx5_1 shares GPU 0000:04:00.0's PCIe switch and verbs"));
        let no = gpu_scratch(&t, at("0000:03:00.0"), |_| Err("no FI_HMEM".into()));
        assert!(
            !no.gpu && no.reason.ends_with("but no FI_HMEM"),
            "{}",
            no.reason
        );
        let far = gpu_scratch(&t, at("0000:83:00.0"), |_| unreachable!());
        assert!(
            !far.gpu && far.reason.contains("not below its PCIe switch"),
            "{}",
            far.reason
        );
        let absent = gpu_scratch(&t, at("0000:05:00.0"), |_| unreachable!());
        assert_eq!(absent.reason, "sysfs lists no GPU at 0000:05:00.0");
        let mut plain = host();
        plain.nics.retain(|n| n.kind == NicKind::Net);
        let v = gpu_scratch(&plain, at("0000:83:00.0"), |_| unreachable!());
        assert!(
            !v.gpu && v.reason.contains("plain network device"),
            "{}",
            v.reason
        );
    }
}
