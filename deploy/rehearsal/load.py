"""Load: the driver on each driver machine, against every broker, as a transient systemd
unit (`systemd-run`, so that it outlives the SSH command that started it and stops by
`systemctl kill`), writing its HDR interval log and JSON report on the machine; then the
logs fetched and merged with `driver merge` into the fleet's exact percentiles.

A run is open loop at a fixed rate per driver (latency from each request's intended start,
so a stall during a restart shows in the percentiles), with the lean pacer so that the
drivers leave the 2 cores to the brokers and providers.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import proc
from .remote import Controller
from .topology import BROKER_PORT, DRIVER_METRICS_PORT, PREFIX, TLS_CA, TLS_FILE, Host, group

#: Where a run writes on a driver machine (its overlay).
LOAD_DIR = "/var/lib/rpcm-load"
#: The installed driver (the driver role puts it there).
DRIVER = "/usr/local/bin/driver"
#: How long a run may take past its own duration to write its report and exit.
EXIT_MARGIN = 30.0
#: The driver's exit status when SIGTERM stopped it (`driver --help`: "130 interrupted:
#: the report is of the part measured"): how a run that `stop` ended exits.
INTERRUPTED_STATUS = "130"


@dataclass
class Run:
    """A load run: the same command on every driver machine."""

    name: str
    drivers: list[Host]
    args: list[str]
    started: float = 0.0
    results: dict[str, dict] = field(default_factory=dict)
    #: Whether `stop` ended it (then its drivers exit INTERRUPTED_STATUS, not 0).
    stopped: bool = False

    @property
    def unit(self) -> str:
        return f"{PREFIX}load-{self.name}.service"


def start(ctl: Controller, name: str, *, rate: float, duration: float, warmup: float,
          concurrency: int, drivers: list[Host] | None = None) -> Run:
    """Starts the driver on every driver machine (or on `drivers`), each against every
    broker."""
    drivers, brokers = drivers or group("drivers"), group("brokers")
    args = [a for b in brokers for a in ("--target", f"{b.ip}:{BROKER_PORT}")]
    # Mutual TLS, as the role tls installs it: the fleet's CA, the driver's certificate.
    cert = TLS_FILE.format(program="driver")
    args += ["--tls-ca", TLS_CA, "--tls-cert", cert, "--tls-key", cert]
    args += [
        "--rate", f"{rate:g}", "--pacer", "lean", "--concurrency", str(concurrency),
        "--duration", f"{duration:g}s", "--warmup", f"{warmup:g}s", "--progress", "plain",
        "--metrics-listen", f"0.0.0.0:{DRIVER_METRICS_PORT}",
        "--hdr-log", f"{LOAD_DIR}/{name}.hlog", "--json", f"{LOAD_DIR}/{name}.json",
    ]
    run = Run(name, drivers, args)
    for d in drivers:
        ctl.ssh(d, f"mkdir -p {LOAD_DIR} && rm -f {LOAD_DIR}/{name}.* && "
                   f"systemd-run --quiet --unit={run.unit} --remain-after-exit "
                   f"--property=KillMode=mixed -- {DRIVER} {shlex.join(args)}")
    run.started = time.monotonic()
    return run


def state(ctl: Controller, run: Run, d: Host) -> dict[str, str]:
    """The run's unit on a driver machine: ActiveState, SubState, Result, ExecMainStatus."""
    text = ctl.ssh_text(d, f"systemctl show -p ActiveState,SubState,Result,ExecMainStatus {run.unit}")
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def finished(s: dict[str, str]) -> bool:
    return s.get("SubState") in ("exited", "failed", "dead")


def measuring_everywhere(ctl: Controller, run: Run) -> bool:
    """Whether every driver of the run is past its warm-up (its progress lines say
    `measuring`), so that every call made from now on is counted."""
    for d in run.drivers:
        if state(ctl, run, d).get("SubState") != "running":
            return False
        lines = ctl.ssh_text(d, f"journalctl -u {run.unit} --no-pager -o cat | tail -n 3")
        if "measuring" not in lines:
            return False
    return True


def stop(ctl: Controller, run: Run) -> None:
    """Ends the run early: SIGTERM to each driver, which stops and writes its report."""
    run.stopped = True
    for d in run.drivers:
        ctl.ssh(d, f"systemctl kill --signal=SIGTERM {run.unit}", check=False)


def wait(ctl: Controller, run: Run, timeout: float) -> dict[str, dict[str, str]]:
    """Waits until every driver of the run exited; their unit states."""
    states: dict[str, dict[str, str]] = {}

    def done():
        for d in run.drivers:
            if d.name not in states or not finished(states[d.name]):
                states[d.name] = state(ctl, run, d)
        return all(finished(s) for s in states.values())

    proc.wait_until(f"the drivers of run {run.name} exited", done, timeout=timeout, poll=1.0)
    return states


def exited_well(run: Run, s: dict[str, str]) -> bool:
    """Whether a driver's unit (its `state`) ended as the run should: exit 0, or, for a
    run `stop` ended, the driver's status for an interrupted run."""
    if s.get("ExecMainStatus") == "0":
        return s.get("Result") == "success"
    return run.stopped and s.get("ExecMainStatus") == INTERRUPTED_STATUS


def collect(ctl: Controller, run: Run, out_dir: Path) -> list[Path]:
    """Fetches each driver's log, report and output; checks each exited as it should
    (`exited_well`). Returns the HDR logs. Each unit is then stopped and its failed state,
    if any (an interrupted driver's status is not 0), reset, so that the machine is
    `running` again."""
    hlogs, problems = [], []
    for d in run.drivers:
        s = state(ctl, run, d)
        base = out_dir / f"{run.name}-{d.name}"
        journal = ctl.ssh(d, f"journalctl -u {run.unit} --no-pager -o cat", check=False)
        base.with_suffix(".log").write_bytes(journal.stdout)
        if not exited_well(run, s):
            problems.append(f"{d.name}: driver {s} (see {base}.log)")
            continue
        ctl.fetch(d, f"{LOAD_DIR}/{run.name}.hlog", base.with_suffix(".hlog"))
        ctl.fetch(d, f"{LOAD_DIR}/{run.name}.json", base.with_suffix(".json"))
        run.results[d.name] = json.loads(base.with_suffix(".json").read_text())
        hlogs.append(base.with_suffix(".hlog"))
        ctl.ssh(d, f"systemctl stop {run.unit}; systemctl reset-failed {run.unit} 2>/dev/null",
                check=False)
    if problems:
        raise proc.RehearsalError("; ".join(problems))
    return hlogs


def merge(driver_bin: Path, hlogs: list[Path], out: Path) -> dict:
    """`driver merge` of the run's logs: the fleet's report (its JSON), text beside it."""
    text = out.with_suffix(".txt")
    proc.run([str(driver_bin), "merge", *map(str, hlogs), "--json", str(out)],
             timeout=60, log=text)
    return json.loads(out.read_text())


def failed_calls(run: Run) -> dict[str, int]:
    """Calls that did not succeed, by kind, over every driver of the run: the report's
    call errors, plus sent calls that got no outcome (there should be none: every call
    gets exactly one)."""
    failed: dict[str, int] = {}
    for r in run.results.values():
        calls = r["calls"]
        for kind, n in calls.get("errors", {}).items():
            failed[kind] = failed.get(kind, 0) + int(n)
        unaccounted = int(calls["sent"]) - int(calls["ok"]) - sum(
            int(n) for n in calls.get("errors", {}).values()
        )
        if unaccounted:
            failed["unaccounted"] = failed.get("unaccounted", 0) + unaccounted
        not_sent = int(r["requests"].get("not_sent", 0))
        if not_sent:
            failed["requests_not_sent"] = failed.get("requests_not_sent", 0) + not_sent
        failed_requests = int(r["requests"].get("failed", 0))
        if failed_requests and not calls.get("errors"):
            failed["requests_failed"] = failed.get("requests_failed", 0) + failed_requests
    return {k: v for k, v in failed.items() if v}


def rerouted_calls(run: Run) -> int | str:
    """Calls the drivers sent again to another target because a draining broker refused
    them unrun (their reports' `calls.rerouted`); a sentence when the driver does not
    count them."""
    counts = [r["calls"].get("rerouted") for r in run.results.values()]
    if any(c is None for c in counts):
        return "not counted (this driver's report has no calls.rerouted)"
    return int(sum(counts))


def latency_figures(merged: dict) -> dict:
    """The calls' figures of a merged report: rate, count and percentiles (ms)."""
    calls = merged["figures"]["calls"]
    lat = calls["latency"]
    return {"calls_per_second": round(calls["per_second"]), "calls": calls["count"],
            "p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"], "p999_ms": lat["p999_ms"],
            "max_ms": lat["max_ms"]}
