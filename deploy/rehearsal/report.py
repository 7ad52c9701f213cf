"""The rehearsal's report: each step with its outcome and seconds, then the figures (the
fleet's calls/s and percentiles from the merged HDR logs, failed calls, the joined
provider's calls, re-routed calls), printed as a short table and written as JSON.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Step:
    name: str
    ok: bool | None = None  # None: not run
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Report:
    steps: list[Step] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    ok: bool = False

    @contextmanager
    def step(self, name: str, say=lambda line: print(line, flush=True)):
        """Times a step; a step that raises is recorded as failed (and re-raised)."""
        s = Step(name)
        self.steps.append(s)
        say(f"== {name}")
        t = time.monotonic()
        try:
            yield s
        except BaseException as e:
            s.ok, s.seconds = False, time.monotonic() - t
            if not s.detail:
                s.detail = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            say(f"   FAILED after {s.seconds:.1f} s: {e}")
            raise
        s.ok, s.seconds = True, time.monotonic() - t
        say(f"   ok {s.seconds:.1f} s" + (f": {s.detail}" if s.detail else ""))

    def total(self) -> float:
        return time.monotonic() - self.started

    def text(self) -> str:
        lines = ["", "rehearsal report", ""]
        width = max((len(s.name) for s in self.steps), default=10)
        for s in self.steps:
            mark = {True: "ok", False: "FAILED", None: "not run"}[s.ok]
            lines.append(f"  {s.name:<{width}}  {mark:<7} {s.seconds:6.1f} s  {s.detail}")
        lines.append(f"  {'total':<{width}}  {'ok' if self.ok else 'FAILED':<7} {self.total():6.1f} s")
        if self.figures:
            lines.append("")
            for k, v in self.figures.items():
                if isinstance(v, dict):
                    v = ", ".join(f"{kk} {vv}" for kk, vv in v.items())
                lines.append(f"  {k.replace('_', ' ')}: {v}")
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Path) -> None:
        data = {"ok": self.ok, "seconds": round(self.total(), 1),
                "steps": [asdict(s) for s in self.steps], "figures": self.figures}
        (out_dir / "report.json").write_text(json.dumps(data, indent=2) + "\n")
        (out_dir / "report.txt").write_text(self.text())
