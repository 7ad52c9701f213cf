"""The rehearsal's checks of mutual TLS on the deployed fleet (deploy/ansible/roles/tls,
docs/security.md): who is refused, and a rotation of every certificate.

- `refusals`: from a driver machine, short driver runs against a broker that must get no
  call through: one with no client certificate (counted by the broker as
  `rpcmesh_tls_handshake_failures_total{reason="no_certificate"}`), one in plaintext
  (`reason="not_tls"`), and one with a certificate of the fleet's CA whose identity no
  rule of the policy names, whose calls are answered "permission denied: IDENTITY may
  not call Service.Method" and counted, exactly, in the broker's
  `rpcmesh_authz_denied_total`.
- `rotate`: site.yml's tls tasks with `rpcmesh_tls_renew=true` (a new key and
  certificate for every host) while the drivers run; each provider and broker must take
  its new certificate from the file (its `rpcmesh_tls_cert_expiry_timestamp_seconds`
  becomes the new one's, its reload counted ok) without a restart (the same main
  process), and each driver host must hold its new file. The change run's zero failed
  calls (checked when it stops) covers the rotation too.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from . import checks, proc, remote
from .load import DRIVER, LOAD_DIR
from .remote import Controller
from .topology import (
    BROKER_METRICS_PORT,
    BROKER_PORT,
    PROVIDER_METRICS_PORT,
    TLS_CA,
    TLS_FILE,
    TRUST_DOMAIN,
    Host,
    group,
)

#: The issuer the roles use (deploy/ansible/roles/tls runs it on the controller).
PKI = Path(__file__).resolve().parents[2] / "scripts/pki.py"
#: The identity of the refused-by-policy probe: a certificate of the fleet's CA whose
#: role no rule of the brokers' policy (rpcmesh_broker_policy) names.
STRANGER = ("tester", "rehearsal")
#: Where the stranger's certificate and key go on the driver machine.
STRANGER_FILE = f"{LOAD_DIR}/stranger.pem"
#: Each probe: a short open-loop run, enough calls to be sure none gets through.
PROBE_ARGS = ["--rate", "20", "--pacer", "lean", "--duration", "2s", "--warmup", "0s",
              "--concurrency", "4", "--metrics-listen", "off", "--progress", "off"]
#: A probe ends by itself after its 2 s, its reconnections and its report.
PROBE_TIMEOUT = 60.0
#: What a denied call's status says (common/src/authz.rs).
DENIED = "permission denied: "
#: How long a program may take to read new TLS files: its watch looks every second
#: (common::net::watch::FILE_POLL); a hang detector.
RELOAD_TIMEOUT = 30.0


def _probe(ctl: Controller, drv: Host, brk: Host, name: str, tls: list[str]) -> dict:
    """A driver run from `drv` against `brk` with the TLS flags `tls`: its JSON report
    (`{}` when it wrote none) and its exit status (`exit`)."""
    json_path = f"{LOAD_DIR}/{name}.json"
    argv = [DRIVER, "--target", f"{brk.ip}:{BROKER_PORT}", *PROBE_ARGS, *tls, "--json", json_path]
    r = ctl.ssh(drv, f"mkdir -p {LOAD_DIR} && rm -f {json_path} && {shlex.join(argv)} >/dev/null 2>&1; "
                     f"echo exit=$?; cat {json_path} 2>/dev/null", timeout=PROBE_TIMEOUT)
    first, _, rest = r.stdout.decode(errors="replace").partition("\n")
    report = json.loads(rest) if rest.strip() else {}
    report["exit"] = first.removeprefix("exit=")
    return report


def _broker_counts(ctl: Controller, brk: Host) -> dict[str, float]:
    samples = checks.scrape(ctl, brk, BROKER_METRICS_PORT)
    fail = "rpcmesh_tls_handshake_failures_total"
    return {
        "no_certificate": checks.metric_sum(samples, fail, side="inbound", reason="no_certificate") or 0.0,
        "not_tls": checks.metric_sum(samples, fail, side="inbound", reason="not_tls") or 0.0,
        "denied": checks.metric_sum(samples, "rpcmesh_authz_denied_total") or 0.0,
    }


def issue_stranger(pki_dir: Path, log: Path) -> Path:
    """The stranger's certificate, from the fleet's CA (on the controller): its file."""
    proc.run(["python3", str(PKI), "issue", str(pki_dir), *STRANGER, "--client",
              "--trust-domain", TRUST_DOMAIN, "--days", "1"], timeout=60, log=log)
    return pki_dir / f"{STRANGER[0]}-{STRANGER[1]}.combined.pem"


def refusals(r, pki_dir: Path) -> dict:
    """The three refusals (see the module's doc), from the second driver machine against
    the first broker, at once. Returns the figures; raises unless each holds."""
    ctl, drv, brk = r.ctl, group("drivers")[-1], group("brokers")[0]
    stranger = issue_stranger(pki_dir, r.out / "pki.log")
    ctl.put(drv, STRANGER_FILE, stranger.read_bytes())
    before = _broker_counts(ctl, brk)
    probes = {
        "no_certificate": ["--tls-ca", TLS_CA],
        "plaintext": [],
        "denied": ["--tls-ca", TLS_CA, "--tls-cert", STRANGER_FILE, "--tls-key", STRANGER_FILE],
    }
    with ThreadPoolExecutor(len(probes)) as pool:
        runs = dict(zip(probes, pool.map(lambda kv: _probe(ctl, drv, brk, f"probe-{kv[0]}", kv[1]),
                                         probes.items())))
    after = _broker_counts(ctl, brk)
    (r.out / "mtls-probes.json").write_text(json.dumps(runs, indent=2) + "\n")
    got = {k: after[k] - before[k] for k in after}
    fig: dict = {"from": drv.name, "to": brk.name}
    problems = []
    for name, report in runs.items():
        calls, due = report.get("calls", {}), report.get("requests", {}).get("due", 0)
        if not due:
            problems.append(f"{name}: the probe had no request to make (exit {report['exit']}, "
                            f"{r.out}/mtls-probes.json)")
        if calls.get("ok"):
            problems.append(f"{name}: {calls['ok']} calls got through")
        # Refused at the handshake, the driver never has a connection to send on.
        if name != "denied" and not calls.get("connect_failures"):
            problems.append(f"{name}: the driver was not refused a connection")
        fig[f"{name}_requests"] = due
    for reason in ("no_certificate", "not_tls"):
        fig[f"refused_{reason}"] = int(got[reason])
        if got[reason] < 1:
            problems.append(f"{brk.name} counted no handshake refused for {reason}")
    denied = runs["denied"].get("calls", {})
    denied_calls = int(denied.get("errors", {}).get("permission_denied", 0))
    texts = [g.get("text") or "" for g in denied.get("failures", [])]
    said = next((t for t in texts if t.startswith(DENIED)), "")
    fig.update(denied_calls=denied_calls, denied_counted=int(got["denied"]), denied_said=said)
    if not denied_calls or not said.startswith(f"{DENIED}spiffe://{TRUST_DOMAIN}/{STRANGER[0]}/"):
        problems.append(f"denied: no \"permission denied\" for the stranger: {texts}")
    if denied_calls != got["denied"]:
        problems.append(f"denied: the driver saw {denied_calls} calls denied, {brk.name} counted {got['denied']:g}")
    r.report.figures["mtls_refusals"] = fig
    if problems:
        raise proc.RehearsalError("mTLS: " + "; ".join(problems))
    return fig


def _not_after(path: Path) -> float:
    """A certificate file's end of validity, in Unix seconds."""
    out = subprocess.run(["openssl", "x509", "-in", str(path), "-noout", "-enddate"],
                         capture_output=True, text=True, check=True).stdout
    when = out.strip().removeprefix("notAfter=")
    return datetime.strptime(when, "%b %d %H:%M:%S %Y %Z").replace(tzinfo=timezone.utc).timestamp()


def _program_state(ctl: Controller, host: Host, program: str) -> dict:
    port = {"provider": PROVIDER_METRICS_PORT, "broker": BROKER_METRICS_PORT}[program]
    pid = ctl.ssh_text(host, f"systemctl show -p MainPID --value rpcmesh-{program}.service").strip()
    s = checks.scrape(ctl, host, port)
    return {"pid": pid,
            "expiry": checks.metric_sum(s, "rpcmesh_tls_cert_expiry_timestamp_seconds", cert="own"),
            "reloads_ok": checks.metric_sum(s, "rpcmesh_file_reloads_total", file="tls", result="ok") or 0.0,
            "reloads_error": checks.metric_sum(s, "rpcmesh_file_reloads_total", file="tls", result="error") or 0.0}


def rotate(r, pki_dir: Path) -> str:
    """Every certificate renewed under the drivers' load, and taken without a restart."""
    ctl = r.ctl
    servers = [(h, "provider") for h in group("providers")] + [(h, "broker") for h in group("brokers")]
    before = {h.name: _program_state(ctl, h, p) for h, p in servers}
    log = r.out / "ansible-rotate.log"
    remote.playbook(ctl, r.site, r.inventory, log, timeout=r.playbook_timeout,
                    extra=["--tags", "tls", "-e", "rpcmesh_tls_renew=true"])
    changed = remote.recap(log)
    unchanged = [h for h, n in changed.items() if h != group("monitoring")[0].name and not n]
    if unchanged:
        raise proc.RehearsalError(f"the renewal changed nothing on {unchanged}: {proc.tail(log, 15)}")
    problems = []

    def took_new(h: Host, program: str) -> bool:
        now = _program_state(ctl, h, program)
        return now["expiry"] == _not_after(pki_dir / f"{program}-{h.name}.pem") and now

    after = {}
    for h, program in servers:
        after[h.name] = proc.wait_until(f"{h.name}'s {program} reading its new certificate",
                                        lambda h=h, p=program: took_new(h, p),
                                        timeout=RELOAD_TIMEOUT, poll=0.5)
        b, a = before[h.name], after[h.name]
        if a["pid"] != b["pid"]:
            problems.append(f"{h.name}'s {program} restarted ({b['pid']} -> {a['pid']})")
        if a["expiry"] == b["expiry"]:
            problems.append(f"{h.name}'s {program} has the same certificate's end as before")
        if a["reloads_error"] != b["reloads_error"]:
            problems.append(f"{h.name}'s {program} refused a read of its TLS files")
    for d in group("drivers"):
        want = hashlib.sha256((pki_dir / f"driver-{d.name}.combined.pem").read_bytes()).hexdigest()
        have = ctl.ssh_text(d, f"sha256sum {TLS_FILE.format(program='driver')}").split()[0]
        if have != want:
            problems.append(f"{d.name} does not hold its new certificate")
    r.report.figures["rotation"] = {
        "hosts_renewed": sum(1 for n in changed.values() if n),
        "servers_reloaded_without_restart": sum(1 for h, _ in servers
                                                if after[h.name]["pid"] == before[h.name]["pid"]),
    }
    if problems:
        raise proc.RehearsalError("rotation: " + "; ".join(problems))
    return (f"{len(servers)} providers and brokers took their new certificates without a restart; "
            f"{len(group('drivers'))} drivers hold theirs")
