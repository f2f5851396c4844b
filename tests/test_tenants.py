"""Tenants (`memkv serve --tenants FILE`, docs/security.md) against the real server: each tenant's
key confines it to its prefix on every path (TCP, RDMA over libfabric's tcp provider, the
same-host copies), its quota to its memory (its own values go first), read-only tenants cannot
write, stats and metrics are per tenant, a one-key server is as before, bad files are refused at
start, and the vLLM side refuses a key prefix outside its tenant's namespace at startup."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import attrs
import numpy as np
import pytest
from disk_fs import tmpfs_dir
from memkv_procs import memkv_command
from test_server import AUTH, HELLO, connect, header, read_frame
from test_shm import Region, server_maps
from tls_certs import Pki

from memkv_vllm.core.backends import store_for
from memkv_vllm.core.client import MemKVClient, Status, Tenant
from memkv_vllm.core.config import ConfigError, MemKVConfig
from memkv_vllm.core.keys import KeyLayout
from memkv_vllm.direct.keys import DirectKeyLayout

KEY_A, KEY_B, KEY_R = "a1" * 32, "b2" * 32, "c3" * 32
MIB = 1 << 20


def tenants_yaml(quota_a: str = "64M", quota_b: str = "64M") -> str:
    return f"""tenants:
  - name: team-a
    auth_key: "{KEY_A}"
    prefix: "a/"
    quota: {quota_a}
  - name: team-b
    auth_key: "{KEY_B}"
    prefix: "b/"
    quota: {quota_b}
  - name: reader
    auth_key: "{KEY_R}"
    prefix: "r/"
    quota: 1M
    read_only: true
"""


def write_tenants(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    path.chmod(0o600)
    return path


def tenant_server(factory, tmp_path: Path, text: str | None = None, **kw):
    path = write_tenants(tmp_path, text or tenants_yaml())
    return factory(extra=["--tenants", str(path), *kw.pop("extra", [])], **kw)


def client(srv, key: str, transport: str = "tcp") -> MemKVClient:
    extra = {"rdma_devices": ("lo",)} if transport == "rdma" else {}
    return MemKVClient(MemKVConfig(servers=(srv.address,), auth_key=bytes.fromhex(key),
                                   transport=transport, op_timeout_s=5.0, **extra))


def server_stats(srv, key: str) -> dict:
    return client(srv, key).stats()[srv.address]


def tenant_stats(srv, key: str) -> dict:
    return server_stats(srv, key)["tenants"]


def test_a_tenant_cannot_read_overwrite_delete_or_probe_another_tenants_keys(
        memkv_server_factory, tmp_path, transport):
    srv = tenant_server(memkv_server_factory, tmp_path, lanes=2)
    name = f"memkv-tenants-{transport}"
    region = Region(4 * MIB, name)
    buf = out = region.array
    a, b = client(srv, KEY_A, transport), client(srv, KEY_B, transport)
    for c in (a, b):
        c.register_buffer(region.ptr, buf.nbytes)
    try:
        buf[:MIB] = 0xA1
        assert a.put([b"a/secret"], [buf[:MIB]]) == [Status.OK]
        buf[MIB : 2 * MIB] = 0xB2
        # Overwrite and delete: refused, a's value as it was.
        assert b.put([b"a/secret", b"b/own"], [buf[MIB : 2 * MIB]] * 2) == [Status.FORBIDDEN,
                                                                             Status.OK]
        assert b.delete([b"a/secret"]) == [Status.FORBIDDEN]
        # Read: refused and no byte of it lands in b's buffer.
        out = buf[2 * MIB : 3 * MIB]
        out[:] = 0
        assert b.get_into([b"a/secret", b"b/own"], [out, buf[3 * MIB :]]) == [Status.FORBIDDEN,
                                                                               Status.OK]
        assert not out.any()
        assert (buf[3 * MIB :] == 0xB2).all()
        # Probe: a stored key and a missing one answer alike, and no lease is taken.
        for lease in (0, 60_000):
            assert b.exists_lengths([b"a/secret", b"a/missing"], lease_ms=lease) == [
                (Status.FORBIDDEN, 0), (Status.FORBIDDEN, 0)]
        assert server_stats(srv, KEY_A)["leased_bytes"] == 0
        # a still reads its own bytes, and cannot reach b's either.
        out[:] = 0
        assert a.get_into([b"a/secret"], [out]) == [Status.OK]
        assert (out == 0xA1).all()
        assert a.exists([b"b/own"]) == [Status.FORBIDDEN]
        st = tenant_stats(srv, KEY_A)
        assert st["team-b"]["forbidden"] == 7 and st["team-a"]["forbidden"] == 1
        assert st["team-a"]["items"] == 1 and st["team-b"]["items"] == 1
        assert a.tenants() == {srv.address: Tenant("team-a", b"a/", False)}
        # Over `transport: shm` the refusals came from the server's copy path itself.
        assert server_maps(srv, name) == (transport == "shm")
    finally:
        for c in (a, b):
            c.unregister_buffer(region.ptr)
        del buf, out  # views of the mapping, which cannot close while they exist
        region.close()


def test_quota_pressure_evicts_the_tenants_own_values_and_leaves_the_others_hits(
        memkv_server_factory, tmp_path):
    srv = tenant_server(memkv_server_factory, tmp_path, tenants_yaml(quota_a="4M", quota_b="32M"),
                        memory="64M", lanes=2)
    a, b = client(srv, KEY_A), client(srv, KEY_B)
    value = np.full(MIB, 7, np.uint8)
    b_keys = [b"b/%d" % i for i in range(8)]
    assert b.put(b_keys, [value] * 8) == [Status.OK] * 8
    for i in range(40):
        assert a.put([b"a/%d" % i], [value]) == [Status.OK]
    out = np.zeros(MIB, np.uint8)
    assert [b.get_into([k], [out])[0] for k in b_keys] == [Status.OK] * 8, "b keeps every value"
    assert a.get_into([b"a/39"], [out]) == [Status.OK]
    st = tenant_stats(srv, KEY_A)
    assert st["team-a"]["used_bytes"] <= st["team-a"]["quota_bytes"] == 4 * MIB
    assert st["team-a"]["items"] == 3, "three 1 MiB values and their index entries fill 4 MiB"
    assert st["team-a"]["quota_evictions"] == st["team-a"]["evictions"] == 37
    assert st["team-b"]["evictions"] == 0 and st["team-b"]["hits"] == 8
    # Every value of a's leased: nothing of its own can go, so its PUT is refused, b untouched.
    a_keys = [b"a/%d" % i for i in range(37, 40)]
    assert a.exists(a_keys, lease_ms=60_000) == [Status.OK] * 3
    assert a.put([b"a/new"], [value]) == [Status.OVER_QUOTA]
    assert b.exists(b_keys) == [Status.OK] * 8
    assert tenant_stats(srv, KEY_A)["team-a"]["over_quota"] == 1


def test_a_full_server_makes_room_from_the_writing_tenants_values_and_others_keep_their_hits(
        memkv_server_factory, tmp_path):
    """Quotas adding up to twice the memory: the memory fills before a tenant's quota does. A
    tenant that writes past its share of the memory (its quota over all the quotas) evicts its
    own values, so another tenant's values, never read yet, all still hit (S3-FIFO alone
    evicted those first: they were the oldest not read)."""
    srv = tenant_server(memkv_server_factory, tmp_path, memory="64M", lanes=1)
    a, b = client(srv, KEY_A), client(srv, KEY_B)
    value = np.full(MIB, 7, np.uint8)
    b_keys = [b"b/%d" % i for i in range(16)]
    assert b.put(b_keys, [value] * 16) == [Status.OK] * 16
    for i in range(80):
        assert a.put([b"a/%d" % i], [value]) == [Status.OK]
    out = np.zeros(MIB, np.uint8)
    assert [b.get_into([k], [out])[0] for k in b_keys] == [Status.OK] * 16, "b keeps every value"
    st = tenant_stats(srv, KEY_A)
    assert st["team-b"]["evictions"] == 0 and st["team-b"]["hits"] == 16
    # a is past its share (64M of 129M of quotas, of the 64M lane): it keeps what b left free.
    assert 40 <= st["team-a"]["items"] <= 48, st["team-a"]
    assert st["team-a"]["evictions"] == 80 - st["team-a"]["items"]
    assert st["team-a"]["quota_evictions"] == 0, "its quota was never full"
    assert a.get_into([b"a/79"], [out]) == [Status.OK]


def test_a_tenant_that_filled_the_server_gives_way_to_one_within_its_share(
        memkv_server_factory, tmp_path):
    """b fills the memory (past its share) and stops; a, writing within its own share, takes
    its room from b's values and keeps every one of its own."""
    srv = tenant_server(memkv_server_factory, tmp_path, memory="64M", lanes=1)
    a, b = client(srv, KEY_A), client(srv, KEY_B)
    value = np.full(MIB, 7, np.uint8)
    for i in range(70):
        assert b.put([b"b/%d" % i], [value]) == [Status.OK]
    a_keys = [b"a/%d" % i for i in range(20)]
    for k in a_keys:
        assert a.put([k], [value]) == [Status.OK]
    assert a.exists(a_keys) == [Status.OK] * 20
    st = tenant_stats(srv, KEY_A)
    assert st["team-a"]["evictions"] == 0 and st["team-a"]["items"] == 20
    assert st["team-b"]["evictions"] == 70 - st["team-b"]["items"] >= 20


def test_a_read_only_tenant_reads_but_cannot_write(memkv_server_factory, tmp_path):
    srv = tenant_server(memkv_server_factory, tmp_path)
    r = client(srv, KEY_R)
    assert r.tenants() == {srv.address: Tenant("reader", b"r/", True)}
    assert r.put([b"r/x"], [b"v"]) == [Status.FORBIDDEN]
    assert r.delete([b"r/x"]) == [Status.FORBIDDEN]
    assert r.exists([b"r/x"]) == [Status.NOT_FOUND]
    assert r.get_into([b"r/x"], [bytearray(1)]) == [Status.NOT_FOUND]
    assert tenant_stats(srv, KEY_R)["reader"]["items"] == 0


def test_stats_metrics_and_the_cli_show_each_tenant(memkv_server_factory, tmp_path):
    srv = tenant_server(memkv_server_factory, tmp_path, metrics=True)
    a = client(srv, KEY_A)
    assert a.put([b"a/1", b"a/2"], [b"x" * 1000] * 2) == [Status.OK] * 2
    assert a.get_into([b"a/1", b"a/3"], [bytearray(1000)] * 2) == [Status.OK, Status.NOT_FOUND]
    port = next(int(ln.split(" metrics=127.0.0.1:")[1].split()[0]) for ln in srv.log().splitlines()
                if " metrics=127.0.0.1:" in ln)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in ['memkv_tenant_items{tenant="team-a"} 2', 'memkv_tenant_items{tenant="team-b"} 0',
                 'memkv_tenant_hits_total{tenant="team-a"} 1',
                 'memkv_tenant_misses_total{tenant="team-a"} 1',
                 'memkv_tenant_quota_bytes{tenant="reader"} 1048576']:
        assert line in text.splitlines(), line
    out = subprocess.run(memkv_command() + ["stats", "--servers", srv.address],
                         capture_output=True, text=True, timeout=30,
                         env={**os.environ, "MEMKV_AUTH_KEY": KEY_B})
    assert out.returncode == 0, out.stderr
    rows = {ln.split()[0]: ln for ln in out.stdout.splitlines() if ln.strip()}
    assert "TENANT" in rows and "reader" in rows
    assert rows["team-a"].split()[1] == "2" and "50.0% of 2" in rows["team-a"]


def test_a_server_with_one_shared_key_is_as_before(memkv_server_factory):
    srv = memkv_server_factory(auth_key=KEY_A, metrics=True)
    c = client(srv, KEY_A)
    assert c.put([b"any/key", b"a/x", b"b/y"], [b"v"] * 3) == [Status.OK] * 3
    assert c.tenants() == {srv.address: None}
    assert "tenants" not in server_stats(srv, KEY_A)
    # The AUTH reply is empty, as it always was.
    s = connect(srv)
    s.sendall(header(HELLO, 0))
    _, body, _ = read_frame(s)
    s.sendall(header(AUTH, 32) + hmac.new(bytes.fromhex(KEY_A), body[1:33],
                                           hashlib.sha256).digest())
    assert read_frame(s) == (0x82, b"", 0)
    s.close()


def run_serve(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(memkv_command() + ["serve", "--listen", "127.0.0.1:0", "--memory",
                                             "16M", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("text,says", [
    ("tenants: []\n", "no tenants"),
    (tenants_yaml().replace('"b/"', '"a/"'), "tenants team-a (prefix \"a/\") and team-b"),
    (tenants_yaml().replace('"b/"', '"a/b/"'), "overlap"),
    (tenants_yaml().replace('"b/"', '""'), "overlap"),
    (tenants_yaml().replace("team-b", "team-a"), "a second tenant of this name"),
    (tenants_yaml().replace(KEY_B, KEY_A), "another tenant's"),
    (tenants_yaml().replace("quota: 1M", "quota: lots"), "tenant #3 (reader): quota"),
    (tenants_yaml().replace("read_only", "readonly"), "unknown field `readonly`"),
    ("tenants:\n  - name: x\n    prefix: x/\n    quota: 1M\n", "no credential"),
    ("tenants: [", "did not find expected node content at line 2"),
])
def test_a_bad_tenants_file_stops_the_server_with_a_clear_error(tmp_path, text, says):
    path = write_tenants(tmp_path, text)
    out = run_serve("--tenants", str(path))
    assert out.returncode != 0 and not out.stdout
    assert f"--tenants {path}" in out.stderr and says in out.stderr, out.stderr


def test_tenants_and_a_shared_key_exclude_each_other_and_a_missing_file_is_named(tmp_path):
    path = write_tenants(tmp_path, tenants_yaml())
    out = run_serve("--tenants", str(path), "--auth-key", KEY_A)
    assert out.returncode == 2 and "--auth-key" in out.stderr, out.stderr
    out = run_serve("--tenants", str(tmp_path / "nope.yaml"))
    assert out.returncode == 1 and "nope.yaml" in out.stderr, out.stderr


def test_quotas_above_the_memory_and_a_file_others_can_read_are_said_at_start(
        memkv_server_factory, tmp_path):
    path = write_tenants(tmp_path, tenants_yaml(quota_a="1G", quota_b="1G"))
    path.chmod(0o644)
    srv = memkv_server_factory(memory="64M", extra=["--tenants", str(path)])
    assert "more than --memory" in srv.log() and "chmod 600" in srv.log()


def test_a_key_prefix_outside_the_tenant_fails_at_startup_naming_both(
        memkv_server_factory, tmp_path):
    """What the tier (its `prefix`) and direct mode (`memkv_spec_prefix`) build their store
    with: a namespace outside the tenant's prefix is a startup error, inside it a store."""
    srv = tenant_server(memkv_server_factory, tmp_path)
    cfg = MemKVConfig(servers=(srv.address,), auth_key=bytes.fromhex(KEY_A))
    c = MemKVClient(cfg)
    tier = KeyLayout("memkv", "m", {"dtype": "bf16"})
    with pytest.raises(ConfigError) as e:
        store_for(c, cfg, key_prefix=(tier.key_start, "prefix"))
    msg = str(e.value)
    assert "'prefix'" in msg and "b'memkv/m_" in msg and "b'a/'" in msg and "team-a" in msg
    direct = DirectKeyLayout(model="m", weights="hub:" + "0" * 40, dtype="bf16", tp_size=1,
                             block_size=16, kv_layout="HND", hash_algo="sha256",
                             hash_seed=b"", spec_prefix="b/")
    with pytest.raises(ConfigError) as e:
        store_for(c, cfg, key_prefix=(direct.prefix, "memkv_spec_prefix"))
    msg = str(e.value)
    assert "'memkv_spec_prefix'" in msg and "b/mkD1" in msg and "b'a/'" in msg
    # Inside the namespace: a store whose values reach the server.
    for prefix in (KeyLayout("a", "m", {}).key_start,
                   attrs.evolve(direct, spec_prefix="a/").prefix):
        store_for(c, cfg, key_prefix=(prefix, "prefix")).close()
    assert c.put([KeyLayout("a", "m", {}).key(b"h" * 32, 0)], [b"v"]) == [Status.OK]


def test_unreachable_servers_do_not_stop_the_startup_check(memkv_server_factory):
    srv = memkv_server_factory()
    cfg = MemKVConfig(servers=(srv.address,), op_timeout_s=1.0, connect_timeout_s=0.5)
    c = MemKVClient(cfg)
    srv.kill()
    t = time.monotonic()
    store_for(c, cfg, key_prefix=(b"memkv/", "prefix")).close()
    assert time.monotonic() - t < 5
    assert json.dumps(c.tenants()) == "{}"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_verified_client_certificate_names_its_tenant_without_a_key(
        memkv_server_factory, tmp_path) -> None:
    """Under mutual TLS the subject of a client's verified certificate names its tenant: no
    auth key, the tenant's prefix enforced and its values counted as its own, and the HELLO
    reply tells the client its tenant, so a tier prefix outside it fails at startup. A
    certificate whose subject names no tenant still needs a tenant's key."""
    pki = Pki(tmp_path / "pki")
    text = tenants_yaml().replace(
        "  - name: team-b\n",
        '  - name: team-b\n    client_cert_subject: "CN=engine-b, O=memkv tests"\n')
    srv = tenant_server(memkv_server_factory, tmp_path, text,
                        extra=pki.server_flags(client_ca=pki))

    def tls_client(cn: str, **kw) -> MemKVClient:
        cert, key = pki.issue(cn, cn, sans=())
        return MemKVClient(MemKVConfig(servers=(srv.address,), tls_ca=str(pki.ca),
                                       tls_cert=str(cert), tls_key=str(key), op_timeout_s=5.0,
                                       **kw))

    b = tls_client("engine-b")
    assert b.tenants() == {srv.address: Tenant("team-b", b"b/", False)}
    with pytest.raises(ConfigError) as e:
        store_for(b, b.config, key_prefix=(KeyLayout("memkv", "m", {}).key_start, "prefix"))
    assert "b'memkv/m_" in str(e.value) and "b'b/'" in str(e.value), e.value
    store_for(b, b.config, key_prefix=(KeyLayout("b", "m", {}).key_start, "prefix")).close()
    assert b.put([b"b/x", b"a/x"], [b"v1", b"v2"]) == [Status.OK, Status.FORBIDDEN]
    out = [bytearray(2)]
    assert b.get_into([b"b/x"], out) == [Status.OK] and out == [b"v1"]
    # The tenant rides on the HELLO reply only for a client that says so in its handshake
    # (ALPN): one from before, which reads the reply strictly, gets it as it always was.
    cert, key = pki.issue("raw-b", "engine-b", sans=())
    for alpn, tail in ((None, b""), ("memkv-hello-tenant", b"\x06\x00team-b\x02\x00b/\x00")):
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        ctx.load_cert_chain(str(cert), str(key))
        if alpn:
            ctx.set_alpn_protocols([alpn])
        host, port = srv.address.rsplit(":", 1)
        with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10),
                             server_hostname=host) as s:
            s.sendall(header(HELLO, 0))
            _, body, _ = read_frame(s)
            assert s.selected_alpn_protocol() == alpn
        assert body[0] == 0 and len(body) == 1 + 32 + 8 + len(tail) and body[41:] == tail, body
    tenants = b.stats()[srv.address]["tenants"]
    assert tenants["team-b"]["items"] == 1 and tenants["team-b"]["forbidden"] == 1
    assert tenants["team-a"]["items"] == 0
    assert tls_client("stranger").put([b"a/y"], [b"v"]) == [Status.AUTH_FAILED]
    with_key = tls_client("stranger-with-key", auth_key=bytes.fromhex(KEY_A))
    assert with_key.tenants() == {srv.address: Tenant("team-a", b"a/", False)}
    assert with_key.put([b"a/y"], [b"v"]) == [Status.OK]
    assert with_key.stats()[srv.address]["tenants"]["team-a"]["items"] == 1


def test_values_a_quota_evicts_spill_to_disk_and_come_back_as_their_tenants(
        memkv_server_factory, tmp_path) -> None:
    """A tenant at its quota evicts its own values, and those go to the disk tier like any
    eviction; read back and promoted (the second hit), a value is its prefix's tenant's again:
    charged to that tenant, within its quota, and to no other."""
    with tmpfs_dir() as disk:
        srv = tenant_server(memkv_server_factory, tmp_path, tenants_yaml(quota_a="4M"),
                            memory="64M", lanes=1,
                            extra=["--disk", str(disk), "--disk-size", "64M",
                                   "--disk-queue", "16M"])
        a = client(srv, KEY_A)
        for i in range(8):
            assert a.put([f"a/{i}".encode()], [np.full(MIB, i, np.uint8)]) == [Status.OK]
        deadline = time.monotonic() + 30
        while (disk_tier := server_stats(srv, KEY_A)["tiers"]["disk"])["queued_bytes"]:
            assert time.monotonic() < deadline, disk_tier
            time.sleep(0.05)
        assert disk_tier["spills"] >= 4, disk_tier
        buf = np.empty(MIB, np.uint8)
        for _ in range(3):  # a disk hit, the promoting hit, then a DRAM hit
            assert a.get_into([b"a/0"], [buf]) == [Status.OK] and (buf == 0).all()
        st = server_stats(srv, KEY_A)
        assert st["tiers"]["disk"]["promotions"] == 1, st["tiers"]
        team_a, team_b = st["tenants"]["team-a"], st["tenants"]["team-b"]
        assert 0 < team_a["used_bytes"] <= 4 * MIB and team_a["hits"] == 3, team_a
        assert team_a["items"] == st["tiers"]["dram"]["items"], (team_a, st["tiers"])
        assert team_b["used_bytes"] == 0 and team_b["items"] == 0, team_b
        srv.kill()
