"""--busy N: other work beside the bench. The broker's busy polling, and any hop's CPU per
call, decide more on a machine whose CPUs other processes want than on a quiet one (the
spinner that did not yield lost to the L4 proxies only there: docs/performance.md, "Busy
polling"), so the bench can run every path beside N processes that only spin, each
pinned to one CPU, started before the first run and stopped by PID after the last. Their
CPU is other processes' in the report's interference line, and counted apart."""

from __future__ import annotations

import subprocess
import sys

import procs
from .usage import proc_usage

#: What a hog runs: a loop that never sleeps. The last argument only names it in `ps`
#: (and lets the tests find one that outlived the bench).
SPIN = ["-c", "while True: pass", "rpcmesh-bench-busy"]


def busy_cpus(allowed: set[int], n: int) -> list[int]:
    """The CPUs of `n` hogs: the lowest of those the bench may use. `--pin` puts the hops on
    the highest, so a hog never shares a hop's CPU (`n` < the CPUs, checked by options)."""
    return sorted(allowed)[:n]


class Hogs:
    """The spinning processes, one per CPU of `cpus`."""

    def __init__(self, cpus: list[int]):
        self.procs = {
            cpu: procs.spawn([sys.executable, *SPIN], subprocess.DEVNULL, subprocess.DEVNULL, {cpu}) for cpu in cpus
        }
        for cpu, p in self.procs.items():
            procs.log(f"bench: --busy: a spinning process (pid {p.pid}) on CPU {cpu}")

    def cpu_seconds(self) -> float:
        """The CPU the hogs have used so far."""
        total = 0.0
        for p in self.procs.values():
            if p.poll() is None:
                total += proc_usage(p.pid).cpu
        return total

    def stop(self) -> None:
        for cpu, p in self.procs.items():
            procs.stop(f"busy hog on CPU {cpu}", p)
