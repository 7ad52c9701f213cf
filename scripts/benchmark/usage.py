"""CPU and context-switch accounting: what a live process (a server) has used, from
/proc/<pid>; what the children this script has waited for have used (the drivers, each
reaped before it is counted), from their rusage; this script's own CPU; and the whole
machine's busy and stolen CPU, from /proc/stat, which `Interference` turns into the CPU
other work took from the bench. Reading only: the processes are started elsewhere."""

from __future__ import annotations

import os
import resource
import time
from typing import NamedTuple

#: The unit of the times in /proc/<pid>/stat and /proc/stat.
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Usage(NamedTuple):
    """What a process has used so far: where its CPU time went, and how often it was
    switched out (the wake-ups it needed)."""

    #: CPU seconds in user mode.
    user: float
    #: CPU seconds in the kernel: system calls, and the network stack's work done on their
    #: behalf (on loopback, a send also runs the receiving socket's softirq work).
    system: float
    #: Context switches, voluntary (slept, e.g. in epoll_wait) and involuntary (preempted).
    switches: int
    #: Seconds its threads were ready to run and waited for a CPU (the run-queue delay of
    #: /proc/<pid>/task/*/schedstat): what the other processes on the machine kept it
    #: from. None where it cannot be read (a child already reaped, a kernel without it).
    waited: float | None = None

    @property
    def cpu(self) -> float:
        return self.user + self.system

    def __sub__(self, other: "Usage") -> "Usage":
        waited = None if self.waited is None or other.waited is None else self.waited - other.waited
        return Usage(self.user - other.user, self.system - other.system, self.switches - other.switches, waited)


def proc_usage(pid: int) -> Usage:
    """A live process's usage (all its threads): times from /proc/<pid>/stat, context
    switches and run-queue delay summed over /proc/<pid>/task/*/status and schedstat (a
    thread that already exited is missed: the programs' threads live as long as they do,
    bar Tokio's idle blocking threads)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read().decode(errors="replace")
    # Fields after "pid (comm)"; comm may hold spaces and parentheses, so split after the
    # last ')'. utime and stime are fields 14 and 15 of the whole line.
    rest = stat[stat.rindex(")") + 2 :].split()
    switches = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        switches += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            pass
    sched = schedstat(pid)
    waited = None if sched is None else sched[1] / 1e9
    return Usage(int(rest[11]) / CLK_TCK, int(rest[12]) / CLK_TCK, switches, waited)


def schedstat(pid: int) -> tuple[int, int] | None:
    """Nanoseconds the threads of the live process `pid` have run on a CPU and have waited
    on a run queue, summed (the first two fields of /proc/<pid>/task/*/schedstat; a thread
    that already ended is missed, as in `proc_usage`); None on a kernel without them."""
    ran = waited = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
        except (FileNotFoundError, ProcessLookupError):
            if os.path.exists(f"/proc/{pid}/task/{tid}"):
                return None  # the thread is there and its schedstat is not: no schedstat
            continue  # the thread ended meanwhile
        ran += int(fields[0])
        waited += int(fields[1])
    return ran, waited


def children_usage() -> Usage:
    """The usage of every child this script has waited for (all their threads, ended ones too)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Usage(r.ru_utime, r.ru_stime, r.ru_nvcsw + r.ru_nivcsw)


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def machine_cpu() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy (all CPUs) and stolen by the hypervisor."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / CLK_TCK, (v[7] if len(v) > 7 else 0) / CLK_TCK


class Interference:
    """What other work took from the bench: the machine's busy CPU time over the bench
    minus that of the bench's own processes (servers, drivers, this script). Made when the
    bench starts; `measure` at its end, while the servers still run."""

    def __init__(self):
        self.busy, self.steal = machine_cpu()
        self.ours = children_usage().cpu + own_cpu()

    def measure(self, servers_cpu, started: float) -> dict:
        """The report's `interference`: `servers_cpu()` gives the servers' CPU seconds so
        far, `started` is when the bench began (time.monotonic)."""
        busy, steal = machine_cpu()
        ours = children_usage().cpu + own_cpu() + servers_cpu() - self.ours
        wall = time.monotonic() - started
        return {
            "wall_seconds": round(wall, 1),
            "machine_busy_cpu_seconds": round(busy - self.busy, 2),
            "bench_cpu_seconds": round(ours, 2),
            "other_cpu_seconds": round(max(0.0, busy - self.busy - ours), 2),
            "steal_seconds": round(steal - self.steal, 2),
        }
