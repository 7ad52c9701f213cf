"""The command line of scripts/bench, validated in one place into the settings of one run:
each workload's levels, the repeats and durations (smoke mode's or a full run's unless
given), the extra flags of each program split as a shell would, the baseline broker made
absolute. A usage error exits 2 with argparse's message."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from procs import ROOT, add_binary_args

from . import busy, plan

from .plan import (
    CLASSIC_LEVELS,
    DEFAULT_DURATION_S,
    DEFAULT_REPEATS,
    DEFAULT_THREADS,
    DEFAULT_WARMUP_S,
    LEVELS,
    SMOKE_DURATION_S,
    SMOKE_LEVELS,
    SMOKE_WARMUP_S,
    SMOKE_WORKLOADS,
    TLS_WARMUP_S,
    WORKLOAD_KIND,
    WORKLOADS,
)
from .handshakes import HANDSHAKE_S, HANDSHAKE_SMOKE_S


def parse_level(s: str):
    """IN_FLIGHT/CONNECTIONS as a level (in flight, connections)."""
    try:
        f, c = s.split("/")
        level = (int(f), int(c))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s}: expected IN_FLIGHT/CONNECTIONS, e.g. 64/8") from None
    if min(level) < 1:
        raise argparse.ArgumentTypeError(f"{s}: both numbers must be at least 1")
    return level


def parse_args(argv, description: str):
    """The options of `argv`; `description` heads --help."""
    p = argparse.ArgumentParser(
        prog="scripts/bench",
        description=description,
        epilog="Method, targets and results: docs/performance.md.",
    )
    p.add_argument("--smoke", action="store_true",
                   help="one short repeat of echo and classic at 8 in flight, every path; exit 0 if every path made calls "
                        "(targets not judged)")  # fmt: skip
    add_binary_args(p)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results", help="directory for the JSON and Markdown reports")
    p.add_argument("--repeats", type=int, help=f"repeats of each cell (default {DEFAULT_REPEATS})")
    p.add_argument("--duration", type=float, help=f"measured seconds per run (default {DEFAULT_DURATION_S})")
    p.add_argument("--warmup", type=float, help=f"warm-up seconds per run (default {DEFAULT_WARMUP_S})")
    p.add_argument("--workloads", help="comma-separated subset of: " + ",".join(WORKLOADS))
    p.add_argument("--levels", help="comma-separated IN_FLIGHT/CONNECTIONS, for every workload (default "
                   + ",".join(f"{a}/{b}" for a, b in LEVELS) + "; the classic workload "
                   + ",".join(f"{a}/{b}" for a, b in CLASSIC_LEVELS) + ")")  # fmt: skip
    for who in ("provider", "broker", "driver"):
        p.add_argument(f"--{who}-threads", type=int, default=DEFAULT_THREADS,
                       help=f"Tokio worker threads of the {who} (default {DEFAULT_THREADS})")  # fmt: skip
    for who, example in (("provider", "--compress off"), ("broker", "--pool-size 2"), ("driver", "--stage-metrics off")):
        p.add_argument(f"--{who}-args", default="",
                       help=f"extra {who} flags, one shell-quoted string (e.g. '{example}')")  # fmt: skip
    p.add_argument("--baseline-broker", type=Path, metavar="PATH",
                   help="another broker binary (e.g. a release build of an older commit): adds the path 'before' "
                        "through it, started with the same broker flags, and the ratios broker / before")  # fmt: skip
    p.add_argument("--baseline-args", default="", metavar="ARGS",
                   help="extra flags of the baseline broker alone, one shell-quoted string, after the broker's "
                        "(e.g. '--busy-poll off' to set one flag against its default, or '--pool-size 4 --busy-poll "
                        "50us' for broker/examples/floor_epoll); none the bench gives both already")  # fmt: skip
    p.add_argument("--pin", action="store_true",
                   help="run the hop of every path (the broker, HAProxy, nginx) on a CPU of its own and the driver and "
                        "upstream on the others (taskset), so that per-call costs compare without the scheduler's "
                        "placement")  # fmt: skip
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run every path beside N processes that only spin, each pinned to one of the lowest N CPUs "
                        "(never the hops' with --pin), to compare the hops on a machine busy with other work "
                        "(default 0: none)")  # fmt: skip
    p.add_argument("--tls", choices=("on", "off"), default="on",
                   help="the TLS paths (direct-tls, broker-tls, haproxy-tls, nginx-tls; rpcmesh's provider only) and "
                        "the handshake measurement (default on)")  # fmt: skip
    p.add_argument("--tls-warmup", type=float,
                   help=f"warm-up seconds of a TLS path's run (default {TLS_WARMUP_S}, smoke the --warmup; never "
                        "shorter than --warmup)")  # fmt: skip
    p.add_argument("--handshake-seconds", type=float,
                   help=f"seconds of each handshake measurement (default {HANDSHAKE_S}, smoke {HANDSHAKE_SMOKE_S}; "
                        "0 leaves it out)")  # fmt: skip
    a = p.parse_args(argv)
    a.tls = a.tls == "on"
    # (hops' CPUs, the others'), or None: the scheduler places them.
    allowed = os.sched_getaffinity(0)
    a.cpus = plan.pin_cpus(allowed) if a.pin else None
    if not 0 <= a.busy < len(allowed):
        p.error(f"--busy must leave a CPU to the bench: 0 to {len(allowed) - 1} on this machine")
    a.busy_cpus = busy.busy_cpus(allowed, a.busy)
    if a.handshake_seconds is None:
        a.handshake_seconds = HANDSHAKE_SMOKE_S if a.smoke else HANDSHAKE_S
    if a.tls_warmup is None:
        a.tls_warmup = 0.0 if a.smoke else TLS_WARMUP_S
    if a.handshake_seconds < 0 or a.tls_warmup < 0:
        p.error("--handshake-seconds and --tls-warmup must be >= 0")
    if a.baseline_broker is not None:
        # Absolute now: the servers run from the workspace root, not from the caller's folder.
        a.baseline_broker = a.baseline_broker.resolve()
        if not (a.baseline_broker.is_file() and os.access(a.baseline_broker, os.X_OK)):
            p.error(f"--baseline-broker {a.baseline_broker}: not an executable file")
    a.repeats = a.repeats if a.repeats is not None else (1 if a.smoke else DEFAULT_REPEATS)
    a.duration = a.duration if a.duration is not None else (SMOKE_DURATION_S if a.smoke else DEFAULT_DURATION_S)
    a.warmup = a.warmup if a.warmup is not None else (SMOKE_WARMUP_S if a.smoke else DEFAULT_WARMUP_S)
    if a.workloads:
        a.workloads = tuple(w.strip() for w in a.workloads.split(","))
        bad = [w for w in a.workloads if w not in WORKLOADS]
        if bad:
            p.error(f"unknown workload(s) {bad}; choose from {WORKLOADS}")
    else:
        a.workloads = SMOKE_WORKLOADS if a.smoke else WORKLOADS
    # Each workload's levels: --levels for all, or the defaults (the classic server's own).
    if a.levels:
        try:
            given = tuple(parse_level(x.strip()) for x in a.levels.split(","))
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
        a.levels = {w: given for w in a.workloads}
    elif a.smoke:
        a.levels = {w: SMOKE_LEVELS for w in a.workloads}
    else:
        a.levels = {w: CLASSIC_LEVELS if WORKLOAD_KIND[w] == "classic" else LEVELS for w in a.workloads}
    if a.repeats < 1 or a.duration <= 0 or a.warmup < 0:
        p.error("--repeats must be >= 1, --duration > 0, --warmup >= 0")
    if a.baseline_args and a.baseline_broker is None:
        p.error("--baseline-args goes with --baseline-broker")
    for who in ("provider", "broker", "driver", "baseline"):
        try:
            setattr(a, f"{who}_args", shlex.split(getattr(a, f"{who}_args")))
        except ValueError as e:
            p.error(f"--{who}-args: {e}")
    return a
