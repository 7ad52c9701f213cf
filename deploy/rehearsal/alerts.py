"""The rehearsal's alerts, end to end: Prometheus on the monitoring machine evaluates the
deployment's alert rules, Alertmanager there (the role monitoring) posts what fires and
resolves to a webhook, and a receiver running in that machine (webhook.py) records it.

- `start_receiver`: webhook.py copied to the monitoring machine and started there as a
  transient unit on 127.0.0.1:WEBHOOK_PORT, before the deployment; Alertmanager's route
  points at it (`settings`).
- `settings`: the deployment's variables the rehearsal changes for its alerts: the
  webhook, Alertmanager's group timings in seconds instead of minutes, and the rule
  files (a copy of grafana/prometheus/rules in which the alert the rehearsal fires has a
  `for` of seconds; every expression and every other alert as they are).
- `fire`: the first provider is made to fail every call it answers (a systemd drop-in
  giving it `RPCMESH_FAIL_CALLS=true`, and a restart) while a driver loads the fleet;
  the brokers eject it, RpcmeshProviderEjected fires and must reach the webhook as
  firing; then the load stops and the provider is put right (the drop-in removed, a
  restart).
- `resolve`: later (the rehearsal's check mode runs in between, while the brokers'
  ejection runs out), the driver calls again: the brokers' probe call to the provider
  succeeds, they take it back, and the alert must reach the webhook as resolved; no call
  of that run may fail.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path

from . import load, proc
from .remote import Controller
from .topology import Host, group

#: The receiver's script, and where it goes on the monitoring machine.
WEBHOOK_SCRIPT = Path(__file__).resolve().parent / "webhook.py"
WEBHOOK_INSTALLED = "/usr/local/lib/rpcm-webhook.py"
#: Where it listens (the monitoring machine's loopback: Alertmanager runs there) and
#: writes what it receives.
WEBHOOK_PORT = 9099
WEBHOOK_FILE = "/var/lib/rpcm-webhook/alerts.jsonl"
WEBHOOK_UNIT = "rpcm-webhook.service"
#: The alert a provider that fails its calls fires (grafana/prometheus/rules/alerts.yml).
ALERT = "RpcmeshProviderEjected"
#: Its `for` in the rehearsal (1m in the deployment): two evaluations at the rehearsal's
#: 1 s interval, so the rule's pending state is still gone through.
ALERT_FOR = "2s"
#: Alertmanager's timings in the rehearsal: a new group is notified a second after its
#: first alert (30 s in the deployment), a resolution a second after Prometheus sends it
#: (5 m), and nothing is sent again within the run (4 h).
ALERTMANAGER_TIMINGS = {
    "rpcmesh_alertmanager_group_wait": "1s",
    "rpcmesh_alertmanager_group_interval": "1s",
    "rpcmesh_alertmanager_repeat_interval": "1h",
}
#: The drop-in that makes the provider fail every call (provider --fail-calls), in /run:
#: gone at a reboot, and never the deployment's files.
FAULT_DROPIN = "/run/systemd/system/rpcmesh-provider.service.d/rehearsal-fault.conf"
#: Requests/s the driver offers meanwhile (50 calls/s): each broker sends the failing
#: provider its 5 calls in a row within a second, and its probe call at once when it
#: calls again.
FAULT_RATE = 10.0
#: The run lasts until stopped; this only bounds it.
FAULT_RUN_MAX_SECONDS = 600.0
#: Requests in flight at most: far above what 10/s at a few ms needs.
FAULT_CONCURRENCY = 100
#: From the fault to the alert at the webhook: the ejection (a second of calls), a
#: scrape and an evaluation (1 s each), the `for`, Alertmanager's group wait: seconds. A
#: hang detector.
FIRING_TIMEOUT = 120.0
#: From calls again to the resolution at the webhook: what is left of the brokers' first
#: ejection (30 s, `--eject-base-time`, if the steps between took less), a probe call, a
#: scrape, an evaluation and a group interval. A hang detector.
RESOLVED_TIMEOUT = 120.0


def start_receiver(ctl: Controller) -> None:
    """The webhook receiver, started on the monitoring machine (it outlives the SSH
    command: a transient unit)."""
    mon = group("monitoring")[0]
    ctl.put(mon, WEBHOOK_INSTALLED, WEBHOOK_SCRIPT.read_bytes(), mode="0755")
    ctl.ssh(mon, f"systemd-run --quiet --unit={WEBHOOK_UNIT} --property=Restart=on-failure "
                 f"python3 {WEBHOOK_INSTALLED} 127.0.0.1:{WEBHOOK_PORT} {WEBHOOK_FILE}")


def rules(src: Path, run_dir: Path) -> list[str]:
    """The deployment's rule files, copied with ALERT's `for` set to ALERT_FOR (nothing
    else changed); their paths."""
    out = run_dir / "rules"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in sorted(src.glob("*.yml")):
        lines, current, changed = [], None, 0
        for line in f.read_text().splitlines():
            key = line.strip()
            if key.startswith("- alert:") or key.startswith("- record:"):
                current = key.split(":", 1)[1].strip()
            elif current == ALERT and key.startswith("for:"):
                line = f"{line.split('for:', 1)[0]}for: {ALERT_FOR}"
                changed += 1
            lines.append(line)
        if f.name == "alerts.yml" and changed != 1:
            raise proc.RehearsalError(f"{f}: no `for` of {ALERT} to shorten")
        (out / f.name).write_text("\n".join(lines) + "\n")
        paths.append(str(out / f.name))
    return paths


def settings(src_rules: Path, run_dir: Path) -> dict:
    """The variables the rehearsal gives the deployment for its alerts."""
    return {
        "rpcmesh_alertmanager_webhook_url": f"http://127.0.0.1:{WEBHOOK_PORT}/alerts",
        **ALERTMANAGER_TIMINGS,
        "rpcmesh_prometheus_rules": rules(src_rules, run_dir),
    }


def _notifications(ctl: Controller, mon: Host) -> list[dict]:
    """What the receiver got: each notification with the time it came (`received`)."""
    text = ctl.ssh_text(mon, f"cat {WEBHOOK_FILE} 2>/dev/null || true")
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [{**x["body"], "received": x["received"]} for x in lines if isinstance(x.get("body"), dict)]


def _seconds(stamp: str) -> float:
    """An RFC 3339 time of Alertmanager's (Go's: nanoseconds, `Z` or an offset)."""
    m = re.fullmatch(r"([^.]+?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    if not m:
        return 0.0
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(f"{m.group(1)}.{(m.group(2) or '0')[:6]:0<6}{zone}").timestamp()


def _alerts(ctl: Controller, mon: Host, status: str, since: float) -> dict[str, dict]:
    """ALERT's alerts the webhook received with `status` (firing, resolved), that began
    after `since` (Unix seconds), by instance; each with the time it came (`received`)."""
    got = {}
    for n in _notifications(ctl, mon):
        for a in n.get("alerts", []):
            labels = a.get("labels", {})
            if (labels.get("alertname") == ALERT and a.get("status") == status
                    and _seconds(a.get("startsAt", "1970-01-01T00:00:00Z")) >= since):
                got.setdefault(labels.get("instance", "?"), {**a, "received": n["received"]})
    return got


def _set_fault(ctl: Controller, prv: Host, on: bool) -> None:
    """Gives the provider RPCMESH_FAIL_CALLS=true (or takes it away) and restarts it
    (drained), then waits until it is active."""
    unit = "rpcmesh-provider.service"
    if on:
        ctl.put(prv, FAULT_DROPIN, b"[Service]\nEnvironment=RPCMESH_FAIL_CALLS=true\n", mode="0644")
    else:
        ctl.ssh(prv, f"rm -f {FAULT_DROPIN}")
    ctl.ssh(prv, f"systemctl daemon-reload && systemctl restart {unit}")
    proc.wait_until(f"{prv.name}'s provider active", lambda: ctl.ssh_text(
        prv, f"systemctl is-active {unit} || true").strip() == "active", timeout=60, poll=0.5)


def _load(r, name: str) -> load.Run:
    """A run of the first driver alone, at FAULT_RATE, until stopped."""
    run = load.start(r.ctl, name, rate=FAULT_RATE, duration=FAULT_RUN_MAX_SECONDS, warmup=0.0,
                     concurrency=FAULT_CONCURRENCY, drivers=group("drivers")[:1])
    r.runs.append(run)
    return run


def _stop(r, run: load.Run) -> tuple[int, int]:
    """Stops a run of `_load`: its calls sent and failed."""
    load.stop(r.ctl, run)
    load.wait(r.ctl, run, load.EXIT_MARGIN)
    load.collect(r.ctl, run, r.out)
    r.runs.remove(run)
    return (sum(int(x["calls"]["sent"]) for x in run.results.values()),
            sum(load.failed_calls(run).values()))


def fire(r) -> str:
    """The first provider made to fail its calls under a driver's load: the alert reaches
    the webhook as firing. Then the load stops and the provider is put right; the brokers'
    ejection runs out meanwhile (30 s), while the rehearsal goes on (`resolve`)."""
    ctl = r.ctl
    mon, prv = group("monitoring")[0], group("providers")[0]
    since = time.time()
    _set_fault(ctl, prv, on=True)
    run = _load(r, "fault")
    try:
        firing = proc.wait_until(f"{ALERT} firing at the webhook",
                                 lambda: _alerts(ctl, mon, "firing", since),
                                 timeout=FIRING_TIMEOUT, poll=1.0)
    finally:
        calls, failed = _stop(r, run)
    _set_fault(ctl, prv, on=False)
    fired_after = round(min(a["received"] for a in firing.values()) - since, 1)
    r.alert = {"since": since, "firing": sorted(firing)}
    r.report.figures["alert"] = {"alert": ALERT, "provider": prv.name, "brokers": sorted(firing),
                                 "firing_after_s": fired_after, "fault_run_calls": calls,
                                 "fault_run_failed": failed}
    return (f"{prv.name} failing every call: {ALERT} for {len(firing)} broker(s) at the webhook "
            f"{fired_after} s after ({failed} of {calls:,} calls failed before the ejection); "
            f"{prv.name} put right")


def resolve(r) -> str:
    """Once the brokers' ejection of the provider `fire` broke has run out (the rehearsal
    went on meanwhile), calls again: the brokers' probe call to it succeeds, they take it
    back, and the alert reaches the webhook as resolved for every broker it fired for."""
    ctl, state, fig = r.ctl, r.alert, r.report.figures["alert"]
    mon = group("monitoring")[0]
    started = time.time()
    run = _load(r, "probe")
    try:
        resolved = proc.wait_until(
            f"{ALERT} resolved at the webhook for {state['firing']}",
            lambda: (lambda got: got if set(state["firing"]) <= set(got) else None)(
                _alerts(ctl, mon, "resolved", state["since"])),
            timeout=RESOLVED_TIMEOUT, poll=1.0)
    finally:
        calls, failed = _stop(r, run)
        (r.out / "webhook.jsonl").write_text(ctl.ssh_text(mon, f"cat {WEBHOOK_FILE} 2>/dev/null || true"))
    after = round(max(a["received"] for a in resolved.values()) - started, 1)
    fig.update(resolved_after_calls_s=after, probe_run_calls=calls, probe_run_failed=failed)
    if failed:
        raise proc.RehearsalError(f"{failed} calls failed once the provider was put right")
    return (f"{ALERT} resolved at the webhook {after} s after calls resumed; "
            f"0 of {calls:,} calls failed")
