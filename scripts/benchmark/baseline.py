"""The baseline broker's verdict (--baseline-broker): whether the current broker is slower
than another broker binary beyond this bench's noise. Its path, `before`, runs right after
the broker's in every repeat, started with the same flags on its own port; the verdict is
the median over the cells of broker ÷ before calls/s against NO_REGRESSION_MIN.

Why 3 %: one cell's ratio between two interleaved paths moves by 2-5 % from one full run to
the next; the median over the 8 cells of a full run moves less than half as much (1-2 %),
and 0.97 sits beyond that: the same binary on both paths passes, a slowdown of 3 % or more
across the cells fails. A narrower run (--workloads, --levels) has fewer cells and more
noise; each cell's broker_over_before_by_repeat in the JSON, and the range printed on the
summary line, show the run's own spread: where the single repeats spread wider than 3 % (a
busy machine), 3 % cannot be resolved. The verdict informs, like the targets: it does not
change the exit status, and smoke mode does not judge it. The targets are computed from the
same paths with or without the option."""

from __future__ import annotations

import datetime as dt
import hashlib
import shlex
import statistics
from pathlib import Path

from .tables import fmt_num

#: broker ÷ before calls/s, median over the cells, at or above which the current broker is
#: not slower than the baseline beyond this bench's noise (see the module's docstring).
NO_REGRESSION_MIN = 0.97


def file_identity(path: Path) -> dict:
    """Which binary: its SHA-256 and modification time (the reports name the baseline by it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    modified = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).isoformat(timespec="seconds")
    return {"sha256": h.hexdigest(), "modified": modified}


def baseline_summary(ratios, binary: Path, extra_args: list[str], broker: Path, judged: bool) -> dict:
    """The report's `baseline`: the median over the cells of broker ÷ before calls/s
    (and of the broker's CPU per call), the range over cells and single repeats, and the
    verdict against NO_REGRESSION_MIN (not judged in smoke mode)."""
    cells = [r["broker_over_before"] for r in ratios if r.get("broker_over_before") is not None]
    cpu = [r["broker_over_before_cpu_per_call"] for r in ratios if r.get("broker_over_before_cpu_per_call") is not None]
    reps = [x for r in ratios for x in r.get("broker_over_before_by_repeat", []) if x is not None]
    median = statistics.median(cells) if cells else None
    if median is None:
        verdict = "not measured"
    elif not judged:
        verdict = "not judged (smoke mode)"
    elif median >= NO_REGRESSION_MIN:
        verdict = "no regression beyond noise"
    else:
        verdict = "REGRESSION: slower than the baseline beyond noise"
    ours, theirs = file_identity(broker), file_identity(binary)
    return {
        "binary": str(binary),
        # --baseline-args: its flags beyond the broker's.
        "args": shlex.join(extra_args),
        **theirs,
        "same_binary_as_broker": ours["sha256"] == theirs["sha256"],
        "cells": len(cells),
        "median_broker_over_before": median,
        "median_broker_over_before_cpu_per_call": statistics.median(cpu) if cpu else None,
        "cell_range": [min(cells), max(cells)] if cells else None,
        "repeat_range": [min(reps), max(reps)] if reps else None,
        "threshold": NO_REGRESSION_MIN,
        "verdict": verdict,
    }


def baseline_line(b: dict) -> str:
    """The summary line the text and Markdown reports give the baseline."""
    if b["median_broker_over_before"] is None:
        return f"broker ÷ before (baseline {b['binary']}): not measured (no cell has both paths)"
    spread = f"cells {b['cell_range'][0]:.3f}-{b['cell_range'][1]:.3f}"
    if b["repeat_range"]:
        spread += f", single repeats {b['repeat_range'][0]:.3f}-{b['repeat_range'][1]:.3f}"
    cpu = b["median_broker_over_before_cpu_per_call"]
    return (
        f"broker ÷ before calls/s, median over {b['cells']} cell(s): {b['median_broker_over_before']:.3f} ({spread}); "
        f"broker CPU per call ÷ before: {fmt_num(cpu, '.3f')}. Verdict (≥ {b['threshold']:g}): {b['verdict']}. "
        f"Baseline: {b['binary']}" + (f" {b['args']}" if b.get("args") else "") + f" (sha256 {b['sha256'][:12]}, modified {b['modified']}"
        + (", the same binary as the broker's)." if b["same_binary_as_broker"] else ").")
    )
