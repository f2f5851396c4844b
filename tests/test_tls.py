"""TLS against the real `memkv serve` (docs/tls.md), with certificates made by the openssl command
here: round trips over TLS and mutual TLS from the Python client and the `memkv` CLI, mismatched
settings failing fast with the setting to change, and a certificate reload on SIGHUP under
traffic that fails no operation. The in-process cases (expired certificates, wrong names, the
refusal of RDMA) are in native/crates/memkv-client/tests/tls.rs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from memkv_procs import memkv_command
from tls_certs import Pki

from memkv_vllm.core.client import MemKVClient, Status
from memkv_vllm.core.config import MemKVConfig, load_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

# Refusals must come well within the clients' operation timeout (10 s).
FAST_S = 2.0


def client(srv, **tls: str) -> MemKVClient:
    return MemKVClient(MemKVConfig(servers=(srv.address,), connections_per_server=1,
                                   op_timeout_s=10.0, **tls))


def round_trip(c: MemKVClient, tag: bytes = b"k") -> None:
    for i, n in enumerate((1, 4096, 3 << 20)):
        val = bytes((j * 7 + i) % 251 for j in range(n))
        assert c.put([tag + bytes([i])], [val]) == [Status.OK]
        buf = bytearray(n)
        assert c.get_into([tag + bytes([i])], [buf]) == [Status.OK]
        assert bytes(buf) == val


def assert_refused(c: MemKVClient, *needles: str) -> None:
    """The first PUT fails fast with AUTH_FAILED, and the reason names every one of `needles`."""
    t = time.monotonic()
    assert c.put([b"x"], [b"v"]) == [Status.AUTH_FAILED]
    took = time.monotonic() - t
    (health,) = c.health().values()
    assert took < FAST_S, (took, health)
    for n in needles:
        assert n in health["reason"], (n, health)


def test_round_trips_over_tls_and_mutual_tls(memkv_server_factory, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    plain_tls = memkv_server_factory(extra=pki.server_flags("s1"))
    round_trip(client(plain_tls, tls_ca=str(pki.ca)))
    mutual = memkv_server_factory(extra=pki.server_flags("s2", client_ca=pki))
    cert, key = pki.issue("engine", "engine-a", sans=())
    round_trip(client(mutual, tls_ca=str(pki.ca), tls_cert=str(cert), tls_key=str(key)))
    # The yaml `tls:` section reaches the same client.
    cfg_file = tmp_path / "client.yaml"
    cfg_file.write_text(f"servers: ['{mutual.address}']\n"
                        f"tls:\n  ca: {pki.ca}\n  cert: {cert}\n  key: {key}\n")
    c = MemKVClient(load_config(env={"MEMKV_CONFIG": str(cfg_file)}))
    assert "tls=mutual" in c.config.describe()
    round_trip(c, b"y")


def test_mismatches_fail_fast_and_name_the_setting(memkv_server_factory, tmp_path: Path) -> None:
    pki, other = Pki(tmp_path, "ca"), Pki(tmp_path, "other")
    tls_srv = memkv_server_factory(extra=pki.server_flags("s1"))
    mutual = memkv_server_factory(extra=pki.server_flags("s2", client_ca=pki))
    plain = memkv_server_factory()
    assert_refused(client(tls_srv), "requires TLS", "MEMKV_TLS_CA")
    assert_refused(client(plain, tls_ca=str(pki.ca)), "speaks plaintext memkv", "--tls-cert")
    assert_refused(client(tls_srv, tls_ca=str(other.ca)), "not signed by the CA", "MEMKV_TLS_CA")
    assert_refused(client(tls_srv, tls_ca=str(pki.ca), tls_server_name="memkv.elsewhere"),
                   "MEMKV_TLS_SERVER_NAME")
    assert_refused(client(mutual, tls_ca=str(pki.ca)), "requires a client certificate",
                   "MEMKV_TLS_CERT")
    cert, key = other.issue("stranger", "engine-x", sans=())
    assert_refused(client(mutual, tls_ca=str(pki.ca), tls_cert=str(cert), tls_key=str(key)),
                   "refused the client certificate")
    assert plain.stats()["errors"]["tls"] >= 1


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMKV_TLS")}
    return subprocess.run(memkv_command() + list(args), capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})})


def test_the_cli_takes_the_same_tls_settings(memkv_server_factory, tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    srv = memkv_server_factory(extra=pki.server_flags(client_ca=pki))
    cert, key = pki.issue("cli", "operator", sans=())
    ok = _cli("ping", "--servers", srv.address, "--tls-ca", str(pki.ca), "--tls-cert", str(cert),
              "--tls-key", str(key))
    assert ok.returncode == 0, ok.stderr + ok.stdout
    # The same through the environment, for `stats`.
    out = _cli("stats", "--json", "--servers", srv.address,
               env={"MEMKV_TLS_CA": str(pki.ca), "MEMKV_TLS_CERT": str(cert),
                    "MEMKV_TLS_KEY": str(key)})
    assert out.returncode == 0, out.stderr + out.stdout
    # Both refusals from the plaintext and the no-certificate clients are counted as tls.
    _cli("ping", "--servers", srv.address)
    _cli("ping", "--servers", srv.address, "--tls-ca", str(pki.ca))
    out = _cli("stats", "--json", "--servers", srv.address,
               env={"MEMKV_TLS_CA": str(pki.ca), "MEMKV_TLS_CERT": str(cert),
                    "MEMKV_TLS_KEY": str(key)})
    assert '"tls": 2' in out.stdout, out.stdout
    no_cert = _cli("ping", "--servers", srv.address, "--tls-ca", str(pki.ca))
    assert no_cert.returncode == 1 and "MEMKV_TLS_CERT" in no_cert.stdout, no_cert.stdout


def test_sighup_reloads_the_certificate_under_traffic(memkv_server_factory, tmp_path: Path
                                                      ) -> None:
    pki, renewed = Pki(tmp_path, "ca"), Pki(tmp_path, "renewed")
    flags = pki.server_flags("live")
    srv = memkv_server_factory(extra=flags)
    live = client(srv, tls_ca=str(pki.ca))
    failures: list[object] = []
    done_ops = [0]
    stop = threading.Event()

    def traffic() -> None:
        val = b"v" * 65536
        buf = bytearray(len(val))
        while not stop.is_set():
            st = live.put([b"live"], [val]) + live.get_into([b"live"], [buf])
            if st != [Status.OK, Status.OK] or buf != val:
                failures.append(st)
            done_ops[0] += 1

    t = threading.Thread(target=traffic)
    t.start()
    try:
        while done_ops[0] < 20:
            time.sleep(0.01)
        cert, key = renewed.issue("next", "localhost")
        shutil.copy(cert, flags[1])
        shutil.copy(key, flags[3])
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGHUP)
        # New connections see the new certificate once the server read it.
        deadline = time.monotonic() + 10
        while client(srv, tls_ca=str(renewed.ca)).ping()[srv.address] is None:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.05)
        before = done_ops[0]
        while done_ops[0] < before + 20:
            time.sleep(0.01)
    finally:
        stop.set()
        t.join(30)
    assert failures == []
    assert srv.alive() and "TLS certificate and key reloaded" in srv.log()
    assert_refused(client(srv, tls_ca=str(pki.ca)), "MEMKV_TLS_CA")
