"""The order of the runs: for every workload and level, the repeats, and within each repeat
every path in turn (direct, broker, haproxy, nginx, direct, broker, ...), so that drift of
the machine hits all paths alike and the paths compared in a ratio run next to each other in
time. Each run is numbered (`order`) and tagged with its `repeat`, and a progress line is
logged as it ends."""

from __future__ import annotations

from pathlib import Path

from procs import log

from . import plan
from .runs import one_run
from .servers import Servers


def runs_total(args, paths) -> int:
    """How many runs the bench makes (the classic server has no TLS paths)."""
    return sum(len(args.levels[w]) * len(plan.kind_paths(paths, plan.WORKLOAD_KIND[w])) for w in args.workloads) * args.repeats


def run_all(driver: Path, servers: Servers, addresses: dict[str, dict[str, str]], paths, args, workdir: Path) -> list[dict]:
    """Every run, interleaved; their records in the order they ran."""
    total = runs_total(args, paths)
    runs: list[dict] = []
    i = 0
    for w in args.workloads:
        kind = plan.WORKLOAD_KIND[w]
        for level in args.levels[w]:
            for rep in range(args.repeats):
                for path in plan.kind_paths(paths, kind):
                    i += 1
                    r = one_run(driver, servers, addresses[kind][path], path, w, level, args, workdir)
                    r["repeat"] = rep + 1
                    r["order"] = i
                    runs.append(r)
                    log(f"[{i:>3}/{total}] {w:<8} {level[0]:>3}/{level[1]:<3} {path:<11} {progress(r)}")
    return runs


def progress(r: dict) -> str:
    """A run's figures on its progress line, and why it failed."""
    status = (
        f"{r['calls_per_second']:>9,.0f} calls/s  p50 {r['p50_us']:>5.0f} us  "
        f"p99 {r['p99_us']:>6.0f} us  max {r['max_us'] / 1000:6.2f} ms"
        + (f"  errors {r['errors_total']}" if r.get("errors_total") else "")
        if "calls_per_second" in r
        else ""
    )
    if r["failure"]:
        status += f"  FAILED: {r['failure']}"
    return status
