"""The targets T1-T5, P1-P3, S1 and S2 (the broker with TLS against the TLS proxies) and their verdicts: each a ratio (or a difference) within
one run of this bench on the 2-core reference machine, computed from the cells and ratio
rows it names and reported as PASS, MISS or '-' (not measured: its cell was not run, e.g.
with --levels). T1-T5 and P1 are judged on the rpcmesh provider's cells, P2 on all
processes' CPU at echo 64/8, P3 on the classic server's cells. The verdicts inform: they do
not change the exit status, and smoke mode does not judge them. Pure: no I/O."""

from __future__ import annotations

from .plan import cell_key
from .stalls import stall_summary
from .summary import TLS_GOAL, TLS_GOAL_200
from .tables import fmt_num

#: Each target: its id, what it measures, the comparison and threshold its value must meet,
#: and the unit of the value (none for a ratio).
TARGETS = (
    {
        "id": "T1",
        "what": "broker calls/s / direct calls/s, echo 32 B, 64 in flight over 8 connections",
        "op": ">=",
        "threshold": 0.75,
        "unit": "",
    },
    {
        "id": "T2",
        "what": "broker calls/s / HAProxy calls/s, 200 connections x 1 in flight "
        "(worst of echo and platform)",
        "op": ">=",
        "threshold": 1.3,
        "unit": "",
    },
    {
        "id": "T3",
        "what": "broker p50 - direct p50 at 1 in flight (worst of echo and platform)",
        "op": "<=",
        "threshold": 25.0,
        "unit": "us",
    },
    {
        "id": "T4",
        "what": "driver CPU per call / provider CPU per call "
        "(reference platform workload, 64 in flight over 8 connections, direct path)",
        "op": "<=",
        "threshold": 1.0,
        "unit": "",
    },
    {
        "id": "T5",
        "what": "max latency at 64 in flight, direct and broker paths "
        "(worst cell median; both workloads)",
        "op": "<",
        "threshold": 5000.0,
        "unit": "us",
    },
    {
        "id": "P1",
        "what": "broker ÷ best of HAProxy and nginx stream, calls/s, every shape of the bench "
        "(worst cell of broker / max(haproxy, nginx))",
        "op": ">=",
        "threshold": 1.3,
        "unit": "",
    },
    {
        "id": "P2",
        "what": "broker's added CPU per call (broker path - direct path, all processes) / HAProxy's added CPU "
        "per call (haproxy path - direct path), echo 32 B, 64 in flight over 8 connections",
        "op": "<=",
        "threshold": 0.5,
        "unit": "",
    },
    {
        "id": "P3",
        "what": "behind the classic server (plain v1, Nagle on, one call at a time per connection): broker / "
        "HAProxy calls/s, and broker / HAProxy p99.9 (worst classic cell)",
        "op": ">=",
        "threshold": 1.0,
        "unit": "",
        # A second figure the same target must meet.
        "and": {"what": "p99.9", "op": "<=", "threshold": 1.5},
    },
    {
        "id": "S1",
        "what": "broker-tls ÷ the better of haproxy-tls and nginx-tls, calls/s, 200 connections x 1 in flight "
        "(worst of echo and platform; mTLS on both hops of every path)",
        "op": ">=",
        "threshold": TLS_GOAL_200,
        "unit": "",
    },
    {
        "id": "S2",
        "what": "broker-tls ÷ the better of haproxy-tls and nginx-tls, calls/s, every other cell of rpcmesh's provider "
        "(the worst)",
        "op": ">=",
        "threshold": TLS_GOAL,
        "unit": "",
    },
)


def judge(cells, ratios, runs, stalls=None) -> list[dict]:
    """The targets, from the cells they name (a target whose cell was not run, e.g. with
    --levels, is reported as not measured)."""

    def cell(w, level, path):
        return next((c for c in cells if (cell_key(c), c["path"]) == ((w, level), path)), None)

    def ratio(w, level):
        return next((r for r in ratios if cell_key(r) == (w, level)), None)

    # T2, T3, T5 and P1 are about rpcmesh's own provider; the classic server has P3.
    classic = [r for r in ratios if r.get("kind") == "classic"]
    ratios = [r for r in ratios if r.get("kind", "rpcmesh") == "rpcmesh"]
    cells = [c for c in cells if c.get("kind", "rpcmesh") == "rpcmesh"]
    runs = [r for r in runs if r.get("kind", "rpcmesh") == "rpcmesh"]
    found = {}
    # T1
    r = ratio("echo", (64, 8))
    if r and r["broker_over_direct"] is not None:
        found["T1"] = (r["broker_over_direct"], "echo, 64 in flight / 8 connections")
    # T2, T3 name no workload, so both must meet them; the worst is reported.
    vals = [(r["broker_over_haproxy"], r["workload"]) for r in ratios
            if (r["in_flight"], r["connections_asked"]) == (200, 200) and r["broker_over_haproxy"] is not None]  # fmt: skip
    if vals:
        v, w = min(vals)
        found["T2"] = (v, f"worst: {w}; " + ", ".join(f"{ww} {vv:.2f}" for vv, ww in vals))
    vals = [(r["broker_minus_direct_p50_us"], r["workload"]) for r in ratios if r["in_flight"] == 1 and r["broker_minus_direct_p50_us"] is not None]
    if vals:
        v, w = max(vals)
        found["T3"] = (v, f"worst: {w}; " + ", ".join(f"{ww} {vv:.0f} us" for vv, ww in vals))
    # T4, on the reference workload, whose provider does real work per call. With echo the
    # two sides do the same work, and a closed loop at 64 in flight keeps both at 100 % of
    # a core, so the ratio is 1 by construction; it is shown beside, for information.
    def cpu_ratio(w):
        c = cell(w, (64, 8), "direct")
        if c:
            d, p = c["median_cpu_per_1000_calls"]["driver"], c["median_cpu_per_1000_calls"]["provider"]
            if d is not None and p:
                return d / p, d, p
        return None

    t4 = cpu_ratio("platform")
    if t4:
        v, d, p = t4
        echo = cpu_ratio("echo")
        extra = f"; echo {echo[0]:.3f}" if echo else ""
        found["T4"] = (v, f"platform, 64 in flight / 8 connections, direct: driver {d:.5f} / provider {p:.5f} CPU s per 1,000 calls{extra}")
    # T5
    cs = [c for c in cells if (c["in_flight"], c["connections_asked"]) == (64, 8) and c["path"] in ("direct", "broker")
          and c["median"]["max_us"] is not None]  # fmt: skip
    if cs:
        worst = max(cs, key=lambda c: c["median"]["max_us"])
        rs = [r for r in runs if (r["in_flight"], r["connections_asked"]) == (64, 8) and r["path"] in ("direct", "broker")
              and "max_us" in r]  # fmt: skip
        single = max(rs, key=lambda r: r["max_us"])
        found["T5"] = (
            worst["median"]["max_us"],
            f"worst cell: {worst['workload']} {worst['path']}; worst single run: "
            f"{single['max_us'] / 1000:.2f} ms ({single['workload']} {single['path']})"
            + (f"; the machine's own stalls: {stall_summary(stalls)}" if stalls else ""),
        )
    # How far the deciding cell's ratio moves between its repeats (each repeat's paths run
    # next to each other): when some repeats meet the goal and others do not, the median's
    # verdict is the machine's noise as much as the broker's, and the note says so.
    spreads = {}

    def spread(tid, reps):
        t = next(t for t in TARGETS if t["id"] == tid)
        xs = [x for x in reps if x is not None]
        if len(xs) < 2:
            return ""
        met = [meets(x, t["op"], t["threshold"]) for x in xs]
        settled = all(met) or not any(met)
        spreads[tid] = {"repeat_range": [min(xs), max(xs)], "settled": settled}
        return f"; single repeats {min(xs):.2f}-{max(xs):.2f}" + (
            "" if settled else " (some meet the goal and some do not: this run does not settle it)"
        )

    # P1: every cell of the run, the broker against the better proxy of that cell.
    vals = [(r["broker_over_best_proxy"], r) for r in ratios if r.get("broker_over_best_proxy") is not None]
    if vals:
        v, r = min(vals, key=lambda x: x[0])
        found["P1"] = (
            v,
            f"worst cell: {r['workload']} {r['in_flight']}/{r['connections_asked']}, best proxy there {r['best_proxy']}"
            f" (broker/haproxy {fmt_num(r['broker_over_haproxy'], '.2f')}, broker/nginx {fmt_num(r['broker_over_nginx'], '.2f')});"
            f" {len(vals)} cell(s)" + spread("P1", r.get(f"broker_over_{r['best_proxy']}_by_repeat", [])),
        )
    # P2: what the broker's hop adds to the CPU of all processes per call, over HAProxy's.
    r = ratio("echo", (64, 8))
    if r and r.get("broker_over_haproxy_added_cpu") is not None:
        found["P2"] = (
            r["broker_over_haproxy_added_cpu"],
            f"echo 64/8, CPU of all processes per call over the direct path: broker +{r['broker_added_cpu_us_per_call']:.2f} us, "
            f"HAProxy +{r['haproxy_added_cpu_us_per_call']:.2f} us",
        )
    elif r and r.get("haproxy_added_cpu_us_per_call") is not None:
        found["P2"] = (None, f"HAProxy added {r['haproxy_added_cpu_us_per_call']:.2f} us per call: no ratio")
    # P3: the worst classic cell, calls/s (the lowest ratio) and p99.9 (the highest).
    vals = [(r["broker_over_haproxy"], r["broker_over_haproxy_p999"], r) for r in classic
            if r["broker_over_haproxy"] is not None and r["broker_over_haproxy_p999"] is not None]  # fmt: skip
    if vals:
        v, _, worst = min(vals, key=lambda x: x[0])
        v2 = max(x[1] for x in vals)
        found["P3"] = (
            v,
            "; ".join(f"{r['in_flight']}/{r['connections_asked']}: calls/s {a:.2f}, p99.9 {b:.2f}" for a, b, r in vals)
            + f"; {len(vals)} cell(s)"
            + spread("P3", worst.get("broker_over_haproxy_by_repeat", [])),
            v2,
        )
    # S1, S2: the broker with TLS against the better TLS proxy of each cell.
    for tid, pick in (("S1", lambda r: (r["in_flight"], r["connections_asked"]) == (200, 200)),
                      ("S2", lambda r: (r["in_flight"], r["connections_asked"]) != (200, 200))):  # fmt: skip
        vals = [(r["broker_tls_over_best_tls_proxy"], r) for r in ratios
                if r.get("broker_tls_over_best_tls_proxy") is not None and pick(r)]  # fmt: skip
        if vals:
            v, r = min(vals, key=lambda x: x[0])
            found[tid] = (
                v,
                f"worst cell: {r['workload']} {r['in_flight']}/{r['connections_asked']}, best TLS proxy there "
                f"{r['best_tls_proxy']}; {len(vals)} cell(s)" + spread(tid, r.get("broker_tls_over_best_tls_proxy_by_repeat", [])),
            )
    return verdicts(found, spreads)


def verdicts(found: dict[str, tuple], spreads: dict[str, dict]) -> list[dict]:
    """Every target with its value, verdict and note: `found` gives the measured ones
    (id -> (value, note[, second value])), `spreads` the deciding cell's range over the
    repeats where there is one."""
    out = []
    for t in TARGETS:
        v, note, *more = found.get(t["id"], (None, "not measured in this run"))
        v2 = more[0] if more else None
        if v is None or ("and" in t and v2 is None):
            verdict = "-"
        else:
            ok = meets(v, t["op"], t["threshold"]) and ("and" not in t or meets(v2, t["and"]["op"], t["and"]["threshold"]))
            verdict = "PASS" if ok else "MISS"
        out.append(
            {
                **t,
                "value": v,
                "verdict": verdict,
                "note": note,
                **({"value2": v2} if "and" in t else {}),
                **spreads.get(t["id"], {}),
            }
        )
    return out


def meets(v: float, op: str, threshold: float) -> bool:
    """Whether `v` meets the goal `op threshold`."""
    return {">=": v >= threshold, "<=": v <= threshold, "<": v < threshold}[op]
