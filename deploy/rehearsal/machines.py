"""The machines: Debian roots booted with systemd as PID 1 by systemd-nspawn, one per
network namespace, all from the one base image, each with a tmpfs overlay over it
(`--volatile=overlay`), so that the base is never written to.

What a machine needs beyond the image is bound into it read-only before it boots: the
controller's SSH key (/root/.ssh), its host name and the fleet's /etc/hosts. On every
machine but the monitoring host, the image's Prometheus and Alertmanager are masked (a
real deployment would not install them there). The host has no system bus, so nspawn runs with `--register=no
--keep-unit`; a machine is halted by SIGTERM to its nspawn process, which powers it off.

Each nspawn starts in a cgroup of its own (`rpcm-<machine>`, in every hierarchy that
systemd uses). Without one, every nspawn started from the same cgroup puts its machine in
the same `payload` cgroup, so the machines' systemds share one `system.slice`: the same
unit on two machines is one cgroup on the host, holding both machines' processes, and a
unit starting on one machine while the same unit stops on another fails to attach to the
cgroup the other just removed (`status=219/CGROUP`; seen at boot, with
systemd-remount-fs).

The process ids of every machine are kept in STATE, so that `--cleanup` can stop the
machines of a run that was killed before its own teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import proc
from .topology import MACHINES, Host

#: The run's state: the machines' process ids, for `--cleanup`.
STATE_DIR = Path("/run/rpcm-rehearsal")
STATE = STATE_DIR / "machines.json"
#: The base's units that run on the monitoring host only (a real deployment would not
#: install them elsewhere): masked on every other machine.
MONITORING_ONLY = ("prometheus.service", "prometheus-alertmanager.service")
#: A machine powers off in a few seconds; its units have TimeoutStopSec=20s at worst.
HALT_TIMEOUT = 30.0


@dataclass
class Machine:
    """A booted machine: its host, its nspawn process and its console log."""

    host: Host
    process: subprocess.Popen
    console: Path

    def leader(self) -> int | None:
        """The machine's PID 1 as the host sees it (the nspawn process's child)."""
        for task in Path(f"/proc/{self.process.pid}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            if kids:
                return int(kids[0])
        return None


#: Where cgroup hierarchies are mounted.
CGROUP_FS = Path("/sys/fs/cgroup")


def cgroup_parents() -> list[Path]:
    """The folders, one per hierarchy systemd uses here, under which a machine's own
    cgroup is made: this process's cgroup in the unified hierarchy (cgroup v2) or, on a
    hybrid host, in `name=systemd` and in the unified one beside it."""
    mine = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        mine[controllers] = path.lstrip("/")
    if (CGROUP_FS / "cgroup.controllers").exists():
        return [CGROUP_FS / mine.get("", "")]
    parents = []
    if "name=systemd" in mine and (CGROUP_FS / "systemd").is_dir():
        parents.append(CGROUP_FS / "systemd" / mine["name=systemd"])
    if "" in mine and (CGROUP_FS / "unified/cgroup.controllers").exists():
        parents.append(CGROUP_FS / "unified" / mine[""])
    return parents


def cgroups_of(name: str) -> list[Path]:
    return [p / name for p in cgroup_parents()]


def remove_cgroups(names: list[str] | None = None) -> list[str]:
    """Removes the machines' cgroups (by default every `rpcm-` one), innermost first,
    after killing any process left in one (by its id: the cgroup holds only what its
    machine ran). Returns the names removed."""
    removed = set()
    for parent in cgroup_parents():
        for top in sorted(parent.glob("rpcm-*")) if parent.is_dir() else []:
            if names is not None and top.name not in names:
                continue
            for procs in top.rglob("cgroup.procs"):
                for pid in procs.read_text().split():
                    proc.kill(int(pid), signal.SIGKILL)
            deadline = time.monotonic() + proc.STOP_GRACE
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                while True:
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            break
                        time.sleep(proc.POLL)
            removed.add(top.name)
    return sorted(removed)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds each machine has used so far (its cgroups' `cpu.stat`; the hierarchies
    without one are skipped)."""
    got: dict[str, float] = {}
    for parent in cgroup_parents():
        for cg in parent.glob("rpcm-*") if parent.is_dir() else []:
            try:
                text = (cg / "cpu.stat").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("usage_usec "):
                    got[cg.name] = int(line.split()[1]) / 1e6
    return got


def prepare(run_dir: Path) -> None:
    """The files bound into the machines: /etc/hosts of the fleet, each one's host name."""
    etc = run_dir / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{m.ip}\t{m.name}" for m in MACHINES]
    (etc / "hosts").write_text("\n".join(lines) + "\n")
    for m in MACHINES:
        (etc / f"hostname.{m.name}").write_text(m.name + "\n")


def boot(host: Host, image: Path, run_dir: Path, out_dir: Path) -> Machine:
    """Starts the machine (returns at once; `ready` tells when it is up)."""
    etc = run_dir / "etc"
    argv = [
        "systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--boot",
        f"--directory={image}", f"--machine={host.name}", "--volatile=overlay",
        f"--network-namespace-path=/run/netns/{host.name}",
        "--console=read-only",
        # Its firewall (the role firewall's nftables rules) is loaded as on a real host:
        # the capability reaches only the machine's own network namespace.
        "--capability=CAP_NET_ADMIN",
        f"--bind-ro={run_dir / 'ssh'}:/root/.ssh",
        f"--bind-ro={etc / ('hostname.' + host.name)}:/etc/hostname",
        f"--bind-ro={etc / 'hosts'}:/etc/hosts",
    ]
    if host.group != "monitoring":
        for unit in MONITORING_ONLY:
            argv.append(f"--bind-ro=/dev/null:/etc/systemd/system/{unit}")
    # /proc/sys/net writable (it is the machine's own network namespace), so that the host
    # tuning (somaxconn and friends) applies; the rest of /proc/sys stays read-only.
    env = dict(os.environ, SYSTEMD_NSPAWN_API_VFS_WRITABLE="network")
    console = out_dir / f"console-{host.name}.log"
    cgroups = cgroups_of(host.name)
    for cg in cgroups:
        cg.mkdir(exist_ok=True)

    def enter_cgroups() -> None:  # in the child, before nspawn runs
        for cg in cgroups:
            (cg / "cgroup.procs").write_text("0")

    return Machine(host, proc.start(argv, log=console, env=env, preexec=enter_cgroups), console)


def save_state(machines: list[Machine]) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps(
        [{"name": m.host.name, "nspawn": m.process.pid, "leader": m.leader()} for m in machines]
    ))


def _is_ours(pid: int) -> bool:
    """Whether `pid` is still one of our nspawn processes (not a reused id)."""
    argv = proc.cmdline(pid)
    return bool(argv) and argv[0].endswith("systemd-nspawn") and any(
        a.startswith("--machine=rpcm-") for a in argv
    )


def halt_pids(nspawns: list[tuple[int, int | None]], timeout: float = HALT_TIMEOUT) -> list[int]:
    """Halts machines by their (nspawn, leader) ids: SIGTERM to nspawn (it powers the
    machine off), then SIGKILL to the leader and nspawn of any still up after `timeout`.
    Returns the nspawn ids that had to be killed."""
    live = [(n, lead) for n, lead in nspawns if proc.alive(n) and _is_ours(n)]
    for n, _ in live:
        proc.kill(n, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(proc.alive(n) for n, _ in live) and time.monotonic() < deadline:
        time.sleep(proc.POLL)
    killed = []
    for n, lead in live:
        if proc.alive(n):
            killed.append(n)
            if lead:
                proc.kill(lead, signal.SIGKILL)  # the PID namespace dies with its init
            proc.kill(n, signal.SIGKILL)
    return killed


def halt(machines: list[Machine]) -> list[str]:
    """Halts the machines of this run; returns the names of those that had to be killed."""
    pids = [(m.process.pid, m.leader()) for m in machines]
    killed = set(halt_pids(pids))
    for m in machines:
        try:
            m.process.wait(timeout=proc.STOP_GRACE)
        except subprocess.TimeoutExpired:
            pass
    STATE.unlink(missing_ok=True)
    return [m.host.name for m in machines if m.process.pid in killed]


def halt_leftovers() -> list[str]:
    """Halts the machines of an earlier run that died before its teardown (from STATE)."""
    try:
        rows = json.loads(STATE.read_text())
    except (OSError, ValueError):
        return []
    live = [r for r in rows if proc.alive(r["nspawn"]) and _is_ours(r["nspawn"])]
    halt_pids([(r["nspawn"], r.get("leader")) for r in live])
    STATE.unlink(missing_ok=True)
    return [r["name"] for r in live]
