"""Network namespaces for the lab scripts (`capacity-lab`, `faults`): hosts made as
namespaces named `<prefix><pid>-<host>` and removed on exit whatever happened, programs run
inside them (`ip netns exec`), servers that are ready once they print their listening line,
and a client that reads a server's /metrics from inside its own namespace.

Nothing is ever addressed from the root namespace (the root namespace routes private ranges
to the real network): every client runs inside a namespace of the lab, and readiness is read
from a server's stdout, not by connecting to it. Each script wires its own topology in
`Namespaces.wire`. Stdlib only, over `procs`.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from procs import ScriptError, spawn, stop, tail, uninterruptible

#: How long a server may take to print its listening line.
START_TIMEOUT_S = 15.0
#: How long reading a server's /metrics from inside a namespace may take.
SCRAPE_TIMEOUT_S = 5.0


def sh(*argv: str) -> None:
    """Runs a command; its failure is a ScriptError with what it said."""
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise ScriptError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")


class Namespaces:
    """The lab's hosts, one namespace each (loopback up), made on entering and removed on
    leaving, also when something failed on the way. Subclasses wire them (`wire`)."""

    def __init__(self, prefix: str, hosts: tuple[str, ...]):
        self.ns = {h: f"{prefix}{os.getpid()}-{h}" for h in hosts}

    def __enter__(self):
        try:
            for n in self.ns.values():
                sh("ip", "netns", "add", n)
                sh("ip", "-n", n, "link", "set", "lo", "up")
            self.wire()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        with uninterruptible():
            self._remove()

    def wire(self) -> None:
        """Links, addresses and routes between the hosts: the subclass's topology."""

    def _remove(self) -> None:
        for n in self.ns.values():
            subprocess.run(["ip", "netns", "del", n], capture_output=True)

    def exec(self, host: str, argv: list[str]) -> list[str]:
        """`argv` as run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def run(self, host: str, *argv: str) -> None:
        """Runs a command inside `host`'s namespace (a ScriptError if it fails)."""
        sh(*self.exec(host, list(argv)))

    def scrape(self, host: str, url: str) -> str:
        """The text at `url` (a /metrics endpoint), read by a client inside `host`'s
        namespace; empty if it could not be read."""
        code = ("import sys, urllib.request; "
                f"sys.stdout.write(urllib.request.urlopen({url!r}, timeout={SCRAPE_TIMEOUT_S}).read().decode())")  # fmt: skip
        r = subprocess.run(self.exec(host, ["python3", "-c", code]), capture_output=True, text=True,
                           timeout=SCRAPE_TIMEOUT_S + 5)  # fmt: skip
        return r.stdout if r.returncode == 0 else ""


class Server:
    """A provider or broker in its namespace, ready once it printed its listening line."""

    def __init__(self, lab: Namespaces, host: str, name: str, argv: list[str], work: Path):
        self.name = name
        self.out = work / f"{name}.out"
        self.err = work / f"{name}.err"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.p = spawn(lab.exec(host, argv), o, e)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while "listening" not in self.out.read_text(errors="replace"):
                if self.p.poll() is not None:
                    raise ScriptError(f"{name} exited (status {self.p.returncode}) at start\n{tail(self.err, name)}")
                if time.monotonic() > deadline:
                    raise ScriptError(f"{name} did not say it listens within {START_TIMEOUT_S:.0f} s\n{tail(self.err, name)}")
                time.sleep(0.05)
        except BaseException:
            # Not yet in the caller's list of servers: stop it here.
            with uninterruptible():
                stop(name, self.p)
            raise

    def stop(self) -> None:
        stop(self.name, self.p)


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of the samples of `name` in a Prometheus exposition `text` whose labels
    include `labels` (0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, rest = head.partition("{")
        if metric_name != name:
            continue
        have = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv)
        if all(have.get(k) == f'"{v}"' for k, v in (labels or {}).items()):
            try:
                total += float(value)
            except ValueError:
                pass
    return total
