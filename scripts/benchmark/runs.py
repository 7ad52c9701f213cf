"""The driver runs: the driver's command line for a workload and level, the readiness
probe that calls through a path until it answers, and one measured run, which starts a
driver, counts the CPU of every process on the path over the measured window, and reads the
driver's JSON report into the run's record (the report's `runs` entries)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from procs import ScriptError, spawn, stop

from . import plan
from .servers import Servers
from .usage import Usage, children_usage, proc_usage

#: Listening is not ready: the broker answers "unavailable" until its pool keeper has
#: connected to the provider and validated the connections with a heartbeat. A one-call
#: probe is retried until it succeeds, at most this long.
READY_TIMEOUT_S = 10.0
READY_RETRY_S = 0.1
#: Per-call timeout of the probe (the broker answers at once; a lost provider would not).
PROBE_CALL_TIMEOUT = "2s"
#: A run that takes this much longer than its warm-up + duration is killed and recorded as
#: failed.
RUN_SLACK_S = 30.0


def ms(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def driver_argv(
    driver: Path, target: str, workload: str, in_flight: int, conns: int, json_path: Path, run: list[str]
) -> list[str]:
    """One driver run: `run` says how long and with what else (duration or count, threads)."""
    name, flags = plan.DRIVER_WORKLOAD[workload]
    return [
        str(driver),
        "--target", target,
        "--workload", name,
        *flags,
        "--payload-size", str(plan.ECHO_PAYLOAD_BYTES),
        "--fanout", "1",
        "--concurrency", str(in_flight),
        "--connections", str(conns),
        "--progress", "off",
        "--metrics-listen", "off",
        "--json", str(json_path),
        *run,
    ]  # fmt: skip


def warmup(args, path: str) -> float:
    """The warm-up of a run on `path`: a TLS path's is longer (`--tls-warmup`), so that its
    connections' handshakes are over before the measured window opens."""
    return max(args.warmup, args.tls_warmup) if plan.is_tls(path) else args.warmup


def measured_run(args, path: str = "direct") -> list[str]:
    """The driver flags of a measured run on `path`."""
    return [
        "--duration", ms(args.duration), "--warmup", ms(warmup(args, path)),
        "--threads", str(args.driver_threads), *args.driver_args,
    ]  # fmt: skip


def tls_flags(args, path: str) -> list[str]:
    """The driver's TLS flags on a TLS path (the CA and its client certificate: `args.driver_tls`,
    set once the bench's certificates are made), none on a plain one."""
    return list(getattr(args, "driver_tls", [])) if plan.is_tls(path) else []


def probe(driver: Path, name: str, target: str, args, workdir: Path, kind: str = "rpcmesh", path: str = "direct") -> None:
    """Calls through `target` until one echo succeeds (bounded), in plain v1 frames for the
    classic server, over TLS on a TLS path."""
    json_path = workdir / "probe.json"
    argv = driver_argv(
        driver, target, "echo" if kind == "rpcmesh" else "classic", 1, 1, json_path,
        ["--requests", "1", "--warmup", "0s", "--timeout", PROBE_CALL_TIMEOUT, "--threads", "1", *tls_flags(args, path)],
    )  # fmt: skip
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        json_path.unlink(missing_ok=True)
        p = spawn(argv, subprocess.DEVNULL, subprocess.PIPE)
        err = b""
        try:
            _, err = p.communicate(timeout=READY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            err = b"the probe did not finish in time"
        finally:
            stop("driver", p)
        try:
            calls = json.loads(json_path.read_text())["calls"]
            if calls["ok"] >= 1:
                return
            last = f"calls: {calls['sent']} sent, errors {calls['errors']}, {calls['connect_failures']} connect failures"
        except (OSError, ValueError, KeyError):
            last = (err or b"").decode(errors="replace").strip()[-500:]
        time.sleep(READY_RETRY_S)
    raise ScriptError(f"the {name} path did not answer an echo within {READY_TIMEOUT_S:.0f} s: {last}")


def one_run(driver: Path, servers: Servers, target: str, path: str, workload: str, level, args, workdir: Path) -> dict:
    """One measured driver run through `path`: its record, `ok` or with its `failure`.
    Raises when a server on the path died."""
    in_flight, conns = level
    json_path = workdir / "run.json"
    json_path.unlink(missing_ok=True)
    kind = plan.WORKLOAD_KIND[workload]
    # Processes by role: the classic kind's roles are played by processes of its own.
    names = {role: plan.process_of(kind, path, role) for role in plan.PATH_SERVERS[path]}
    servers.check_alive(names.values())
    run = {
        "workload": workload,
        "kind": kind,
        "in_flight": in_flight,
        "connections_asked": conns,
        "path": path,
        "ok": False,
        "failure": None,
    }
    children_before = children_usage()
    err = open(workdir / "driver.err", "wb")
    try:
        t0 = time.monotonic()
        argv = driver_argv(driver, target, workload, in_flight, conns, json_path, measured_run(args, path) + tls_flags(args, path))
        p = spawn(argv, subprocess.DEVNULL, err, servers.cpus_of("driver"))
        try:
            # CPU is counted over the measured window only: sampled when the warm-up ends
            # (the driver's own clock starts a few ms after the spawn, so a few ms of
            # warm-up count too) and again when the driver has exited. So are the
            # brokers' allocations.
            time.sleep(max(0.0, t0 + warmup(args, path) - time.monotonic()))
            mark = servers.usage(names.values())
            allocs_at_mark = servers.allocations(names.values())
            try:
                driver_at_mark = proc_usage(p.pid)
            except (OSError, ValueError):  # the driver already exited: a failed run
                driver_at_mark = None
            try:
                p.wait(timeout=warmup(args, path) + args.duration + RUN_SLACK_S)
            except subprocess.TimeoutExpired:
                run["failure"] = "driver did not finish in time; killed"
        finally:
            stop("driver", p)
        wall = time.monotonic() - t0
        after = servers.usage(names.values())
        allocs_after = servers.allocations(names.values())
        driver_total = children_usage() - children_before
    finally:
        err.close()
    run["wall_seconds"] = round(wall, 3)
    run["driver_exit"] = p.returncode
    if run["failure"] is None and p.returncode != 0:
        tail = (workdir / "driver.err").read_text(errors="replace").strip()[-500:]
        run["failure"] = f"driver exited with status {p.returncode}: {tail}"
    try:
        report = json.loads(json_path.read_text())
    except (OSError, ValueError) as e:
        run["failure"] = run["failure"] or f"no JSON report: {e}"
        servers.check_alive(names.values())
        return run
    used = {role: after[n] - mark[n] for role, n in names.items()}
    if driver_at_mark is not None:
        used["driver"] = driver_total - driver_at_mark
    record_report(run, report, used)
    for role, n in names.items():
        a, b = allocs_at_mark[n], allocs_after[n]
        if a is not None and b is not None and run.get("calls_sent"):
            # A broker's heap allocations per call of the window: 0 in steady state.
            run.setdefault("allocations_per_call", {})[role] = round((b - a) / run["calls_sent"], 5)
    servers.check_alive(names.values())
    return run


def record_report(run: dict, report: dict, used: dict[str, Usage]) -> None:
    """Adds to `run` the driver's figures from its JSON `report` and what each process on
    the path used (`used`, by role), per call; decides `ok`."""
    c = report["calls"]
    lat = c["latency"]
    run.update(
        connections=report["setup"]["connections"],
        measured_seconds=report["measured_seconds"],
        calls_sent=c["sent"],
        calls_ok=c["ok"],
        errors=c["errors"],
        errors_total=sum(c["errors"].values()),
        late_replies=c["late_replies"],
        connect_failures=c["connect_failures"],
        calls_per_second=c["ok_per_second"],
        # The driver reports ms with µs resolution; round away float noise (0.121 * 1000).
        p50_us=round(lat["p50_ms"] * 1000, 1),
        p99_us=round(lat["p99_ms"] * 1000, 1),
        p999_us=round(lat["p999_ms"] * 1000, 1),
        max_us=round(lat["max_ms"] * 1000, 1),
        # Successful calls over the driver's SLOW_CALL_US (30 ms): stalls, not queueing.
        slow_calls=c.get("slow", 0),
    )
    run["cpu_seconds"] = {k: round(u.cpu, 4) for k, u in used.items()}
    run["cpu_per_1000_calls"], run["per_call"] = {}, {}
    n = c["sent"]
    for k, u in used.items():
        if n > 0:
            run["cpu_per_1000_calls"][k] = round(u.cpu * 1000 / n, 7)
            # Where the time went, per call: user and kernel µs, context switches, and for
            # a server the µs it waited for a CPU.
            run["per_call"][k] = {"user_us": round(u.user * 1e6 / n, 4), "system_us": round(u.system * 1e6 / n, 4),
                                  "switches": round(u.switches / n, 5)}  # fmt: skip
            if u.waited is not None:
                run["per_call"][k]["waited_us"] = round(u.waited * 1e6 / n, 4)
    if n > 0 and "driver" in used:
        # Every process on the path together (P2: what a hop adds over the direct path).
        run["cpu_us_per_call_all"] = round(sum(u.cpu for u in used.values()) * 1e6 / n, 4)
    if run["failure"] is None and c["ok"] == 0:
        run["failure"] = f"no successful call ({c['sent']} sent, errors {c['errors']}, {c['connect_failures']} connect failures)"
    run["ok"] = run["failure"] is None
