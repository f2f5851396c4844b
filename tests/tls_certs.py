"""Certificates made on the spot with the openssl command (the test venv has no `cryptography`):
a CA per `Pki`, and leaf certificates it signs for servers and clients, as PEM files in a
directory of the test's own."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


class Pki:
    """A test CA in `dir`: `ca` is its certificate."""

    def __init__(self, dir: Path, name: str = "ca") -> None:
        dir.mkdir(parents=True, exist_ok=True)
        self.dir, self.name = dir, name
        self.ca = dir / f"{name}.pem"
        self._key = dir / f"{name}.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", str(self._key), "-out", str(self.ca), "-days", "2",
                 "-subj", f"/CN=memkv test CA {name}",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=dir)

    def issue(self, name: str, cn: str, sans: tuple[str, ...] = ("DNS:localhost", "IP:127.0.0.1")
              ) -> tuple[Path, Path]:
        """(certificate, key) for `cn` with the subject alternative names `sans`, usable by
        servers and clients."""
        cert, key, csr = (self.dir / f"{name}.{ext}" for ext in ("pem", "key", "csr"))
        ext = self.dir / f"{name}.ext"
        lines = ["basicConstraints=CA:FALSE", "extendedKeyUsage=serverAuth,clientAuth"]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}/O=memkv tests",
                 cwd=self.dir)
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self._key),
                 "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
                 cwd=self.dir)
        return cert, key

    def server_flags(self, name: str = "server", client_ca: Pki | None = None) -> list[str]:
        """`memkv serve` flags for a fresh server certificate (`localhost`, 127.0.0.1), with
        mutual TLS against `client_ca` when given."""
        cert, key = self.issue(name, "localhost")
        flags = ["--tls-cert", str(cert), "--tls-key", str(key)]
        if client_ca is not None:
            flags += ["--tls-client-ca", str(client_ca.ca)]
        return flags
