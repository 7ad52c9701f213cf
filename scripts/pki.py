"""A throwaway CA for the scripts' TLS runs (the capacity lab's, the bench's), made with
openssl as docs/security.md shows: EC P-256 keys, one certificate per program with its
SPIFFE ID (`spiffe://TRUST-DOMAIN/ROLE/NAME`) and the IP addresses and DNS names clients
dial; servers' certificates for server and client use (a broker's is both), clients' for
client use; keys mode 0600. The files go in a folder of the caller's."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: The trust domain of the scripts' SPIFFE IDs unless a caller names its own.
TRUST_DOMAIN = "rpcmesh.lab"
#: Days the certificates are valid: a run lasts minutes; a day is room for clocks apart.
DAYS = 1


@dataclass(frozen=True)
class Cert:
    """A certificate and its key, as files."""

    cert: Path
    key: Path

    def flags(self, ca: Path) -> list[str]:
        """A server's (or the driver's) flags presenting this certificate and trusting `ca`."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(ca)]


def _openssl(*argv: str) -> None:
    r = subprocess.run(["openssl", *argv], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(argv[:2])}: {r.stderr.strip()}")


class Pki:
    """A CA in `dir` (made if missing) and the certificates it issues."""

    def __init__(self, dir: Path, name: str = "rpcmesh lab CA", trust_domain: str = TRUST_DOMAIN, days: int = DAYS):
        self.dir = dir
        self.trust_domain = trust_domain
        self.days = days
        dir.mkdir(parents=True, exist_ok=True)
        self.ca = dir / "ca.pem"
        self._ca_key = dir / "ca.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", str(self._ca_key), "-out", str(self.ca), "-days", str(days),
                 "-subj", f"/CN={name}",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
        os.chmod(self._ca_key, 0o600)

    def spiffe(self, role: str, name: str) -> str:
        """The SPIFFE ID `spiffe://TRUST-DOMAIN/ROLE/NAME`."""
        return f"spiffe://{self.trust_domain}/{role}/{name}"

    def issue(self, role: str, name: str, ips: tuple[str, ...] = (), dns: tuple[str, ...] = (),
              server: bool = True) -> Cert:
        """A certificate for `spiffe://TRUST-DOMAIN/ROLE/NAME`, valid for `ips` and `dns` too;
        for server and client use, or client use only (`server=False`)."""
        stem = self.dir / f"{role}-{name}"
        sans = [f"URI:{self.spiffe(role, name)}", *(f"DNS:{d}" for d in dns), *(f"IP:{ip}" for ip in ips)]
        usage = "serverAuth,clientAuth" if server else "clientAuth"
        ext = stem.with_suffix(".ext")
        ext.write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            f"extendedKeyUsage={usage}\nsubjectAltName={','.join(sans)}\n"
        )
        cert, key, csr = stem.with_suffix(".pem"), stem.with_suffix(".key"), stem.with_suffix(".csr")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")  # fmt: skip
        os.chmod(key, 0o600)
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self._ca_key),
                 "-CAcreateserial", "-out", str(cert), "-days", str(self.days), "-extfile", str(ext))  # fmt: skip
        return Cert(cert, key)
