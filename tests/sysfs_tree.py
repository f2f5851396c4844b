"""Builds a sysfs tree like the kernel's from a recorded description (tests/data/sysfs/*.json),
so `memkv net topo --sysfs ROOT` reads directories and relative symlinks as it does in /sys.

A description lists what the topology reader looks at and nothing else:

- ``pci``: PCI functions by canonical path below ``devices/`` (``pci0000:00/0000:00:01.0/...``)
  with ``vendor``, ``class`` and ``numa`` (-1: unknown). Every PCI directory on the way is a
  function too (``bus/pci/devices/<addr>`` links to each); bridges not listed get a PCIe bridge's
  class and a switch vendor's id, so the reader must tell them from GPUs.
- ``infiniband``: RDMA devices by name: ``device`` (a listed function's address), ``ports``
  (port number -> ``state``, ``link_layer``) and ``netdevs`` (interfaces on the same function).
- ``net``: interfaces by name: the function's address, optionally followed by a child device
  (``0000:00:03.0/virtio2``), or null for a virtual interface (``lo``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "sysfs"
BRIDGE = {"vendor": "0x10b5", "class": "0x060400", "numa": -1}


def link(at: Path, target: Path) -> None:
    """A relative symlink at ``at`` to ``target``, as the kernel makes them."""
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(os.path.relpath(target, at.parent))


def build(name: str, root: Path) -> Path:
    """Builds tests/data/sysfs/<name>.json below ``root``; returns ``root``."""
    spec = json.loads((DATA / f"{name}.json").read_text())
    devices = root / "devices"
    functions: dict[str, Path] = {}
    listed: dict[str, dict] = {}
    for path, attrs in spec["pci"].items():
        parts = path.split("/")
        for depth in range(2, len(parts) + 1):  # parts[0] is the host bridge
            functions[parts[depth - 1]] = devices.joinpath(*parts[:depth])
        listed[parts[-1]] = attrs
    for addr, d in functions.items():
        attrs = listed.get(addr, BRIDGE)
        d.mkdir(parents=True, exist_ok=True)
        (d / "vendor").write_text(attrs["vendor"] + "\n")
        (d / "class").write_text(attrs["class"] + "\n")
        (d / "numa_node").write_text(f"{attrs['numa']}\n")
        link(root / "bus" / "pci" / "devices" / addr, d)
    for ib, attrs in spec.get("infiniband", {}).items():
        fn = functions[attrs["device"]]
        d = fn / "infiniband" / ib
        d.mkdir(parents=True)
        link(d / "device", fn)
        link(root / "class" / "infiniband" / ib, d)
        for port, p in attrs.get("ports", {}).items():
            pd = d / "ports" / port
            pd.mkdir(parents=True)
            (pd / "state").write_text(p["state"] + "\n")
            (pd / "link_layer").write_text(p["link_layer"] + "\n")
        for nd in attrs.get("netdevs", []):
            (fn / "net" / nd).mkdir(parents=True)
            link(root / "class" / "net" / nd, fn / "net" / nd)
            link(fn / "net" / nd / "device", fn)
    for nd, where in spec.get("net", {}).items():
        if where is None:
            d = devices / "virtual" / "net" / nd
            d.mkdir(parents=True)
        else:
            addr, _, child = where.partition("/")
            parent = functions[addr] / child if child else functions[addr]
            parent.mkdir(parents=True, exist_ok=True)
            d = parent / "net" / nd
            d.mkdir(parents=True)
            link(d / "device", parent)
        link(root / "class" / "net" / nd, d)
    return root


def record(sysfs: Path = Path("/sys")) -> dict:
    """The description of a host's tree, as ``build`` reads it (run on a host with
    ``python tests/sysfs_tree.py > tests/data/sysfs/<name>.json`` to record it)."""
    devices = (sysfs / "devices").resolve()

    def below(p: Path) -> str:
        return str(p.resolve().relative_to(devices))

    def text(p: Path) -> str:
        return p.read_text().strip()

    pci = {}
    for fn in sorted((sysfs / "bus" / "pci" / "devices").iterdir()):
        pci[below(fn)] = {"vendor": text(fn / "vendor"), "class": text(fn / "class"),
                          "numa": int(text(fn / "numa_node")) if (fn / "numa_node").exists()
                          else -1}
    ib_dir = sysfs / "class" / "infiniband"
    infiniband = {}
    for d in sorted(ib_dir.iterdir()) if ib_dir.exists() else []:
        ports = sorted((d / "ports").iterdir()) if (d / "ports").exists() else []
        net = d / "device" / "net"
        infiniband[d.name] = {
            "device": (d / "device").resolve().name,
            "ports": {p.name: {"state": text(p / "state"), "link_layer": text(p / "link_layer")}
                      for p in ports},
            "netdevs": sorted(n.name for n in net.iterdir()) if net.exists() else [],
        }
    ib_netdevs = {n for d in infiniband.values() for n in d["netdevs"]}
    net = {}
    for d in sorted((sysfs / "class" / "net").iterdir()):
        if d.name in ib_netdevs:
            continue
        if not (d / "device").exists():
            net[d.name] = None
            continue
        path = below(d / "device").split("/")
        # The PCI function, then what hangs below it (virtio2) if anything.
        i = max(k for k, p in enumerate(path) if len(p) >= 12 and p[-2] == ".")
        net[d.name] = "/".join(path[i:])
    return {"about": "recorded", "pci": pci, "infiniband": infiniband, "net": net}


if __name__ == "__main__":
    print(json.dumps(record(), indent=1))
