"""What the rehearsal checks on the deployed fleet: each machine's systemd state, its
group's units and its node_exporter, Prometheus's targets on the monitoring host, and
figures read from the programs' own /metrics pages (the Prometheus text format, parsed
here: stdlib only).
"""

from __future__ import annotations

import re
import urllib.parse

from . import proc
from .remote import Controller
from .topology import (
    BROKER_METRICS_PORT,
    EVERY_MACHINE_UNITS,
    MACHINES,
    DRIVER_METRICS_PORT,
    NODE_EXPORTER_PORT,
    PROMETHEUS_PORT,
    PROVIDER_METRICS_PORT,
    PROVIDER_PORT,
    UNITS,
    Host,
    group,
)

#: A Prometheus sample line: name, optional {labels}, value.
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a /metrics page: (name, labels, value)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        try:
            samples.append((m.group(1), labels, float(m.group(4))))
        except ValueError:
            continue
    return samples


def metric_sum(samples, name: str, **want: str) -> float | None:
    """The sum of a metric's samples whose labels match `want` (a value starting with
    `!` excludes); None when the page has no sample of that name at all."""
    found, total = False, 0.0
    for n, labels, v in samples:
        if n != name:
            continue
        found = True
        ok = True
        for k, w in want.items():
            got = labels.get(k, "")
            ok &= got != w[1:] if w.startswith("!") else got == w
        if ok:
            total += v
    return total if found else None


def scrape(ctl: Controller, host: Host, port: int):
    """A program's /metrics, read on its own host (over SSH, with curl): the firewall
    opens the metrics ports to the monitoring host only."""
    text = ctl.ssh_text(host, f"curl -sf --max-time 10 http://127.0.0.1:{port}/metrics")
    return parse_metrics(text)


def running_build(ctl: Controller, host: Host, program: str) -> dict[str, str]:
    """What a program's host says of it: the binary its service's main process runs
    (`exe`), what /usr/local/bin/PROGRAM links to (`linked`), and the commit its
    rpcmesh_build_info names (`commit`)."""
    unit = f"rpcmesh-{program}.service"
    command = ('pid=$(systemctl show --property MainPID --value UNIT); '
               'echo "exe=$([ "${pid:-0}" -gt 0 ] && readlink /proc/$pid/exe)"; '
               'echo "linked=$(readlink /usr/local/bin/PROGRAM)"')
    text = ctl.ssh_text(host, command.replace("UNIT", unit).replace("PROGRAM", program))
    got = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    port = {"provider": PROVIDER_METRICS_PORT, "broker": BROKER_METRICS_PORT}[program]
    info = [labels for name, labels, _ in scrape(ctl, host, port) if name == "rpcmesh_build_info"]
    got["commit"] = info[0].get("commit", "") if info else ""
    return got


def reaches(ctl: Controller, src: Host, dst: Host, port: int) -> bool:
    """Whether a TCP connect from `src` to `dst`:`port` succeeds within 3 s (a port the
    firewall drops times out; nothing sent but the SYN)."""
    r = ctl.ssh(src, f"timeout 3 bash -c '</dev/tcp/{dst.ip}/{port}'", check=False)
    return r.returncode == 0


def system_state(ctl: Controller, m: Host) -> str:
    """`systemctl is-system-running` of a machine, with its failed units if not running."""
    r = ctl.ssh(m, "systemctl is-system-running; systemctl --failed --no-legend --plain",
                check=False)
    return " ".join(r.stdout.decode(errors="replace").split())


def units_active(ctl: Controller, *, joined: bool) -> dict[str, str]:
    """Each deployed machine's units and their states (`active` when all is well), and
    each machine's own state (`running`: no unit failed)."""
    states = {}
    for m in MACHINES:
        if not (joined or not m.joins_later):
            continue
        states[f"{m.name} system"] = system_state(ctl, m)
        units = (*UNITS.get(m.group, ()), *EVERY_MACHINE_UNITS)
        r = ctl.ssh(m, f"systemctl is-active {' '.join(units)}", check=False)
        said = r.stdout.decode().split()
        for i, unit in enumerate(units):
            states[f"{m.name} {unit}"] = said[i] if i < len(said) else f"exit {r.returncode}"
    return states


def not_well(states: dict[str, str]) -> dict[str, str]:
    """The entries of `units_active` that are not as they should be."""
    return {k: v for k, v in states.items()
            if v != ("running" if k.endswith(" system") else "active")}


def prometheus_targets(ctl: Controller) -> list[dict]:
    """The active targets of the monitoring host's Prometheus: job, instance, health."""
    mon = group("monitoring")[0]
    got = ctl.http_json(f"http://{mon.ip}:{PROMETHEUS_PORT}/api/v1/targets?state=active")
    return [
        {"job": t["labels"].get("job", ""), "instance": t["labels"].get("instance", ""),
         "health": t.get("health", ""), "error": t.get("lastError", "")}
        for t in got["data"]["activeTargets"]
    ]


def prometheus_query(ctl: Controller, query: str) -> list[dict]:
    mon = group("monitoring")[0]
    q = urllib.parse.quote(query)
    got = ctl.http_json(f"http://{mon.ip}:{PROMETHEUS_PORT}/api/v1/query?query={q}")
    if got.get("status") != "success":
        raise proc.RehearsalError(f"query {query!r}: {got}")
    return got["data"]["result"]


def prometheus_value(ctl: Controller, query: str) -> float | None:
    """The value of a query that gives one number (None when it gives none)."""
    result = prometheus_query(ctl, query)
    return float(result[0]["value"][1]) if result else None


def wait_targets_up(ctl: Controller, expected: list[tuple[Host, int]], timeout: float) -> list[dict]:
    """Waits until Prometheus has a target for every expected (machine, port), named by
    address or by host name, and every target is up (Prometheus's first scrape comes
    seconds after it starts: never a fixed sleep). Returns the targets."""
    last: list[dict] = []

    def missing() -> list[str]:
        have = {t["instance"] for t in last}
        return [f"{h.ip}:{p}" for h, p in expected
                if f"{h.ip}:{p}" not in have and f"{h.name}:{p}" not in have]

    def ready():
        nonlocal last
        last = prometheus_targets(ctl)
        return not missing() and all(t["health"] == "up" for t in last) and last

    try:
        return proc.wait_until("every Prometheus target up", ready, timeout=timeout, poll=1.0)
    except proc.RehearsalError as e:
        down = [f"{t['instance']} {t['health']} {t['error']}" for t in last if t["health"] != "up"]
        raise proc.RehearsalError(f"{e}; missing {missing()}; not up {down}") from e


def expected_targets(*, joined: bool, drivers: bool) -> list[tuple[Host, int]]:
    """The (machine, port) pairs Prometheus must scrape: every program's metrics endpoint
    (the drivers' only while they run), and every machine's node_exporter."""
    ports = {"providers": PROVIDER_METRICS_PORT, "brokers": BROKER_METRICS_PORT}
    if drivers:
        ports["drivers"] = DRIVER_METRICS_PORT
    programs = [(m, p) for g, p in ports.items() for m in group(g, joined=joined)]
    return programs + [(m, NODE_EXPORTER_PORT) for m in MACHINES if joined or not m.joins_later]


def provider_calls(ctl: Controller, host: Host) -> float:
    """Calls a provider answered, by its own /metrics (0 before it counted any)."""
    samples = scrape(ctl, host, PROVIDER_METRICS_PORT)
    return metric_sum(samples, "rpcmesh_calls_total", role="provider") or 0.0


def brokers_routed_to(ctl: Controller, host: Host) -> float:
    """Calls the brokers routed to a provider, by their /metrics."""
    total = 0.0
    for b in group("brokers"):
        samples = scrape(ctl, b, BROKER_METRICS_PORT)
        total += metric_sum(samples, "rpcmesh_upstream_calls_total",
                            upstream=f"{host.ip}:{PROVIDER_PORT}") or 0.0
    return total
