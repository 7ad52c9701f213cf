"""The rehearsal's fleet: which machines there are, their Ansible groups, addresses and
ports, and the names of everything a run makes. Pure data: nothing here touches the system.

Every name starts with `rpcm-` and every address is in 10.77.0.0/24, so that a run (and
`--cleanup`) never touches another lab's namespaces (another engineer's use `ans-` and
10.78.0.0/24; `scripts/capacity-lab` names its own `rpcm<pid>-`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The prefix of every namespace, machine, interface and unit a run makes.
PREFIX = "rpcm-"
#: The first three octets of every address (a /24 of the private range no other lab here
#: uses). Nothing in the root namespace is ever given one, nor sends to one.
SUBNET = "10.77.0"
#: The prefix length of the fleet's one network.
PREFIX_LEN = 24
#: The namespace that holds the bridge: the switch every machine's link is plugged into.
SWITCH_NS = f"{PREFIX}sw"
#: The bridge, inside SWITCH_NS.
BRIDGE = "br0"
#: Every link is shaped to this, at both ends (the reference deployment's 1 Gbit LAN).
LINK_RATE = "1gbit"
#: tbf's bucket: 256 KiB holds a burst of a whole pool's batched writes at 1 Gbit/s
#: (about 2 ms) without drops; measured accurate in the lab (967 Mbit/s with iperf3).
LINK_BURST = "256kb"
#: tbf's most queueing delay before it drops: 5 ms, as in the lab's measured recipe.
LINK_LATENCY = "5ms"

#: The providers' RPC port, and the others: the programs' defaults (deploy/systemd/*.env).
PROVIDER_PORT = 7800
PROVIDER_METRICS_PORT = 9780
BROKER_PORT = 7700
BROKER_METRICS_PORT = 9770
DRIVER_METRICS_PORT = 9790
PROMETHEUS_PORT = 9090
#: Every machine's node_exporter (group_vars/all.yml's rpcmesh_node_exporter_port).
NODE_EXPORTER_PORT = 9100

#: What the role tls installs on every rpcmesh host (deploy/ansible/group_vars: the
#: programs' rpcmesh_*_tls_* variables): the fleet's CA, and each program's certificate
#: with its key in one file (given as both --tls-cert and --tls-key).
TLS_CA = "/etc/rpcmesh/ca.pem"
TLS_FILE = "/etc/rpcmesh/{program}.pem"
#: The identities' trust domain (group_vars/all.yml's rpcmesh_tls_trust_domain).
TRUST_DOMAIN = "rpcmesh.internal"

#: The units that must be active on every machine of a group once deployed, and on
#: every machine.
UNITS = {
    "providers": ("rpcmesh-provider.service",),
    "brokers": ("rpcmesh-broker.service",),
    "monitoring": ("prometheus.service", "prometheus-alertmanager.service"),
}
EVERY_MACHINE_UNITS = ("prometheus-node-exporter.service",)


@dataclass(frozen=True)
class Host:
    """One host of the rehearsal: a network namespace, and (but for the controller) a
    systemd machine booted in it, of one Ansible group."""

    #: The namespace's name, the machine's name, its host name and its port on the bridge
    #: (at most 15 characters: an interface name).
    name: str
    #: The Ansible group; None for the controller, which is not deployed to.
    group: str | None
    #: The last octet of its address.
    octet: int
    #: Booted with the others, but in the inventory only from the join step on.
    joins_later: bool = False

    @property
    def ip(self) -> str:
        return f"{SUBNET}.{self.octet}"


#: The controller: a namespace without a machine, from which SSH and Ansible run.
CONTROLLER = Host(f"{PREFIX}ctl", None, 10)

#: The machines: two drivers, two brokers, two providers, a monitoring host, and the third
#: provider that joins later.
MACHINES = (
    Host(f"{PREFIX}drv1", "drivers", 11),
    Host(f"{PREFIX}drv2", "drivers", 12),
    Host(f"{PREFIX}brk1", "brokers", 21),
    Host(f"{PREFIX}brk2", "brokers", 22),
    Host(f"{PREFIX}prv1", "providers", 31),
    Host(f"{PREFIX}prv2", "providers", 32),
    Host(f"{PREFIX}prv3", "providers", 33, joins_later=True),
    Host(f"{PREFIX}mon", "monitoring", 40),
)

#: Every namespace a run makes but the switch's.
HOSTS = (CONTROLLER, *MACHINES)

#: The order of the groups in the inventory and the reports.
GROUPS = ("providers", "brokers", "drivers", "monitoring")


def group(name: str, *, joined: bool = True) -> list[Host]:
    """The machines of a group; without the late joiner unless `joined`."""
    return [m for m in MACHINES if m.group == name and (joined or not m.joins_later)]


def joiner() -> Host:
    """The provider that joins during the rehearsal."""
    return next(m for m in MACHINES if m.joins_later)


def machine(name: str) -> Host:
    """The machine of that name."""
    return next(m for m in MACHINES if m.name == name)


def owned(name: str) -> bool:
    """Whether a namespace (or machine) name is one a run of the rehearsal makes."""
    return name.startswith(PREFIX)
