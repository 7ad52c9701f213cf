"""The bench's report: the result document (the machine, the settings, every run, the
cells, ratios and targets; written as bench-results/bench-<timestamp>.json), and its
drawing as text (printed) and as Markdown (bench-<timestamp>.md) from the same document."""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import subprocess
from pathlib import Path

import procs
from procs import ROOT

from . import plan
from .baseline import baseline_line
from .stalls import stall_summary
from .summary import cpu_columns
from .tables import (
    handshake_rows,
    md_table,
    ratio_rows,
    split_rows,
    suite_rows,
    table_rows,
    target_rows,
    text_table,
    tls_rows,
)
from .usage import CLK_TCK


def machine(haproxy: str, nginx: str) -> dict:
    """The report's `machine`: CPUs, kernel, the proxies' and rustc's versions, the commit, the date."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def out(argv):
        try:
            return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    u = os.uname()
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "kernel": f"{u.sysname} {u.release}",
        "hostname": u.nodename,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "haproxy": (out([haproxy, "-v"]).splitlines() or [""])[0].split(" - ")[0],
        # nginx -v writes to stderr.
        "nginx": out(["sh", "-c", f"{shlex.quote(nginx)} -v 2>&1"]).replace("nginx version: ", ""),
        "rustc": out(["rustc", "--version"]),
        "git": out(["git", "describe", "--always", "--dirty"]),
    }


def document(args, *, machine_info: dict, kinds, paths, bin_dir: Path, build_seconds, bench_seconds: float,
             interference, stalls: dict, total_seconds: float, runs, cells, ratios, targets, baseline,
             tls: dict | None = None) -> dict:
    """The result document of one bench, as the JSON report holds it. `baseline` (the
    baseline's summary) is None without --baseline-broker, and the document then has no
    trace of it."""
    result = {
        "bench": "rpcmesh scripts/bench",
        "mode": "smoke" if args.smoke else "full",
        "machine": machine_info,
        "settings": {
            "repeats": args.repeats,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "tls_warmup_s": max(args.warmup, args.tls_warmup) if args.tls else None,
            "workloads": list(args.workloads),
            # Every level run (a workload's own, e.g. the classic server's, by workload below).
            "levels": [{"in_flight": a, "connections": b}
                       for a, b in dict.fromkeys(x for w in args.workloads for x in args.levels[w])],
            "levels_by_workload": {w: [{"in_flight": a, "connections": b} for a, b in args.levels[w]]
                                   for w in args.workloads},
            "upstream_kinds": kinds,
            "echo_payload_bytes": plan.ECHO_PAYLOAD_BYTES,
            "fanout": 1,
            "provider_threads": args.provider_threads,
            "broker_threads": args.broker_threads,
            "driver_threads": args.driver_threads,
            "haproxy_threads": 1,
            "nginx_processes": 1,
            "provider_args": shlex.join(args.provider_args),
            "broker_args": shlex.join(args.broker_args),
            "baseline_args": shlex.join(args.baseline_args),
            "driver_args": shlex.join(args.driver_args),
            "clock_ticks_per_second": CLK_TCK,
            # --pin: the hops' CPUs and the others' (None: the scheduler placed them).
            "pinned": None if args.cpus is None else {"hops": sorted(args.cpus[0]), "others": sorted(args.cpus[1])},
            # --busy: the CPUs a spinning process kept busy for the whole bench.
            "busy_cpus": args.busy_cpus,
            # Where provider, broker and driver came from: figures are a release build's.
            "bin_dir": str(bin_dir),
        },
        "build_seconds": build_seconds,
        "bench_seconds": round(bench_seconds, 1),
        # Other work on the machine skews everything: how much CPU it took during the bench.
        "interference": interference,
        # The machine's own stalls with every CPU busy: the floor under any max latency.
        "stall_probe": stalls,
        "total_seconds": round(total_seconds, 1),
        "runs": runs,
        "cells": cells,
        "ratios": ratios,
        "targets": targets,
        "all_runs_ok": bool(runs) and all(r["ok"] for r in runs),
    }
    if baseline is not None:
        result["settings"]["paths"] = list(paths)
        result["baseline"] = baseline
    if tls is not None:
        # The TLS paths' setup, what each negotiates, and the handshake measurement.
        result["settings"]["tls"] = True
        result["tls"] = tls
    return result


def render(result, markdown: bool) -> str:
    tab = md_table if markdown else text_table
    s = result["settings"]
    m = result["machine"]
    # Only with --baseline-broker: without it the report has no trace of the baseline.
    b = result.get("baseline")
    tls = result.get("tls")
    paths = plan.paths(bool(b), bool(tls))
    columns = cpu_columns(bool(b))
    o = []
    if markdown:
        o.append(f"# rpcmesh bench, {m['date']}\n")
    o.append(
        f"Machine: {m['nproc']} CPUs ({m['cpu_model'] or 'unknown CPU'}), {m['kernel']}; {m['haproxy']}; "
        f"nginx {m.get('nginx') or '?'}; "
        f"git {m['git'] or '?'}; {m['date']}."
    )
    i = result["interference"]
    if i:
        hogs = s.get("busy_cpus") or []
        # What other work took beyond the --busy hogs, which are there by design.
        unasked = i["other_cpu_seconds"] - i.get("busy_cpu_seconds", 0.0)
        o.append(
            f"Other processes used {i['other_cpu_seconds']:.1f} CPU s during the {i['wall_seconds']:.0f} s of the bench "
            f"({100 * i['other_cpu_seconds'] / max(i['wall_seconds'], 1e-9):.1f} % of one CPU; the bench's own processes "
            f"{i['bench_cpu_seconds']:.0f} CPU s); hypervisor steal {i['steal_seconds']:.1f} s."
            + (f" Busy on purpose (--busy {len(hogs)}): a process spinning on CPU {', '.join(map(str, hogs))} for the "
               f"whole bench ({i.get('busy_cpu_seconds', 0.0):.1f} CPU s), counted with the other processes." if hogs else "")
            + (" The machine was not quiet: treat the numbers with care." if unasked > max(1.0, 0.05 * i["wall_seconds"]) else "")
        )  # fmt: skip
    p = result.get("stall_probe")
    if p:
        o.append(
            f"Machine stalls (every CPU kept busy by a process reading the clock): {stall_summary(p)}. "
            "No max latency below the largest can be promised on this machine."
        )
    o.append(
        f"Runs: {s['repeats']} repeat(s) of {s['duration_s']} s after {s['warmup_s']} s warm-up"
        + (f" ({s['tls_warmup_s']} s on the TLS paths)" if s.get("tls_warmup_s") else "")
        + ", paths interleaved "
        f"({', '.join(paths)}, ...); threads provider {s['provider_threads']}, broker {s['broker_threads']}, "
        f"driver {s['driver_threads']}, HAProxy 1, nginx 1 process"
        + "".join(f"; {w} args: {s[w + '_args']}" for w in ("provider", "broker", "driver") if s[w + "_args"])
        + (f"; binaries from {s['bin_dir']}" if "bin_dir" in s and Path(s["bin_dir"]) != procs.RELEASE_DIR.resolve() else "")
        + (f"; pinned: the hops on CPU {s['pinned']['hops']}, the others on {s['pinned']['others']}" if s.get("pinned") else "")
        + f". Bench time {result['bench_seconds']:.0f} s ({result['bench_seconds'] / 60:.1f} min)"
        + (f", build {result['build_seconds']:.0f} s" if result["build_seconds"] is not None else "")
        + "."
    )
    o.append("")
    o.append(
        "Medians over the repeats. Latency in microseconds (successful calls). cpu X = CPU seconds of process X "
        "per 1,000 calls sent ('-' = not on that path). errors = failed calls summed over the repeats."
        + (f" Path before: driver -> the baseline broker ({b['binary']}, started like the broker"
           + (f", with {b['args']}" if b.get("args") else "") + ") -> the same provider; cpu before is that "
           "broker's." if b else "")  # fmt: skip
        + (" Workload classic: echo 32 B in plain v1 frames against the classic server (provider --classic: Nagle "
           "on, one call at a time per connection), behind a broker of its own (--upstream-v1) and second frontends "
           "of HAProxy and nginx; in its rows cpu provider is the classic server's, cpu broker (before) its own "
           "broker's. calls >30ms = successful calls slower than 30 ms, summed over the repeats."
           if "classic" in s["workloads"] else " calls >30ms = successful calls slower than 30 ms, summed over the repeats.")  # fmt: skip
    )
    if any(c["connections"] != c["connections_asked"] for c in result["cells"]):
        o.append("* the driver never opens more connections than calls in flight: 1 in flight uses 1 connection.")
    o.append("")
    h, r = table_rows(result["cells"], columns)
    o.append(tab(h, r, left=(0, 3)))
    o.append("")
    o.append(
        "Where the CPU goes (medians): microseconds of CPU per call sent in user mode + in the kernel "
        "(system calls and the network stack's work on their behalf), context switches per call "
        "(a process that sleeps between batches must be woken, which its peer pays for), and "
        "microseconds per call each server was ready to run and waited for a CPU (its run-queue "
        "delay: the time the other processes on the machine kept it from running)."
    )
    o.append("")
    h, r = split_rows(result["cells"], columns)
    o.append(tab(h, r, left=(0, 3)))
    o.append("")
    h, r = ratio_rows(result["ratios"], bool(b))
    o.append(tab(h, r))
    o.append("")
    if b:
        o.append(baseline_line(b))
        o.append("")
    if tls:
        o.extend(render_tls(result, tls, tab))
    if result["targets"] is None:
        o.append("Smoke mode: targets not judged.")
    elif markdown:
        h, r = target_rows(result["targets"])
        o.append(tab(h, r, left=(0, 1, 3, 4, 5)))
    else:
        for t in target_rows(result["targets"])[1]:
            tid, what, value, goal, verdict, note = t
            o.append(f"{tid}  {verdict:<4}  {value:>8}  (goal {goal})  {what}")
            o.append(f"{'':14}{note}")
    failed = [x for x in result["runs"] if not x["ok"]]
    if failed:
        o.append("")
        o.append(f"{len(failed)} failed run(s):")
        for x in failed:
            o.append(f"- {x['workload']} {x['in_flight']}/{x['connections_asked']} {x['path']} repeat {x['repeat']}: {x['failure']}")
    return "\n".join(o) + "\n"


def render_tls(result, tls: dict, tab) -> list[str]:
    """The TLS section: the TLS paths against each other (S1 and S2 per cell), what each
    negotiates, and the handshakes per core-second."""
    o = [
        "TLS (rpcmesh's provider only: the classic server speaks no TLS). Every TLS path has TLS 1.3 and client "
        f"certificates on every hop, one CA and EC P-256 keys ({tls['certificates']}): direct-tls driver -> provider; "
        "broker-tls driver -> broker -> provider (--upstream-tls on); haproxy-tls (ssl on bind and server lines, "
        "verify required) and nginx-tls (stream, listen ssl, proxy_ssl on, proxy_ssl_verify on). Goal: broker-tls "
        "/ the better TLS proxy >= 1.3 at 200 connections x 1 in flight, >= 1.0 elsewhere. broker-tls / broker = "
        "what TLS costs the broker's calls/s. cpu us/call all = CPU of every process on the path per call.",
        "",
    ]
    h, r = tls_rows(result["cells"], result["ratios"])
    o.append(tab(h, r))
    o.append("")
    if tls.get("suites"):
        o.append("Negotiated (openssl s_client offering the driver's suites and groups in rustls's order, once per path's "
                 "first listener; the upstream hops are configured alike):")  # fmt: skip
        o.append("")
        h, r = suite_rows(tls["suites"])
        o.append(tab(h, r, left=(0, 1, 2, 3, 4)))
        o.append("")
    hs = tls.get("handshakes")
    if hs:
        o.append(
            f"Handshakes per second per core ({tls['handshake_seconds']:g} s each, one client connecting in turn with "
            "the driver's certificate, waiting for the session tickets, then closing; per core-second = handshakes / "
            "the listening process's CPU seconds; resumed = offering the last connection's ticket). haproxy and nginx: "
            "a frontend with the TLS paths' settings and no upstream; '... path': the TLS path's frontend, where each "
            "connection also costs the proxy a TLS connection to the provider."
        )
        o.append("")
        h, r = handshake_rows(hs)
        o.append(tab(h, r, left=(0, 1)))
        o.append("")
    elif tls.get("handshake_seconds") == 0:
        o.append("Handshakes: not measured (--handshake-seconds 0).")
        o.append("")
    return o


def publish(result: dict, out: Path, bench_seconds: float) -> None:
    """Writes the JSON and Markdown reports into `out` and prints the text report, the
    bench's time against its budget and where the reports are."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = out / f"bench-{stamp}.json"
    md_path = out / f"bench-{stamp}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(render(result, markdown=True))
    print()
    print(render(result, markdown=False), end="")
    print()
    print(f"bench time {bench_seconds:.0f} s ({bench_seconds / 60:.1f} min)"
          + (f"; over the {plan.TIME_BUDGET_S / 60:.0f}-minute budget" if bench_seconds > plan.TIME_BUDGET_S else ""))  # fmt: skip
    print(f"written: {json_path}")
    print(f"         {md_path}")
    if not result["all_runs_ok"]:
        print("FAILED: at least one run made no successful call (see above)")
