#!/usr/bin/env python3
"""The CA and certificates of rpcmesh's scripts and deployment, made with openssl as
docs/security.md shows: EC P-256 keys, one certificate per program with its SPIFFE ID
(`spiffe://TRUST-DOMAIN/ROLE/NAME`) and the IP addresses and DNS names clients dial;
servers' certificates for server and client use (a broker's is both), clients' for
client use; keys mode 0600. The files go in a folder of the caller's.

Two uses:

- a throwaway CA for one run (the capacity lab's, the bench's): `Pki(folder)` makes a new
  CA, `issue` a certificate;
- a fleet's long-lived CA (the Ansible roles, deploy/ansible/roles/tls, run this file as a
  command on the controller): `pki.py ca DIR` makes the CA once, `pki.py issue DIR ROLE
  NAME ...` issues a certificate only when the one there is missing, names other hosts,
  was signed by another CA, or expires within `--renew-days` (or with `--force`), and
  prints what it did (`kept`, `issued: WHY`) or, with `--check`, what it would do. Each
  certificate is also written with its key in one file (`ROLE-NAME.combined.pem`), which
  a program is given as both `--tls-cert` and `--tls-key`: a rotation then replaces the
  pair in one rename, and a reload never reads a new certificate with the old key.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import subprocess
import sys
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

    @property
    def combined(self) -> Path:
        """The certificate and its key in one file (what `ensure` writes)."""
        return self.cert.with_name(self.cert.stem + ".combined.pem")


def _openssl(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["openssl", *argv], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(argv[:2])}: {r.stderr.strip()}")
    return r


def subject_alt_names(role: str, name: str, trust_domain: str, dial: tuple[str, ...]) -> list[str]:
    """The SANs of a certificate: its SPIFFE ID first (its identity), then each name
    clients dial, as an IP address when it is one, else as a DNS name."""
    sans = [f"URI:spiffe://{trust_domain}/{role}/{name}"]
    for d in dial:
        try:
            sans.append(f"IP:{ipaddress.ip_address(d)}")
        except ValueError:
            sans.append(f"DNS:{d}")
    return sans


class Pki:
    """A CA in `dir` and the certificates it issues: a new CA, or with `keep` the one
    already there (made if missing)."""

    def __init__(self, dir: Path, name: str = "rpcmesh lab CA", trust_domain: str = TRUST_DOMAIN,
                 days: int = DAYS, *, ca_days: int | None = None, keep: bool = False):
        self.dir = dir
        self.trust_domain = trust_domain
        self.days = days
        dir.mkdir(parents=True, exist_ok=True)
        self.ca = dir / "ca.pem"
        self._ca_key = dir / "ca.key"
        #: Whether the CA was made now.
        self.made = not (keep and self.ca.exists() and self._ca_key.exists())
        if self.made:
            _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                     "-keyout", str(self._ca_key), "-out", str(self.ca), "-days", str(ca_days or days),
                     "-subj", f"/CN={name}",
                     "-addext", "basicConstraints=critical,CA:TRUE",
                     "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
            os.chmod(self._ca_key, 0o600)

    def spiffe(self, role: str, name: str) -> str:
        """The SPIFFE ID `spiffe://TRUST-DOMAIN/ROLE/NAME`."""
        return f"spiffe://{self.trust_domain}/{role}/{name}"

    def _extensions(self, sans: list[str], server: bool) -> str:
        usage = "serverAuth,clientAuth" if server else "clientAuth"
        return ("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                f"extendedKeyUsage={usage}\nsubjectAltName={','.join(sans)}\n")

    def _sign(self, stem: Path, name: str, extensions: str, days: int) -> Cert:
        ext = stem.with_suffix(".ext")
        ext.write_text(extensions)
        cert, key, csr = stem.with_suffix(".pem"), stem.with_suffix(".key"), stem.with_suffix(".csr")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")  # fmt: skip
        os.chmod(key, 0o600)
        # A random serial, not a serial file: several issues may run at once (Ansible issues
        # every host's at the same time), and each certificate's serial is its own.
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self._ca_key),
                 "-set_serial", f"0x{secrets.randbits(127):x}", "-out", str(cert), "-days", str(days),
                 "-extfile", str(ext))  # fmt: skip
        return Cert(cert, key)

    def issue(self, role: str, name: str, ips: tuple[str, ...] = (), dns: tuple[str, ...] = (),
              server: bool = True) -> Cert:
        """A certificate for `spiffe://TRUST-DOMAIN/ROLE/NAME`, valid for `ips` and `dns` too;
        for server and client use, or client use only (`server=False`)."""
        sans = [f"URI:{self.spiffe(role, name)}", *(f"DNS:{d}" for d in dns), *(f"IP:{ip}" for ip in ips)]
        return self._sign(self.dir / f"{role}-{name}", name, self._extensions(sans, server), self.days)

    def ensure(self, role: str, name: str, dial: tuple[str, ...] = (), server: bool = True, *,
               renew_days: int = 0, force: bool = False, check: bool = False) -> tuple[bool, str]:
        """Keeps the certificate of ROLE/NAME while it is as asked (the same names and use,
        signed by this CA, valid for more than `renew_days`), else issues a new one with
        a new key, and writes both into `Cert.combined` (0600). With `check`, only says.
        Returns (issued or would issue, what and why)."""
        stem = self.dir / f"{role}-{name}"
        c = Cert(stem.with_suffix(".pem"), stem.with_suffix(".key"))
        wanted = self._extensions(subject_alt_names(role, name, self.trust_domain, dial), server)
        # Written last, once everything else is: an issue cut short is never kept.
        spec = stem.with_suffix(".spec")
        why = ""
        if force:
            why = "renewal asked for"
        elif not all(p.exists() for p in (c.cert, c.key, c.combined, spec)):
            why = "none yet"
        elif spec.read_text() != wanted:
            why = "names or use changed"
        elif "OK" not in _openssl("verify", "-CAfile", str(self.ca), str(c.cert), check=False).stdout:
            why = "not signed by this CA"
        elif _openssl("x509", "-in", str(c.cert), "-noout", "-checkend", str(renew_days * 86400),
                      check=False).returncode != 0:
            why = f"expires within {renew_days} days"
        if not why:
            return False, f"kept: {self.spiffe(role, name)}, {enddate(c.cert)}"
        if check:
            return True, f"would issue: {why}"
        self._sign(stem, name, wanted, self.days)
        tmp = c.combined.with_suffix(".tmp")
        tmp.write_bytes(c.cert.read_bytes() + c.key.read_bytes())
        tmp.chmod(0o600)
        tmp.replace(c.combined)
        spec.write_text(wanted)
        return True, f"issued: {why}; {self.spiffe(role, name)}, {enddate(c.cert)}"


def enddate(cert: Path) -> str:
    """A certificate's notAfter, as openssl prints it (`notAfter=...`)."""
    return _openssl("x509", "-in", str(cert), "-noout", "-enddate").stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pki.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ca = sub.add_parser("ca", help="make the CA in DIR unless it is there; prints kept, made or would make")
    ca.add_argument("dir", type=Path)
    ca.add_argument("--name", default="rpcmesh CA", help="the CA's common name")
    ca.add_argument("--days", type=int, default=3650, help="the CA's validity")
    ca.add_argument("--check", action="store_true", help="say what would be done, do nothing")
    issue = sub.add_parser("issue", help="issue ROLE-NAME's certificate in DIR unless the one there is kept")
    issue.add_argument("dir", type=Path)
    issue.add_argument("role")
    issue.add_argument("name")
    issue.add_argument("--dial", action="append", default=[], metavar="HOST",
                       help="an address or DNS name clients dial (repeat)")
    issue.add_argument("--client", action="store_true", help="client use only (default: server and client)")
    issue.add_argument("--trust-domain", default=TRUST_DOMAIN)
    issue.add_argument("--days", type=int, default=DAYS, help="a new certificate's validity")
    issue.add_argument("--renew-days", type=int, default=0,
                       help="issue a new one when the one there expires within this many days")
    issue.add_argument("--force", action="store_true", help="issue a new one whatever the one there is")
    issue.add_argument("--check", action="store_true", help="say what would be done, do nothing")
    a = p.parse_args(argv)
    try:
        if a.command == "ca":
            if (a.dir / "ca.pem").exists() and (a.dir / "ca.key").exists():
                print("kept")
            elif a.check:
                print("would make")
            else:
                Pki(a.dir, name=a.name, ca_days=a.days, keep=True)
                a.dir.chmod(0o700)  # it holds the CA's key
                print("made")
            return 0
        if not ((a.dir / "ca.pem").exists() and (a.dir / "ca.key").exists()):
            if a.check:
                print("would issue: no CA yet")
                return 0
            raise RuntimeError(f"{a.dir}: no CA (pki.py ca {a.dir} makes it)")
        pki = Pki(a.dir, trust_domain=a.trust_domain, days=a.days, keep=True)
        _, said = pki.ensure(a.role, a.name, tuple(a.dial), server=not a.client,
                             renew_days=a.renew_days, force=a.force, check=a.check)
        print(said)
        return 0
    except (RuntimeError, OSError) as e:
        print(f"pki.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
