"""The machine stall probe: before the runs, one process per CPU spins reading the clock.
The largest gap any of them sees is a stall of the machine itself with every CPU busy
(kernel threads, the scheduler, the hypervisor) that no path can beat: the floor under
every max latency, and the yardstick for T5."""

from __future__ import annotations

import os
import subprocess
import sys

from procs import LISTEN_TIMEOUT_S, ScriptError, spawn, stop

#: How long the spinners run in a full bench: 3 s sees a handful of stalls on a VM.
STALL_PROBE_S = 3.0
#: How long they run in smoke mode, which checks that the probe works, not its figures.
STALL_PROBE_SMOKE_S = 0.3
#: A gap between two clock reads longer than this counts as a stall (a spinner reads the
#: clock every few hundred nanoseconds).
STALL_GAP_NS = 500_000
#: What each spinner runs (python3 -c CODE SECONDS GAP_NS): prints its gaps in ns.
STALL_SPINNER = """
import sys, time
clock = time.perf_counter_ns
end = clock() + int(float(sys.argv[1]) * 1e9)
gap = int(sys.argv[2])
last = clock()
gaps = []
while last < end:
    now = clock()
    if now - last > gap:
        gaps.append(now - last)
    last = now
print(" ".join(map(str, gaps)))
"""


def stall_probe(seconds: float) -> dict:
    """Keeps every CPU busy with a clock-reading spinner for `seconds`; returns the stalls
    they saw (the report's `stall_probe`)."""
    n = len(os.sched_getaffinity(0))
    spinners = []
    gaps: list[int] = []
    try:
        for _ in range(n):
            spinners.append(spawn([sys.executable, "-c", STALL_SPINNER, str(seconds), str(STALL_GAP_NS)],
                                  subprocess.PIPE, subprocess.DEVNULL))  # fmt: skip
        for p in spinners:
            try:
                out, _ = p.communicate(timeout=seconds + LISTEN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise ScriptError(f"the stall probe did not finish in {seconds + LISTEN_TIMEOUT_S:.0f} s")
            gaps += [int(x) for x in out.split()]
    finally:
        for p in spinners:
            stop("stall probe", p)
    gaps.sort(reverse=True)
    return {
        "spinners": n,
        "seconds": seconds,
        "gap_threshold_us": STALL_GAP_NS / 1000,
        "stalls": len(gaps),
        "largest_us": [round(g / 1000, 1) for g in gaps[:10]],
    }


def stall_summary(probe: dict) -> str:
    """The probe in one phrase, for the log, T5's note and the reports."""
    top = probe["largest_us"]
    largest = f"the largest {top[0] / 1000:.2f} ms" if top else "none"
    return (f"{probe['spinners']} spinner(s) x {probe['seconds']:g} s: {probe['stalls']} stall(s) over "
            f"{probe['gap_threshold_us'] / 1000:g} ms, {largest}")  # fmt: skip
