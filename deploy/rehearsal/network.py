"""The fleet's network: a namespace per host, each joined to a bridge that lives in a
namespace of its own (the switch), every link shaped with tbf at both ends. Nothing is made
in, or addressed from, the root namespace: each veth pair is created with its ends already
in the switch and in the host's namespace.

Also: the removal of every namespace a run made (`rpcm-*`), with any process left in one.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from . import proc
from .topology import (
    BRIDGE,
    LINK_BURST,
    LINK_LATENCY,
    LINK_RATE,
    PREFIX_LEN,
    SWITCH_NS,
    Host,
    owned,
)

#: Each `ip`/`tc` command is quick; this only catches a hang.
IP_TIMEOUT = 15.0


def _ip(*args: str) -> None:
    proc.run(["ip", *args], timeout=IP_TIMEOUT)


def _shape(ns: str, dev: str) -> None:
    proc.run(
        ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
         "rate", LINK_RATE, "burst", LINK_BURST, "latency", LINK_LATENCY],
        timeout=IP_TIMEOUT,
    )


def namespaces() -> list[str]:
    """The network namespaces that exist, by name."""
    text = proc.output(["ip", "netns", "list"], timeout=IP_TIMEOUT)
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def create(hosts: tuple[Host, ...] | list[Host]) -> None:
    """Makes the switch (a bridge in its own namespace) and, for each host, a namespace
    with `eth0` at its address, plugged into the bridge; both ends shaped to LINK_RATE."""
    left = [n for n in namespaces() if owned(n)]
    if left:
        raise proc.RehearsalError(
            f"namespaces of an earlier run are still there ({', '.join(left)}): "
            "run `deploy/rehearse --cleanup` first"
        )
    _ip("netns", "add", SWITCH_NS)
    _ip("-n", SWITCH_NS, "link", "set", "lo", "up")
    _ip("-n", SWITCH_NS, "link", "add", BRIDGE, "type", "bridge")
    _ip("-n", SWITCH_NS, "link", "set", BRIDGE, "up")
    for h in hosts:
        _ip("netns", "add", h.name)
        # Both ends are born in their namespaces: the root namespace never holds either.
        _ip("link", "add", h.name, "netns", SWITCH_NS, "type", "veth",
            "peer", "name", "eth0", "netns", h.name)
        _ip("-n", SWITCH_NS, "link", "set", h.name, "master", BRIDGE)
        _ip("-n", SWITCH_NS, "link", "set", h.name, "up")
        _ip("-n", h.name, "link", "set", "lo", "up")
        _ip("-n", h.name, "addr", "add", f"{h.ip}/{PREFIX_LEN}", "dev", "eth0")
        _ip("-n", h.name, "link", "set", "eth0", "up")
        _shape(h.name, "eth0")  # the host's egress
        _shape(SWITCH_NS, h.name)  # the switch's egress toward the host


def check_isolated(hosts: list[Host]) -> list[str]:
    """Problems with the isolation: an address of the fleet on a root-namespace interface,
    or a host whose route to another host does not go out of its own eth0."""
    problems = []
    root = proc.output(["ip", "-o", "addr", "show"], timeout=IP_TIMEOUT)
    for h in hosts:
        if f" {h.ip}/" in root:
            problems.append(f"{h.ip} is on an interface of the root namespace")
    a, b = hosts[0], hosts[-1]
    route = proc.output(["ip", "-n", a.name, "route", "get", b.ip], timeout=IP_TIMEOUT)
    if "dev eth0" not in route:
        problems.append(f"{a.name} reaches {b.ip} by {route.strip()!r}, not its eth0")
    return problems


def qdiscs(h: Host) -> str:
    """The qdisc of the host's end and of the switch's end of its link (for the report)."""
    mine = proc.output(["tc", "-n", h.name, "qdisc", "show", "dev", "eth0"], timeout=IP_TIMEOUT)
    theirs = proc.output(["tc", "-n", SWITCH_NS, "qdisc", "show", "dev", h.name], timeout=IP_TIMEOUT)
    return mine.strip() + " | " + theirs.strip()


def pids_in(ns: str) -> list[int]:
    """The processes whose network namespace is `ns`."""
    r = proc.run(["ip", "netns", "pids", ns], timeout=IP_TIMEOUT, check=False)
    return [int(p) for p in r.stdout.decode().split() if p.isdigit()]


def remove_all(log: Path | None = None) -> list[str]:
    """Removes every namespace a run makes (`rpcm-*`): first any process still in one
    (SIGKILL, by its id: by now the machines were halted and a process left is stuck),
    then the namespace (its veth pairs go with it), the switch last. Returns the names
    removed."""
    mine = [n for n in namespaces() if owned(n)]
    for ns in mine:
        for pid in pids_in(ns):
            if log:
                with open(log, "a") as f:
                    f.write(f"killing {pid} left in {ns}: {' '.join(proc.cmdline(pid))[:200]}\n")
            proc.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + proc.STOP_GRACE
    while any(pids_in(ns) for ns in mine) and time.monotonic() < deadline:
        time.sleep(proc.POLL)
    for ns in sorted(mine, key=lambda n: n == SWITCH_NS):
        proc.run(["ip", "netns", "del", ns], timeout=IP_TIMEOUT, check=False)
    return mine
