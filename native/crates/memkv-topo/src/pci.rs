//! PCI addresses and where a device sits in the PCIe tree, from its canonical sysfs path.

use std::fmt;
use std::str::FromStr;

/// A PCI function address (domain:bus:device.function), ordered as the kernel and `nvidia-smi`
/// list devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddr {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl FromStr for PciAddr {
    type Err = String;

    /// Accepts the kernel's `0000:1b:00.0`, `nvidia-smi`'s `00000000:1B:00.0` and a bare
    /// `1b:00.0` (domain 0).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("'{s}' is not a PCI address (like 0000:1b:00.0)");
        let (head, function) = s.rsplit_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = head.split(':').collect();
        let (domain, bus, device) = match parts[..] {
            [d, b, v] => (d, b, v),
            [b, v] => ("0", b, v),
            _ => return Err(bad()),
        };
        let hex = |t: &str, max_digits: usize| {
            if t.is_empty() || t.len() > max_digits {
                return Err(bad());
            }
            u32::from_str_radix(t, 16).map_err(|_| bad())
        };
        let (device, function) = (hex(device, 2)?, hex(function, 1)?);
        if device > 0x1f || function > 7 {
            return Err(bad());
        }
        Ok(PciAddr {
            domain: hex(domain, 8)?,
            bus: hex(bus, 2)? as u8,
            device: device as u8,
            function: function as u8,
        })
    }
}

/// Where a PCI function sits: its host bridge (root complex), the chain of PCI functions from
/// the root port down to it, and its NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciPlace {
    pub addr: PciAddr,
    /// The host bridge's sysfs name, e.g. `pci0000:00`.
    pub root_complex: String,
    /// Root port first, the device itself last.
    pub chain: Vec<PciAddr>,
    /// None where the kernel does not know (`numa_node` is -1 or missing).
    pub numa_node: Option<u32>,
}

impl PciPlace {
    /// The upstream port of the topmost PCIe switch above the device (the chain's second
    /// element), or None for a device attached to its root port directly. Two devices below the
    /// same top-level switch exchange traffic without crossing the root complex, which is what
    /// peer-to-peer DMA from a NIC into GPU memory needs to be fast; nested switches below it
    /// count as the same switch.
    pub fn switch(&self) -> Option<PciAddr> {
        (self.chain.len() >= 3).then(|| self.chain[1])
    }

    /// Reads a place from a canonical sysfs path relative to the sysfs root, such as
    /// `devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0` or, for a net
    /// device behind virtio, `devices/pci0000:00/0000:00:03.0/virtio2`: the device is the last
    /// PCI address after the last host bridge. None when the path has no PCI device (a virtual
    /// net device).
    pub fn from_path(rel: &str, numa_node: Option<u32>) -> Option<PciPlace> {
        let parts: Vec<&str> = rel.split('/').collect();
        let host = parts.iter().rposition(|p| is_host_bridge(p))?;
        let chain: Vec<PciAddr> = parts[host + 1..]
            .iter()
            .map_while(|p| p.parse().ok())
            .collect();
        Some(PciPlace {
            addr: *chain.last()?,
            root_complex: parts[host].to_string(),
            chain,
            numa_node,
        })
    }
}

/// `pci0000:00`, `pci10000:e0` (Intel VMD), `pci7870:00` (Hyper-V): a host bridge's directory.
fn is_host_bridge(name: &str) -> bool {
    name.strip_prefix("pci")
        .and_then(|r| r.split_once(':'))
        .is_some_and(|(d, b)| {
            !d.is_empty()
                && b.len() == 2
                && d.chars().chain(b.chars()).all(|c| c.is_ascii_hexdigit())
        })
}

/// How near two PCI devices are, nearest first. Derives `Ord` in that order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proximity {
    /// Below the same top-level PCIe switch.
    Switch,
    /// Below the same host bridge.
    RootComplex,
    /// Attached to the same NUMA node (same CPU socket).
    Numa,
    /// Anywhere else, or where the kernel reports no NUMA node.
    Far,
}

impl Proximity {
    pub fn of(a: &PciPlace, b: &PciPlace) -> Proximity {
        if a.switch().is_some() && a.switch() == b.switch() && a.root_complex == b.root_complex {
            Proximity::Switch
        } else if a.root_complex == b.root_complex {
            Proximity::RootComplex
        } else if a.numa_node.is_some() && a.numa_node == b.numa_node {
            Proximity::Numa
        } else {
            Proximity::Far
        }
    }

    /// The short name used in `memkv net topo --json`.
    pub fn key(self) -> &'static str {
        match self {
            Proximity::Switch => "switch",
            Proximity::RootComplex => "root_complex",
            Proximity::Numa => "numa",
            Proximity::Far => "far",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Proximity::Switch => "same PCIe switch",
            Proximity::RootComplex => "same root complex",
            Proximity::Numa => "same NUMA node",
            Proximity::Far => "across NUMA nodes",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_in_the_kernels_and_nvidia_smis_spelling() {
        let a: PciAddr = "0000:1b:00.0".parse().unwrap();
        assert_eq!(a, "00000000:1B:00.0".parse().unwrap());
        assert_eq!(a, "1b:00.0".parse().unwrap());
        assert_eq!(a.to_string(), "0000:1b:00.0");
        assert_eq!(
            "10000:e0:1f.7".parse::<PciAddr>().unwrap().to_string(),
            "10000:e0:1f.7"
        );
        for bad in [
            "",
            "1b:00",
            "0000:1b:00.8",
            "0000:1b:20.0",
            "x:1b:00.0",
            "0:0:1:2.0",
        ] {
            assert!(bad.parse::<PciAddr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_place_is_read_from_the_canonical_path() {
        let p = PciPlace::from_path(
            "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0",
            Some(1),
        )
        .unwrap();
        assert_eq!(p.addr.to_string(), "0000:03:00.0");
        assert_eq!(p.root_complex, "pci0000:00");
        assert_eq!(p.switch().unwrap().to_string(), "0000:01:00.0");
        let v = PciPlace::from_path("devices/pci0000:00/0000:00:03.0/virtio2", None).unwrap();
        assert_eq!(v.addr.to_string(), "0000:00:03.0");
        assert_eq!(v.switch(), None);
        assert!(PciPlace::from_path("devices/virtual/net/lo", None).is_none());
    }

    #[test]
    fn proximity_prefers_switch_then_root_complex_then_numa() {
        let at = |p: &str, n| PciPlace::from_path(p, n).unwrap();
        let gpu = at(
            "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",
            Some(0),
        );
        let nic_sw = at(
            "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0",
            Some(0),
        );
        let nic_rc = at("devices/pci0000:00/0000:00:02.0/0000:05:00.0", Some(0));
        let nic_numa = at("devices/pci0000:40/0000:40:01.0/0000:41:00.0", Some(0));
        let nic_far = at("devices/pci0000:80/0000:80:01.0/0000:81:00.0", Some(1));
        assert_eq!(Proximity::of(&gpu, &nic_sw), Proximity::Switch);
        assert_eq!(Proximity::of(&gpu, &nic_rc), Proximity::RootComplex);
        assert_eq!(Proximity::of(&gpu, &nic_numa), Proximity::Numa);
        assert_eq!(Proximity::of(&gpu, &nic_far), Proximity::Far);
        // An unknown NUMA node is near nothing across root complexes.
        let a = at("devices/pci0000:40/0000:40:01.0/0000:41:00.0", None);
        let b = at("devices/pci0000:80/0000:80:01.0/0000:81:00.0", None);
        assert_eq!(Proximity::of(&a, &b), Proximity::Far);
        assert!(Proximity::Switch < Proximity::RootComplex && Proximity::Numa < Proximity::Far);
    }
}
