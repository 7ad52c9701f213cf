"""The certificates of the TLS paths, made with `openssl` in the bench's temp folder once per
bench, so that every TLS path (the provider, the broker, HAProxy, nginx and the driver)
uses the same CA, the same kind of key and the same identities: a CA, then one
certificate per role, each an EC P-256 key (the kind docs/security.md issues) with its
SPIFFE ID as a URI SAN (`spiffe://TRUST_DOMAIN/ROLE/NAME`). The servers' certificates also
carry 127.0.0.1 (the broker and the driver verify a server by the host of its address)
and a DNS name (HAProxy's `verifyhost` and nginx's `proxy_ssl_name` check DNS names, not
IP addresses). HAProxy wants the certificate and its key in one PEM file: `combined`."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pki
from procs import ScriptError

#: The trust domain of the bench's identities.
TRUST_DOMAIN = "bench.rpcmesh"
#: Each role's certificate: its SPIFFE name, whether it serves (server and client use, and
#: the server's DNS name), and the DNS name a proxy checks on the upstream. The L4 proxies
#: share one certificate: each presents it both to the driver and to the provider.
ROLES = {
    "provider": {"name": "p1", "server": True},
    "broker": {"name": "b1", "server": True},
    "proxy": {"name": "l4", "server": True},
    "driver": {"name": "d1", "server": False},
}
#: How long the certificates are valid: one bench is minutes long.
VALID_DAYS = 2


class Cert(NamedTuple):
    """One role's files: its certificate, its key, and both in one PEM (for HAProxy)."""

    cert: Path
    key: Path
    combined: Path
    #: The DNS name its certificate carries (servers), which a proxy checks upstream.
    dns: str | None
    #: Its identity, the URI SAN.
    spiffe: str


class Certs(NamedTuple):
    ca: Path
    by_role: dict[str, Cert]

    def __getitem__(self, role: str) -> Cert:  # type: ignore[override]
        return self.by_role[role]


def dns_name(role: str) -> str:
    return f"{ROLES[role]['name']}.{role}.{TRUST_DOMAIN}"


def make(folder: Path) -> Certs:
    """The CA and every role's certificate in `folder` (keys 0600), issued by scripts/pki.py."""
    ca = pki.Pki(folder, name="rpcmesh bench CA", trust_domain=TRUST_DOMAIN, days=VALID_DAYS)
    by_role = {}
    for role, spec in ROLES.items():
        dns = dns_name(role) if spec["server"] else None
        try:
            c = ca.issue(role, spec["name"], ips=("127.0.0.1",) if dns else (), dns=(dns,) if dns else (),
                         server=bool(spec["server"]))  # fmt: skip
        except RuntimeError as e:
            raise ScriptError(str(e)) from None
        combined = folder / f"{role}.combined.pem"
        combined.write_bytes(c.cert.read_bytes() + c.key.read_bytes())
        combined.chmod(0o600)
        by_role[role] = Cert(c.cert, c.key, combined, dns, ca.spiffe(role, spec["name"]))
    return Certs(ca.ca, by_role)
