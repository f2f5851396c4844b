"""`memkv net topo` and `memkv net selftest` through the real `memkv` command, against sysfs trees
recorded in tests/data/sysfs (built below tmp_path with the kernel's directories and relative
symlinks) and against this host's own /sys; and the GPU-scratch answer direct mode asks for."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import sysfs_tree
from memkv_procs import memkv_command

from memkv_vllm import _native


def memkv(*args: str, devices: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMKV_RDMA_DEVICES"}
    if devices is not None:
        env["MEMKV_RDMA_DEVICES"] = devices
    return subprocess.run(memkv_command() + list(args), capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture
def tree(tmp_path: Path):
    """``tree(name)``: the recorded tree ``name`` built below tmp_path; returns its root."""
    return lambda name: str(sysfs_tree.build(name, tmp_path / name))


def topo(root: str, devices: str | None = None) -> dict:
    r = memkv("net", "topo", "--sysfs", root, "--json", devices=devices)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def pairing(t: dict) -> list[tuple[str, str | None, str | None]]:
    return [(p["pci"], p["nic"], p["proximity"]) for p in t["pairing"]]


def test_one_gpu_and_nic_per_switch_pairs_each_gpu_with_its_switchs_nic(tree) -> None:
    t = topo(tree("switch_pairs"))
    # NVIDIA compute GPUs only: not the NVSwitch (a bridge class), not the BMC's VGA (ASPEED).
    assert [(g["index"], g["pci"], g["vendor"]) for g in t["gpus"]] == [
        (0, "0000:18:00.0", "NVIDIA"), (1, "0000:3a:00.0", "NVIDIA"),
        (2, "0000:9a:00.0", "NVIDIA"), (3, "0000:ba:00.0", "NVIDIA")]
    g0 = t["gpus"][0]
    assert (g0["numa_node"], g0["root_complex"], g0["switch"]) == (0, "pci0000:15", "0000:16:00.0")
    nics = {n["name"]: n for n in t["nics"]}
    assert list(nics) == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "eno1"]
    assert (nics["mlx5_2"]["pci"], nics["mlx5_2"]["kind"], nics["mlx5_2"]["netdevs"],
            nics["mlx5_2"]["link_layers"], nics["mlx5_2"]["active"]) == (
        "0000:19:00.0", "rdma", ["ib0"], ["InfiniBand"], True)
    assert nics["mlx5_1"]["active"] is False
    # The RDMA device's own interface (ib0) is not listed again as a plain NIC; eno1 is.
    assert (nics["eno1"]["kind"], nics["eno1"]["switch"]) == ("net", None)
    # Pairing follows the topology, not the names; mlx5_1 has no ACTIVE port, so GPU 3 goes to
    # the NIC on its NUMA node.
    assert pairing(t) == [
        ("0000:18:00.0", "mlx5_2", "switch"), ("0000:3a:00.0", "mlx5_3", "switch"),
        ("0000:9a:00.0", "mlx5_0", "switch"), ("0000:ba:00.0", "mlx5_0", "numa")]


def test_more_gpus_than_nics_go_to_the_nearest_nic_and_share_it(tree) -> None:
    root = tree("more_gpus")
    t = topo(root)
    assert len(t["gpus"]) == 8  # GPU 0's audio function (0000:03:00.1) is no GPU
    assert [(p["nic"], p["proximity"]) for p in t["pairing"]] == [
        ("mlx5_0", "switch"), ("mlx5_0", "switch"),
        ("mlx5_0", "root_complex"), ("mlx5_0", "root_complex"),
        ("mlx5_0", "numa"), ("mlx5_0", "numa"),
        # Two GPUs below one switch with two NICs: one NIC each.
        ("mlx5_1", "switch"), ("mlx5_2", "switch")]
    assert [n["link_layers"] for n in t["nics"]] == [["Ethernet"]] * 3


def test_rdma_devices_narrow_the_nics_from_the_variable_or_the_flag(tree) -> None:
    root = tree("more_gpus")
    only1 = [(p["nic"], p["proximity"]) for p in topo(root, devices="mlx5_1")["pairing"]]
    assert only1 == [("mlx5_1", "far")] * 6 + [("mlx5_1", "switch")] * 2
    r = memkv("net", "topo", "--sysfs", root, "--json", "--rdma-devices", " mlx5_2, mlx5_0 ",
              devices="mlx5_1")  # the flag wins over the variable
    assert r.returncode == 0, r.stderr
    assert [n["name"] for n in json.loads(r.stdout)["nics"]] == ["mlx5_0", "mlx5_2"]


def test_the_tcp_providers_loopback_is_a_valid_device_and_nobodys_nic(tree) -> None:
    t = topo(tree("switch_pairs"), devices="lo")
    assert t["nics"] == []
    assert [(p["nic"], p["proximity"]) for p in t["pairing"]] == [(None, None)] * 4


def test_an_unknown_rdma_device_is_a_clear_error_naming_the_hosts_nics(tree) -> None:
    root = tree("switch_pairs")
    for args, devices in ((), "mlx5_2,mlx5_9"), (("--rdma-devices", "mlx5_9"), None):
        r = memkv("net", "topo", "--sysfs", root, *args, devices=devices)
        assert r.returncode == 1
        assert r.stdout == ""
        assert ("MEMKV_RDMA_DEVICES names mlx5_9 but this host has mlx5_0, mlx5_1, mlx5_2, "
                "mlx5_3, eno1, lo (see") in r.stderr
    r = memkv("net", "selftest", "--sysfs", root, devices="mlx5_9")
    assert r.returncode == 1
    assert "FAIL  topology: MEMKV_RDMA_DEVICES names mlx5_9" in r.stdout


def test_without_an_rdma_nic_gpus_pair_with_the_plain_network_device(tree) -> None:
    root = tree("no_nic")
    t = topo(root)
    assert [(g["vendor"], g["numa_node"]) for g in t["gpus"]] == [("AMD", None)] * 2
    # The virtio interface sits below its PCI function; `lo` has no device and is not a NIC.
    assert [(n["name"], n["kind"], n["pci"]) for n in t["nics"]] == [
        ("eth0", "net", "0000:00:03.0")]
    assert pairing(t) == [("0000:03:00.0", "eth0", "root_complex"),
                          ("0000:04:00.0", "eth0", "root_complex")]
    assert not any(p["gpu_scratch"] for p in t["pairing"])
    text = memkv("net", "topo", "--sysfs", root).stdout
    assert "No RDMA NIC: only libfabric's software providers (tcp, sockets) can run here" in text


def test_the_table_shows_gpus_nics_and_the_pairing(tree) -> None:
    r = memkv("net", "topo", "--sysfs", tree("switch_pairs"))
    assert r.returncode == 0, r.stderr
    lines = [line.split() for line in r.stdout.splitlines()]
    assert ["GPUs:", "4"] in lines
    assert ["0", "0000:18:00.0", "0", "pci0000:15", "0000:16:00.0", "NVIDIA"] in lines
    assert ["NICs:", "4", "RDMA,", "1", "plain", "network"] in lines
    assert ["mlx5_1", "0000:bb:00.0", "1", "pci0000:b7", "0000:b8:00.0", "rdma", "InfiniBand",
            "down", "ib3"] in lines
    assert lines[lines.index(["Pairing", "(each", "GPU's", "rank", "uses", "the", "nearest",
                              "NIC):"]) + 2][:6] == ["0", "0000:18:00.0", "mlx5_2", "same",
                                                    "PCIe", "switch"]


def test_gpu_scratch_verdict_needs_a_switch_local_rdma_nic_that_reaches_gpu_memory(tree) -> None:
    pairs, more, bare = tree("switch_pairs"), tree("more_gpus"), tree("no_nic")
    ok, why = _native.gpu_scratch_verdict("00000000:18:00.0", [], pairs)  # nvidia-smi spelling
    # The topology allows it; no client said its transport registers GPU memory.
    assert (ok, why) == (False, "RDMA NIC mlx5_2 shares GPU 0000:18:00.0's PCIe switch but "
                                "no transport that registers GPU memory was opened")
    # The client's `gpu_memory()` answer decides the second condition.
    assert _native.gpu_scratch_verdict(
        "0000:18:00.0", [], pairs, (True, "provider verbs on mlx5_2 registers GPU memory")) == (
        True, "RDMA NIC mlx5_2 shares GPU 0000:18:00.0's PCIe switch and provider verbs on "
              "mlx5_2 registers GPU memory")
    ok, why = _native.gpu_scratch_verdict("0000:18:00.0", [], pairs, (False, "no FI_HMEM"))
    assert (ok, why) == (False, "RDMA NIC mlx5_2 shares GPU 0000:18:00.0's PCIe switch but "
                                "no FI_HMEM")
    ok, why = _native.gpu_scratch_verdict("0000:08:00.0", [], more)
    assert (ok, why) == (False, "GPU 0000:08:00.0's nearest RDMA NIC mlx5_0 is not below its "
                                "PCIe switch (same root complex)")
    ok, why = _native.gpu_scratch_verdict("0000:83:00.0", ["mlx5_0"], more)
    assert not ok and "(across NUMA nodes)" in why
    ok, why = _native.gpu_scratch_verdict("0000:03:00.0", sysfs=bare)
    assert not ok and "plain network device" in why
    assert _native.gpu_scratch_verdict("0000:19:00.0", [], pairs) == (
        False, "sysfs lists no GPU at 0000:19:00.0")
    ok, why = _native.gpu_scratch_verdict("0000:18:00.0", [], pairs + "/missing")
    assert not ok and "cannot read sysfs" in why
    with pytest.raises(ValueError, match="is not a PCI address"):
        _native.gpu_scratch_verdict("cuda:0", [], pairs)
    with pytest.raises(ValueError, match="names mlx5_9 but this host has"):
        _native.gpu_scratch_verdict("0000:18:00.0", ["mlx5_9"], pairs)


def test_nic_for_gpu_is_the_gpus_entry_in_the_pairing(tree) -> None:
    pairs, more, bare = tree("switch_pairs"), tree("more_gpus"), tree("no_nic")
    assert _native.nic_for_gpu("0000:9a:00.0", [], pairs) == ("mlx5_0", "same PCIe switch")
    assert _native.nic_for_gpu("00000000:BA:00.0", [], pairs) == ("mlx5_0", "same NUMA node")
    assert _native.nic_for_gpu("0000:84:00.0", [], more) == ("mlx5_2", "same PCIe switch")
    assert _native.nic_for_gpu("0000:84:00.0", ["mlx5_0"], more) == ("mlx5_0",
                                                                       "across NUMA nodes")
    assert _native.nic_for_gpu("0000:03:00.0", sysfs=bare) == ("eth0", "same root complex")
    assert _native.nic_for_gpu("0000:19:00.0", [], pairs) is None  # a NIC, not a GPU
    with pytest.raises(ValueError, match="names mlx5_9"):
        _native.nic_for_gpu("0000:9a:00.0", ["mlx5_9"], pairs)
    with pytest.raises(ValueError, match="cannot read sysfs"):
        _native.nic_for_gpu("0000:9a:00.0", [], pairs + "/missing")


def test_the_topology_of_an_unreadable_root_is_an_error(tmp_path: Path) -> None:
    r = memkv("net", "topo", "--sysfs", str(tmp_path / "absent"))
    assert r.returncode == 1
    assert f"cannot read sysfs at {tmp_path / 'absent'}" in r.stderr


def test_topo_and_selftest_run_against_this_hosts_sysfs() -> None:
    t = topo("/sys")
    assert {"gpus", "nics", "pairing"} <= t.keys()
    r = memkv("net", "selftest")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert [line.split(":")[0] for line in out[:-1]] == [
        "ok    topology", "ok    tcp round trip", "ok    libfabric", "ok    providers",
        "ok    rdma round trip"]
    assert "put and got back 3 values" in out[1] and "identical" in out[1]
    # No RDMA NIC here (CI, this machine): the one-sided path runs over tcp on loopback.
    assert "tcp (tcp;ofi_rxm on " in out[3]
    assert out[4].startswith("ok    rdma round trip: tcp (tcp;ofi_rxm): put and got back 3 values")
    assert out[-1] == "5 passed, 0 failed, 0 not checked"


def test_selftest_fails_a_host_whose_rdma_nics_no_hardware_provider_serves(tree) -> None:
    # The recorded tree has four InfiniBand NICs; this host's libfabric has no verbs device.
    r = memkv("net", "selftest", "--sysfs", tree("switch_pairs"))
    assert r.returncode == 1
    assert ("FAIL  providers: RDMA NICs mlx5_0, mlx5_1, mlx5_2, mlx5_3 but libfabric offers no "
            "verbs or efa endpoint") in r.stdout
    # The other checks still run and say what they found.
    assert "ok    rdma round trip: tcp" in r.stdout
    assert r.stdout.splitlines()[-1] == "4 passed, 1 failed, 0 not checked"


def test_a_recorded_gpu_host_gives_what_memkv_net_topo_printed_there(tree) -> None:
    want = json.loads((sysfs_tree.DATA / "h200_vm.topo.json").read_text())
    got = topo(tree("h200_vm"))
    assert got == want
    assert want["pairing"][0]["nic"] == "eth0" and not want["pairing"][0]["gpu_scratch"]
