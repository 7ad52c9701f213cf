"""The rehearsal's report: each step with its outcome, seconds and CPU seconds, then the
figures (the fleet's calls/s and percentiles from the merged HDR logs, failed calls, the
joined provider's calls, re-routed calls), printed as a short table and written as JSON.

A step's CPU seconds are those the run itself spent in it: the commands it ran (Ansible
and its workers, SSH, the checks: this process's children) and the machines (their
cgroups: the programs, the load, the modules Ansible ran there). On a host that builds
beside the rehearsal, a step's seconds grow with the others' work; its CPU seconds much
less, so they compare runs. The teardown's are not counted: reaping the machines' nspawn
processes adds the whole of the machines' CPU to this process's children.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Step:
    name: str
    ok: bool | None = None  # None: not run
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    detail: str = ""


def children_cpu() -> float:
    """CPU seconds of this process's children that ended (user and system)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def spent(before: dict[str, float], after: dict[str, float]) -> float:
    """CPU seconds between two readings of `cpu` (a cgroup that went away in between
    counts nothing more)."""
    return sum(v - before.get(k, 0.0) for k, v in after.items() if v >= before.get(k, 0.0))


@dataclass
class Report:
    steps: list[Step] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    ok: bool = False
    #: CPU seconds used so far, by part (name: seconds; only ever growing).
    cpu: Callable[[], dict[str, float]] = field(
        default=lambda: {"children": children_cpu()}, repr=False)

    @contextmanager
    def step(self, name: str, say=lambda line: print(line, flush=True), *, count_cpu: bool = True):
        """Times a step (and its CPU, with `count_cpu`); a step that raises is recorded as
        failed (and re-raised)."""
        s = Step(name)
        self.steps.append(s)
        say(f"== {name}")
        t, cpu = time.monotonic(), self.cpu()

        def done() -> None:
            s.seconds = time.monotonic() - t
            s.cpu_seconds = spent(cpu, self.cpu()) if count_cpu else 0.0

        try:
            yield s
        except BaseException as e:
            s.ok = False
            done()
            if not s.detail:
                s.detail = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            say(f"   FAILED after {s.seconds:.1f} s: {e}")
            raise
        s.ok = True
        done()
        say(f"   ok {s.seconds:.1f} s, {s.cpu_seconds:.0f} s CPU" + (f": {s.detail}" if s.detail else ""))

    def total(self) -> float:
        return time.monotonic() - self.started

    def text(self) -> str:
        lines = ["", "rehearsal report", ""]
        width = max((len(s.name) for s in self.steps), default=10)
        for s in self.steps:
            mark = {True: "ok", False: "FAILED", None: "not run"}[s.ok]
            lines.append(f"  {s.name:<{width}}  {mark:<7} {s.seconds:6.1f} s  {s.cpu_seconds:5.0f} s CPU  {s.detail}")
        lines.append(f"  {'total':<{width}}  {'ok' if self.ok else 'FAILED':<7} {self.total():6.1f} s"
                     f"  {sum(s.cpu_seconds for s in self.steps):5.0f} s CPU")
        if self.figures:
            lines.append("")
            for k, v in self.figures.items():
                if isinstance(v, dict):
                    v = ", ".join(f"{kk} {vv}" for kk, vv in v.items())
                lines.append(f"  {k.replace('_', ' ')}: {v}")
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Path) -> None:
        data = {"ok": self.ok, "seconds": round(self.total(), 1),
                "cpu_seconds": round(sum(s.cpu_seconds for s in self.steps), 1),
                "steps": [asdict(s) for s in self.steps], "figures": self.figures}
        (out_dir / "report.json").write_text(json.dumps(data, indent=2) + "\n")
        (out_dir / "report.txt").write_text(self.text())
