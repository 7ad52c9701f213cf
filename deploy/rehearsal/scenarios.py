"""The rehearsal's rollout faults and checks beyond the happy path, each a step of
`deploy/rehearse` run while the drivers load the fleet (but the firewall's and check
mode's): what docs/deployment.md promises when a rollout goes wrong.

- `firewall`: a driver machine cannot reach a provider (calls or metrics), and still
  reaches the brokers; the monitoring host reaches the providers' metrics.
- `lost_restart`: a task made to fail after the copy of a new build leaves the host on
  the build it ran (put back, the play stopped saying so), and a second run rolls the
  build out and restarts; then a run that died between the link and the restart (the
  link put back by hand, the process still on the other build) is caught by the next
  run (rollback.yml, to a build named), which restarts from the running-build check.
- `rollback`: a deliberately broken build rolled out to the providers: the first one
  fails its health check, is put back on its previous build automatically, the play
  stops with a clear message, and the other providers are never touched.
- `check_mode`: `site.yml --check --diff` on every host of the converged fleet: no
  failure and nothing it would change.
- `watchdog`: a provider whose process is frozen (SIGSTOP: no task of its runtime runs,
  so no watchdog ping) is killed by systemd's watchdog and started again (no load runs
  then: its calls in flight would wait for it).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import checks, proc, remote
from .topology import (
    BROKER_PORT,
    PROVIDER_METRICS_PORT,
    PROVIDER_PORT,
    group,
)

#: Health tries of the runs that are meant to fail (the broken build never gets
#: healthy, and its port check waits all of them): enough for the previous build's
#: restart, which is healthy again within a few seconds (the brokers reconnect within
#: their reconnect backoff, at most 1 s, and a heartbeat, 1 s), far fewer than the 60 of
#: a real rollout.
FAILING_HEALTH_RETRIES = 10
#: The rollouts of a provider build (the lost restart's and the rollback's runs) run only
#: site.yml's providers play (and the builds kept), as an operator rolling out a provider
#: build may: the plays that prepare the hosts have nothing to do on the converged fleet
#: (the join and check mode run them whole), and each costs seconds of the 2 cores.
PROVIDER_ROLLOUT = ["--tags", "providers"]
#: What the roles say when they put a host back (roles/provider/tasks/main.yml).
STOPPED = "The rollout stops here"


def firewall(r) -> str:
    """A driver machine cannot reach a provider; the rest of the fleet's paths work."""
    ctl = r.ctl
    drv, brk, prv, mon = group("drivers")[0], group("brokers")[0], group("providers")[0], \
        group("monitoring")[0]
    want = [(drv, prv, PROVIDER_PORT, False), (drv, prv, PROVIDER_METRICS_PORT, False),
            (drv, brk, BROKER_PORT, True), (brk, prv, PROVIDER_PORT, True),
            (mon, prv, PROVIDER_METRICS_PORT, True)]
    # At once: a dropped connect waits its whole timeout.
    with ThreadPoolExecutor(len(want)) as pool:
        results = list(pool.map(lambda w: checks.reaches(ctl, w[0], w[1], w[2]), want))
    got = {f"{s.name}->{d.name}:{p}": ok for (s, d, p, _), ok in zip(want, results)}
    wrong = {k: v for (_, _, _, w), (k, v) in zip(want, got.items()) if v != w}
    r.report.figures["firewall"] = {k: "open" if v else "dropped" for k, v in got.items()}
    if wrong:
        raise proc.RehearsalError(f"the firewall does not hold: {wrong} (want {want})")
    return (f"{drv.name} cannot reach {prv.name}:{PROVIDER_PORT} nor :{PROVIDER_METRICS_PORT}; "
            f"it reaches {brk.name}:{BROKER_PORT}, the brokers the providers, monitoring their metrics")


def _site(r, log: str, *, bin_dir: Path, limit: str, extra: list[str] | None = None,
          playbook: Path | None = None, expect_ok: bool = True):
    """site.yml (or `playbook`) with the build of `bin_dir` on the hosts of `limit`, its
    providers play (PROVIDER_ROLLOUT); its exit as `expect_ok` says, else a
    RehearsalError. Returns the log's path."""
    path = r.out / log
    res = remote.playbook(r.ctl, playbook or r.site, r.inventory, path,
                          timeout=r.playbook_timeout,
                          extra=["-e", f"rpcmesh_bin_dir={bin_dir}", "--limit", limit,
                                 *PROVIDER_ROLLOUT, *(extra or [])], check=False)
    if (res.returncode == 0) != expect_ok:
        raise proc.RehearsalError(
            f"{path.name}: exit {res.returncode}, expected {'success' if expect_ok else 'a failure'}: "
            f"{proc.tail(path, 15)}")
    return path


def _on(r, host, manifest: dict) -> dict[str, str]:
    """Checks the provider of `host` runs `manifest`'s build, linked and running."""
    binary = f"{r.host_builds}/{manifest['build']}/provider"
    got = checks.running_build(r.ctl, host, "provider")
    if got.get("exe") != binary or got.get("linked") != binary or got.get("commit") != manifest["commit"]:
        raise proc.RehearsalError(f"{host.name} should run {binary}: {got}")
    return got


def lost_restart(r) -> str:
    """A failure after the copy, the run after it; then a restart lost and caught."""
    ctl, prv = r.ctl, group("providers")[0]
    good, second = r.builds["good"], r.builds["second"]
    fig = r.report.figures.setdefault("lost_restart", {})
    # 1. The unit's source is missing: the task right after the binary's copy fails.
    empty = r.run_dir / "no-source"
    empty.mkdir(exist_ok=True)
    log = _site(r, "ansible-fail-after-copy.log", bin_dir=r.build_dirs["second"],
                limit=prv.name, extra=["-e", f"rpcmesh_source_dir={empty}"], expect_ok=False)
    said = log.read_text(errors="replace")
    if STOPPED not in said or good["build"] not in said:
        raise proc.RehearsalError(f"{log.name} does not say the host was put back: {proc.tail(log, 15)}")
    _on(r, prv, good)
    fig["failed_after_copy"] = f"put back on {good['build']}, running it"
    # 2. The same rollout again: it restarts the provider on the new build.
    log = _site(r, "ansible-second-run.log", bin_dir=r.build_dirs["second"], limit=prv.name)
    _on(r, prv, second)
    fig["second_run"] = f"restarted on {second['build']} ({remote.recap(log).get(prv.name)} changed)"
    # 3. A rollback that died between the link and the restart: linked to the good build,
    #    still running the second. rollback.yml to the good build finds the link in
    #    place and restarts from the running-build check alone.
    ctl.ssh(prv, f"ln -sfn {r.host_builds}/{good['build']}/provider /usr/local/bin/provider")
    before = checks.running_build(ctl, prv, "provider")
    if before.get("exe") != f"{r.host_builds}/{second['build']}/provider":
        raise proc.RehearsalError(f"{prv.name} should still run the second build: {before}")
    log = _site(r, "ansible-lost-restart.log", bin_dir=r.build_dirs["good"], limit=prv.name,
                playbook=r.rollback, extra=["-e", f"rpcmesh_rollback_build={good['build']}"])
    _on(r, prv, good)
    fig["lost_restart_caught_by"] = f"rollback.yml -e rpcmesh_rollback_build={good['build']}"
    return (f"failed after the copy: put back; second run: restarted on {second['build']}; "
            f"a lost restart: caught by rollback.yml, back on {good['build']}")


def rollback(r) -> str:
    """The broken build rolled out to the providers: the first is put back, the play
    stops, the others are untouched."""
    ctl = r.ctl
    first, *others = group("providers")
    good, bad = r.builds["good"], r.builds["broken"]
    before = {p.name: checks.running_build(ctl, p, "provider")["exe"] for p in others}
    log = _site(r, "ansible-broken-build.log", bin_dir=r.build_dirs["broken"], limit="providers",
                extra=["-e", f"rpcmesh_health_retries={FAILING_HEALTH_RETRIES}"], expect_ok=False)
    said = log.read_text(errors="replace")
    if STOPPED not in said or bad["build"] not in said:
        raise proc.RehearsalError(f"{log.name} does not say why it stopped: {proc.tail(log, 15)}")
    _on(r, first, good)
    after = {p.name: checks.running_build(ctl, p, "provider")["exe"] for p in others}
    if after != before:
        raise proc.RehearsalError(f"the providers after {first.name} were changed: {before} -> {after}")
    message = next(line.strip() for line in said.splitlines() if STOPPED in line)
    r.report.figures["rollback"] = {"host": first.name, "build": bad["build"],
                                    "put_back_on": good["build"], "others_untouched": len(others),
                                    "message": message[:300]}
    return (f"{bad['build']} failed on {first.name}: put back on {good['build']}; "
            f"the play stopped; {len(others)} providers untouched")


def check_mode(r) -> str:
    """`site.yml --check --diff` on every host: succeeds, and would change nothing. All
    the providers (then the brokers) in one batch (`rpcmesh_serial=100%`): a check
    restarts nothing, so there is nothing to roll one host at a time, and each host is
    checked (health checks included) as it would be alone."""
    log = r.out / "ansible-check.log"
    remote.playbook(r.ctl, r.site, r.inventory, log, timeout=r.playbook_timeout,
                    extra=["--check", "--diff", "-e", "rpcmesh_serial=100%"])
    changed = remote.recap(log)
    r.report.figures["check_mode_changed"] = changed
    would = {h: n for h, n in changed.items() if n}
    if would:
        raise proc.RehearsalError(f"--check --diff would change {would} on the converged fleet")
    return f"site.yml --check --diff on {len(changed)} hosts: clean, nothing to change"


#: How long systemd may take to notice a frozen provider and start it again: its
#: WatchdogSec (10 s), the kill, RestartSec (1 s) and the start, with room; a hang
#: detector.
WATCHDOG_TIMEOUT = 60.0


def watchdog(r) -> str:
    """A frozen provider is restarted by systemd's watchdog."""
    ctl, prv = r.ctl, group("providers")[1]
    unit = "rpcmesh-provider.service"

    def show() -> dict[str, str]:
        text = ctl.ssh_text(prv, f"systemctl show -p MainPID,NRestarts,ActiveState {unit}")
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    before = show()
    frozen = time.monotonic()
    ctl.ssh(prv, f"kill -STOP {before['MainPID']}")
    proc.wait_until(
        f"{prv.name}'s frozen provider restarted by the watchdog",
        lambda: (lambda s: s.get("ActiveState") == "active" and s.get("MainPID") not in ("0", before["MainPID"])
                 and int(s.get("NRestarts", "0")) > int(before.get("NRestarts", "0")))(show()),
        timeout=WATCHDOG_TIMEOUT, poll=1.0)
    seconds = round(time.monotonic() - frozen, 1)
    said = ctl.ssh_text(prv, f"journalctl -u {unit} --no-pager -o cat | grep -c 'Watchdog timeout' || true")
    if int(said.strip() or 0) < 1:
        raise proc.RehearsalError(f"{prv.name}: restarted, but the journal names no watchdog timeout")
    r.report.figures["watchdog"] = {"host": prv.name, "restarted_after_s": seconds}
    return f"{prv.name}'s provider frozen (SIGSTOP): the watchdog restarted it after {seconds} s"
